"""Pre-flight checklist (the best-practices guide §1) as code: run it before every long run.

The command line, usage and details: train/preflight.py (its docstring).
"""
from __future__ import annotations

import copy
import glob
import math
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from train.core.config import RunConfig
from train.core.env import environment
from train.core.errors import ConfigError, DataError, UserError

OK, FAIL, WARN = "ok", "fail", "warn"
MARKS = {OK: "✓", FAIL: "✗", WARN: "⚠"}
SECTIONS = ("dataset", "loader", "model/optimizer", "environment")
BYTES_PER_PARAM = 4 * 3  # fp32 weights + the two AdamW moments
EYE_TOKENS = 48
ALLOC_SETTING = "expandable_segments:True"


@dataclass
class Check:
    section: str
    status: str  # ok | fail | warn
    name: str
    detail: str

    def line(self) -> str:
        return f"{MARKS[self.status]} {self.name}: {self.detail}"


@dataclass
class PreflightResult:
    config: str
    checks: list[Check] = field(default_factory=list)
    eye_test: list[str] = field(default_factory=list)  # decoded snippets, for a human to read
    git_sha: str = "unknown"

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.status == WARN]

    @property
    def ok(self) -> bool:
        return not self.failures

    def find(self, name: str) -> list[Check]:
        return [c for c in self.checks if c.name == name]

    def render(self) -> str:
        lines = [f"pre-flight: {self.config} (git {self.git_sha})"]
        for section in SECTIONS:
            passed = [c for c in self.checks if c.section == section and c.status != WARN]
            if passed:
                lines.append(f"[{section}]")
                lines += [f"  {c.line()}" for c in passed]
        if self.warnings:
            lines.append("warnings:")
            lines += [f"  {c.line()}" for c in self.warnings]
        if self.eye_test:
            lines.append("eye test (decoded; read it):")
            lines += [f"  {s}" for s in self.eye_test]
        verdict = "PASS" if self.ok else f"FAIL ({len(self.failures)} failed)"
        lines.append(f"pre-flight {verdict}: {len(self.checks) - len(self.warnings)} checks, "
                     f"{len(self.warnings)} warnings")
        return "\n".join(lines)


class _Recorder:
    def __init__(self, result: PreflightResult):
        self.result, self.section = result, SECTIONS[0]

    def __call__(self, status: str, name: str, detail: str) -> None:
        self.result.checks.append(Check(self.section, status, name, detail))


# ---- dataset ---------------------------------------------------------------------------------

def _dataset(cfg: RunConfig, add: _Recorder, eye: list[str], checksums: bool) -> None:
    kind = cfg.data.source_kind
    if kind == "bin":
        _bin_dataset(Path(cfg.data.source.split(":", 1)[1]), cfg, add, eye, checksums)
    elif kind == "synthetic":
        add(WARN, "data source", "synthetic tokens: fine for smoke tests, not a production dataset")
    else:
        _stream_dataset(cfg, add)


def _bin_dataset(data_dir: Path, cfg: RunConfig, add, eye: list[str], checksums: bool) -> None:
    from train.data.build import tokenizers_agree
    from train.data.meta import SPLITS, dtype_for_vocab, read_meta, split_tokens

    try:
        meta = read_meta(data_dir)
    except DataError as exc:
        add(FAIL, "metadata", str(exc))
        return
    which = "meta.pkl (legacy)" if meta.legacy else "meta.json"
    add(OK, "metadata", f"{data_dir}/{which}: dtype {meta.dtype}, tokenizer {meta.tokenizer}, vocab {meta.vocab_size}")
    want = dtype_for_vocab(meta.vocab_size)
    if meta.vocab_size > 2**16 and meta.dtype == "uint16":
        add(FAIL, "token dtype", f"uint16 cannot hold a vocabulary of {meta.vocab_size} (needs uint32)")
    elif meta.dtype != want:
        add(WARN, "token dtype", f"metadata says {meta.dtype} but vocab {meta.vocab_size} implies {want}; "
                                 f"prepare writes {want}, so check how the files were written")
    agree = {"same": OK, "assumed": WARN, "different": FAIL}[tokenizers_agree(meta.tokenizer, cfg.data.tokenizer)]
    if agree != OK:
        add(agree, "tokenizer", f"data prepared with {meta.tokenizer}, data.tokenizer={cfg.data.tokenizer}")
    model_vocab = cfg.model.vocab_size
    if meta.vocab_size > model_vocab or meta.id_bound >= model_vocab:
        add(FAIL, "vocab", f"tokenizer vocab {meta.vocab_size} (ids up to {meta.id_bound}) exceeds model.vocab_size {model_vocab}")
    else:
        add(OK, "vocab", f"tokenizer {meta.vocab_size} <= model {model_vocab} (ids up to {meta.id_bound})")
    sizes_ok = {}
    for split in SPLITS:
        try:
            sizes_ok[split] = split_tokens(data_dir, meta, split)
        except DataError as exc:
            add(FAIL, "sizes", str(exc))
    if len(sizes_ok) == len(SPLITS):
        add(OK, "sizes", ", ".join(f"{s} {n:,} tokens" for s, n in sizes_ok.items()) + f" ({meta.dtype}) match the metadata")
    _checksums(data_dir, meta, cfg, add, checksums, sizes_ok)
    _eye_test(data_dir, meta, cfg, add, eye)


