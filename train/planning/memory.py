"""Peak memory per rank of a training run, from its config (no weights are allocated).

    peak = parameters + gradients + optimizer state + activations + loss path + workspace

- parameters / gradients: fp32 master weights and fp32 gradients (4 bytes each); FSDP2 keeps 1/W of
  both, plus the unsharded compute copy of the blocks in flight.
- optimizer: AdamW's two fp32 moments (8 bytes per parameter); with train.optimizer=muon, Muon's parameters
  (train/core/param_groups.py's rule, counted on a model built on the meta device) keep one fp32 momentum
  buffer (4 bytes) and the rest AdamW's 8; ZeRO-1 and FSDP2 keep 1/W.
- activations: what autograd saves, per layer and per token of a micro-batch (the formulas below,
  docs/MODELS.md "Memory"); with activation checkpointing every k-th block keeps only its fp32 input
  and one block's activations are alive again during its recomputation; NSA's selected attention on a
  GPU adds one layer's per-slot partials (small GQA groups, transient).
- loss path: chunked cross-entropy (model.loss_chunk rows) keeps one chunk of fp32 logits and its
  gradient, the head's weight gradient and the hidden states' gradient; full logits (loss_chunk=0)
  keep bf16/fp32 logits, their fp32 upcast and their gradient for every token.
- workspace: CUDA context, cuBLAS/NCCL workspaces and allocator slack (a constant + 5%).

Calibrated against measured peaks on CPU (bench/bench_activation_memory.py, docs/BENCHMARKS.md).
"""
from __future__ import annotations

from dataclasses import dataclass

from train.core.config import RunConfig
from train.core.param_groups import muon_names

GIB = 2**30
# device memory as nvidia-smi reports it (MiB), by the names `--gpu` accepts
GPU_MIB = {
    "4090-24GB": 24564, "A6000-48GB": 49140, "A100-40GB": 40960, "A100-80GB": 81920,
    "H100-80GB": 81559, "B200-192GB": 183359,
}
WORKSPACE_BYTES = 1.5 * GIB  # CUDA context + library workspaces
SLACK = 0.05  # allocator fragmentation, as a fraction of everything else
STATE_BYTES = {"adamw": 8, "muon": 4}  # fp32 optimizer state per parameter: AdamW's two moments, Muon's momentum


@dataclass
class MemoryEstimate:
    """Bytes per rank."""

    params: float
    grads: float
    optimizer: float
    activations: float
    activations_per_layer: float  # one layer, whole micro-batch, without checkpointing
    activations_per_layer_checkpointed: float  # what a checkpointed layer keeps
    loss: float
    workspace: float

    @property
    def total(self) -> float:
        core = self.params + self.grads + self.optimizer + self.activations + self.loss
        return core * (1 + SLACK) + self.workspace

    def as_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in self.__dataclass_fields__}, "total": self.total}


