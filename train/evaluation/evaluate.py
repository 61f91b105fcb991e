"""Score a checkpoint on a whole data split: loss, perplexity, bits per token and per byte.

    result = evaluate(EvalRequest(checkpoint=Path("artifacts/run"), data="bin:data/kjv", split="val"))

Every target of the split's token stream is scored exactly once (train/evaluation/scoring.py):
non-overlapping windows by default, a sliding window with `stride` for RoPE models. The data comes from
train/evaluation/eval_data.py; the batch, unless the request names it, from the model and the free memory
(train/evaluation/eval_batch.py): the result does not depend on it. Progress with an ETA goes to stderr
every PROGRESS_EVERY_S. The result is written to eval_<name>.json beside the checkpoint (a file of another
checkpoint, or not written by this tool, is never replaced). The command line: train/evaluation/evaluate.py.
"""
from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from train.checkpoint.io import load_checkpoint, model_from_checkpoint, resolve_checkpoint
from train.core.config import TrainConfig
from train.core.distributed import autocast_context, resolve_precision
from train.core.data_config import DataConfig
from train.core.errors import UserError
from train.core.mixture import Mixture, parse_mixture
from train.evaluation.eval_batch import batch_size_for
from train.evaluation.eval_data import DOCUMENT_KINDS, data_kind, load_eval_tokens
from train.evaluation.scoring import count_windows, position_buckets, score_stream
from train.observe.telemetry import write_json_atomic

TOOL = "train.evaluate"  # marks the result files this tool may replace
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
PROGRESS_EVERY_S = 5.0


@dataclass
class EvalRequest:
    """What to score; None picks the default the command line documents (`python -m train.evaluate --help`)."""
    checkpoint: Path  # a checkpoint file or a run directory (its newest valid checkpoint)
    data: str  # bin:DIR | text:GLOB | jsonl:GLOB | parquet:GLOB | mixture (evaluate_mixture)
    split: str | None = None  # bin: only; train | val (default val)
    seq_len: int | None = None  # default: the checkpoint's train.seq_len
    stride: int | None = None  # default seq_len (non-overlapping windows)
    batch_size: int | None = None  # default: from the model and the free memory
    device: str = "auto"  # auto | cpu | cuda
    max_tokens: int | None = None  # score only the first N tokens of the stream
    name: str | None = None  # result file eval_<name>.json (default: from data, split and step)
    text_field: str | None = None  # jsonl:/parquet: column with the text (default text)
    text_sample_by: str | None = None  # text: document (default) | paragraph | line
    by_position: int | None = None  # the loss in this many equal slices of the window too (non-overlapping windows)


def check_data_options(args: EvalRequest, kind: str) -> None:
    """--split belongs to prepared directories; --text_field / --text_sample_by to document globs."""
    if kind in DOCUMENT_KINDS and args.split is not None:
        raise UserError(f"--split applies to bin: directories; {kind}: scores every document of the matched files "
                        f"(for held-out documents, prepare a directory and evaluate its val split)")
    if kind == "bin" and (args.text_field is not None or args.text_sample_by is not None):
        raise UserError("--text_field and --text_sample_by apply to text:/jsonl:/parquet: globs; "
                        "a bin: directory was tokenized by prepare already")


def check_windows(model_cfg, seq_len: int, stride: int, batch_size: int | None, max_tokens: int | None) -> None:
    if seq_len < 1 or (batch_size is not None and batch_size < 1) or (max_tokens is not None and max_tokens < 2):
        raise UserError(f"--seq_len and --batch_size must be >= 1 and --max_tokens >= 2 "
                        f"(got {seq_len}, {batch_size}, {max_tokens})")
    if not 1 <= stride <= seq_len:
        raise UserError(f"--stride must be in [1, seq_len={seq_len}], got {stride}")
    if model_cfg.pos_emb == "learned":
        if stride < seq_len:
            raise UserError("--stride applies to RoPE models; this checkpoint has learned positions "
                            "(model.pos_emb=learned): evaluate it in non-overlapping windows (no --stride)")
        if seq_len > model_cfg.max_seq_len:
            raise UserError(f"--seq_len {seq_len} exceeds the learned position table (model.max_seq_len="
                            f"{model_cfg.max_seq_len})")


def default_name(spec: str, split: str | None, step: int) -> str:
    """e.g. bin:data/kjv + val at step 800 -> bin_kjv_val_step800; text:corpus/*.txt -> text_corpus_txt_step800."""
    kind, _, arg = spec.partition(":")
    path = Path(arg.rstrip("/"))
    tail = f"{path.parent.name}_{path.name}" if any(c in path.name for c in "*?[") else path.name
    parts = [kind, tail, *([split] if split else []), f"step{step}"]
    return re.sub(r"[^A-Za-z0-9-]+", "_", "_".join(parts)).strip("_")[:100]


