"""Our Transformer <-> Hugging Face `transformers` models: configs and state dicts, both ways.

Pure functions, no file I/O (train/hf/export.py and train/hf/importer.py read and write files).

    family  our ModelConfig                                       transformers class
    gpt2    learned positions + layernorm + gelu (tanh), MHA       GPT2LMHeadModel
    llama   rope + rmsnorm + swiglu                                LlamaForCausalLM
    qwen3   rope + rmsnorm + swiglu + qk_norm, no biases           Qwen3ForCausalLM
    nsa     attention=nsa: no transformers class computes it;      (our names, our config)
            its tensors keep our names and our config describes it

Everything else is refused with a one-line ConversionError naming the reason. docs/HF.md.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from nsa.config import ModelConfig, ModelConfigError
from nsa.model import Transformer
from train.core.errors import ConversionError

ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
GPT2_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")  # both are GELU's tanh approximation, as ours
# tensors some HF checkpoints carry that are not weights (GPT-2's causal-mask buffers, RoPE tables)
IGNORED_HF_TENSORS = re.compile(r"(\.attn\.(masked_)?bias|rotary_emb\.inv_freq)$")
NSA_ONLY = "NSA checkpoints export to safetensors + our own config only (no transformers class computes NSA attention)"


# ---- which family ----------------------------------------------------------------------------
def family(cfg: ModelConfig) -> str:
    """gpt2 | llama | qwen3 | nsa; ConversionError (one line) for a model no transformers class computes."""
    if cfg.attention == "nsa":
        return "nsa"
    if cfg.pos_emb == "learned":
        if (cfg.norm, cfg.mlp) != ("layernorm", "gelu"):
            raise ConversionError(f"a learned-position model exports as GPT-2, which needs norm=layernorm and "
                                  f"mlp=gelu; this one has norm={cfg.norm}, mlp={cfg.mlp}")
        if cfg.n_kv_heads != cfg.n_heads:
            raise ConversionError(f"GPT-2 has no grouped-query attention; this model has n_kv_heads={cfg.n_kv_heads} "
                                  f"!= n_heads={cfg.n_heads}")
        if cfg.head_dim * cfg.n_heads != cfg.dim:
            raise ConversionError(f"GPT-2 needs head_dim = dim / n_heads; this model has head_dim={cfg.head_dim}, "
                                  f"dim={cfg.dim}, n_heads={cfg.n_heads}")
        if cfg.qk_norm:
            raise ConversionError("GPT-2 has no QK-norm; this learned-position model has qk_norm=true")
        if cfg.rope_scale != 1.0:
            raise ConversionError(f"rope_scale={cfg.rope_scale} on a learned-position model has no GPT-2 equivalent")
        return "gpt2"
    if (cfg.norm, cfg.mlp) != ("rmsnorm", "swiglu"):
        raise ConversionError(f"a RoPE model exports as LLaMA or Qwen3, which need norm=rmsnorm and mlp=swiglu; "
                              f"this one has norm={cfg.norm}, mlp={cfg.mlp}")
    if cfg.dim % cfg.n_heads:
        raise ConversionError(f"transformers' LLaMA/Qwen3 configs require dim divisible by n_heads; "
                              f"this model has dim={cfg.dim}, n_heads={cfg.n_heads}")
    if not cfg.qk_norm:
        return "llama"
    if cfg.bias:
        raise ConversionError("Qwen3 has no MLP biases; this QK-norm model has bias=true (in every linear layer)")
    return "qwen3"


# ---- configs ---------------------------------------------------------------------------------
def to_hf_config(cfg: ModelConfig, dtype_name: str, special_ids: dict[str, int]) -> dict:
    """config.json for transformers. dtype_name: float32 | bfloat16; special_ids: bos/eos/pad_token_id."""
    kind = family(cfg)
    if kind == "nsa":
        raise ConversionError(NSA_ONLY)
    common = {"architectures": [ARCHITECTURES[kind]], "model_type": kind, "vocab_size": cfg.vocab_size,
              "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
              "torch_dtype": dtype_name, **special_ids}
    if kind == "gpt2":
        return common | {
            "n_embd": cfg.dim, "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": cfg.ffn_dim,
            "n_positions": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new",
            # our dropout acts on embeddings and residual outputs, never on attention probabilities
            "embd_pdrop": cfg.dropout, "resid_pdrop": cfg.dropout, "attn_pdrop": 0.0,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        }
    hf = common | {
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
        "rope_theta": cfg.rope_theta, "attention_bias": cfg.bias, "attention_dropout": 0.0,
    }
    if cfg.rope_scale > 1.0 and cfg.rope_scaling != "linear":
        raise ConversionError(f"model.rope_scaling={cfg.rope_scaling!r} has no exact transformers equivalent (their YaRN "
                              f"ramps over whole dimensions); export the model with rope_scale 1 or linear scaling")
    if cfg.rope_scale > 1.0:  # position interpolation: positions / factor, as ours
        hf["rope_scaling"] = {"rope_type": "linear", "factor": cfg.rope_scale}
    if kind == "llama":
        hf["mlp_bias"] = cfg.bias
    else:
        hf["use_sliding_window"] = False
    return hf


def from_hf_config(hf: dict) -> ModelConfig:
    """config.json -> our ModelConfig (GPT-2: bias=true; from_hf_tensors may drop all-zero biases).
    ConversionError (one line) for a config we cannot represent."""
    kind = hf.get("model_type")
    if kind == "gpt2":
        fields = _gpt2_fields(hf)
    elif kind in ("llama", "qwen3"):
        fields = _rope_fields(hf, kind)
    else:
        raise ConversionError(f"model_type {kind!r} is not supported; supported: gpt2, llama, qwen3")
    try:
        return ModelConfig(**fields)
    except ModelConfigError as exc:
        raise ConversionError(f"{kind} config cannot be represented: {exc}") from None


def _required(hf: dict, *keys: str) -> list:
    missing = [k for k in keys if hf.get(k) is None]
    if missing:
        raise ConversionError(f"{hf.get('model_type')} config lacks {', '.join(missing)}")
    return [hf[k] for k in keys]


def _gpt2_fields(hf: dict) -> dict:
    vocab, dim, layers, heads = _required(hf, "vocab_size", "n_embd", "n_layer", "n_head")
    act = hf.get("activation_function", "gelu_new")
    if act not in GPT2_TANH_GELUS:
        raise ConversionError(f"GPT-2 activation_function={act!r}; only the tanh GELU ({', '.join(GPT2_TANH_GELUS)}) is supported")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False), ("add_cross_attention", False)):
        if hf.get(key, want) != want:
            raise ConversionError(f"GPT-2 {key}={hf[key]!r} is not supported (ours computes {key}={want})")
    return dict(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, ffn_dim=hf.get("n_inner") or 4 * dim,
                max_seq_len=hf.get("n_positions", 1024), norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                mlp="gelu", pos_emb="learned", tie_embeddings=hf.get("tie_word_embeddings", True), bias=True,
                dropout=float(hf.get("resid_pdrop", 0.0)), init_std=hf.get("initializer_range", 0.02))


def _rope_fields(hf: dict, kind: str) -> dict:
    vocab, dim, layers, heads, ffn = _required(hf, "vocab_size", "hidden_size", "num_hidden_layers",
                                               "num_attention_heads", "intermediate_size")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"{kind} hidden_act={hf['hidden_act']!r}; only silu (SwiGLU) is supported")
    attention_bias = bool(hf.get("attention_bias", False))
    if kind == "llama" and attention_bias != bool(hf.get("mlp_bias", False)):
        raise ConversionError(f"llama attention_bias={attention_bias} differs from mlp_bias={hf.get('mlp_bias', False)}; "
                              "ours has biases in every linear layer or in none")
    if kind == "qwen3":
        if attention_bias:
            raise ConversionError("qwen3 attention_bias=true is not supported (biases in attention but not in the MLP)")
        if hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or []):
            raise ConversionError("qwen3 sliding-window attention layers are not supported")
    theta, scale = _rope(hf)
    head_dim = hf.get("head_dim") or (128 if kind == "qwen3" else dim // heads)  # transformers' defaults
    return dict(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads,
                n_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim, ffn_dim=ffn,
                max_seq_len=hf.get("max_position_embeddings", 32768 if kind == "qwen3" else 2048),
                norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), mlp="swiglu", pos_emb="rope",
                rope_theta=theta, rope_scale=scale, qk_norm=kind == "qwen3",
                tie_embeddings=hf.get("tie_word_embeddings", False), bias=attention_bias,
                init_std=hf.get("initializer_range", 0.02))


def _rope(hf: dict) -> tuple[float, float]:
    """(theta, linear scale) from transformers 5 `rope_parameters` or 4.x `rope_theta` + `rope_scaling`."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise ConversionError("per-layer-type rope_parameters are not supported")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ConversionError(f"rope type {kind!r} is not supported (only default and linear position interpolation)")
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConversionError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    return theta, float(params["factor"]) if kind == "linear" else 1.0