def _checksums(data_dir: Path, meta, cfg: RunConfig, add, enabled: bool, sizes_ok: dict) -> None:
    from train.data.verification import scan

    if not enabled:
        add(WARN, "checksums", "skipped (--no-checksums); run python -m train.data.verify before the launch")
        return
    if meta.legacy:
        add(WARN, "checksums", "legacy meta.pkl records none; only sizes were checked")
        return
    bad = []
    for split in sizes_ok:
        info = meta.splits[split]
        sha, max_id = scan(data_dir / info.file, meta.np_dtype)
        if info.sha256 and sha != info.sha256:
            bad.append(f"{info.file} sha256 {sha[:12]}… != metadata {info.sha256[:12]}…")
        if max_id >= cfg.model.vocab_size:
            bad.append(f"{info.file} holds id {max_id} >= model.vocab_size {cfg.model.vocab_size}")
    if bad:
        add(FAIL, "checksums", "; ".join(bad))
    elif sizes_ok:
        add(OK, "checksums", f"sha256 of {', '.join(meta.splits[s].file for s in sizes_ok)} match the metadata")


def _eye_test(data_dir: Path, meta, cfg: RunConfig, add, eye: list[str]) -> None:
    """Decode a short window near the start and the end of each split (the best-practices guide: 'eye test')."""
    from train.data.meta import SPLITS
    from train.data.tokenizers import load_tokenizer

    try:
        tokenizer = load_tokenizer(meta.tokenizer or cfg.data.tokenizer)
    except DataError as exc:
        add(WARN, "eye test", f"skipped: {exc}")
        return
    garbled = []
    itemsize = np.dtype(meta.np_dtype).itemsize
    for split in SPLITS:
        path = data_dir / meta.splits[split].file
        n = path.stat().st_size // itemsize if path.is_file() else 0
        if not n:
            continue
        tokens = np.memmap(path, dtype=meta.np_dtype, mode="r", shape=(n,))
        for label, start in (("start", 0), ("end", max(0, n - EYE_TOKENS))):
            window = [int(t) for t in tokens[start:start + EYE_TOKENS]]
            text = tokenizer.decode([t for t in window if t < tokenizer.n_vocab])
            eye.append(f"{split} {label} @{start:,}: {text[:100]!r}")
            if text.count("\ufffd") > len(text) / 10 or len(window) != sum(t < tokenizer.n_vocab for t in window):
                garbled.append(f"{split} {label}")
        del tokens
    if garbled:
        add(WARN, "eye test", f"{', '.join(garbled)} decode to garbage (invalid ids / replacement characters): "
                              f"wrong dtype or tokenizer?")
    else:
        add(OK, "eye test", f"decoded start and end of each split with {tokenizer.name} (printed below)")