def claim_result_file(path: Path, checkpoint: Path) -> None:
    """Refuse to replace a file that is not this tool's result for this checkpoint."""
    if not path.exists():
        return
    try:
        prior = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        prior = None
    if isinstance(prior, dict) and prior.get("tool") == TOOL:
        if Path(str(prior.get("checkpoint"))).name == checkpoint.name:
            return
        owner = f"the evaluation of {Path(str(prior.get('checkpoint'))).name}"
    else:
        owner = "a file this tool did not write"
    raise UserError(f"{path} already holds {owner}; pass --name to write another file")


def pick_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA device is available")
    return torch.device("cuda" if requested != "cpu" and torch.cuda.is_available() else "cpu")


def bits_per_byte(nll_sum: float, text_bytes: int | None) -> float | None:
    """Summed nats over the scored targets / (UTF-8 bytes of the text x ln 2)."""
    return nll_sum / (text_bytes * math.log(2)) if text_bytes else None


MIXTURE = "mixture"  # --data mixture: each source of the checkpoint's own data.mixture


def stored_mixture(config: dict) -> Mixture:
    """A checkpoint config's data.mixture with its stages; UserError when it was trained on one source."""
    data = config.get("data") or {}
    if not data.get("mixture"):
        raise UserError(f"--data {MIXTURE}: the checkpoint was trained on data.source={data.get('source')!r}, not a "
                        f"data.mixture; give --data bin:DIR")
    return parse_mixture(_known(DataConfig, data), steps=config["train"]["steps"],
                         decay_start=_decay_start(config["train"]))


def _known(cls, section: dict):
    """A config dataclass from a stored section, keys it no longer has left out."""
    return cls(**{k: v for k, v in section.items() if k in cls.__dataclass_fields__})


def _decay_start(train: dict) -> int | None:
    """The first decaying step of a stored wsd run (a mixture stage may start at 'decay'), else None."""
    cfg = _known(TrainConfig, train)
    return cfg.wsd_decay()[0] if cfg.lr_schedule == "wsd" else None


def weighted_result(results: dict[str, dict], weights: dict[str, float]) -> dict:
    """Several sources' results as one: loss, bits per token and bits per byte weighted (bits per byte only when every
    source records its bytes), tokens summed, each source's own result under "sources"."""
    first = next(iter(results.values()))
    bpb = [r.get("bits_per_byte") for r in results.values()]
    return {"split": first.get("split"), "step": first.get("step"), "max_tokens": first.get("max_tokens"),
            "tokens": sum(r["tokens"] for r in results.values()),
            "loss": sum(weights[n] * r["loss"] for n, r in results.items()),
            "bits_per_token": sum(weights[n] * r["bits_per_token"] for n, r in results.items()),
            "bits_per_byte": None if None in bpb else sum(weights[n] * r["bits_per_byte"] for n, r in results.items()),
            "weights": weights, "sources": results}


def stage_weighted_result(results: dict[str, dict], mixture: Mixture, step: int) -> dict:
    """weighted_result with the weights of the mixture's stage in force at `step` (the evaluated checkpoint's: what
    the run's own validation at that step weighs, train/trainer/loop.py), and that stage's `at` under "stage"."""
    stage = mixture.stage_at(step)
    return {**weighted_result(results, dict(zip(mixture.names, stage.weights))), "stage": stage.at}


def evaluate_mixture(args: EvalRequest) -> dict:
    """--data mixture: every source of the checkpoint's data.mixture scored as `evaluate` scores one (its own
    eval_<name>.json each, named <name>_<source> with --name), and their stage_weighted_result."""
    checkpoint = resolve_checkpoint(args.checkpoint).resolve()
    ckpt = load_checkpoint(checkpoint)
    mixture = stored_mixture(ckpt["config"])
    results = {s.name: evaluate(replace(args, data=s.source, name=f"{args.name}_{s.name}" if args.name else None))
               for s in mixture.sources}
    return stage_weighted_result(results, mixture, ckpt["step"])