# ---- state dicts -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """One of our tensors and the HF tensor(s) holding it."""

    ours: str  # our state-dict name
    theirs: tuple[str, ...]  # several: ours is their tensors concatenated along dim 0 (fused qkv, gate|up)
    sizes: tuple[int, ...] = ()  # rows of each part, when several
    transpose: bool = False  # GPT-2's Conv1D stores weights as [in, out]; ours (nn.Linear) as [out, in]


def links(cfg: ModelConfig) -> list[Link]:
    """Every tensor of our model and where it lives in the HF (or, for NSA, our own) checkpoint.
    A tied lm_head has no link: it is the token embedding."""
    kind = family(cfg)
    if kind == "nsa":
        return [Link(name, (name,)) for name in our_state_shapes(cfg) if not _is_tied_head(cfg, name)]
    return _gpt2_links(cfg) if kind == "gpt2" else _rope_links(cfg)


def _is_tied_head(cfg: ModelConfig, name: str) -> bool:
    return cfg.tie_embeddings and name == "lm_head.weight"


def _gpt2_links(cfg: ModelConfig) -> list[Link]:
    out = [Link("tok_emb.weight", ("transformer.wte.weight",)), Link("pos_emb.weight", ("transformer.wpe.weight",))]
    params = ("weight", "bias") if cfg.bias else ("weight",)
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b, conv in (("attn_norm", "ln_1", False), ("attn.qkv", "attn.c_attn", True),
                           ("attn.proj", "attn.c_proj", True), ("mlp_norm", "ln_2", False),
                           ("mlp.w_in", "mlp.c_fc", True), ("mlp.w_out", "mlp.c_proj", True)):
            out += [Link(f"{ours}{a}.{p}", (f"{theirs}{b}.{p}",), transpose=conv and p == "weight") for p in params]
    out += [Link(f"norm.{p}", (f"transformer.ln_f.{p}",)) for p in params]
    return out + ([] if cfg.tie_embeddings else [Link("lm_head.weight", ("lm_head.weight",))])


