"""FLOP accounting, parameter counts, dense peak throughput and MFU.

Three ways to count training FLOPs per token (docs/MFU.md explains each, with the formulas below):

    v1  nanogpt_legacy_v1          6N + 12·L·H·Q·T                       (PaLM appendix B, as nanoGPT does it)
    v2  combined_formula_v2        per layer 2SH²(2 + 2/G) + 4S²H, + MLP and logits, training = 3 × forward
    v3  component_summation_v2025  Q, K, V, O, scores, weighted values, MLP, norms, logits summed one by one;
                                   backward = 2 × forward; NSA-aware when cfg.attention == "nsa"

Conventions shared by all three:
  * FLOPs of a matmul [m, k] @ [k, n] = 2·m·k·n (one multiply and one add), as FlopCounterMode counts.
  * Dense causal attention counts the full S × S score rectangle (S keys per query), not the causal half.
    That is what PaLM's 12·L·H·Q·T, the v2 term 4S²H, the manual attention path and FlopCounterMode
    (for SDPA and plain matmuls alike) count. A causal flash kernel skips about half of it.
  * NSA attention counts the keys each branch may see, averaged over query positions (model FLOPs:
    masked chunk tails and recomputation in the implementation are not credited).
  * Not counted anywhere: embedding lookup, RoPE, softmax, activations, residual adds, bias adds, dropout,
    the loss. v3 does count norms (approximately, see NORM_FLOPS_PER_ELEMENT).

This module is plain arithmetic on ModelConfig; it never builds a model and never imports train/.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import asdict, dataclass, field
from typing import Sequence

from nsa.config import ModelConfig

# ------------------------------------------------------------------------------------------------
# Parameter count
# ------------------------------------------------------------------------------------------------


def _norm_params(cfg: ModelConfig, dim: int) -> int:
    """LayerNorm: weight (+ bias when cfg.bias); RMSNorm: weight only."""
    if cfg.norm == "layernorm":
        return dim * (2 if cfg.bias else 1)
    return dim


def _linear_params(cfg: ModelConfig, d_in: int, d_out: int) -> int:
    return d_in * d_out + (d_out if cfg.bias else 0)


def _dense_attention_params(cfg: ModelConfig) -> int:
    D, H, H_kv, hd = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    qkv = _linear_params(cfg, D, H * hd + 2 * H_kv * hd)  # fused Q, K, V projections
    out = _linear_params(cfg, H * hd, D)
    qk_norm = 2 * hd if cfg.qk_norm else 0  # one RMSNorm(head_dim) for q, one for k
    return qkv + out + qk_norm


def _nsa_attention_params(cfg: ModelConfig) -> int:
    """NativeSparseAttention (nsa/attention/nsa.py): q_proj, kv_proj (K and V for 3 branches),
    φ_K and φ_V (BlockCompressor: position encoding [l, hd], l·hd -> hd -> hd), gate MLP
    D -> gate_hidden -> 3·n_heads (always with biases), output projection, optional QK-norm.
    Window-only (nsa.gates=window): q_proj, kv_proj of the window branch, output projection, QK-norm; no φ, no gate."""
    D, H, H_kv, hd, l = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.nsa.l
    q = _linear_params(cfg, D, H * hd)
    kv = _linear_params(cfg, D, 2 * nsa_kv_branches(cfg) * H_kv * hd)
    out = _linear_params(cfg, H * hd, D)
    qk_norm = 2 * hd if cfg.qk_norm else 0
    if cfg.nsa.window_only:
        return q + kv + out + qk_norm
    phi = l * hd + _linear_params(cfg, l * hd, hd) + _linear_params(cfg, hd, hd)
    gate = mlp_params(default_gate_widths(cfg))
    return q + kv + 2 * phi + gate + out + qk_norm


def mlp_params(widths: Sequence[int]) -> int:
    """Weights and biases of an MLP with layer widths (w0, ..., wn): Σ (w_i + 1)·w_{i+1}."""
    return sum((a + 1) * b for a, b in zip(widths[:-1], widths[1:]))


def _mlp_params(cfg: ModelConfig) -> int:
    D, F = cfg.dim, cfg.ffn_dim
    n_in = 2 * F if cfg.mlp == "swiglu" else F  # SwiGLU fuses gate and up: [D] -> [2F]
    return _linear_params(cfg, D, n_in) + _linear_params(cfg, F, D)


def param_count(cfg: ModelConfig, include_embeddings: bool = True) -> int:
    """Unique parameters of Transformer(cfg) by closed-form arithmetic (a tied head counts once).

    include_embeddings=False drops the token table and the learned position table, exactly as
    Transformer.num_params(include_embeddings=False) does; an untied lm_head stays in.
    NSA layers follow the shapes of nsa/attention/nsa.py (see _nsa_attention_params).
    """
    V, D, L = cfg.vocab_size, cfg.dim, cfg.n_layers
    attention = _nsa_attention_params(cfg) if cfg.attention == "nsa" else _dense_attention_params(cfg)
    per_layer = 2 * _norm_params(cfg, D) + attention + _mlp_params(cfg)
    body = L * per_layer + _norm_params(cfg, D)  # blocks + final norm
    lm_head = 0 if cfg.tie_embeddings else V * D
    if not include_embeddings:
        return body + lm_head
    tok_emb = V * D
    pos_emb = cfg.max_seq_len * D if cfg.pos_emb == "learned" else 0
    return body + lm_head + tok_emb + pos_emb


# ------------------------------------------------------------------------------------------------
# FLOPs per token
# ------------------------------------------------------------------------------------------------

METHODS = {
    "v1": "nanogpt_legacy_v1",
    "v2": "combined_formula_v2",
    "v3": "component_summation_v2025",
}

# Approximate elementwise FLOPs per normalised element (v3 only; FlopCounterMode counts none of them).
#   RMSNorm:   x², sum, scale by rsqrt, × weight                          -> 4
#   LayerNorm: mean, subtract, x², sum, normalise, × weight (+ bias)      -> 6 (+1 with bias)
NORM_FLOPS_PER_ELEMENT = {"rmsnorm": 4, "layernorm": 6}

# Breakdown keys that belong to attention (for attention_to_ffn_ratio); MLP keys start with "mlp".
_ATTENTION_PREFIX = "attn_"


@dataclass(frozen=True)
class FlopsReport:
    """FLOPs per token of one training step at sequence length `seq_len`.

    flops_per_token:          training, forward + backward (what MFU uses)
    forward_flops_per_token:  forward only
    attention_to_ffn_ratio:   forward attention FLOPs / forward MLP FLOPs (None for v1: it has no split)
    breakdown:                forward FLOPs per token by component, summed over layers
    """

    calculation_method: str
    flops_per_token: float
    forward_flops_per_token: float
    attention_to_ffn_ratio: float | None
    breakdown: dict[str, float] = field(default_factory=dict)
    seq_len: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def flops_per_token(cfg: ModelConfig, seq_len: int, method: str = "v3") -> FlopsReport:
    """Training FLOPs per token of `cfg` at sequence length `seq_len` by one of the three methods.

    method: "v1" | "v2" | "v3" or the full names nanogpt_legacy_v1 | combined_formula_v2 |
    component_summation_v2025. Only v3 knows NSA; v1 and v2 always use their dense formulas.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    name = METHODS.get(method, method)
    if name == "nanogpt_legacy_v1":
        return _flops_v1(cfg, seq_len)
    if name == "combined_formula_v2":
        return _flops_v2(cfg, seq_len)
    if name == "component_summation_v2025":
        return _flops_v3(cfg, seq_len)
    valid = ", ".join(list(METHODS) + list(METHODS.values()))
    raise ValueError(f"unknown FLOP counting method {method!r}; valid: {valid}")


