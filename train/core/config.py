"""Run configuration: YAML sections model / nsa / train / data / runtime -> typed dataclasses.

Strict by design: an unknown key, a key nothing reads, or a value of the wrong type is a
ConfigError naming the file (or, for an override, the command-line flag), the key and the closest
valid key (difflib; with none close, where the keys are listed). Command-line overrides use
`--section.key=value`, a bare `--key=value` when the leaf name is unambiguous, or one of the
nanoGPT-style aliases in ALIASES (the source guides' commands).
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from nsa.config import WINDOW_FIELDS, ModelConfig, ModelConfigError, NSAConfig
from train.core.data_config import DataConfig
from train.core.errors import ConfigError, UserError
from train.core.mixture import Mixture, parse_mixture
from train.core.versions import torch_refusal


LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
DECAY_SHAPES = ("linear", "1-sqrt", "cosine")
WSD_ONLY_KEYS = ("decay_fraction", "decay_steps", "decay_shape")  # train keys only lr_schedule=wsd reads
SPIKE_ONLY_KEYS = ("spike_skip_window", "spike_skip_limit")  # train keys only spike skipping (a threshold set) reads
OPTIMIZERS = ("adamw", "muon")
MUON_ADJUST_LR = ("match_rms_adamw", "original")  # torch.optim.Muon's adjust_lr_fn names
MUON_ONLY_KEYS = ("muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_adjust_lr", "muon_lr_ratio")  # train keys only optimizer=muon reads


@dataclass
class TrainConfig:
    out_dir: str = "artifacts/run"  # every artefact of the run (docs/ARTIFACTS.md)
    steps: int = 1000  # optimizer steps; the LR schedule's horizon
    stop_after: int = 0  # stop (checkpoint, exit 0) after this many steps in this invocation; 0 = never
    # each rank's heartbeat 'train' record carries batch_digest: a hash of the tokens it trained on in the interval
    # (a check that a resume or a retried read replays the data exactly; one hash of each batch on the host)
    batch_digest: bool = False
    seed: int = 1337  # model init, data order and dropout derive from it
    seq_len: int = 1024  # tokens per training sequence
    batch_size: int = 8  # micro-batch per rank
    accumulate_grad_batches: int = 1  # micro-batches per optimizer step
    lr: float = 6e-4  # peak learning rate
    min_lr_ratio: float = 0.1  # the floor the decay ends at = lr * min_lr_ratio (cosine, linear, wsd)
    warmup_steps: int = 100  # linear warmup, in optimizer steps
    lr_schedule: str = "cosine"  # cosine | linear | constant | wsd (warmup-stable-decay), after warmup
    decay_fraction: float | None = None  # wsd only: the last fraction of train.steps that decays, in (0, 1], rounded to whole steps; or decay_steps (docs/USE.md)
    decay_steps: int | None = None  # wsd only: the last N steps decay (raising train.steps on resume lengthens the flat phase); or decay_fraction
    decay_shape: str = "1-sqrt"  # wsd only: 1-sqrt | linear | cosine, from lr to the floor, reached at the last step
    weight_decay: float = 0.1  # applied to matrices (>= 2-D parameters) only
    beta1: float = 0.9  # AdamW
    beta2: float = 0.95  # AdamW
    adam_eps: float = 1e-8  # AdamW
    # adamw: AdamW for every parameter; muon: Muon (torch.optim.Muon) for the hidden weight matrices (attention and MLP
    # projections), AdamW (lr, betas, eps, weight_decay above) for the rest (docs/USE.md "Muon")
    optimizer: str = "adamw"
    muon_momentum: float = 0.95  # muon only: momentum of Muon's buffer, in [0, 1)
    muon_nesterov: bool = True  # muon only: Nesterov momentum
    muon_ns_steps: int = 5  # muon only: Newton-Schulz iterations that orthogonalize the update, 1..99
    muon_adjust_lr: str = "match_rms_adamw"  # muon only: match_rms_adamw (update RMS of AdamW's: Muon shares train.lr and weight_decay) | original (Keller Jordan's: wants ~10-20x AdamW's lr, see muon_lr_ratio)
    muon_lr_ratio: float = 1.0  # muon only: the Muon matrices' lr = the schedule's lr x this (1 with match_rms_adamw)
    grad_clip: float = 1.0  # clip by the global gradient norm; 0 disables
    log_every: int = 10  # steps per training.csv row / heartbeat (the only host sync)
    eval_every: int = 0  # 0 disables periodic evaluation
    eval_steps: int = 20  # held-out batches per evaluation
    eval_at_start: bool = False  # evaluate before the first step (needs eval_every > 0)
    eval_only: bool = False  # evaluate the resumed checkpoint, write eval_step{N}.json, exit
    # downstream tasks scored at every evaluation (eval_every, eval_at_start, eval_only), off the training clock, into
    # tasks.csv: hellaswag, arc_easy, ..., TASK:VARIANT or a .jsonl / .jsonl.gz path (docs/USE.md "Downstream tasks");
    # a YAML list or, on the command line, comma-separated; every task is loaded at start-up
    eval_tasks: list[str] = field(default_factory=list)
    eval_tasks_limit: int = 500  # docs per task at each evaluation: the same seeded subset every time (curves compare the same items); stderr near 0.3 is about 0.02 at 500
    save_every: int = 0  # 0: only the final checkpoint
    keep_last: int = 3  # checkpoints kept unless keep_all_checkpoints
    keep_all_checkpoints: bool = False  # never delete checkpoints
    always_save_checkpoint: bool = True  # False: a periodic save happens only if val loss improved
    # true: a save stages the state to host memory (pinned on CUDA), the only part that stops training, and a background
    # thread writes the file while training goes on; one write in flight at most; the final save, .HALT, SIGTERM and
    # errors wait for it (docs/RUNBOOK.md "Asynchronous checkpoints")
    async_checkpoint: bool = False
    # sequence-length stages after the first (this section's seq_len, batch_size and the model's RoPE / nsa.w): a list of
    # {at: STEP, seq_len, batch_size, rope_theta, rope_scale, nsa_w}; tokens per step kept unless a stage sets its
    # batch_size (train/core/seq_stages.py, docs/USE.md "Long context"). null: one stage
    seq_stages: list[dict] | None = None
    resume: str = "auto"  # auto | none | PATH to a checkpoint
    init_from: str = ""  # fresh starts only: initial weights from hf:DIR (a Hugging Face model directory) or PATH to one of our checkpoints (weights only)
    # fresh starts only: a longer-context stage of a finished run (docs/USE.md "Long context"): its checkpoint's weights (a
    # file or run directory) with a fresh optimizer and schedule, like init_from, but model.max_seq_len / rope_theta /
    # rope_scale and nsa.w may differ from the checkpoint's; recorded as extended_from in metrics.json, run.info, checkpoints
    extend_from: str = ""
    nonfinite_skip_limit: int = 3  # non-finite steps skipped before the run halts
    # spike skipping (docs/RUNBOOK.md "Skipped steps"), on when a threshold is set: a step whose loss / gradient norm is more
    # than that many standard deviations above the mean of the last spike_skip_window accepted steps is skipped like a non-finite one
    spike_skip_z_loss: float | None = None  # spike skipping on the step's global mean loss: a threshold in standard deviations above the window's mean (e.g. 6); null: loss not checked
    spike_skip_z_norm: float | None = None  # spike skipping on the global gradient norm (before clipping), in standard deviations; null: norm not checked (both null: spike skipping off, the default)
    spike_skip_window: int = 100  # accepted steps in the trailing window, >= 2; nothing is flagged before it is full (spike skipping on only)
    spike_skip_limit: int = 10  # this many spike skips in a row stop the run with a checkpoint, exit 3 (spike skipping on only)
    loss_floor: float = 0.0  # alert (heartbeat 'alert') if loss < floor before loss_floor_steps
    loss_floor_steps: int = 0  # the window (in steps) of the loss_floor alert
    loss_spike_sigma: float = 6.0  # record a 'loss_spike' alert when an interval's loss exceeds mean + k*std
    loss_spike_window: int = 50  # log intervals in the spike statistics' window
    sample_every: int = 0  # every N steps rank 0 writes greedy samples to samples.jsonl and TensorBoard text; 0: off
    sample_prompts: str = ""  # prompts for sample_every, separated by '|', or @FILE with one prompt per line; empty: one sample from EOS
    sample_tokens: int = 64  # new tokens per sample

    def validate(self) -> None:
        positive = ("steps", "seq_len", "batch_size", "accumulate_grad_batches", "log_every", "eval_steps",
                    "eval_tasks_limit")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name} must be positive, got {getattr(self, name)}")
        for name in ("stop_after", "warmup_steps", "eval_every", "save_every", "keep_last", "nonfinite_skip_limit",
                     "sample_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("train.lr must be > 0 and train.min_lr_ratio in [0, 1]")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"train.lr_schedule={self.lr_schedule!r}; valid: {', '.join(LR_SCHEDULES)}")
        if self.lr_schedule == "wsd":
            self._validate_wsd()
        if self.sample_tokens <= 0:
            raise ConfigError(f"train.sample_tokens must be positive, got {self.sample_tokens}")
        if self.keep_last == 0 and not self.keep_all_checkpoints:
            raise ConfigError("train.keep_last must be >= 1 (or set keep_all_checkpoints)")
        self._validate_spike_skip()
        self._validate_optimizer()
        if self.eval_tasks and not (self.eval_every or self.eval_only):
            raise ConfigError("train.eval_tasks has no effect with train.eval_every=0: tasks are scored at each "
                              "evaluation; set train.eval_every")

    @property
    def spike_skip(self) -> bool:
        """Spike skipping is on: a threshold is set (train/trainer/spikes.py)."""
        return self.spike_skip_z_loss is not None or self.spike_skip_z_norm is not None

    def _validate_spike_skip(self) -> None:
        for name in ("spike_skip_z_loss", "spike_skip_z_norm"):
            z = getattr(self, name)
            if z is not None and not 0 < z < float("inf"):
                raise ConfigError(f"train.{name} must be a positive number of standard deviations (null: not checked), "
                                  f"got {z}")
        if self.spike_skip_window < 2:
            raise ConfigError(f"train.spike_skip_window must be >= 2 (a standard deviation needs two steps), "
                              f"got {self.spike_skip_window}")
        if self.spike_skip_limit < 1:
            raise ConfigError(f"train.spike_skip_limit must be >= 1, got {self.spike_skip_limit}")

    def _validate_optimizer(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"train.optimizer={self.optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
        if self.optimizer == "muon" and (refusal := torch_refusal("train.optimizer=muon")):
            raise ConfigError(refusal)
        if not 0 <= self.muon_momentum < 1:
            raise ConfigError(f"train.muon_momentum must be in [0, 1), got {self.muon_momentum}")
        if not 1 <= self.muon_ns_steps <= 99:  # torch.optim.Muon refuses 100 and more
            raise ConfigError(f"train.muon_ns_steps must be in 1..99, got {self.muon_ns_steps}")
        if self.muon_adjust_lr not in MUON_ADJUST_LR:
            raise ConfigError(f"train.muon_adjust_lr={self.muon_adjust_lr!r}; valid: {', '.join(MUON_ADJUST_LR)}")
        if not 0 < self.muon_lr_ratio < float("inf"):
            raise ConfigError(f"train.muon_lr_ratio must be a positive number, got {self.muon_lr_ratio}")

    def _validate_wsd(self) -> None:
        if (self.decay_fraction is None) == (self.decay_steps is None):
            raise ConfigError("train.lr_schedule=wsd needs exactly one of train.decay_fraction (e.g. 0.2) and "
                              f"train.decay_steps, got decay_fraction={self.decay_fraction}, decay_steps={self.decay_steps}")
        if self.decay_fraction is not None and not 0 < self.decay_fraction <= 1:
            raise ConfigError(f"train.decay_fraction must be in (0, 1], got {self.decay_fraction}")
        if self.decay_steps is not None and self.decay_steps <= 0:
            raise ConfigError(f"train.decay_steps must be positive, got {self.decay_steps}")
        if self.decay_shape not in DECAY_SHAPES:
            raise ConfigError(f"train.decay_shape={self.decay_shape!r}; valid: {', '.join(DECAY_SHAPES)}")
        start, length = self.wsd_decay()
        if start < self.warmup_steps:
            raise ConfigError(f"train.lr_schedule=wsd: warmup ({self.warmup_steps}) + decay ({length}) steps exceed "
                              f"train.steps={self.steps}; shorten the decay or raise train.steps")

    def wsd_decay(self) -> tuple[int, int]:
        """(first decaying step, decay length) of a wsd schedule: steps start .. train.steps - 1 (0-based) decay.
        decay_fraction rounds to the nearest step, at least one."""
        length = self.decay_steps if self.decay_steps is not None else max(1, round(self.decay_fraction * self.steps))
        return self.steps - length, length


@dataclass
class RuntimeConfig:
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp16
    compile: bool = False  # torch.compile each block in place (regional: one compilation serves every block)
    gradient_checkpointing: int = 0  # 0/false: off; 1/true: every block; k: every k-th block
    watchdog_s: float = 900.0  # dump stacks if no step completes for this long; 0 disables
    threads: int = 0  # torch intra-op threads on CPU; 0 = torch default
    disable_gc: bool = False  # no automatic Python GC; a collection runs at each log interval instead
    cuda_graphs: bool = False  # torch.compile mode 'reduce-overhead' (CUDA graphs); needs compile on CUDA
    nvtx: bool = False  # NVTX ranges around the step and the NSA branches (for nsys); zero cost when off
    sdpa_audit: bool = False  # log once which attention kernel each call site used
    profile_steps: str = ""  # 'A:B': torch.profiler trace of steps A..B (and a CUDA memory snapshot)
    throughput_alert_drop: float = 0.2  # alert when tokens/s falls this far below its running median ...
    throughput_alert_s: float = 300.0  # ... for this long; then a profiler trace is captured once
    gate_collapse_alert: float = 0.01  # NSA: alert when gate_collapse_frac (one branch's gate > 0.99, both others < 0.01) rises above this; 0 disables
    gate_entropy_alert: float = 0.5  # NSA: alert when gate_entropy_mean (nats, at most ln 2 = 0.69) falls below this; nsa.gate_init=window scales it by its starting entropy / ln 2 (0.53); 0 disables
    wandb: bool = False  # log to Weights & Biases (pre-flight fails if the package is missing)
    wandb_project: str = "nsa-train"
    wandb_run_name: str | None = None
    # distributed
    ddp_compress: str = "none"  # none | bf16 | fp16 (DDP gradient-compression hook)
    ddp_bucket_mb: int = 25  # DDP gradient bucket size (MB)
    ddp_static_graph: bool = False  # DDP static_graph=True (same graph every step)
    zero1: bool = False  # ZeroRedundancyOptimizer
    fsdp: bool = False  # FSDP2 fully_shard with bf16 mixed precision

    def validate(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"runtime.device={self.device!r}; valid: auto, cpu, cuda")
        if self.precision not in ("auto", "fp32", "bf16", "fp16"):
            raise ConfigError(f"runtime.precision={self.precision!r}; valid: auto, fp32, bf16, fp16")
        if self.gradient_checkpointing < 0:
            raise ConfigError("runtime.gradient_checkpointing must be >= 0")
        if self.ddp_compress not in ("none", "bf16", "fp16"):
            raise ConfigError(f"runtime.ddp_compress={self.ddp_compress!r}; valid: none, bf16, fp16")
        if self.profile_steps and not re.fullmatch(r"\d+:\d+", self.profile_steps):
            raise ConfigError(f"runtime.profile_steps={self.profile_steps!r}; expected A:B, e.g. 10:15")
        if self.cuda_graphs and not self.compile:
            raise ConfigError("runtime.cuda_graphs needs runtime.compile=true (CUDA graphs come from torch.compile)")
        if self.zero1 and self.fsdp:
            raise ConfigError("runtime.zero1 and runtime.fsdp are exclusive; pick one")
        for name in ("gate_collapse_alert", "gate_entropy_alert"):
            if getattr(self, name) < 0:
                raise ConfigError(f"runtime.{name} must be >= 0 (0 disables), got {getattr(self, name)}")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    source: str = "<defaults>"  # where the config came from (for messages)
    overrides: frozenset[str] = frozenset()  # 'section.key' set on the command line (an explicit choice)

    def to_dict(self) -> dict:
        """Every section in full (checkpoints and run summaries store this)."""
        model = dataclasses.asdict(self.model)
        nsa = model.pop("nsa")
        return {
            "model": model,
            "nsa": nsa,
            "train": dataclasses.asdict(self.train),
            "data": dataclasses.asdict(self.data),
            "runtime": dataclasses.asdict(self.runtime),
        }


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "nsa": NSAConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "runtime": RuntimeConfig,
}

_PRECISION_NAMES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16", "bf16": "bf16", "fp32": "fp32",
                    "fp16": "fp16", "auto": "auto"}


def _init_from(value: str) -> tuple[str, str]:
    """`train.resume`: resume -> auto, scratch -> none; hf:DIR or a checkpoint PATH -> `train.init_from`"""
    mapping = {"resume": "auto", "scratch": "none"}
    if value in mapping:
        return "train.resume", mapping[value]
    if value.startswith("hf:") or value.endswith(".pt"):
        return "train.init_from", value
    raise ConfigError(f"--init_from={value!r}; valid: resume, scratch, hf:DIR, PATH.pt")


def _dtype(value: str) -> tuple[str, str]:
    """`runtime.precision`: bfloat16 -> bf16, float32 -> fp32, float16 -> fp16"""
    if value not in _PRECISION_NAMES:
        raise ConfigError(f"--dtype={value!r}; valid: {', '.join(_PRECISION_NAMES)}")
    return "runtime.precision", _PRECISION_NAMES[value]


def _use_flash(value) -> tuple[str, str]:
    """`model.attn_backend`: true -> auto (flash-attn when importable), false -> sdpa"""
    return "model.attn_backend", "auto" if _as_bool(value, "--use_flash") else "sdpa"


def _attention_backend(value: str) -> tuple[str, str]:
    """`model.attn_backend`: flash_attn_2 -> flash, sdpa, manual"""
    mapping = {"flash_attn_2": "flash", "flash": "flash", "sdpa": "sdpa", "manual": "manual"}
    if value not in mapping:
        raise ConfigError(f"--attention_backend={value!r}; valid: {', '.join(mapping)}")
    return "model.attn_backend", mapping[value]


def _use_dataloader(value) -> tuple[str, int]:
    """`data.num_workers`: true -> 4 worker processes (stream sources), false -> 0; give
    --dataloader_num_workers after it to choose the count"""
    return "data.num_workers", 4 if _as_bool(value, "--use_dataloader") else 0


# alias -> "section.key" or a function value -> (section.key, converted value)
ALIASES: dict[str, object] = {
    "max_iters": "train.steps",
    "batch_size": "train.batch_size",
    "gradient_accumulation_steps": "train.accumulate_grad_batches",
    "block_size": "train.seq_len",
    "learning_rate": "train.lr",
    "eval_interval": "train.eval_every",
    "eval_iters": "train.eval_steps",
    "log_interval": "train.log_every",
    "warmup_iters": "train.warmup_steps",
    "grad_clip": "train.grad_clip",
    "compile": "runtime.compile",
    "dtype": _dtype,
    "init_from": _init_from,
    "use_flash": _use_flash,
    "attention_backend": _attention_backend,
    "use_zero1": "runtime.zero1",
    "use_fsdp": "runtime.fsdp",
    "use_cuda_graphs": "runtime.cuda_graphs",
    "use_dataloader": _use_dataloader,
    "dataloader_num_workers": "data.num_workers",
    "wandb_log": "runtime.wandb",
    "wandb_project": "runtime.wandb_project",
    "wandb_run_name": "runtime.wandb_run_name",
    "profile_steps": "runtime.profile_steps",
    "flash_attn": _use_flash,
}

# data keys that only stream sources read (a bin: source reads prepared tokens in-process)
STREAM_ONLY_DATA_KEYS = ("subset", "split", "text_field", "text_sample_by", "val_fraction", "val_source", "split_seed",
                         "num_workers", "persistent_workers", "prefetch_factor", "tokenize_batch_docs",
                         "synthetic_on_fail", "first_batch_timeout_s", "retry_max", "retry_max_s", "read_timeout_s",
                         "retry_backoff_s",
                         "spool_dir")

# seed flags accepted as documented no-ops: flag -> why nothing needs to happen (printed as a note)
NO_OP_FLAGS: dict[str, str] = {
    "gradient_log_interval": "the global gradient norm is logged at every log interval (training.csv grad_norm); "
                             "there is no separate gradient log",
}


def _as_bool(value, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ConfigError(f"{where}: expected true/false, got {value!r}")


class CliText(str):
    """A command-line value: text, typed only once the target field's type is known."""