def _rope_links(cfg: ModelConfig) -> list[Link]:
    q, kv, ffn = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    params = ("weight", "bias") if cfg.bias else ("weight",)
    out = [Link("tok_emb.weight", ("model.embed_tokens.weight",))]
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        out += [Link(f"{ours}attn_norm.weight", (f"{theirs}input_layernorm.weight",)),
                Link(f"{ours}mlp_norm.weight", (f"{theirs}post_attention_layernorm.weight",))]
        for p in params:
            out += [Link(f"{ours}attn.qkv.{p}", tuple(f"{theirs}self_attn.{x}_proj.{p}" for x in "qkv"), (q, kv, kv)),
                    Link(f"{ours}attn.proj.{p}", (f"{theirs}self_attn.o_proj.{p}",)),
                    Link(f"{ours}mlp.w_in.{p}", (f"{theirs}mlp.gate_proj.{p}", f"{theirs}mlp.up_proj.{p}"), (ffn, ffn)),
                    Link(f"{ours}mlp.w_out.{p}", (f"{theirs}mlp.down_proj.{p}",))]
        if cfg.qk_norm:
            out += [Link(f"{ours}attn.{n}.weight", (f"{theirs}self_attn.{n}.weight",)) for n in ("q_norm", "k_norm")]
    out.append(Link("norm.weight", ("model.norm.weight",)))
    return out + ([] if cfg.tie_embeddings else [Link("lm_head.weight", ("lm_head.weight",))])