def _report(name: str, seq_len: int, breakdown: dict[str, float], training: float | None = None) -> FlopsReport:
    """Totals from a forward breakdown; training = 3 × forward unless given (v1 states it directly).

    attention_to_ffn_ratio = Σ "attn_*" / Σ "mlp*" entries; None without MLP entries (v1).
    """
    forward = float(sum(breakdown.values()))
    attention = sum(v for k, v in breakdown.items() if k.startswith(_ATTENTION_PREFIX))
    mlp = sum(v for k, v in breakdown.items() if k.startswith("mlp"))
    ratio = attention / mlp if mlp else None
    return FlopsReport(
        calculation_method=name,
        flops_per_token=3.0 * forward if training is None else float(training),
        forward_flops_per_token=forward,
        attention_to_ffn_ratio=ratio,
        breakdown=breakdown,
        seq_len=seq_len,
    )


def _flops_v1(cfg: ModelConfig, seq_len: int) -> FlopsReport:
    """nanoGPT's estimate_mfu: 6N + 12·L·H·Q·T.

    N is what nanoGPT's get_num_params(non_embedding=True) returns: every parameter except the
    position table. The token table stays in (in nanoGPT it is tied to lm_head and stands in for
    the logits matmul), so an *untied* model also counts its input embedding as if it were a matmul:
    v1 exceeds v3 by about 6·V·D there. GQA itself is not the cause: N counts the real, smaller K/V.
    H = n_heads, Q = head_dim, T = seq_len; the attention term counts the full T × T rectangle.
    """
    L, H, Q, T = cfg.n_layers, cfg.n_heads, cfg.head_dim, seq_len
    N = param_count(cfg, include_embeddings=True)
    if cfg.pos_emb == "learned":
        N -= cfg.max_seq_len * cfg.dim
    training = 6 * N + 12 * L * H * Q * T
    breakdown = {"params_2N": 2.0 * N, "attn_4LHQT": 4.0 * L * H * Q * T}
    return _report("nanogpt_legacy_v1", seq_len, breakdown, training=training)


