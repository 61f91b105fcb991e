"""python -m train.export_hf CKPT_OR_RUN_DIR OUT_DIR [--dtype fp32|bf16] [--overwrite]

The command line, usage and details: train/export_hf.py (its docstring).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import yaml

from train.checkpoint.io import load_checkpoint, model_from_checkpoint, resolve_checkpoint
from train.core.artifacts import TRAIN_CSV, VAL_CSV, read_csv
from train.core.errors import ConversionError
from train.core.optional import require
from train.hf.convert import ARCHITECTURES, NSA_ONLY, family, to_hf_config, to_hf_tensors

DTYPES = {"fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16")}
EXPORT_MARKERS = ("config.json", "nsa_config.json")  # a directory holding one of these is a previous export


def export(source: Path, out: Path, dtype: str = "fp32", overwrite: bool = False) -> str:
    """Write the export of `source` to `out`; returns the family (gpt2 | llama | qwen3 | nsa)."""
    source, out = Path(source), Path(out)
    ckpt_path = resolve_checkpoint(source)
    _check_destination(out, ckpt_path, overwrite)
    model, run_config = model_from_checkpoint(ckpt_path)
    kind = family(model.cfg)  # refuses what no transformers class computes, before anything is written
    torch_dtype, dtype_name = DTYPES[dtype]
    ckpt = load_checkpoint(ckpt_path)  # memory-mapped: step and tokens seen for the card
    tmp = out.parent / f".{out.name}.tmp{os.getpid()}"
    try:
        tmp.mkdir(parents=True)
        tokenizer_note, special_ids = write_tokenizer(run_config["data"]["tokenizer"], tmp, model.cfg.max_seq_len)
        write_weights(model, torch_dtype, tmp)
        if kind == "nsa":
            _write_json(tmp / "nsa_config.json", run_config)
        else:
            _write_json(tmp / "config.json", to_hf_config(model.cfg, dtype_name, special_ids))
            _write_json(tmp / "generation_config.json", special_ids)
        card = model_card(model, kind, dtype_name, ckpt, ckpt_path, run_config, tokenizer_note)
        (tmp / "README.md").write_text(card)
        _publish(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return kind


def _check_destination(out: Path, ckpt_path: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConversionError(f"OUT_DIR {out} exists and is not a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise ConversionError(f"OUT_DIR {out} is not empty; pass --overwrite to replace a previous export")
    if not any((out / name).exists() for name in EXPORT_MARKERS):
        raise ConversionError(f"OUT_DIR {out} is not a previous export (no {' or '.join(EXPORT_MARKERS)}); "
                              "--overwrite replaces only exports")
    if ckpt_path.resolve().is_relative_to(out.resolve()):
        raise ConversionError(f"OUT_DIR {out} holds the checkpoint being exported; choose another OUT_DIR")


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished export into place; a replaced export is removed only after that."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    old = out.parent / f".{out.name}.old{os.getpid()}" if out.exists() else None
    if old is not None:
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def write_weights(model, dtype: torch.dtype, out: Path) -> None:
    """model.safetensors: HF tensor names (NSA: ours), no tied head."""
    from safetensors.torch import save_file

    tensors = to_hf_tensors(model.cfg, model.state_dict(), dtype)
    path = out / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o666 & ~_umask())  # safetensors renames a private (0600) temporary file into place


def _umask() -> int:
    """The process umask (reading it means setting it, so it is set back at once)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


# ---- tokenizer -------------------------------------------------------------------------------
def write_tokenizer(name: str, out: Path, max_len: int) -> tuple[str, dict[str, int]]:
    """The run's tokenizer files into out. Returns (a line for the card, bos/eos/pad ids). Our
    tokenizers end every document with EOS, so EOS also starts the next: bos = eos, and pad = eos."""
    if name == "byte":
        from train.data.tokenizers import load_tokenizer

        eos = load_tokenizer("byte").eos_id
        return (f"byte (ids 0-255 are UTF-8 bytes, {eos} is EOS): transformers has no such tokenizer, "
                "so no tokenizer files are included", _special_ids(eos, eos, eos))
    if name == "gpt2":
        tok = _gpt2_tokenizer(max_len)
    elif name.startswith("hf:"):
        tok = _hf_tokenizer(name[3:])
    else:
        raise ConversionError(f"the run's tokenizer {name!r} is unknown (expected gpt2, byte or hf:DIR)")
    tok.save_pretrained(str(out))
    eos = tok.eos_token_id
    bos = tok.bos_token_id if tok.bos_token_id is not None else eos
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    return f"{name} (files included; load with AutoTokenizer)", _special_ids(bos, eos, pad)