def our_state_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Every state-dict name of our model and its shape (built on the meta device: no memory)."""
    with torch.device("meta"):
        return {name: t.shape for name, t in Transformer(cfg).state_dict().items()}


def to_hf_tensors(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Our state dict -> the HF checkpoint's tensors (own memory each, as safetensors needs).
    GPT-2 always has biases: a bias-free model of ours exports exact zeros."""
    out: dict[str, torch.Tensor] = {}
    for link in links(cfg):
        tensor = state[link.ours]
        parts = tensor.split(link.sizes) if link.sizes else (tensor,)
        for name, part in zip(link.theirs, parts):
            out[name] = (part.t() if link.transpose else part).to(dtype).contiguous().clone()
    if family(cfg) == "gpt2" and not cfg.bias:
        for link in _missing_gpt2_biases(cfg):
            rows = state[link.ours.removesuffix(".bias") + ".weight"].shape[0]  # LayerNorm [D]; Linear [out, in]
            out[link.theirs[0]] = torch.zeros(rows, dtype=dtype)
    return out


def _missing_gpt2_biases(cfg: ModelConfig) -> list[Link]:
    """The bias links GPT-2 has and a bias-free model of ours lacks."""
    return [link for link in _gpt2_links(dataclasses.replace(cfg, bias=True)) if link.ours.endswith(".bias")]


def from_hf_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """HF checkpoint tensors -> (our config, our float32 state dict). A GPT-2 whose biases are all exactly
    zero becomes bias=false (the same function). ConversionError for a missing or unexpected tensor."""
    tensors = _with_prefix(cfg, {k: v for k, v in tensors.items() if not IGNORED_HF_TENSORS.search(k)})
    unused = set(tensors)
    if family(cfg) == "gpt2" and cfg.bias:
        biases = [link.theirs[0] for link in _missing_gpt2_biases(cfg)]
        if all(name in tensors and not tensors[name].any() for name in biases):
            cfg = dataclasses.replace(cfg, bias=False)
            unused -= set(biases)
    state: dict[str, torch.Tensor] = {}
    for link in links(cfg):
        missing = [name for name in link.theirs if name not in tensors]
        if missing:
            raise ConversionError(f"checkpoint lacks tensor {missing[0]!r} (our {link.ours})")
        tensor = torch.cat([tensors[name] for name in link.theirs]) if link.sizes else tensors[link.theirs[0]]
        state[link.ours] = (tensor.t() if link.transpose else tensor).float().contiguous()
        unused -= set(link.theirs)
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["tok_emb.weight"]
        unused.discard("lm_head.weight")  # transformers ties it on load; a stored copy is ignored
    if unused:
        raise ConversionError(f"checkpoint has tensors this {family(cfg)} model does not use: {', '.join(sorted(unused)[:3])}")
    return cfg, state


def _with_prefix(cfg: ModelConfig, tensors: dict) -> dict:
    """A base model saved without its head class has no `transformer.` / `model.` prefix; add it."""
    prefix = {"gpt2": "transformer.", "llama": "model.", "qwen3": "model."}.get(family(cfg))
    if prefix is None or any(k.startswith(prefix) for k in tensors):
        return tensors
    return {(k if k == "lm_head.weight" else prefix + k): v for k, v in tensors.items()}