def _stream_dataset(cfg: RunConfig, add) -> None:
    from train.data.meta import dtype_for_vocab
    from train.data.tokenizers import load_tokenizer

    kind, _, arg = cfg.data.source.partition(":")
    if kind in ("text", "jsonl", "parquet"):
        files = glob.glob(arg, recursive=True)
        add(OK if files else FAIL, "source files", f"{cfg.data.source}: {len(files)} file(s)")
    else:
        add(WARN, "source files", f"{cfg.data.source} is remote: not checked offline (the run fails after "
                                  f"data.first_batch_timeout_s={cfg.data.first_batch_timeout_s:g}s if unreachable)")
    try:
        tokenizer = load_tokenizer(cfg.data.tokenizer)
    except DataError as exc:
        add(FAIL, "tokenizer", str(exc))
        return
    if tokenizer.n_vocab > cfg.model.vocab_size:
        add(FAIL, "vocab", f"tokenizer {tokenizer.name} has {tokenizer.n_vocab} ids > model.vocab_size {cfg.model.vocab_size}")
    else:
        add(OK, "vocab", f"tokenizer {tokenizer.name} {tokenizer.n_vocab} <= model {cfg.model.vocab_size} "
                         f"(stream: {dtype_for_vocab(tokenizer.n_vocab)} ids, no metadata or checksums)")


# ---- loader ----------------------------------------------------------------------------------

def _loader(cfg: RunConfig, add) -> None:
    d = cfg.data
    if d.source_kind == "bin":
        add(OK, "sampler", "random offsets (counter-hash window starts per rank slice; never sliding windows)")
        add(OK, "token dtype", "taken from the dataset metadata, never from the config")
        add(OK, "dataloader", "bin batches are gathered in the training process from np.memmap (no workers needed)")
        return
    if d.source_kind == "synthetic":
        add(OK, "sampler", "synthetic: random phrases at random offsets")
        return
    add(OK, "sampler", "stream source: documents are packed in order into seq_len+1 windows (no random offsets; "
                       "each token is trained once per epoch)")
    add(OK, "token dtype", "streams tokenize on the fly; the dtype follows the tokenizer size")
    if d.num_workers == 0:
        add(WARN, "dataloader", "data.num_workers=0: tokenization runs in the training process (the best-practices guide asks >= 16)")
    else:
        add(OK, "dataloader", f"{d.num_workers} workers per rank, prefetch {d.prefetch_factor}")
    if not d.pin_memory:
        add(WARN, "pin_memory", "data.pin_memory=false: host-to-device copies are slower")
    if d.num_workers and not d.persistent_workers:
        add(WARN, "persistent_workers", "data.persistent_workers=false: workers restart every epoch")


# ---- model / optimizer -----------------------------------------------------------------------

def _gpu_memory(cfg: RunConfig, add, gpus: int, gpu_bytes: int | None) -> None:
    """Peak memory per rank (train/planning/memory.py) against the detected GPU, one line per sequence-length stage
    (train.seq_stages); FAIL with the knob that fixes it."""
    if not cfg.train.seq_stages:
        return _stage_memory(cfg, add, gpus, gpu_bytes, "gpu memory")
    from train.core.seq_stages import seq_stages, stage_config

    for stage in seq_stages(cfg):
        _stage_memory(stage_config(cfg, stage), add, gpus, gpu_bytes,
                      f"gpu memory (from step {stage.at}, seq_len {stage.seq_len})")


def _stage_memory(cfg: RunConfig, add, gpus: int, gpu_bytes: int | None, name: str) -> None:
    from train.planning.memory import estimate_memory, verdict

    if gpu_bytes is None:
        need = estimate_memory(cfg, gpus).total
        add(OK, name, f"needs {need / 1e9:.1f} GB per rank (no CUDA here to compare; "
                              f"python -m train.plan CONFIG --gpu NAME)")
        return
    v = verdict(cfg, gpus, "detected GPU", capacity=gpu_bytes)
    if v["fits"]:
        add(OK, name, f"needs {v['total'] / 1e9:.1f} GB per rank of {gpu_bytes / 1e9:.1f} GB")
        return
    fix = v["fix"] or "a larger GPU, more GPUs with --use_fsdp=true, or a smaller model"
    add(FAIL, name, f"does not fit: needs {v['total'] / 1e9:.1f} GB per rank, the GPU has "
                            f"{gpu_bytes / 1e9:.1f} GB; fix: {fix}")