def activation_bytes_per_token(cfg: RunConfig, act_bytes: int) -> float:
    """Bytes autograd saves for one layer and one token. act_bytes: 2 under bf16/fp16 autocast
    (matmul outputs), 4 in fp32. Norm inputs and the residual stream stay fp32."""
    m = cfg.model
    D, F, hd = m.dim, m.ffn_dim, m.head_dim
    q, kv = m.n_heads * hd, m.n_kv_heads * hd
    cast = act_bytes if act_bytes < 4 else 0  # autocast saves the low-precision copy a matmul reads
    norms = 2 * (4 * D + cast * D)  # two pre-norms: fp32 input (+ the cast output the matmul reads)
    if act_bytes == 4:
        norms += 2 * 4 * D  # fp32: the norm output is its own tensor, saved by the next matmul
    mlp = (4 if m.mlp == "swiglu" else 2) * F * act_bytes  # swiglu: gate, up, silu(gate), product
    qk_norm = 4 * (q + kv) if m.qk_norm else 0
    if m.attention == "nsa" and not m.nsa.window_only:
        # one query projection, 3 branches of keys/values, rotated q / sel and win keys, three branch
        # outputs and their gated sum, the gate MLP (hidden dim/4 default), per-branch log-sum-exps
        gate_hidden = m.nsa.gate_hidden or max(1, D // 4)
        attn = act_bytes * (q + 6 * kv + (q + 2 * kv) + 3 * q + q + 2 * gate_hidden + 3 * m.n_heads) \
            + 4 * 3 * m.n_heads
        attn *= NSA_FACTOR
    else:  # dense, and NSA's window-only control (nsa.gates=window: the same tensors, for the window branch)
        # q, k, v; rotated q, k; the attention output (read by the output projection); fp32 lse
        attn = act_bytes * (q + 2 * kv + (q + kv) + q) + 4 * m.n_heads
    return norms + attn + qk_norm + mlp


# NSA keeps selection / compression bookkeeping beyond the tensors listed (block indices, tile
# layouts, compressed keys): calibrated on CPU against a measured peak (docs/BENCHMARKS.md)
NSA_FACTOR = 1.25


def selection_partial_bytes(cfg: RunConfig, tokens: int, cuda: bool) -> float:
    """NSA's block-centric selected attention on a GPU (small GQA groups) holds per-slot partials for one
    layer at a time (nsa/attention/kernels/selected_attention.py `partial_bytes`); 0 off the Triton path."""
    m = cfg.model
    if not cuda or m.attention != "nsa" or m.nsa.window_only or m.nsa.kernel == "torch":
        return 0.0
    try:
        from nsa.attention.kernels.selected_attention import partial_bytes
    except ImportError:  # no triton: the torch path runs
        return 0.0
    import torch

    dtype = torch.float32 if cfg.runtime.precision == "fp32" else torch.bfloat16
    return float(partial_bytes(tokens * m.n_heads, m.head_dim, m.nsa.n_sel, m.n_groups, dtype))


def loss_bytes(cfg: RunConfig, tokens: int, act_bytes: int) -> float:
    """The head's weight gradient and the hidden states' gradient (both paths), plus the logits: one
    chunk's fp32 logits and their gradient (chunked), or every token's logits in the compute dtype,
    their fp32 upcast and their fp32 gradient (loss_chunk=0)."""
    m = cfg.model
    V, D = m.vocab_size, m.dim
    chunk = m.loss_chunk
    gradients = 4 * V * D + 4 * tokens * D
    if chunk and chunk < tokens:
        return gradients + 2 * 4 * chunk * V
    return gradients + tokens * V * (act_bytes + 4 + 4)


def muon_parameters(cfg: RunConfig) -> int:
    """How many of the model's parameters Muon trains (train/core/param_groups.py), on the meta device."""
    import torch

    from nsa.model import Transformer

    with torch.device("meta"):
        model = Transformer(cfg.model)
    sizes = dict(model.named_parameters())
    return sum(sizes[name].numel() for name in muon_names(model))


def estimate_memory(cfg: RunConfig, world_size: int = 1, *, cuda: bool = True) -> MemoryEstimate:
    """Peak bytes per rank for cfg on `world_size` ranks (cuda=False: CPU, no workspace, fp32 unless bf16)."""
    rt, t, m = cfg.runtime, cfg.train, cfg.model
    precision = rt.precision if rt.precision != "auto" else ("bf16" if cuda else "fp32")
    act_bytes = 4 if precision == "fp32" else 2
    from nsa.flops import param_count

    P = param_count(cfg.model)
    sharded_states = world_size > 1 and rt.fsdp
    zero1 = world_size > 1 and rt.zero1 and not rt.fsdp
    params = 4 * P / (world_size if sharded_states else 1)
    grads = 4 * P / (world_size if sharded_states else 1)
    if sharded_states:  # the unsharded low-precision copy of two blocks (one computing, one prefetched)
        per_block = P / max(1, m.n_layers)
        params += 2 * per_block * act_bytes
        grads += per_block * 4
    on_muon = muon_parameters(cfg) if t.optimizer == "muon" else 0
    state = STATE_BYTES["adamw"] * (P - on_muon) + STATE_BYTES["muon"] * on_muon
    optimizer = state / (world_size if (sharded_states or zero1) else 1)
    tokens = t.batch_size * t.seq_len
    per_layer = activation_bytes_per_token(cfg, act_bytes) * tokens
    per_layer_ckpt = 4 * m.dim * tokens  # the block's fp32 input
    every = rt.gradient_checkpointing
    if every:  # checkpointed blocks keep their input; one block is recomputed at a time
        n_ckpt = m.n_layers // every
        activations = n_ckpt * per_layer_ckpt + (m.n_layers - n_ckpt) * per_layer + per_layer
    else:
        activations = m.n_layers * per_layer
    # backward of the last block: the gradients of its activations live beside them
    activations += per_layer + selection_partial_bytes(cfg, tokens, cuda)
    activations += 4 * m.dim * tokens * 2  # embedding output and the final norm's input
    return MemoryEstimate(
        params=params, grads=grads, optimizer=optimizer, activations=activations,
        activations_per_layer=per_layer, activations_per_layer_checkpointed=per_layer_ckpt,
        loss=loss_bytes(cfg, tokens, act_bytes), workspace=WORKSPACE_BYTES if cuda else 0.0,
    )


def fit_advice(cfg: RunConfig, world_size: int, capacity: float) -> str | None:
    """The cheapest knob that brings the estimate under capacity, or None. In order: chunked loss
    (free), smaller micro-batches with more accumulation (same global batch; kept >= 4096 tokens so
    the GPU stays busy), activation checkpointing (about a third more compute), FSDP2 (more traffic)."""
    from dataclasses import replace

    def total(runtime: dict = {}, train: dict = {}, model: dict = {}) -> float:  # noqa: B006 (read only)
        new = replace(cfg, runtime=replace(cfg.runtime, **runtime), train=replace(cfg.train, **train),
                      model=replace(cfg.model, **model))
        return estimate_memory(new, world_size).total

    if cfg.model.loss_chunk == 0 and total(model={"loss_chunk": 1024}) <= capacity:
        return "--model.loss_chunk=1024 (chunked cross-entropy: no full logits)"
    b, acc, t = cfg.train.batch_size, cfg.train.accumulate_grad_batches, cfg.train.seq_len
    for div in (2, 3, 4, 6, 8, 16, 32, 64):
        if b % div or (b // div) * t < 4096:
            continue
        if total(train={"batch_size": b // div, "accumulate_grad_batches": acc * div}) <= capacity:
            return (f"--train.batch_size={b // div} --train.accumulate_grad_batches={acc * div} "
                    f"(same global batch, smaller micro-batches)")
    if not cfg.runtime.gradient_checkpointing and total(runtime={"gradient_checkpointing": 1}) <= capacity:
        return "--runtime.gradient_checkpointing=1 (activation checkpointing of every block)"
    if world_size > 1 and not cfg.runtime.fsdp and total(runtime={"fsdp": True}) <= capacity:
        return "--use_fsdp=true (shard parameters, gradients and optimizer state)"
    return None


def verdict(cfg: RunConfig, world_size: int, gpu: str, capacity: float | None = None) -> dict:
    """The estimate against a GPU's memory (capacity: bytes, default GPU_MIB[gpu]); "fix" when it does not fit."""
    capacity = GPU_MIB[gpu] * 2**20 if capacity is None else capacity
    est = estimate_memory(cfg, world_size)
    fits = est.total <= capacity
    out = {"gpu": gpu, "capacity_bytes": capacity, "world_size": world_size, "fits": fits,
           "optimizer_name": cfg.train.optimizer, **est.as_dict()}
    if not fits:
        out["fix"] = fit_advice(cfg, world_size, capacity)
    return out


def render_memory(v: dict) -> str:
    g = lambda b: f"{b / 1e9:7.2f} GB"  # noqa: E731
    lines = [
        f"memory per rank on {v['gpu']} ({v['capacity_bytes'] / 1e9:.1f} GB), {v['world_size']} rank(s):",
        f"  parameters        {g(v['params'])}",
        f"  gradients         {g(v['grads'])}",
        f"  optimizer {'(' + {'adamw': 'AdamW', 'muon': 'Muon'}[v['optimizer_name']] + ')':7} {g(v['optimizer'])}",
        f"  activations       {g(v['activations'])}  (per layer {v['activations_per_layer'] / 1e9:.2f} GB; "
        f"checkpointed {v['activations_per_layer_checkpointed'] / 1e9:.3f} GB)",
        f"  loss path         {g(v['loss'])}",
        f"  workspace + {SLACK:.0%}  {g(v['total'] - v['params'] - v['grads'] - v['optimizer'] - v['activations'] - v['loss'])}",
        f"  peak              {g(v['total'])}",
    ]
    if v["fits"]:
        lines.append(f"  verdict           fits ({(v['capacity_bytes'] - v['total']) / 1e9:.1f} GB to spare)")
    else:
        fix = v.get("fix") or "a larger GPU, more GPUs with --use_fsdp=true, or a smaller model"
        lines.append(f"  verdict           does not fit (needs {v['total'] / 1e9:.1f} GB); fix: {fix}")
    return "\n".join(lines)


def gpu_name(name: str) -> str:
    """Accept e.g. h100, H100-80GB, 'A100-40'; return the GPU_MIB key."""
    wanted = name.upper().replace("_", "-").replace(" ", "-")
    for key in GPU_MIB:
        if key.upper() == wanted or key.upper().startswith(wanted) or key.upper().replace("GB", "") == wanted:
            return key
    from train.core.errors import ConfigError

    raise ConfigError(f"--gpu {name!r}: unknown GPU; choose one of {', '.join(GPU_MIB)}")