def _as_names(value, where: str) -> list[str]:
    """A list of names: a YAML list, or text (the command line) either comma-separated or a YAML flow list
    ('[a, b]'); empty text is the empty list."""
    if isinstance(value, str):
        text = value.strip()
        if not text.startswith("["):
            return [part.strip() for part in text.split(",") if part.strip()]
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            raise ConfigError(f"{where}: malformed list {text!r}; write a,b or [a, b]") from None
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise ConfigError(f"{where}: expected a list of names, got {value!r}")
    return [v.strip() for v in value]


def _as_mappings(value, where: str) -> list[dict]:
    """A list of mappings: a YAML list, or text (the command line) holding a YAML flow list ('[{a: 1}, {a: 2}]')."""
    if isinstance(value, str):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(f"{where}: malformed list {value!r}; write [{{key: value, ...}}, ...]") from None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError(f"{where}: expected a list of mappings, got {value!r}")
    return value


def _coerce(value, annotation, where: str):
    """Check / convert one value against a dataclass field annotation (str, int, float, bool, X | None,
    list[str], list[dict])."""
    if typing.get_origin(annotation) is list:
        if typing.get_args(annotation) == (dict,):
            return _as_mappings(value, where)
        return _as_names(value, where)
    if isinstance(value, CliText):
        nullable_text = str in typing.get_args(annotation)
        if annotation is str or (nullable_text and value.strip().lower() not in ("null", "none", "~")):
            return str(value)  # '3:4' stays text (YAML 1.1 would read it as the integer 184)
        value = _parse_value(value)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], where)
    if annotation is bool:
        return _as_bool(value, where)
    if annotation is int:
        if isinstance(value, bool) and "gradient_checkpointing" in where:
            return int(value)  # the source guides write `gradient_checkpointing: false`
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)  # 5e4 in YAML
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise ConfigError(f"{where}: unsupported field type {annotation}")


