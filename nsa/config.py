"""Model configuration: plain dataclasses, validated on construction.

The model library owns these; the trainer fills them from YAML (train/core/config.py).
Every field here is read by the model builder (tests/nsa/test_dense_model.py changes each ModelConfig field
and sees the model change; the NSA fields have their own tests under tests/nsa/).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from nsa.triton_support import triton_unavailable


# nsa.* keys that change kernels, memory, the initial weights or the optimizer, not the function a checkpoint computes:
# a checkpoint made with other values loads (resume, import).
NON_ARCHITECTURE_FIELDS = frozenset({"q_chunk", "sel_chunk", "sel_tile", "win_block", "kernel", "gate_init",
                                     "gate_bias", "aux_decay", "aux_lr_scale", "indexer_kl", "indexer_warmup_steps",
                                     "indexer_target", "indexer_lr_scale", "sel_distance_cap_from_step"})
GATE_INITS = ("equal", "window")
# nsa.gates: learned (NSA: three branches mixed by the gate MLP) | window (the control: the gates pinned to
# (cmp, sel, win) = (0, 0, 1), so the layer is its sliding-window branch alone; docs/NSA.md)
GATES = ("learned", "window")
# nsa.selector: how a query's free blocks are scored. pooled (NSA, Eq. 8-10: the compressed branch's probabilities
# summed over a block) | indexer (a learned block indexer, nsa/attention/indexer.py, trained by KL to that mass)
SELECTORS = ("pooled", "indexer")
INDEXER_POOLS = ("keys", "scores")  # nsa.indexer_pool: how the indexer scores a block (nsa/attention/indexer.py)
INDEXER_TARGETS = ("compressed", "dense")  # nsa.indexer_target: what the indexer's KL imitates (nsa/attention/indexer.py)
# the nsa.* keys a window-only layer (gates: window) reads; the others have no effect on it
WINDOW_FIELDS = frozenset({"gates", "w", "win_block", "kernel"})


def architecture_keys(nsa: dict) -> list[str]:
    """The keys of an nsa section (NSAConfig fields as a dict) that fix the function a checkpoint computes: all but
    NON_ARCHITECTURE_FIELDS, and for a window-only layer (gates: window) only those among WINDOW_FIELDS."""
    window_only = nsa.get("gates") == "window"
    return [k for k in nsa if k not in NON_ARCHITECTURE_FIELDS and (k in WINDOW_FIELDS or not window_only)]


class ModelConfigError(ValueError):
    """A model or NSA configuration that cannot be built."""


@dataclass
class NSAConfig:
    """Native Sparse Attention hyper-parameters (Yuan et al. 2025, defaults from the paper)."""

    l: int = 32  # compression block length
    d: int = 16  # compression stride
    l_sel: int = 64  # selection block length (l')
    n_sel: int = 16  # selected blocks per query, forced blocks included (n)
    w: int = 512  # sliding window length
    q_chunk: int = 256  # queries processed together in the vectorised path (memory bound)
    gate_hidden: int = 0  # hidden width of the gate MLP; 0 means dim // 4
    sel_chunk: int = 8192  # queries per selection chunk (bounds the block-tile index buffers; see docs/NSA.md)
    sel_tile: int = 128  # (query, block) pairs per tile in block-centric selected attention
    win_block: int = 128  # queries per sliding-window block (each block reads win_block + w - 1 keys)
    kernel: str = "auto"  # fused CUDA paths: auto (Triton selection + FlexAttention branches on CUDA, torch elsewhere) | triton | torch
    aux_decay: bool = True  # weight decay (train.weight_decay) on the matrices of the gate MLP and of phi; false: none
    aux_lr_scale: float = 1.0  # learning-rate multiplier (on train.lr's schedule) for the gate MLP and phi parameters
    gate_init: str = "window"  # branch gates at step 0: window (cmp, sel ~0.018, win ~0.982 at gate_bias 4) | equal (all ~0.5, the generic init); docs/NSA.md
    gate_bias: float = 4.0  # gate_init=window: pre-sigmoid biases -b, -b, +b for cmp, sel, win (2: 0.12 / 0.88; 4: 0.018 / 0.982)
    gates: str = "learned"  # learned (NSA) | window (control: gates pinned to cmp, sel, win = 0, 0, 1: the sliding-window branch alone, no compression, selection or gate modules); docs/NSA.md
    selector: str = "pooled"  # pooled (NSA's scores from the compressed branch) | indexer (a learned block indexer); docs/NSA.md
    indexer_heads: int = 2  # selector=indexer: index-query heads per KV group
    indexer_dim: int = 32  # selector=indexer: width of an index query and of the shared index key
    indexer_pool: str = "keys"  # selector=indexer: keys (a block's key = the max of its tokens' keys) | scores (a block's score = the max of its tokens' scores)
    indexer_target: str = "compressed"  # selector=indexer: the KL's target: compressed (the compressed branch's mass per block) | dense (dense attention over the selected branch's keys, per block)
    indexer_kl: float = 1.0  # selector=indexer: weight of the indexer's KL term (its gradient reaches the indexer only)
    indexer_warmup_steps: int = 0  # selector=indexer: steps that select by pooled scores while the indexer learns
    indexer_lr_scale: float = 1.0  # selector=indexer: learning-rate multiplier (on train.lr's schedule) for the indexer's parameters
    indexer_every: int = 1  # selector=indexer: an indexer in every k-th layer (0, k, 2k, ..); the layers between reuse its picks (IndexShare); 1: every layer its own
    sel_distance_cap: int = 0  # the selected branch reads keys more than this many positions back as if this far back (RoPE; ReRoPE / InfLLM-style); 0: off. Torch ops over a [Tq, Tk] mask (short contexts); docs/NSA.md
    sel_distance_cap_from_step: int = 0  # sel_distance_cap > 0: training steps before the cap takes effect (the selected branch reads at every distance until then; inference always capped)

    def owns_indexer(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) has an indexer of its own (nsa.selector=indexer, every
        nsa.indexer_every-th layer from 0); the layers after it, up to the next, reuse its picks."""
        return self.selector == "indexer" and layer % self.indexer_every == 0

    @property
    def shares_picks(self) -> bool:
        """nsa.indexer_every > 1: the model passes each indexer layer's picks on to the layers that reuse them."""
        return self.selector == "indexer" and self.indexer_every > 1

    @property
    def window_only(self) -> bool:
        """nsa.gates=window: the layer is its sliding-window branch alone (WINDOW_FIELDS are all it reads)."""
        return self.gates == "window"

    def validate(self) -> None:
        for name in ("l", "d", "l_sel", "n_sel", "w", "q_chunk", "sel_chunk", "sel_tile", "win_block"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"nsa.{name} must be positive, got {getattr(self, name)}")
        if self.l % self.d:
            raise ModelConfigError(f"nsa.d={self.d} must divide nsa.l={self.l}")
        if self.l_sel % self.d:
            raise ModelConfigError(f"nsa.d={self.d} must divide nsa.l_sel={self.l_sel}")
        if self.l > self.l_sel:
            raise ModelConfigError(f"nsa.l={self.l} must be <= nsa.l_sel={self.l_sel}")
        if self.n_sel < 3:
            raise ModelConfigError(
                f"nsa.n_sel={self.n_sel} must be >= 3: block 0, the current and the previous block are forced picks"
            )
        if not self.gate_bias > 0:
            raise ModelConfigError(f"nsa.gate_bias must be positive, got {self.gate_bias}")
        if not self.aux_lr_scale > 0:
            raise ModelConfigError(f"nsa.aux_lr_scale must be positive, got {self.aux_lr_scale}")
        if self.gate_hidden < 0:
            raise ModelConfigError(f"nsa.gate_hidden must be >= 0, got {self.gate_hidden}")
        if self.gates not in GATES:
            raise ModelConfigError(f"nsa.gates={self.gates!r}; valid: {', '.join(GATES)}")
        if self.gate_init not in GATE_INITS:
            raise ModelConfigError(f"nsa.gate_init={self.gate_init!r}; valid: {', '.join(GATE_INITS)}")
        if self.selector not in SELECTORS:
            raise ModelConfigError(f"nsa.selector={self.selector!r}; valid: {', '.join(SELECTORS)}")
        for name in ("indexer_heads", "indexer_dim"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"nsa.{name} must be positive, got {getattr(self, name)}")
        if self.indexer_pool not in INDEXER_POOLS:
            raise ModelConfigError(f"nsa.indexer_pool={self.indexer_pool!r}; valid: {', '.join(INDEXER_POOLS)}")
        if self.indexer_target not in INDEXER_TARGETS:
            raise ModelConfigError(f"nsa.indexer_target={self.indexer_target!r}; valid: {', '.join(INDEXER_TARGETS)}")
        if not self.indexer_kl >= 0:
            raise ModelConfigError(f"nsa.indexer_kl must be >= 0, got {self.indexer_kl}")
        if not self.indexer_lr_scale > 0:
            raise ModelConfigError(f"nsa.indexer_lr_scale must be positive, got {self.indexer_lr_scale}")
        if self.indexer_every < 1:
            raise ModelConfigError(f"nsa.indexer_every must be >= 1, got {self.indexer_every}")
        if self.indexer_every > 1 and self.selector != "indexer":
            raise ModelConfigError(f"nsa.indexer_every={self.indexer_every} needs nsa.selector=indexer (the picks it "
                                   f"shares are the indexer's)")
        if self.indexer_warmup_steps < 0:
            raise ModelConfigError(f"nsa.indexer_warmup_steps must be >= 0, got {self.indexer_warmup_steps}")
        if self.sel_distance_cap < 0:
            raise ModelConfigError(f"nsa.sel_distance_cap must be >= 0 (0: off), got {self.sel_distance_cap}")
        if self.sel_distance_cap_from_step < 0:
            raise ModelConfigError(f"nsa.sel_distance_cap_from_step must be >= 0, got {self.sel_distance_cap_from_step}")
        if self.sel_distance_cap_from_step and not self.sel_distance_cap:
            raise ModelConfigError("nsa.sel_distance_cap_from_step needs nsa.sel_distance_cap > 0 (the cap it delays)")
        if self.sel_distance_cap and self.window_only:
            raise ModelConfigError("nsa.sel_distance_cap needs selection: nsa.gates=window has none")
        if self.selector == "indexer" and self.window_only:
            raise ModelConfigError("nsa.selector=indexer needs selection: nsa.gates=window has none")
        if self.kernel not in ("auto", "triton", "torch"):
            raise ModelConfigError(f"nsa.kernel={self.kernel!r}; valid: auto, triton, torch")
        if self.kernel == "triton" and (problem := triton_unavailable()):
            raise ModelConfigError(f"nsa.kernel=triton: {problem}")


