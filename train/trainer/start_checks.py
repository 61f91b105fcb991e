"""The checks a training launch makes before its first step, as the functions the trainer itself calls
(train/trainer/build_run.py), so that the preflight checklist (train/workflows/preflight.py) and the bash runners refuse
exactly what the launch refuses, in the launch's own words:

The command line, usage and details: train/start_checks.py (its docstring).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from train.checkpoint import io as ckpt_io
from train.checkpoint.run_dir import OutDirLock, StartPlan, plan_start
from train.core.config import RunConfig, data_mixture
from train.core.errors import CheckpointError, ConfigError, DataError
from train.data.build import check_data_source, train_state_refusal
from train.trainer.lr_schedule import resume_refusal, saved_train_config
from train.trainer.optim import optimizer_resume_refusal
from train.trainer.safety import stale_halt_message
from train.trainer.tasks_eval import LoopTasks

BATCH_KEYS = ("train.batch_size", "train.accumulate_grad_batches")
WORLD_SIZE_FREE_SOURCES = ("synthetic", "bin")  # their batches depend on (step, global row) only (data/state.py)


@dataclass(frozen=True)
class BatchSplit:
    """One optimizer step's rows: batch_size per rank and micro-batch x accumulate x world_size."""

    batch_size: int
    accumulate: int
    world_size: int

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.accumulate * self.world_size

    def text(self) -> str:
        return (f"{self.global_batch} (train.batch_size {self.batch_size} x accumulate_grad_batches "
                f"{self.accumulate} x {self.world_size} rank(s))")