def _field_types(cls: type) -> dict[str, object]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name != "nsa"}


def _did_you_mean(name: str, choices: dict[str, str], otherwise: str) -> str:
    """choices: candidate -> how to write it. 'did you mean X?' for the closest candidate, else `otherwise`."""
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f"did you mean {choices[close[0]]}?" if close else otherwise


def _section_hint(section: str) -> str:
    return _did_you_mean(section, {s: f"'{s}'" for s in SECTIONS}, f"valid sections: {', '.join(SECTIONS)}")


def _build(cls: type, values: dict, where: str, section: str = "", origins: dict[str, str] | None = None):
    """Typed keyword arguments for cls. origins: key -> the command-line flag that set it (errors about
    such a key name the flag, not the YAML file `where`)."""
    types_ = _field_types(cls)
    origins = origins or {}
    unknown = sorted(set(values) - set(types_), key=lambda k: (k not in origins, k))
    if unknown:
        key = unknown[0]
        hint = _did_you_mean(key, {k: f"'{k}'" for k in types_},
                             "no close match; `python -m train --help` lists the keys (docs/CONFIG.md)")
        if key in origins:
            raise ConfigError(f"{origins[key]}: unknown key '{key}' in section {section}; {hint}")
        raise ConfigError(f"{where}: unknown key '{key}'; {hint}")
    kwargs = {k: _coerce(v, types_[k], origins.get(k, f"{where}.{k}")) for k, v in values.items()}
    return kwargs


