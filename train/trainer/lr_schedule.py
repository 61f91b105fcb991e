"""The learning-rate schedule: a pure function of the optimizer step (not the micro-step), so resume needs only
the step count and the horizon is `train.steps` whatever the accumulation; and the rule a resume keeps with it.

Schedules (train.lr_schedule), each after a linear warmup of train.warmup_steps:
- cosine / linear: decay from lr to the floor (lr * min_lr_ratio) over the rest of train.steps;
- constant: lr;
- wsd (warmup-stable-decay): lr, then the last train.decay_steps (or train.decay_fraction of train.steps) decay
  with train.decay_shape to the floor at the last step. Raising train.steps on resume, while the checkpoint is
  still before the decay, moves the decay later (a longer flat phase); a decay that has begun cannot be undone
  or moved (`resume_refusal`). docs/USE.md "Learning-rate schedules and cooldowns" shows the cooldown workflow.
"""
from __future__ import annotations

import dataclasses
import math

from train.core.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """LR for optimizer step `step` (0-based): linear warmup, then cosine / linear decay to the floor over the rest
    of train.steps, a constant lr, or wsd: lr until the decay window (TrainConfig.wsd_decay), then `decay_shape`
    down to the floor, which the last step (train.steps - 1) reaches."""
    floor = cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if cfg.lr_schedule == "wsd":
        return _wsd_lr(step, cfg, floor)
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.lr_schedule == "linear":
        return cfg.lr - (cfg.lr - floor) * progress
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def _wsd_lr(step: int, cfg: TrainConfig, floor: float) -> float:
    """The stable phase and the decay of wsd. The decay's first step already takes one step of it (progress
    1/length), as warmup's first step takes 1/warmup_steps, so the last step is the floor (progress 1). 1-sqrt:
    Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations"."""
    start, length = cfg.wsd_decay()
    if step < start:
        return cfg.lr
    progress = min(1.0, (step - start + 1) / length)
    if cfg.decay_shape == "linear":
        fall = progress
    elif cfg.decay_shape == "1-sqrt":
        fall = math.sqrt(progress)
    else:  # cosine
        fall = 0.5 * (1.0 - math.cos(math.pi * progress))
    return floor + (cfg.lr - floor) * (1.0 - fall)


def saved_train_config(saved: dict) -> TrainConfig:
    """A checkpoint's `config['train']` as a TrainConfig (keys it predates take their defaults)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in saved.items() if k in names})


def resume_refusal(saved: TrainConfig, new: TrainConfig, step: int, checkpoint: str) -> str | None:
    """Why `new` must not continue a checkpoint at `step` written under `saved` (one line), or None. The steps
    already taken keep their wsd schedule: a decay that began before the checkpoint keeps its window and shape,
    and a new wsd decay may not begin before the checkpoint. Other changes to the schedule on resume (lr,
    min_lr_ratio, cosine's horizon) stay the operator's choice, as before wsd."""
    if new.lr_schedule == "wsd" and saved.lr_schedule == "wsd" and new.wsd_decay() == saved.wsd_decay() \
            and new.decay_shape == saved.decay_shape:
        return None
    if saved.lr_schedule == "wsd":
        start, length = saved.wsd_decay()
        if step > start:
            return (f"checkpoint {checkpoint} (step {step}) is inside its wsd decay (steps {start + 1}..{saved.steps}, "
                    f"{saved.decay_shape}); a decay cannot be undone or moved: resume it with train.steps={saved.steps} "
                    f"train.decay_steps={length} train.decay_shape={saved.decay_shape}, or branch a new decay from a "
                    f"checkpoint at or before step {start}")
    if new.lr_schedule == "wsd":
        start, length = new.wsd_decay()
        if step > start:
            return (f"train.steps={new.steps} with a {length}-step wsd decay would decay steps {start + 1}..{new.steps}, "
                    f"but checkpoint {checkpoint} is at step {step} already; set train.steps to at least {step + length} "
                    f"or shorten the decay")
    return None