def _flops_v2(cfg: ModelConfig, seq_len: int) -> FlopsReport:
    """Algebraic GQA form, per layer forward over one sequence:

        attention = 2SH²(2 + 2/G) + 4S²H     (Q and O: 2·2SH²; K and V: 2·2SH²/G; QKᵀ and AV: 4S²H)
        mlp       = 3·2SHF (SwiGLU) or 2·2SHF (GELU)
        logits    = 2SHV (once, after the last layer)

    divided by S for per-token numbers. H is the hidden size (dim), G = n_heads / n_kv_heads.
    Assumes n_heads·head_dim == dim (true for every preset); norms are not counted.
    """
    S, H, G, F, V, L = seq_len, cfg.dim, cfg.n_groups, cfg.ffn_dim, cfg.vocab_size, cfg.n_layers
    n_mlp_matmuls = 3 if cfg.mlp == "swiglu" else 2
    per_sequence = {
        "attn_projections": L * 2 * S * H**2 * (2 + 2 / G),
        "attn_scores_values": L * 4 * S**2 * H,
        "mlp": L * n_mlp_matmuls * 2 * S * H * F,
        "logits": 2 * S * H * V,
    }
    return _report("combined_formula_v2", seq_len, {k: v / S for k, v in per_sequence.items()})


def _flops_v3(cfg: ModelConfig, seq_len: int) -> FlopsReport:
    """Explicit component summation, forward per token (×L for per-layer terms), training = 3 × forward:

        attn_q       = 2·D·(H·hd)                 attn_o      = 2·(H·hd)·D
        attn_k       = 2·D·(H_kv·hd) = attn_q / G attn_v      = attn_k
        attn_scores  = 2·H·hd·S                   attn_values = 2·H·hd·S      (full S keys per query)
        mlp_gate, mlp_up, mlp_down = 2·D·F each (SwiGLU); mlp_up, mlp_down (GELU)
        norms        = NORM_FLOPS_PER_ELEMENT·(2·L·D + D) (+ qk-norm on q and k)
        logits       = 2·D·V

    NSA (cfg.attention == "nsa") replaces the attention terms with nsa_attention_flops().
    """
    D, L, V, F = cfg.dim, cfg.n_layers, cfg.vocab_size, cfg.ffn_dim
    if cfg.attention == "nsa":
        attention = nsa_attention_flops(cfg, seq_len)
        norms = norm_flops(cfg, qk_norm_k_heads=nsa_kv_branches(cfg) * cfg.n_kv_heads)  # k-norm on every branch's keys
    else:
        attention = dense_attention_flops(cfg, seq_len)
        norms = norm_flops(cfg)
    breakdown = {k: L * v for k, v in attention.items()}
    if cfg.mlp == "swiglu":
        breakdown |= {"mlp_gate": L * 2 * D * F, "mlp_up": L * 2 * D * F, "mlp_down": L * 2 * F * D}
    else:
        breakdown |= {"mlp_up": L * 2 * D * F, "mlp_down": L * 2 * F * D}
    breakdown["norms"] = norms
    breakdown["logits"] = 2 * D * V
    return _report("component_summation_v2025", seq_len, {k: float(v) for k, v in breakdown.items()})


