"""Full-state checkpoints: atomic writes, a `latest.pt` link, retention, validated loading.

A checkpoint holds everything exact resume needs: model, optimizer, step, tokens seen, every RNG
state, the data sampler's state and the effective config. Files are written to a temporary name,
fsynced and renamed, so `checkpoint_step{N}.pt` exists only when complete.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import random
import zipfile
from pathlib import Path

import numpy as np
import torch

from nsa.config import ModelConfig, NSAConfig, architecture_keys
from train.core.artifacts import LATEST, checkpoint_files, checkpoint_name
from train.core.errors import CheckpointError

FORMAT_VERSION = 1
# model fields that change neither shapes nor the function a checkpoint's weights compute: they may
# differ between the checkpoint and the run that loads it (resume, train.init_from)
FREE_MODEL_FIELDS = frozenset({"attn_backend", "dropout", "init_std", "loss_chunk", "rope_scale"})


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The newest checkpoint in out_dir that validates."""
    found = valid_checkpoints(out_dir)
    return found[-1][1] if found else None


def rng_state() -> dict:
    """Every RNG the run touches, as tensors / plain types (loadable with weights_only=True)."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "python": _to_lists(random.getstate()),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate(_to_tuples(state["python"]))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_lists(x):
    return [_to_lists(v) for v in x] if isinstance(x, tuple) else x


def _to_tuples(x):
    return tuple(_to_tuples(v) for v in x) if isinstance(x, list) else x


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj: dict, path: Path) -> None:
    """obj to path whole (temporary name, fsync, rename) or not at all. A write the disk refuses (ENOSPC, EFBIG, a
    quota) raises the OS's OSError, and the temporary file goes."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            try:
                torch.save(obj, _WholeWrites(f))
            except RuntimeError as exc:  # torch's writer reports a failed write as a position mismatch
                if isinstance(exc.__context__, OSError):
                    raise exc.__context__ from None  # the OS's reason, which it carries along
                raise
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)


class _WholeWrites:
    """A file's write() that writes all it is given or raises: a short write (the disk filling up) is continued, so the
    OS's error surfaces instead of a silently shorter count."""

    def __init__(self, f):
        self._f = f

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += self._f.write(view[done:])
        return done

    def flush(self) -> None:
        self._f.flush()


def update_latest_link(out_dir: Path, target: Path) -> None:
    link = out_dir / LATEST
    tmp = out_dir / f".{LATEST}.tmp{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target.name, tmp)
    os.replace(tmp, link)


def repoint_latest(out_dir: Path) -> None:
    """`latest.pt` -> the newest valid checkpoint in out_dir, or no link when there is none."""
    valid = valid_checkpoints(out_dir)
    if valid:
        update_latest_link(out_dir, valid[-1][1])
    elif (out_dir / LATEST).is_symlink():
        (out_dir / LATEST).unlink()


# path -> (size, mtime_ns) of files seen to validate: retention and listings do not re-read them
_validated: dict[Path, tuple[int, int]] = {}


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def is_valid(path: Path) -> bool:
    stamp = _stamp(path)
    if stamp is None:
        return False
    if _validated.get(path) == stamp:
        return True
    if checkpoint_problem(path) is None:
        _validated[path] = stamp
        return True
    return False


def valid_checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    """Checkpoints in out_dir that validate, oldest first."""
    return [(step, p) for step, p in checkpoint_files(out_dir) if is_valid(p)]


def apply_retention(out_dir: Path, keep_last: int, keep_all: bool, protect: tuple[Path, ...] = ()) -> list[Path]:
    """Delete valid checkpoints beyond the newest keep_last (none when keep_all), never one in
    `protect` (the one just written, the one the run resumed from). Files that do not validate are
    not counted and not deleted. Returns the deleted paths."""
    if keep_all or keep_last <= 0:
        return []
    valid = valid_checkpoints(out_dir)
    keep = {p.resolve() for _, p in valid[-keep_last:]} | {Path(p).resolve() for p in protect}
    doomed = [p for _, p in valid if p.resolve() not in keep]
    for p in doomed:
        p.unlink(missing_ok=True)
        _validated.pop(p, None)
    return doomed


def checkpoint_payload(step: int, state: dict) -> dict:
    """What a checkpoint file holds. state: model, optimizer, tokens_seen, data, config, lineage, ... ; adds step,
    this process's RNG states (taken now, on the calling thread) and the format version."""
    return {"format_version": FORMAT_VERSION, "step": step, "rng": rng_state(), **state}


def save_checkpoint(out_dir: Path, step: int, state: dict, keep_last: int, keep_all: bool,
                    protect: tuple[Path, ...] = ()) -> Path:
    """state: model, optimizer, tokens_seen, data, config, lineage, ... ; adds step, RNG states, format version."""
    return write_checkpoint(out_dir, step, checkpoint_payload(step, state), keep_last, keep_all, protect)


def write_checkpoint(out_dir: Path, step: int, payload: dict, keep_last: int, keep_all: bool,
                     protect: tuple[Path, ...] = ()) -> Path:
    """The write of save_checkpoint (train/checkpoint/async_writer.py runs it on its thread): the file (temporary
    name, fsync, rename), then `latest.pt` and retention, which so move only once the file is whole."""
    path = out_dir / checkpoint_name(step)
    atomic_save(payload, path)
    if (stamp := _stamp(path)) is not None:
        _validated[path] = stamp  # written whole, fsynced and renamed just now
    update_latest_link(out_dir, path)
    apply_retention(out_dir, keep_last, keep_all, protect=(path, *protect))
    return path