def _load_yaml(path: Path) -> dict:
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    if path.is_dir():
        raise ConfigError(f"config path {path} is a directory, not a YAML file")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text (a binary file?)") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: malformed YAML{at}: {getattr(exc, 'problem', exc)}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections ({', '.join(SECTIONS)})")
    for section, body in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"{path}: unknown section '{section}'; {_section_hint(str(section))}")
        if body is not None and not isinstance(body, dict):
            raise ConfigError(f"{path}: section '{section}' must be a mapping, got {type(body).__name__}")
    return {k: dict(v or {}) for k, v in raw.items()}


def _leaf_index() -> dict[str, list[str]]:
    index: dict[str, list[str]] = {}
    for section, cls in SECTIONS.items():
        for name in _field_types(cls):
            index.setdefault(name, []).append(f"{section}.{name}")
    return index


def _parse_value(text: str):
    """CLI values are YAML scalars: 3 -> int, 3e-4 -> float, true -> bool, none -> None, else the string."""
    text = str(text)
    if text.strip().lower() in ("null", "none", "~"):
        return None
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if value is None or isinstance(value, (str, dict, list)):
        return text
    return value


def parse_overrides(args: list[str]) -> list[tuple[str, object]]:
    """['--train.steps=5', '--max_iters', '7'] -> [('train.steps', 5), ('train.steps', 7)]."""
    return [(key, value) for key, value, _ in _parse_overrides(args)]