def evaluate(args: EvalRequest) -> dict:
    """Score, write eval_<name>.json beside the checkpoint, return the result."""
    kind = data_kind(args.data)
    check_data_options(args, kind)
    split = (args.split or "val") if kind == "bin" else None
    checkpoint = resolve_checkpoint(args.checkpoint).resolve()  # latest.pt -> the checkpoint it names
    step = load_checkpoint(checkpoint)["step"]
    device = pick_device(args.device)
    model, cfg = model_from_checkpoint(checkpoint, str(device))
    seq_len = args.seq_len if args.seq_len is not None else cfg["train"]["seq_len"]
    stride = args.stride if args.stride is not None else seq_len
    check_windows(model.cfg, seq_len, stride, args.batch_size, args.max_tokens)
    if args.by_position is not None and (stride != seq_len or not 1 <= args.by_position <= seq_len):
        raise UserError(f"--by_position {args.by_position}: 1 .. seq_len slices of non-overlapping windows (no --stride)")
    name = args.name or default_name(args.data, split, step)
    if not NAME_RE.match(name):
        raise UserError(f"--name {name!r}: use letters, digits, '.', '_' and '-' (at most 100)")
    result_path = checkpoint.parent / f"eval_{name}.json"
    claim_result_file(result_path, checkpoint)

    data = load_eval_tokens(args.data, tokenizer_name=cfg["data"]["tokenizer"], split=split,
                            text_field=args.text_field or "text", text_sample_by=args.text_sample_by or "document",
                            max_tokens=args.max_tokens)
    n_tokens = len(data.tokens)
    if n_tokens < 2:
        raise UserError(f"{args.data}{f' split {split}' if split else ''} holds {n_tokens} token(s); nothing to score")
    if data.id_bound >= model.cfg.vocab_size:
        raise UserError(f"{args.data} holds token ids up to {data.id_bound} but the model's vocab_size is "
                        f"{model.cfg.vocab_size}")

    precision = resolve_precision("auto", device)  # bf16 on CUDA, fp32 on CPU
    n_windows = count_windows(n_tokens, seq_len, stride)
    batch_size, batch_from = batch_size_for(args.batch_size, model.cfg, seq_len=seq_len, n_windows=n_windows,
                                            device=device, precision=precision)
    n_targets = n_tokens - 1 if data.mask is None else int(np.count_nonzero(data.mask[1:]))  # the loss mask's own
    print(f"evaluate: {n_targets:,} targets in {n_windows:,} windows of up to {seq_len} tokens, {batch_size} "
          f"per forward ({batch_from})", file=sys.stderr, flush=True)
    started = time.perf_counter()
    score = score_stream(model, data.tokens, seq_len=seq_len, stride=stride, batch_size=batch_size, device=device,
                         autocast=lambda: autocast_context(device, precision),
                         progress=_progress_printer(n_targets, started), mask=data.mask,
                         by_position=args.by_position is not None)
    seconds = time.perf_counter() - started
    bpb = bits_per_byte(score.nll_sum, data.text_bytes)
    result = {
        "tool": TOOL, "checkpoint": str(checkpoint), "step": step, "data": args.data, "split": split,
        "tokenizer": cfg["data"]["tokenizer"], "seq_len": seq_len, "stride": stride, "batch_size": batch_size,
        "batch_size_from": batch_from,
        "max_tokens": args.max_tokens, "loss_mask": data.mask is not None, "windows": score.windows, "tokens": score.tokens, "loss": score.loss,
        "perplexity": math.exp(score.loss) if score.loss < 700 else math.inf,
        "bits_per_token": score.loss / math.log(2), "bytes": data.text_bytes, "bytes_from": data.bytes_from,
        "bits_per_byte": bpb, **({"note": data.note} if bpb is None else {}),
        "tokens_per_s": score.tokens / max(seconds, 1e-9), "seconds": round(seconds, 3),
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "precision": str(precision).removeprefix("torch."), "file": str(result_path),
    }
    if args.by_position is not None:  # the loss by position in the window, against the length it trained at
        result["training_length"] = cfg["train"]["seq_len"]
        result["by_position"] = position_buckets(score, args.by_position, cfg["train"]["seq_len"])
    write_json_atomic(result_path, result)
    return result


def _progress_printer(total: int, started: float):
    """progress(scored) for score_stream: one stderr line per PROGRESS_EVERY_S at most, with rate and ETA."""
    last = [started]

    def report(scored: int) -> None:
        now = time.perf_counter()
        if now - last[0] >= PROGRESS_EVERY_S and scored < total:
            last[0] = now
            rate = scored / max(now - started, 1e-9)
            print(f"evaluate: {scored:,} / {total:,} targets ({scored / total:.1%}), {rate:,.0f} tokens/s, "
                  f"ETA {duration((total - scored) / max(rate, 1e-9))}", file=sys.stderr, flush=True)
    return report


def duration(seconds: float) -> str:
    """e.g. 42s, 3m52s, 2h05m."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