REQUIRED_KEYS = ("format_version", "model", "optimizer", "step", "rng", "config")


def load_checkpoint(path: Path) -> dict:
    """The checkpoint at path, memory-mapped (tensors are read from the file as they are used, so
    loading does not hold a second copy of the state). One-sentence CheckpointError when the file is
    missing, truncated, foreign or lacks a key exact resume needs."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} is not a file")
    size = path.stat().st_size
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"checkpoint {path} is incomplete or not a checkpoint: its {size:,} bytes do not end in the zip "
            f"directory that torch.save writes last (a write cut short, a truncated copy, or another kind of file)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, EOFError, zipfile.BadZipFile, pickle.UnpicklingError, OSError, ValueError, KeyError) as exc:
        raise CheckpointError(
            f"checkpoint {path} ({size:,} bytes) cannot be read as a checkpoint of this trainer "
            f"({type(exc).__name__} while unpickling its state with weights_only=True)") from None
    if not isinstance(ckpt, dict) or ckpt.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has an unknown format (expected a dict with format_version={FORMAT_VERSION})")
    missing = [key for key in REQUIRED_KEYS if key not in ckpt]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {', '.join(repr(k) for k in missing)}, which resume needs")
    if not isinstance(ckpt["step"], int) or not isinstance(ckpt["config"], dict):
        raise CheckpointError(f"checkpoint {path} has a malformed 'step' or 'config' entry")
    return ckpt


def checkpoint_problem(path: Path) -> str | None:
    """None when path holds a complete, loadable checkpoint; otherwise why not (one sentence)."""
    try:
        load_checkpoint(path)
    except CheckpointError as exc:
        return str(exc)
    return None


def check_architecture(ckpt: dict, model_config: dict, path: Path) -> None:
    """The checkpoint's model section must equal the run's (shapes and semantics). A model or nsa key the
    checkpoint does not name (saved before the key existed) holds its default, as the checkpoint's model is built
    (stored_model_config): a checkpoint from before nsa.gates is a learned-gates model, one from before
    model.rope_scaling interpolates linearly."""
    saved = {**dataclasses.asdict(ModelConfig()), **ckpt["config"].get("model", {})}
    saved_nsa = {**dataclasses.asdict(NSAConfig()), **ckpt["config"].get("nsa", {})}
    current_nsa = model_config.get("nsa", {})
    current = {k: v for k, v in model_config.items() if k != "nsa"}
    free = FREE_MODEL_FIELDS
    diffs = [f"model.{k}: checkpoint {saved.get(k)!r} vs config {v!r}"
             for k, v in current.items() if k not in free and saved.get(k) != v]
    if current["attention"] == "nsa":
        diffs += [f"nsa.{k}: checkpoint {saved_nsa.get(k)!r} vs config {current_nsa[k]!r}"
                  for k in architecture_keys(current_nsa) if saved_nsa.get(k) != current_nsa[k]]
    if diffs:
        raise CheckpointError(f"checkpoint {path} does not match the config's architecture ({'; '.join(diffs[:3])})")


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint file, or a run directory -> its newest valid checkpoint (inference tools take either)."""
    path = Path(path)
    if path.is_dir():
        found = latest_checkpoint(path)
        if found is None:
            raise CheckpointError(f"{path} holds no valid checkpoint (checkpoint_step<N>.pt)")
        return found
    return path


def stored_model_config(run_config: dict, where: str, **model_overrides):
    """The ModelConfig of a stored run config (a checkpoint's `config`, an NSA export's nsa_config.json);
    one CheckpointError line naming `where` when it cannot be built."""
    from nsa.config import ModelConfig, NSAConfig

    try:
        return ModelConfig(**{**run_config["model"], **model_overrides}, nsa=NSAConfig(**run_config.get("nsa", {})))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: its model config cannot be built: {exc}") from None


def config_as_trained(ckpt: dict) -> dict:
    """A checkpoint's run config with its model (RoPE) and nsa (window) sections as the weights were trained: for a
    staged run (train.seq_stages), the stage of the checkpoint's last step; otherwise the config as stored."""
    from train.core.seq_stages import trained_fields

    run_config = ckpt["config"]
    if not run_config.get("train", {}).get("seq_stages"):
        return run_config
    fields = trained_fields(run_config, int(ckpt["step"]))
    out = {**run_config, "model": {**run_config["model"], "rope_theta": fields["rope_theta"],
                                   "rope_scale": fields["rope_scale"]}}
    if fields["nsa_w"] is not None:
        out["nsa"] = {**run_config.get("nsa", {}), "w": fields["nsa_w"]}
    return out


DOCUMENT_EOS_KEY = "document_eos_id"  # the EOS that opened documents in training (data.document_mask), or None


def model_from_checkpoint(path: Path, device: str = "cpu", **model_overrides):
    """Build the checkpoint's model (from its stored config) and load its weights, for inference
    tools (needle test, long-context demo, generate, evaluate, export). `path`: a checkpoint file or a
    run directory (its newest valid checkpoint). model_overrides: e.g. rope_scale=8.0.
    Returns (model in eval mode, the checkpoint's config dict)."""
    from nsa.model import Transformer

    ckpt = load_checkpoint(resolve_checkpoint(path))
    cfg = config_as_trained(ckpt)
    model = Transformer(stored_model_config(cfg, f"checkpoint {path}", **model_overrides))
    model.load_state_dict(ckpt["model"])
    model.document_eos_id = ckpt.get(DOCUMENT_EOS_KEY)  # evaluate on packed data by the rule it trained with
    return model.to(device).eval(), cfg