def _model_optimizer(cfg: RunConfig, add, gpus: int, env: dict, cuda: bool, gpu_bytes: int | None = None) -> None:
    accum, rt = cfg.train.accumulate_grad_batches, cfg.runtime
    sharded = "zero1" if rt.zero1 else "fsdp" if rt.fsdp else None
    if gpus > 1 and accum > 1 and not sharded:
        add(WARN, "zero1", f"{gpus} GPUs x accumulation {accum} without ZeRO-1: set --use_zero1=true "
                           "(shards the AdamW moments; the best-practices guide)")
    else:
        add(OK, "zero1", f"{sharded} on" if sharded else f"not needed ({gpus} GPU(s), accumulation {accum})")
    alloc = env.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if ALLOC_SETTING in alloc:
        add(OK, "allocator", f"PYTORCH_CUDA_ALLOC_CONF={alloc}")
    else:
        status = FAIL if cuda else WARN
        where = "" if cuda else " (no CUDA here; required on the GPU machine)"
        add(status, "allocator", f"export PYTORCH_CUDA_ALLOC_CONF={ALLOC_SETTING} before the launch{where}")
    _gpu_memory(cfg, add, gpus, gpu_bytes)
    t = cfg.train
    if t.save_every > 0:
        keep = "all kept" if t.keep_all_checkpoints else f"newest {t.keep_last} kept"
        add(OK, "checkpoint cadence", f"every {t.save_every} steps, {keep}")
    else:
        add(FAIL, "checkpoint cadence", "train.save_every=0: only the final checkpoint; set --train.save_every")


# ---- environment -----------------------------------------------------------------------------

def checkpoint_bytes(cfg: RunConfig) -> int:
    from nsa.flops import param_count

    return param_count(cfg.model) * BYTES_PER_PARAM


def checkpoints_on_disk(cfg: RunConfig) -> int:
    """Checkpoints the run holds at its peak: all (periodic + final) with keep_all, else keep_last + 1
    (the newest is written before the oldest is deleted)."""
    t = cfg.train
    total = math.ceil(t.steps / t.save_every) if t.save_every else 1
    return total if t.keep_all_checkpoints else min(t.keep_last + 1, total)


