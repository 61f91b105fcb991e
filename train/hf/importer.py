"""python -m train.import_hf HF_DIR OUT_CKPT

The command line, usage and details: train/import_hf.py (its docstring).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from nsa.config import ModelConfig, architecture_keys
from train.checkpoint.io import (
    FORMAT_VERSION,
    FREE_MODEL_FIELDS,
    atomic_save,
    load_checkpoint,
    resolve_checkpoint,
    rng_state,
    stored_model_config,
)
from train.core.config import RunConfig
from train.core.data_config import DataConfig
from train.core.errors import CheckpointError, ConfigError, ConversionError
from train.hf.convert import from_hf_config, from_hf_tensors, our_state_shapes

# model fields a source may differ in from the run: they change neither shapes nor the trained weights'
# meaning (rope_scale: context extension by position interpolation is a reason to start from weights)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


# ---- reading ---------------------------------------------------------------------------------
def read_model_dir(model_dir: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """-> (our model config, our float32 state dict, the run config a checkpoint of it stores)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConversionError(f"{model_dir} is not a directory (expected a Hugging Face model directory)")
    if (model_dir / "nsa_config.json").is_file() and not (model_dir / "config.json").is_file():
        run_config = _read_json(model_dir / "nsa_config.json")
        cfg = stored_model_config(run_config, str(model_dir / "nsa_config.json"))
    else:
        cfg = from_hf_config(_read_json(model_dir / "config.json"))
        run_config = None
    cfg, state = from_hf_tensors(cfg, _read_tensors(model_dir))
    if run_config is None:  # a transformers model: our defaults, its tokenizer when the directory has one
        has_tokenizer = any((model_dir / name).is_file() for name in TOKENIZER_FILES)
        data = DataConfig(tokenizer=f"hf:{model_dir.resolve()}") if has_tokenizer else DataConfig()
        run_config = RunConfig(model=cfg, data=data).to_dict()
    return cfg, state, run_config


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ConversionError(f"{path} not found (a Hugging Face model directory has config.json; "
                              "an NSA export has nsa_config.json)")
    try:
        found = json.loads(path.read_text())
    except (ValueError, OSError) as exc:
        raise ConversionError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(found, dict):
        raise ConversionError(f"{path} does not hold a JSON object")
    return found


def _read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, or the shards a model.safetensors.index.json names."""
    from safetensors.torch import load_file

    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        files = sorted({model_dir / name for name in _read_json(index).get("weight_map", {}).values()})
    else:
        raise ConversionError(f"{model_dir} has no model.safetensors nor model.safetensors.index.json "
                              "(only safetensors weights are read)")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            tensors.update(load_file(str(path)))
        except Exception as exc:  # safetensors raises its own SafetensorError, or OSError
            raise ConversionError(f"{path} cannot be read as safetensors: {str(exc).splitlines()[0]}") from None
    return tensors


# ---- checks ----------------------------------------------------------------------------------
# what a longer-context stage may change (train.extend_from): positions and the window, never a weight's shape
EXTENSION_FIELDS = frozenset({"max_seq_len", "rope_theta", "rope_scale", "rope_scaling", "nsa.w"})


def architecture_diffs(source: ModelConfig, run: ModelConfig, free_fields: frozenset = frozenset()) -> list[str]:
    """The architecture fields in which source and run differ, as `field: A in the source vs B in the run`.
    free_fields: more that may differ (EXTENSION_FIELDS for train.extend_from; nsa.* named with the prefix)."""
    free = FREE_MODEL_FIELDS | ({"max_seq_len"} if run.pos_emb == "rope" else set()) | free_fields  # RoPE: a limit
    a, b = dataclasses.asdict(source), dataclasses.asdict(run)
    nsa_a, nsa_b = a.pop("nsa"), b.pop("nsa")
    diffs = [f"{k}: {a[k]!r} in the source vs {v!r} in the run" for k, v in b.items() if k not in free and a[k] != v]
    if run.attention == "nsa" and source.attention == "nsa":
        diffs += [f"nsa.{k}: {nsa_a[k]!r} in the source vs {nsa_b[k]!r} in the run"
                  for k in architecture_keys(nsa_b) if nsa_a[k] != nsa_b[k] and f"nsa.{k}" not in free]
    return diffs


def check_fits(state: dict[str, torch.Tensor], cfg: ModelConfig, what: str) -> None:
    """Exactly our model's tensor names, each of exactly its shape."""
    shapes = our_state_shapes(cfg)
    missing, unexpected = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
    wrong = [f"{k} {tuple(state[k].shape)} vs {tuple(s)}" for k, s in shapes.items() if k in state and state[k].shape != s]
    if missing or unexpected or wrong:
        detail = (f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}" if unexpected
                  else f"shape {wrong[0]}")
        raise ConversionError(f"{what}: the weights do not fit the model ({detail})")


def init_state_dict(spec: str, cfg: ModelConfig, key: str = "train.init_from",
                    free_fields: frozenset = frozenset()) -> dict[str, torch.Tensor]:
    """`train.init_from`: hf:DIR or one of our checkpoints (file or run directory) -> a state dict for
    a model of `cfg`. ConfigError (one line, every differing field) when the architectures differ (free_fields may:
    EXTENSION_FIELDS for train.extend_from, named by `key`)."""
    if spec.startswith("hf:"):
        source, state, _ = read_model_dir(Path(spec[3:]))
    else:
        ckpt = load_checkpoint(resolve_checkpoint(Path(spec)))
        source, state = stored_model_config(ckpt["config"], spec), ckpt["model"]
    diffs = architecture_diffs(source, cfg, free_fields)
    if diffs:
        raise ConfigError(f"{key}={spec} does not match the run's model: {'; '.join(diffs)}")
    check_fits(state, cfg, f"{key}={spec}")
    return state


# ---- writing ---------------------------------------------------------------------------------
def import_checkpoint(model_dir: Path, out: Path) -> ModelConfig:
    """Write the weights-only checkpoint of model_dir to out (never over an existing file)."""
    model_dir, out = Path(model_dir), Path(out)
    if out.exists() or out.is_symlink():
        raise CheckpointError(f"{out} exists; import never overwrites, choose another OUT_CKPT")
    cfg, state, run_config = read_model_dir(model_dir)
    check_fits(state, cfg, str(model_dir))
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_save({
        "format_version": FORMAT_VERSION, "step": 0, "model": state,
        "optimizer": {"state": {}, "param_groups": []},  # no training state: train.resume refuses it
        "rng": rng_state(), "config": run_config, "tokens_seen": 0,
        "imported_from": str(model_dir.resolve()),
    }, out)
    return cfg