def _parse_overrides(args: list[str]) -> list[tuple[str, object, str]]:
    """parse_overrides with each pair's origin for messages: '--train.steps', '--max_iters (train.steps)'."""
    pairs: list[tuple[str, object, str]] = []
    index = _leaf_index()
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.key=value")
        body = arg[2:]
        if "=" in body:
            key, text = body.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, text = body, args[i + 1]
            i += 1
        else:
            key, text = body, "true"  # a bare flag: --compile
        i += 1
        key = key.replace("-", "_") if "." not in key else key
        value = CliText(text)
        if "." in key:
            section = key.split(".", 1)[0]
            if section not in SECTIONS:
                raise ConfigError(f"--{key}: unknown section '{section}'; {_section_hint(section)}")
            pairs.append((key, value, f"--{key}"))
        elif key in NO_OP_FLAGS:
            print(f"note: --{key}={text} has no effect: {NO_OP_FLAGS[key]}", file=sys.stderr)
        elif key in ALIASES:
            target = ALIASES[key]
            target_key, target_value = target(_parse_value(value)) if callable(target) else (target, value)
            pairs.append((target_key, target_value, f"--{key} ({target_key})"))
        elif key in index and len(index[key]) == 1:
            pairs.append((index[key][0], value, f"--{key} ({index[key][0]})"))
        elif key in index:
            raise ConfigError(f"--{key} is ambiguous ({', '.join(index[key])}); give the section")
        else:
            flags = {name: " or ".join(f"--{q}" for q in qualified) for name, qualified in index.items()}
            flags.update({name: f"--{name}" for name in [*ALIASES, *NO_OP_FLAGS]})
            raise ConfigError(f"--{key}: unknown option; " + _did_you_mean(
                key, flags, f"use --section.key=value (sections: {', '.join(SECTIONS)})"))
    return pairs