def _existing_parent(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def _disk(cfg: RunConfig, add, free_bytes: Callable[[Path], int]) -> None:
    size, count = checkpoint_bytes(cfg), checkpoints_on_disk(cfg)
    need = size * count
    where = _existing_parent(Path(cfg.train.out_dir))
    free = free_bytes(where)
    detail = (f"{count} checkpoint(s) x {size / 1e9:.2f} GB (params x 12 B) = {need / 1e9:.1f} GB needed, "
              f"{free / 1e9:.1f} GB free at {where}")
    add(OK if free >= need else FAIL, "disk", detail)


def _out_dir(cfg: RunConfig, add, gpus: int) -> None:
    """The launch's own start checks (train/trainer/start_checks.py, the functions the trainer calls): stale .HALT,
    a live owner, the resume plan (not carried out), what resuming on `gpus` ranks needs, and train.eval_tasks."""
    from train.checkpoint import io as ckpt_io
    from train.core.config import data_mixture
    from train.core.mixture import plan_lines
    from train.data.build import mixture_plan
    from train.trainer.start_checks import launch_data_check, out_dir_checks, resume_checks

    out, resume = Path(cfg.train.out_dir), cfg.train.resume
    try:
        add(OK, "launch data checks", launch_data_check(cfg, gpus))
        if not (mixture := data_mixture(cfg)).single:
            t = cfg.train
            plan = mixture_plan(cfg.data, mixture, seq_len=t.seq_len, vocab_size=cfg.model.vocab_size,
                                global_batch=t.batch_size * t.accumulate_grad_batches * gpus)
            add(OK, "data mixture plan", "; ".join(plan_lines(plan)))
    except UserError as exc:
        add(FAIL, "launch data checks", str(exc))
    if cfg.train.eval_tasks:
        from train.trainer.tasks_eval import LoopTasks

        try:
            add(OK, "downstream tasks", LoopTasks.load(cfg).describe())
        except UserError as exc:
            add(FAIL, "downstream tasks", str(exc))
    try:
        plan = out_dir_checks(cfg)
    except UserError as exc:
        add(FAIL, "out_dir", str(exc))
        return
    for note in plan.notes:
        add(WARN, "out_dir", note.split(": ", 1)[1])
    if plan.resume is None:
        add(OK, "out_dir", f"{out}: fresh run" + ("" if out.is_dir() else " (the directory does not exist yet)"))
        return
    try:
        ckpt = ckpt_io.load_checkpoint(plan.resume)
        notes = resume_checks(copy.deepcopy(cfg), ckpt, plan.resume, gpus).notes
    except UserError as exc:
        add(FAIL, "resume", str(exc))
        return
    add(OK, "out_dir", f"{out}: continuing from {plan.resume.name if resume == 'auto' else plan.resume} "
                       f"(step {ckpt['step']}, train.resume={'auto' if resume == 'auto' else 'PATH'})")
    add(OK, "resume", f"architecture, train.steps, tokenizer and data state fit {gpus} rank(s)"
                      + "".join(f"; {note}" for note in notes))


def _wandb_logged_in(env: dict) -> bool:
    if env.get("WANDB_API_KEY") or env.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return True
    netrc = Path(env.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="replace")


def _wandb(cfg: RunConfig, add, env: dict) -> None:
    from train.observe.wandb_log import require_wandb

    if not cfg.runtime.wandb:
        add(OK, "wandb", "off (runtime.wandb=false)")
        return
    try:
        wandb = require_wandb()
    except ConfigError as exc:
        add(FAIL, "wandb", str(exc))
        return
    add(OK, "wandb", f"wandb {getattr(wandb, '__version__', '?')} importable, project {cfg.runtime.wandb_project}")
    if not _wandb_logged_in(env):
        add(WARN, "wandb login", "no WANDB_API_KEY, no api.wandb.ai in ~/.netrc, WANDB_MODE not offline: run `wandb login`")


def _git(add, result: PreflightResult) -> None:
    from train.observe.summary import git_sha

    result.git_sha = git_sha()
    if result.git_sha == "unknown":
        add(WARN, "git", "not a git checkout: the run cannot be tied to a code version")
        return
    add(OK, "git", f"HEAD {result.git_sha} (recorded in metrics.json and the run JSON)")
    try:
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return
    if dirty:
        add(WARN, "git", f"{len(dirty.splitlines())} tracked file(s) modified: the SHA does not fully identify the code")


# ---- entry points ----------------------------------------------------------------------------

def _disk_free(path: Path) -> int:
    return shutil.disk_usage(path).free


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _gpu_total_bytes() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))


def run_preflight(cfg: RunConfig, *, gpus: int | None = None, free_bytes: Callable[[Path], int] | None = None,
                  checksums: bool = True, env: dict | None = None, cuda: bool | None = None,
                  gpu_bytes: int | None = None) -> PreflightResult:
    """Every programmatic item of the best-practices guide §1 against cfg. gpus: the launch's world size (default
    $WORLD_SIZE or 1); free_bytes(path) -> free bytes (default shutil.disk_usage); env: the
    environment to inspect (default os.environ); cuda: whether this machine has CUDA (default torch);
    gpu_bytes: the smallest GPU's memory (default: detected when cuda)."""
    env = environment() if env is None else dict(env)
    gpus = gpus if gpus is not None else int(env.get("WORLD_SIZE", "1") or 1)
    cuda = _cuda_available() if cuda is None else cuda
    if gpu_bytes is None and cuda:
        gpu_bytes = _gpu_total_bytes()
    result = PreflightResult(config=cfg.source)
    add = _Recorder(result)
    add.section = "dataset"
    _dataset(cfg, add, result.eye_test, checksums)
    add.section = "loader"
    _loader(cfg, add)
    add.section = "model/optimizer"
    _model_optimizer(cfg, add, gpus, env, cuda, gpu_bytes)
    add.section = "environment"
    _wandb(cfg, add, env)
    _disk(cfg, add, free_bytes or _disk_free)
    _out_dir(cfg, add, gpus)
    _git(add, result)
    return result