def dense_attention_flops(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token of one dense attention layer (see _flops_v3 for the formulas)."""
    D, H, H_kv, hd, S = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, seq_len
    return {
        "attn_q": 2 * D * H * hd,
        "attn_k": 2 * D * H_kv * hd,
        "attn_v": 2 * D * H_kv * hd,
        "attn_scores": 2 * H * hd * S,
        "attn_values": 2 * H * hd * S,
        "attn_o": 2 * H * hd * D,
    }


def norm_flops(cfg: ModelConfig, qk_norm_k_heads: int | None = None) -> float:
    """Approximate forward FLOPs per token of all norms: 2 per block + the final one, plus QK-norm.

    qk_norm_k_heads: how many key heads are normalised (n_kv_heads for dense attention).
    """
    per_element = NORM_FLOPS_PER_ELEMENT[cfg.norm] + (1 if cfg.norm == "layernorm" and cfg.bias else 0)
    total = per_element * (2 * cfg.n_layers + 1) * cfg.dim
    if cfg.qk_norm:
        k_heads = cfg.n_kv_heads if qk_norm_k_heads is None else qk_norm_k_heads
        total += NORM_FLOPS_PER_ELEMENT["rmsnorm"] * cfg.n_layers * (cfg.n_heads + k_heads) * cfg.head_dim
    return float(total)


# ------------------------------------------------------------------------------------------------
# NSA attention (Yuan et al. 2025): three branches - compressed, selected, sliding window
# ------------------------------------------------------------------------------------------------

NSA_BRANCHES = 3  # compression, selection, sliding window: each has its own K and V projections


def nsa_kv_branches(cfg: ModelConfig) -> int:
    """Branches with K and V projections of their own: 3, or 1 for a window-only layer (nsa.gates=window)."""
    return 1 if cfg.nsa.window_only else NSA_BRANCHES


def mlp_flops(widths: Sequence[int]) -> int:
    """Forward FLOPs of an MLP with layer widths (w0, w1, ..., wn) applied to one input: Σ 2·w_i·w_{i+1}."""
    return sum(2 * a * b for a, b in zip(widths[:-1], widths[1:]))


def default_phi_widths(cfg: ModelConfig) -> tuple[int, ...]:
    """Shape of the compression MLP φ: one block of l keys (l·head_dim inputs) -> one key.

    Matches BlockCompressor in nsa/attention/compressor.py: φ(X) = mean_j X_j + W2 gelu(W1 flatten(X + E)),
    W1: l·hd -> hd, W2: hd -> hd, applied per compressed token per KV head, once for K and once for V.
    The mean, the position-encoding add and gelu are elementwise and not counted.
    """
    return (cfg.nsa.l * cfg.head_dim, cfg.head_dim, cfg.head_dim)


def default_gate_widths(cfg: ModelConfig) -> tuple[int, ...]:
    """Gate MLP of nsa/attention/nsa.py: x [D] -> gate_hidden (0 means max(1, D // 4)) -> 3 gates per head."""
    hidden = cfg.nsa.gate_hidden or max(1, cfg.dim // 4)
    return (cfg.dim, hidden, NSA_BRANCHES * cfg.n_heads)


def mean_capped_keys(cap: int, seq_len: int) -> float:
    """Mean over query positions t = 0..S-1 of min(cap, t + 1): keys a capped causal branch sees.

    S <= cap:  (S + 1) / 2
    S >  cap:  (cap·(cap + 1)/2 + (S - cap)·cap) / S
    """
    S = seq_len
    if S <= cap:
        return (S + 1) / 2
    return (cap * (cap + 1) / 2 + (S - cap) * cap) / S


def n_compressed_blocks(l: int, d: int, seq_len: int) -> int:
    """Compressed tokens in a sequence: blocks [j·d, j·d + l) that fit, j = 0..nb-1."""
    return 0 if seq_len < l else (seq_len - l) // d + 1


def mean_compressed_keys(l: int, d: int, seq_len: int) -> float:
    """Mean over query positions of the compressed tokens visible to a query.

    Block j ends at position j·d + l - 1 and is visible to the S - (j·d + l - 1) queries at or after it:
        mean = Σ_j (S - l + 1 - j·d) / S = (nb·(S - l + 1) - d·nb·(nb - 1)/2) / S  ≈ (S - l) / (2d)
    """
    S, nb = seq_len, n_compressed_blocks(l, d, seq_len)
    return (nb * (S - l + 1) - d * nb * (nb - 1) / 2) / S


def nsa_attention_flops(
    cfg: ModelConfig,
    seq_len: int,
    phi_widths: Sequence[int] | None = None,
    gate_widths: Sequence[int] | None = None,
) -> dict[str, float]:
    """Forward FLOPs per token of one NSA attention layer.

        attn_q, attn_o        as dense
        attn_k, attn_v        3 × dense (one K and one V projection per branch)
        attn_compress_phi     2 (K and V) · H_kv · (nb / S) · mlp_flops(φ)   (nb / S ≈ 1/d compressed tokens per token)
        attn_gate             mlp_flops(gate)
        attn_cmp              4·H·hd · mean compressed keys visible      ≈ (S - l) / (2d)
        attn_sel              4·H·hd · mean min(n·l', t + 1)
        attn_win              4·H·hd · mean min(w, t + 1)
    where 4·H·hd per key is QKᵀ (2·hd) plus the weighted value (2·hd) for each of the H query heads.
    A window-only layer (nsa.gates=window) has attn_q, attn_o, attn_k and attn_v as dense and attn_win alone.

    These are model FLOPs: each branch is charged the keys it may see. Work the implementation does
    beyond that is not credited (docs/MFU.md): the masked tails of query chunks and selection tiles,
    and the block-importance scores, which the paper takes from the compressed branch's softmax but
    nsa/attention/impl/compression.py recomputes (forward only, QKᵀ against all nb compressed tokens).
    Not counted either: softmax, the overlap sum of Eq. 9, top-n, gathers, the gated sum (elementwise).
    """
    D, H, H_kv, hd, S = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, seq_len
    nsa = cfg.nsa
    phi = default_phi_widths(cfg) if phi_widths is None else tuple(phi_widths)
    gate = default_gate_widths(cfg) if gate_widths is None else tuple(gate_widths)
    per_key = 4 * H * hd
    if nsa.window_only:
        return {
            "attn_q": 2 * D * H * hd,
            "attn_k": 2 * D * H_kv * hd,
            "attn_v": 2 * D * H_kv * hd,
            "attn_win": per_key * mean_capped_keys(nsa.w, S),
            "attn_o": 2 * H * hd * D,
        }
    compressed_per_token = n_compressed_blocks(nsa.l, nsa.d, S) / S
    return {
        "attn_q": 2 * D * H * hd,
        "attn_k": NSA_BRANCHES * 2 * D * H_kv * hd,
        "attn_v": NSA_BRANCHES * 2 * D * H_kv * hd,
        "attn_compress_phi": 2 * H_kv * compressed_per_token * mlp_flops(phi),
        "attn_gate": mlp_flops(gate),
        "attn_cmp": per_key * mean_compressed_keys(nsa.l, nsa.d, S),
        "attn_sel": per_key * mean_capped_keys(nsa.n_sel * nsa.l_sel, S),
        "attn_win": per_key * mean_capped_keys(nsa.w, S),
        "attn_o": 2 * H * hd * D,
    }


# ------------------------------------------------------------------------------------------------
# Dense peak throughput and MFU
# ------------------------------------------------------------------------------------------------

# Dense (no 2:4 sparsity) peak TFLOPS per GPU from NVIDIA's datasheets. "bf16" is the tensor-core
# rate with FP32 accumulate (FP16 is the same on every device listed), "tf32" the tensor-core TF32
# rate, "fp32" the non-tensor FP32 rate. Sparse figures are exactly twice these and are never used.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "RTX A6000": {"bf16": 154.8, "tf32": 77.4, "fp32": 38.7},
    "RTX 4090": {"bf16": 165.2, "tf32": 82.6, "fp32": 82.6},
    "H100 SXM": {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.0, "tf32": 417.5, "fp32": 60.0},
    "H200": {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0},
    "H200 NVL": {"bf16": 835.0, "tf32": 417.5, "fp32": 60.0},
    "B200": {"bf16": 2250.0, "tf32": 1100.0, "fp32": 75.0},
}

# torch.cuda.get_device_name() patterns, most specific first; the first match wins.
# \b keeps GH200 / GB200 / RTX A1000 from matching H200 / B200 / A100.
_DEVICE_PATTERNS: list[tuple[str, str]] = [
    (r"\bH100\b.*\bPCIe\b", "H100 PCIe"),
    (r"\bH100\b.*\bNVL\b", "H100 NVL"),
    (r"\bH100\b", "H100 SXM"),  # "NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5 80GB"
    (r"\bH200\b.*\bNVL\b", "H200 NVL"),
    (r"\bH200\b", "H200"),
    (r"\bB200\b", "B200"),
    (r"\bA100\b", "A100"),  # SXM4 and PCIe have the same peaks
    (r"\bRTX A6000\b", "RTX A6000"),
    (r"\bRTX 4090\b(?!\s*(D\b|Laptop))", "RTX 4090"),  # not the cut-down 4090 D or the laptop part
]

_DTYPE_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16", "fp16": "bf16", "float16": "bf16", "half": "bf16",
    "tf32": "tf32",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
}

_warned_devices: set[str] = set()


def match_device(device_name: str) -> str | None:
    """The PEAK_TFLOPS key for a torch.cuda.get_device_name() string, or None."""
    for pattern, key in _DEVICE_PATTERNS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return key
    return None


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of one GPU (not TFLOPS) for a device name and a compute dtype.

    dtype: bf16 | bfloat16 | fp16 | float16 | tf32 | fp32 | float32 (a "torch." prefix is ignored).
    An unknown device returns None and warns once per name: MFU is then not reported rather than
    computed against a guessed peak.
    """
    key = _DTYPE_ALIASES.get(str(dtype).lower().removeprefix("torch."))
    if key is None:
        raise ValueError(f"unknown dtype {dtype!r} for peak FLOPs; valid: {', '.join(_DTYPE_ALIASES)}")
    device = match_device(device_name)
    if device is None:
        if device_name not in _warned_devices:
            _warned_devices.add(device_name)
            warnings.warn(f"no dense peak FLOPs known for device {device_name!r}; MFU will not be reported",
                          stacklevel=2)
        return None
    return PEAK_TFLOPS[device][key] * 1e12


def mfu(tokens_per_s_global: float, flops_per_token: float, peak_flops_per_gpu: float | None,
        n_gpus: int) -> float | None:
    """Model FLOPs utilisation = tokens/s × FLOPs/token / (peak FLOP/s per GPU × n_gpus).

    tokens_per_s_global: training tokens per second over all GPUs, with eval and checkpoint time
    excluded (the caller's job). flops_per_token: training FLOPs (FlopsReport.flops_per_token).
    Returns None when the peak is unknown.
    """
    if n_gpus < 1:
        raise ValueError(f"n_gpus must be >= 1, got {n_gpus}")
    if tokens_per_s_global < 0 or flops_per_token < 0:
        raise ValueError("tokens_per_s_global and flops_per_token must be non-negative")
    if peak_flops_per_gpu is None:
        return None
    if peak_flops_per_gpu <= 0:
        raise ValueError(f"peak_flops_per_gpu must be positive, got {peak_flops_per_gpu}")
    return tokens_per_s_global * flops_per_token / (peak_flops_per_gpu * n_gpus)