def _one_decay_length(train: dict, origins: dict[str, str]) -> None:
    """decay_fraction and decay_steps are one setting written two ways: one given on the command line replaces the
    other from the YAML file (a cooldown launch sets --train.decay_steps over a preset's decay_fraction)."""
    pair = ("decay_fraction", "decay_steps")
    for key, other in (pair, pair[::-1]):
        if key in origins and other not in origins:
            train.pop(other, None)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """YAML file (or defaults when path is None) + CLI overrides -> validated RunConfig."""
    sections: dict[str, dict] = {name: {} for name in SECTIONS}
    where = str(path) if path is not None else "<defaults>"
    if path is not None:
        for name, body in _load_yaml(Path(path)).items():
            sections[name].update(body)
    origins: dict[str, dict[str, str]] = {name: {} for name in SECTIONS}  # leaf -> the flag that set it
    for key, value, origin in _parse_overrides(overrides or []):
        section, leaf = key.split(".", 1)
        sections[section][leaf] = value
        origins[section][leaf] = origin
    _one_decay_length(sections["train"], origins["train"])
    _one_data_choice(sections["data"], origins["data"])
    built = {name: _build(cls, sections[name], f"{where}: {name}", name, origins[name])
             for name, cls in SECTIONS.items()}
    try:
        nsa = NSAConfig(**built["nsa"])
        model = ModelConfig(**built["model"], nsa=nsa)
        if model.attention != "nsa" and sections["nsa"]:
            raise ConfigError(f"{where}: an 'nsa' section is set but model.attention is {model.attention!r}; "
                              "remove it or set model.attention: nsa")
        if model.pos_emb != "rope":
            ignored = sorted({"rope_theta", "rope_scale"} & set(sections["model"]))
            if ignored:
                raise ConfigError(f"{where}: model.{ignored[0]} has no effect with model.pos_emb={model.pos_emb!r}")
        if model.attention == "nsa" and "attn_backend" in sections["model"]:
            raise ConfigError(f"{where}: model.attn_backend has no effect with model.attention='nsa' (it picks the "
                              "dense attention kernel; NSA's kernels are chosen by nsa.kernel)")
        data = DataConfig(**built["data"])
        if (data.source_kind == "bin" or data.mixture is not None) and not data.reads_streams:
            ignored = sorted(set(sections["data"]) & set(STREAM_ONLY_DATA_KEYS))
            if ignored:
                raise ConfigError(f"{where}: data.{ignored[0]} has no effect with a bin: source (prepared tokens are read "
                                  "from np.memmap in the training process; loader and document settings apply to stream sources)")
    except (ModelConfigError, TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    cfg = RunConfig(model=model, train=TrainConfig(**built["train"]), data=data,
                    runtime=RuntimeConfig(**built["runtime"]), source=where,
                    overrides=frozenset(f"{section}.{leaf}" for section, leaves in origins.items() for leaf in leaves))
    if "eval_tasks_limit" in sections["train"] and not cfg.train.eval_tasks:
        raise ConfigError(f"{where}: train.eval_tasks_limit has no effect with no train.eval_tasks")
    cfg.train.validate()
    if cfg.train.init_from and cfg.train.extend_from:
        raise ConfigError(f"{where}: train.init_from and train.extend_from both start from other weights; give one")
    if cfg.train.lr_schedule != "wsd" and (ignored := [k for k in WSD_ONLY_KEYS if k in sections["train"]]):
        raise ConfigError(f"{origins['train'].get(ignored[0], where)}: train.{ignored[0]} has no effect with train.lr_schedule="
                          f"{cfg.train.lr_schedule!r}; it sets the decay of lr_schedule=wsd")
    if not cfg.train.spike_skip and (ignored := [k for k in SPIKE_ONLY_KEYS if k in sections["train"]]):
        raise ConfigError(f"{origins['train'].get(ignored[0], where)}: train.{ignored[0]} has no effect with spike "
                          "skipping off; set train.spike_skip_z_loss and/or train.spike_skip_z_norm to turn it on")
    if cfg.train.optimizer != "muon" and (ignored := [k for k in MUON_ONLY_KEYS if k in sections["train"]]):
        raise ConfigError(f"{origins['train'].get(ignored[0], where)}: train.{ignored[0]} has no effect with train.optimizer="
                          f"{cfg.train.optimizer!r}; set train.optimizer=muon to use it")
    cfg.runtime.validate()
    if cfg.train.optimizer == "muon" and cfg.runtime.fsdp:
        raise ConfigError(f"{where}: train.optimizer=muon does not run with runtime.fsdp (FSDP2 shards each matrix across "
                          "ranks; Muon orthogonalizes whole matrices): use DDP (the default) or runtime.zero1=true")
    try:
        cfg.data.validate()
        data_mixture(cfg)
    except (ValueError, UserError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if cfg.model.pos_emb == "learned" and cfg.train.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"{where}: train.seq_len={cfg.train.seq_len} exceeds model.max_seq_len="
                          f"{cfg.model.max_seq_len} (learned positions)")
    if cfg.train.seq_stages:
        from train.core.seq_stages import seq_stages

        seq_stages(cfg, where)
        if cfg.data.reads_streams:
            raise ConfigError(f"{where}: train.seq_stages need bin: or synthetic sources, alone or in a mixture (a global "
                              f"step's rows are then a function of the step at any seq_len); prepare the stream (python -m "
                              f"train.data.prepare) or train one stage per run with train.extend_from")
    return cfg


def _one_data_choice(data: dict, cli: dict[str, str]) -> None:
    """The command line's choice of data replaces the file's: --data.mixture drops the file's data.source, and
    --data.source drops the file's data.mixture and data.stages (set both in one place and the mixture refuses)."""
    if "mixture" in cli and "source" not in cli:
        data.pop("source", None)
    if "source" in cli and "mixture" not in cli:
        data.pop("mixture", None)
        if "stages" not in cli:
            data.pop("stages", None)


def data_mixture(cfg: RunConfig) -> Mixture:
    """The run's data mixture (data.mixture and data.stages, or data.source as a mixture of one): the one parse that
    the loader, the start checks, preflight and the plan use. DataError (one line) on a bad mixture."""
    decay_start = cfg.train.wsd_decay()[0] if cfg.train.lr_schedule == "wsd" else None
    return parse_mixture(cfg.data, steps=cfg.train.steps, decay_start=decay_start)


def dump_config(cfg: RunConfig) -> str:
    """The effective config as YAML that load_config accepts again: keys that have no effect for
    this run (the nsa section of a dense model, attn_backend of an NSA model, the nsa keys a window-only
    layer does not read, rope_* with learned positions, stream-loader settings of a bin: source, the task limit
    without tasks, the wsd decay keys of another schedule, the spike-skip window and limit with spike skipping
    off, the muon keys with another optimizer) are left out."""
    doc = cfg.to_dict()
    if cfg.model.attention != "nsa":
        doc.pop("nsa")
    else:
        doc["model"].pop("attn_backend")
        if cfg.model.nsa.window_only:
            doc["nsa"] = {k: v for k, v in doc["nsa"].items() if k in WINDOW_FIELDS}
    if (cfg.data.source_kind == "bin" or cfg.data.mixture is not None) and not cfg.data.reads_streams:
        for key in STREAM_ONLY_DATA_KEYS:
            doc["data"].pop(key)
    if cfg.model.pos_emb != "rope":
        for key in ("rope_theta", "rope_scale"):
            doc["model"].pop(key)
    if not cfg.train.eval_tasks:
        doc["train"].pop("eval_tasks_limit")
    if cfg.train.lr_schedule != "wsd":
        for key in WSD_ONLY_KEYS:
            doc["train"].pop(key)
    if not cfg.train.spike_skip:
        for key in SPIKE_ONLY_KEYS:
            doc["train"].pop(key)
    if cfg.train.optimizer != "muon":
        for key in MUON_ONLY_KEYS:
            doc["train"].pop(key)
    return yaml.safe_dump(doc, sort_keys=False)