def _special_ids(bos: int, eos: int, pad: int) -> dict[str, int]:
    return {"bos_token_id": int(bos), "eos_token_id": int(eos), "pad_token_id": int(pad)}


def _gpt2_tokenizer(max_len: int):
    """GPT-2's byte-level BPE from the bundled encoder.json / vocab.bpe (= vocab.json / merges.txt)."""
    require("tokenizers"), require("transformers")  # one line each when missing
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import GPT2TokenizerFast

    from train.data.tokenizers import gpt2_bpe_files

    files = gpt2_bpe_files()
    backend = Tokenizer(BPE.from_file(str(files["encoder.json"]), str(files["vocab.bpe"])))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return GPT2TokenizerFast(tokenizer_object=backend, model_max_length=max_len)


def _hf_tokenizer(where: str):
    AutoTokenizer = require("transformers").AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(where, local_files_only=True)
    except Exception as exc:  # transformers raises OSError / ValueError variants
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConversionError(f"the run's tokenizer hf:{where} cannot be loaded: {first}") from None


# ---- model card ------------------------------------------------------------------------------
def model_card(model, kind: str, dtype_name: str, ckpt: dict, ckpt_path: Path, run_config: dict,
               tokenizer_note: str) -> str:
    cfg = model.cfg
    step, tokens = ckpt["step"], ckpt.get("tokens_seen")
    train_loss, val_loss = final_losses(ckpt_path.parent, step)
    arch = "NSA (no transformers class)" if kind == "nsa" else f"{ARCHITECTURES[kind]} (model_type {kind})"
    heads = f"{cfg.n_heads} heads" + (f" ({cfg.n_kv_heads} KV heads)" if cfg.n_kv_heads != cfg.n_heads else "")
    position = "learned positions" if cfg.pos_emb == "learned" else (
        f"RoPE theta {cfg.rope_theta:g}" + (f", linear scale {cfg.rope_scale:g}" if cfg.rope_scale > 1 else ""))
    lines = [
        f"# {ckpt_path.parent.name}: {arch}",
        "",
        "Exported with `python -m train.export_hf` from this repository's trainer.",
        "",
        f"- Architecture: {arch}; {cfg.n_layers} layers, dim {cfg.dim}, {heads}, head_dim {cfg.head_dim}, "
        f"{cfg.mlp} MLP {cfg.ffn_dim}, {cfg.norm} (eps {cfg.norm_eps:g}), {position}"
        f"{', QK-norm' if cfg.qk_norm else ''}{', biases' if cfg.bias else ''}, vocab {cfg.vocab_size}, "
        f"{'tied' if cfg.tie_embeddings else 'untied'} embeddings, context {cfg.max_seq_len}",
        f"- Parameters: {model.num_params():,} ({model.num_params(False):,} without embeddings; a tied head counts once)",
        f"- Trained: step {step}, {tokens:,} tokens" if tokens is not None else f"- Trained: step {step}",
        f"- Final train loss: {train_loss}",
        f"- Final validation loss: {val_loss}",
        f"- Weights: {dtype_name}",
        f"- Tokenizer: {tokenizer_note}",
        f"- Source checkpoint: `{ckpt_path}`",
        "",
    ]
    if kind == "nsa":
        lines += [NSA_ONLY + ": `model.safetensors` holds our tensor names (a tied lm_head is not stored), "
                  "`nsa_config.json` our run config. There is no config.json. Load it back with "
                  "`python -m train.import_hf DIR OUT.pt` or train from it with `--train.init_from=hf:DIR`.", ""]
    else:
        lines += ["```python", "from transformers import AutoModelForCausalLM",
                  "model = AutoModelForCausalLM.from_pretrained(DIR)", "```", ""]
    lines += ["## Config", "", "```yaml", yaml.safe_dump(run_config, sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)


def final_losses(run_dir: Path, step: int) -> tuple[str, str]:
    """Last logged train / validation losses at or before `step`, from the run's training.csv / val.csv."""
    found = []
    for name, column in ((TRAIN_CSV, "loss"), (VAL_CSV, "val_loss")):
        rows = [r for r in read_csv(run_dir / name) if r.get(column) and int(r["step"]) <= step]
        best = f"{float(rows[-1][column]):.4f} (step {rows[-1]['step']}, {name})" if rows else None
        found.append(best or f"unknown (no {name} row at or before step {step} beside the checkpoint)")
    return found[0], found[1]