@dataclass
class ModelConfig:
    """A decoder-only Transformer. Presets live in configs/*.yaml; see docs/MODELS.md."""

    vocab_size: int = 50304  # embedding rows; >= the tokenizer's size, a multiple of 64
    dim: int = 768  # model width
    n_layers: int = 12  # Transformer blocks
    n_heads: int = 12  # query heads
    n_kv_heads: int = 0  # 0 means n_heads (MHA)
    head_dim: int = 0  # 0 means dim // n_heads
    ffn_dim: int = 3072  # MLP hidden width (SwiGLU: width of each of the gate and up projections)
    max_seq_len: int = 1024  # rows of the learned position table; with RoPE only a documented limit
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    norm_eps: float = 1e-5  # epsilon of every norm (Qwen3: 1e-6)
    mlp: str = "swiglu"  # swiglu | gelu
    pos_emb: str = "rope"  # rope | learned
    rope_theta: float = 10000.0  # RoPE base (LLaMA-2 1e4, LLaMA-3 5e5, Qwen3 1e6)
    rope_scale: float = 1.0  # RoPE stretch factor (>= 1): the model runs at rope_scale x the context it trained at
    rope_scaling: str = "linear"  # how rope_scale stretches: linear (position interpolation) | yarn (NTK-by-parts + temperature; trained context max_seq_len / rope_scale)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    tie_embeddings: bool = False  # output head shares the token embedding matrix
    bias: bool = False  # biases in linear layers and LayerNorm (GPT-2)
    attention: str = "dense"  # dense | nsa
    attn_backend: str = "auto"  # auto (flash-attn when importable on CUDA in bf16/fp16, else SDPA) | sdpa | flash | manual
    dropout: float = 0.0  # dropout on embeddings, attention output and MLP output
    init_std: float = 0.02  # std of the normal init; residual output projections use std / sqrt(2 * n_layers)
    loss_chunk: int = 1024  # rows per chunk of the chunked cross-entropy (fp32 logits for that many rows at a time); 0: full logits
    nsa: NSAConfig = field(default_factory=NSAConfig)

    def __post_init__(self) -> None:
        if isinstance(self.nsa, dict):
            self.nsa = NSAConfig(**self.nsa)
        if self.n_kv_heads == 0:
            self.n_kv_heads = self.n_heads
        if self.head_dim == 0:
            if self.dim % self.n_heads:
                raise ModelConfigError(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}")
            self.head_dim = self.dim // self.n_heads
        self.validate()

    def distance_cap_problem(self) -> str | None:
        """Why the selected branch's distance cap (nsa.sel_distance_cap, or the probe nsa.gate_health.distance_capped)
        cannot apply to this model, or None: it needs plain RoPE (a rotation of unit magnitude it can undo)."""
        if self.pos_emb != "rope" or self.rope_scaling == "yarn":
            return "the distance cap needs plain RoPE positions (model.pos_emb=rope, model.rope_scaling=linear)"
        return None

    @property
    def n_groups(self) -> int:
        """Query heads per KV head (G in the GQA formulas)."""
        return self.n_heads // self.n_kv_heads

    def validate(self) -> None:
        positive = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_seq_len")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ModelConfigError(
                f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}"
            )
        choices = {
            "norm": ("rmsnorm", "layernorm"),
            "mlp": ("swiglu", "gelu"),
            "pos_emb": ("rope", "learned"),
            "attention": ("dense", "nsa"),
            "attn_backend": ("auto", "sdpa", "flash", "manual"),
            "rope_scaling": ("linear", "yarn"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ModelConfigError(f"model.{name}={getattr(self, name)!r}; valid: {', '.join(allowed)}")
        if self.pos_emb == "rope" and self.head_dim % 2:
            raise ModelConfigError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.rope_scale < 1.0:
            raise ModelConfigError(f"model.rope_scale must be >= 1, got {self.rope_scale}")
        if self.norm_eps <= 0:
            raise ModelConfigError(f"model.norm_eps must be positive, got {self.norm_eps}")
        if self.loss_chunk < 0:
            raise ModelConfigError(f"model.loss_chunk must be >= 0 (0: full logits), got {self.loss_chunk}")
        if not 0.0 <= self.dropout < 1.0:
            raise ModelConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.attention == "nsa":
            self.nsa.validate()
            if self.nsa.sel_distance_cap and (problem := self.distance_cap_problem()):
                raise ModelConfigError(f"nsa.sel_distance_cap: {problem}")