def fit_global_batch(saved: int, wanted: BatchSplit, *, explicit: bool, checkpoint: str) -> tuple[BatchSplit, str | None]:
    """The split this run uses to keep the checkpoint's global batch `saved` on wanted.world_size ranks, and a
    one-line note when it differs from the config's. The per-rank micro-batch never grows (memory): it is the
    largest divisor of the per-rank rows that is <= the configured batch_size, and accumulation makes up the
    rest. explicit: the batch keys were set on the command line, so the config's split is used as given (a new
    global batch, said in the note). ConfigError when `saved` rows cannot be split over the ranks."""
    if wanted.global_batch == saved:
        return wanted, None
    if explicit:
        return wanted, (f"note: global batch changes from the checkpoint's {saved} to {wanted.text()}, as the command "
                        f"line sets {' / '.join(BATCH_KEYS)}; the data order continues with the new batch")
    ranks = wanted.world_size
    if saved % ranks:
        worlds = [n for n in range(1, min(saved, 64) + 1) if saved % n == 0]
        raise ConfigError(f"checkpoint {checkpoint} was trained with global batch {saved}, which {ranks} rank(s) cannot "
                          f"split evenly; resume on {' / '.join(map(str, worlds))} rank(s) (--nproc_per_node), or set "
                          f"--train.batch_size and --train.accumulate_grad_batches to choose a new global batch")
    per_rank = saved // ranks
    micro = max(b for b in range(1, min(wanted.batch_size, per_rank) + 1) if per_rank % b == 0)
    fitted = BatchSplit(micro, per_rank // micro, ranks)
    return fitted, (f"resume: keeping the checkpoint's global batch {saved} on {ranks} rank(s): train.batch_size "
                    f"{fitted.batch_size} x accumulate_grad_batches {fitted.accumulate} (the config says "
                    f"{wanted.batch_size} x {wanted.accumulate}; set both on the command line to override)")


def saved_global_batch(ckpt: dict) -> int:
    """Rows per optimizer step of the run that wrote ckpt (its data state says; else its config and world size)."""
    states = ckpt.get("data") or []
    if states and isinstance(states[0], dict) and isinstance(states[0].get("global_batch"), int):
        return states[0]["global_batch"]
    train = ckpt["config"].get("train", {})
    return int(train.get("batch_size", 1)) * int(train.get("accumulate_grad_batches", 1)) * int(ckpt.get("world_size", 1))


@dataclass
class ResumeDecision:
    """What resuming a checkpoint does: notes (one line each, to print) and data_restart: None when the training data
    continues from the checkpoint's position, else why it starts afresh (data.restart_on_change)."""

    notes: list[str]
    data_restart: str | None = None


def resume_checks(cfg: RunConfig, ckpt: dict, path: Path, world_size: int) -> ResumeDecision:
    """Everything that must hold to continue `ckpt` (loaded from path) with cfg on world_size ranks: the one place
    that decides the launch's refusals (the trainer, start checks and preflight call it). Sets cfg.train's batch keys
    to the split that keeps the global batch (fit_global_batch). CheckpointError / ConfigError / DataError (one line)
    when the launch must not happen."""
    if ckpt.get("imported_from"):  # written by train/hf/importer.py
        raise CheckpointError(f"checkpoint {path} holds imported weights only (no optimizer or data state) and cannot "
                              f"be resumed; start from it with train.init_from={path}")
    model = cfg.to_dict()
    ckpt_io.check_architecture(ckpt, model["model"] | {"nsa": model["nsa"]}, path)
    if cfg.train.eval_only:
        return ResumeDecision([])
    step = int(ckpt["step"])
    if cfg.train.steps < step:
        raise ConfigError(f"train.steps={cfg.train.steps} is below the step of checkpoint {path} ({step}); set "
                          f"--train.steps above {step} to train on, or resume an earlier checkpoint")
    saved_train = saved_train_config(ckpt["config"].get("train", {}))
    if refusal := resume_refusal(saved_train, cfg.train, step, str(path)):
        raise ConfigError(refusal)
    if refusal := optimizer_resume_refusal(saved_train, cfg.train, str(path)):
        raise ConfigError(refusal)
    saved_data = ckpt["config"].get("data", {})
    saved_tokenizer = saved_data.get("tokenizer")
    if saved_tokenizer and saved_tokenizer != cfg.data.tokenizer and not (
            saved_tokenizer.startswith("hf:") and cfg.data.tokenizer.startswith("hf:")):
        raise ConfigError(f"checkpoint {path} was trained on data.tokenizer={saved_tokenizer} but this run has "
                          f"data.tokenizer={cfg.data.tokenizer}; token ids would change meaning (set "
                          f"--data.tokenizer={saved_tokenizer}, or start a new out_dir)")
    t = cfg.train
    notes = []
    if cfg.data.source_kind in WORLD_SIZE_FREE_SOURCES or not ckpt.get("data"):
        explicit = any(key in cfg.overrides for key in BATCH_KEYS)
        split, note = fit_global_batch(saved_global_batch(ckpt), BatchSplit(t.batch_size, t.accumulate_grad_batches,
                                                                            world_size),
                                       explicit=explicit, checkpoint=str(path))
        t.batch_size, t.accumulate_grad_batches = split.batch_size, split.accumulate
        notes += [note] if note else []
    restart = data_restart(cfg, ckpt, path, world_size)
    if restart:
        notes.append(f"data: starting the training data afresh (data.restart_on_change=true): {restart}")
    return ResumeDecision(notes, restart)


def data_restart(cfg: RunConfig, ckpt: dict, path: Path, world_size: int) -> str | None:
    """None when the training data continues from the checkpoint's position; else what changed (the refusal that
    data.restart_on_change=true overrides: the data then starts afresh). DataError when it is not set."""
    states = ckpt.get("data") or []
    if not states:  # an old checkpoint without a data state: the data starts afresh, as it always did
        return None
    t = cfg.train
    refusal = train_state_refusal(cfg.data, states, seq_len=t.seq_len, batch_size=t.batch_size,
                                  vocab_size=cfg.model.vocab_size, seed=t.seed, world_size=world_size,
                                  saved_num_workers=ckpt["config"].get("data", {}).get("num_workers", 0),
                                  checkpoint=str(path), mixture=data_mixture(cfg))
    if refusal and not cfg.data.restart_on_change:
        raise DataError(refusal)
    return refusal.split("; ", 1)[0] if refusal else None  # what changed, without the advice


def out_dir_checks(cfg: RunConfig) -> StartPlan:
    """A stale .HALT, a live owner, and the resume plan, as the trainer's start decides them (reads only)."""
    out = Path(cfg.train.out_dir)
    if out.is_file():
        raise ConfigError(f"train.out_dir {out} is a file, not a directory")
    if not cfg.train.eval_only and (halt := stale_halt_message(out)):
        raise ConfigError(halt)
    OutDirLock(out).check_free()
    return plan_start(out, cfg.train.resume, eval_only=cfg.train.eval_only)


def launch_data_check(cfg: RunConfig, world_size: int) -> str:
    """The launch's checks of its data (every source of a mixture, and the epochs its plan reads), reading only: one
    line describing it, or UserError. start_checks and preflight both ask this."""
    t = cfg.train
    return check_data_source(cfg.data, vocab_size=cfg.model.vocab_size, mixture=data_mixture(cfg), seq_len=t.seq_len,
                             global_batch=t.batch_size * t.accumulate_grad_batches * world_size)


def start_checks(cfg: RunConfig, world_size: int) -> list[str]:
    """Every check of a launch with cfg on world_size ranks, reading only; the lines a launch would print
    (resume point, batch split, data, downstream tasks). UserError (one line) for the first refusal."""
    data = f"data: {launch_data_check(cfg, world_size)}"
    tasks = LoopTasks.load(cfg)  # train.eval_tasks, read as the launch reads them before it claims the out_dir
    plan = out_dir_checks(cfg)
    lines = [note.split(": ", 1)[1] if note.startswith(("note: ", "warning: ")) else note for note in plan.notes]
    if plan.resume is not None:
        ckpt = ckpt_io.load_checkpoint(plan.resume)
        lines.append(f"resume: {plan.resume} (step {ckpt['step']})")
        lines += resume_checks(cfg, ckpt, plan.resume, world_size).notes
        del ckpt
    else:
        lines.append(f"resume: none, fresh start in {cfg.train.out_dir}")
    return lines + [data] + ([f"tasks: {tasks.describe()}"] if tasks is not None else [])
