"""Sequence-length stages (train.seq_stages): train short, then longer, in one run (docs/USE.md "Long context").

    train:
      seq_len: 64
      batch_size: 128
      seq_stages:
        - {at: 2000, seq_len: 256, rope_theta: 40000}   # from optimizer step 2,000 on (the 2,001st step)
        - {at: 3000, seq_len: 512, rope_scale: 2.0, nsa_w: 16}

The config's own train.seq_len / batch_size / model.rope_* / nsa.w are the first stage (from step 0). A stage takes
effect from optimizer step `at` on (steps are counted from 0: `at` steps are done when it starts), like data.stages.
Per stage:
- seq_len: the training sequence length.
- batch_size: rows per micro-batch per rank. Left out (the default), the tokens per step are kept: each rank's rows
  per step become (first stage's rows per step) x (first seq_len / this seq_len), split into micro-batches of at most
  the first stage's tokens (memory per micro-batch never grows). Given, the rows per step change with it (the plan
  says by how much).
- rope_theta, rope_scale: the RoPE base and linear position interpolation from this stage on (RoPE models only).
- nsa_w: NSA's sliding window from this stage on (NSA models only; its other geometry stays).
What is not given is the stage before's. The data (bin: and synthetic sources: a global step's rows are a function
of the step, so resume and any world size stay exact), the model's RoPE and window, MFU and the logged tokens follow
the stage. One parse (`seq_stages`) for the trainer, the start checks, preflight and the plan.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from train.core.errors import ConfigError

STAGE_KEYS = ("at", "seq_len", "batch_size", "rope_theta", "rope_scale", "nsa_w")


@dataclass(frozen=True)
class SeqStage:
    at: int  # the first optimizer step (0-based) of the stage
    seq_len: int
    batch_size: int  # rows per micro-batch per rank
    accumulate: int  # micro-batches per optimizer step
    rope_theta: float
    rope_scale: float
    nsa_w: int | None  # None: a dense model
    tokens_kept: bool = True  # False: the stage set its own batch_size

    def rows_per_rank(self) -> int:
        return self.batch_size * self.accumulate

    def describe(self, world_size: int) -> str:
        rope = f", rope_theta {self.rope_theta:g}, rope_scale {self.rope_scale:g}"
        return (f"from step {self.at}: seq_len {self.seq_len}, {self.batch_size} x {self.accumulate} rows per rank "
                f"({self.rows_per_rank() * self.seq_len * world_size:,} tokens per step on {world_size} rank(s))"
                + rope + (f", nsa.w {self.nsa_w}" if self.nsa_w is not None else ""))


def seq_stages(cfg, where: str = "config") -> list[SeqStage]:
    """The run's stages, the first from the config itself; ConfigError (one line) for a plan that cannot work. `cfg`: a
    RunConfig (its train.batch_size / accumulate_grad_batches: the split of this launch's world size)."""
    t, m = cfg.train, cfg.model
    nsa_w = m.nsa.w if m.attention == "nsa" else None
    first = SeqStage(at=0, seq_len=t.seq_len, batch_size=t.batch_size, accumulate=t.accumulate_grad_batches,
                     rope_theta=m.rope_theta, rope_scale=m.rope_scale, nsa_w=nsa_w)
    stages = [first]
    for i, raw in enumerate(t.seq_stages or []):
        name = f"{where}: train.seq_stages[{i}]"
        if not isinstance(raw, dict):
            raise ConfigError(f"{name}: a stage is a mapping with keys {', '.join(STAGE_KEYS)}, got {raw!r}")
        if unknown := sorted(set(raw) - set(STAGE_KEYS)):
            raise ConfigError(f"{name}: unknown key {unknown[0]!r} (a stage takes {', '.join(STAGE_KEYS)})")
        before = stages[-1]
        at = _int(raw, "at", name)
        if at is None or not before.at < at < t.steps:
            raise ConfigError(f"{name}: at={raw.get('at')!r} must be a step after the stage before's ({before.at}) and "
                              f"before train.steps={t.steps}")
        seq_len = _int(raw, "seq_len", name) or before.seq_len
        if seq_len < 1:
            raise ConfigError(f"{name}: seq_len must be >= 1, got {seq_len}")
        if m.pos_emb == "learned" and seq_len > m.max_seq_len:
            raise ConfigError(f"{name}: seq_len {seq_len} is above the learned positions (model.max_seq_len="
                              f"{m.max_seq_len}); a longer context needs pos_emb: rope")
        if m.pos_emb != "rope" and ("rope_theta" in raw or "rope_scale" in raw):
            raise ConfigError(f"{name}: rope_theta / rope_scale need model.pos_emb: rope")
        if m.rope_scaling != "linear" and "rope_scale" in raw:
            raise ConfigError(f"{name}: rope_scale with model.rope_scaling={m.rope_scaling} (its trained context would be "
                              f"the last stage's, not this one's); scale linearly, or extend in a second run with "
                              f"train.extend_from")
        if nsa_w is None and "nsa_w" in raw:
            raise ConfigError(f"{name}: nsa_w needs model.attention: nsa")
        theta = float(raw.get("rope_theta", before.rope_theta))
        scale = float(raw.get("rope_scale", before.rope_scale))
        if theta <= 0 or scale < 1:
            raise ConfigError(f"{name}: rope_theta must be > 0 and rope_scale >= 1, got {theta:g} and {scale:g}")
        w = _int(raw, "nsa_w", name) if "nsa_w" in raw else before.nsa_w
        if w is not None and "nsa_w" in raw:
            _check_window(m, w, name)
        batch = _int(raw, "batch_size", name)
        if batch is not None:
            if batch < 1:
                raise ConfigError(f"{name}: batch_size must be >= 1, got {batch}")
            stage = SeqStage(at, seq_len, batch, first.accumulate, theta, scale, w, tokens_kept=False)
        else:
            stage = _keeping_tokens(first, at, seq_len, theta, scale, w, name)
        stages.append(stage)
    return stages


def _keeping_tokens(first: SeqStage, at: int, seq_len: int, theta: float, scale: float, w: int | None,
                    name: str) -> SeqStage:
    """The first stage's tokens per step at seq_len: rows per rank scaled, micro-batches of at most its tokens."""
    tokens = first.rows_per_rank() * first.seq_len
    if tokens % seq_len:
        raise ConfigError(f"{name}: the first stage's {tokens:,} tokens per rank and step are not a whole number of "
                          f"sequences of {seq_len}; the tokens per step cannot be kept: give this stage a batch_size, "
                          f"or a seq_len that divides {tokens:,}")
    rows = tokens // seq_len
    most = max(1, first.batch_size * first.seq_len // seq_len)  # a micro-batch holds no more tokens than the first's
    batch = max(d for d in range(1, min(rows, most) + 1) if rows % d == 0)
    return SeqStage(at, seq_len, batch, rows // batch, theta, scale, w)


def _check_window(model_cfg, w: int, name: str) -> None:
    try:
        replace(model_cfg.nsa, w=w).validate()  # the NSA geometry's own rules
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: nsa_w={w}: {exc}") from None


def _int(raw: dict, key: str, name: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: {key} must be a whole number, got {value!r}")
    return value


def trained_fields(run_config: dict, step: int) -> dict:
    """What a stored run config (a checkpoint's `config`: plain dicts) trained its step-th optimizer step at:
    {seq_len, rope_theta, rope_scale, nsa_w (None unless NSA)}. A checkpoint at step N holds the weights after step N,
    which ran in the last stage whose `at` is below N (a stage takes effect from step `at` on, steps counted from 0).
    Inference tools build a staged checkpoint's model with this RoPE and window, and train.extend_from records it."""
    model, train, nsa = run_config.get("model", {}), run_config.get("train", {}), run_config.get("nsa") or {}
    fields = {"seq_len": train.get("seq_len"), "rope_theta": model.get("rope_theta", 10000.0),
              "rope_scale": model.get("rope_scale", 1.0),
              "nsa_w": nsa.get("w") if model.get("attention") == "nsa" else None}
    for stage in train.get("seq_stages") or []:
        if stage.get("at", 0) < step:
            fields.update({k: stage[k] for k in ("seq_len", "rope_theta", "rope_scale") if k in stage})
            if "nsa_w" in stage and fields["nsa_w"] is not None:
                fields["nsa_w"] = stage["nsa_w"]
    return fields


def stage_config(cfg, stage: SeqStage):
    """A copy of RunConfig `cfg` as the stage trains: its seq_len and batch split, RoPE and NSA window (what the memory
    planner and preflight measure per stage)."""
    out = copy.deepcopy(cfg)
    out.train.seq_len, out.train.batch_size, out.train.accumulate_grad_batches = \
        stage.seq_len, stage.batch_size, stage.accumulate
    out.train.seq_stages = None
    out.model.rope_theta, out.model.rope_scale = stage.rope_theta, stage.rope_scale
    if stage.nsa_w is not None:
        out.model.nsa.w = stage.nsa_w
    return out


def stage_lines(stages: list[SeqStage], steps: int, world_size: int) -> list[str]:
    """One line per stage: its steps, split and tokens (train.plan, preflight)."""
    lines = []
    for i, stage in enumerate(stages):
        end = stages[i + 1].at if i + 1 < len(stages) else steps
        tokens = (end - stage.at) * stage.rows_per_rank() * stage.seq_len * world_size
        lines.append(f"steps {stage.at}-{end}: seq_len {stage.seq_len}, {stage.batch_size} x {stage.accumulate} rows "
                     f"per rank, {tokens:,} tokens" + (f", rope_theta {stage.rope_theta:g}" if i == 0 or
                                                       stage.rope_theta != stages[i - 1].rope_theta else "")
                     + (f", rope_scale {stage.rope_scale:g}" if stage.rope_scale != 1 else "")
                     + (f", nsa.w {stage.nsa_w}" if stage.nsa_w is not None else "")
                     + ("" if stage.tokens_kept else " (its own batch_size: tokens per step changed)"))
    return lines


def stage_at(stages: list[SeqStage], step: int) -> SeqStage:
    """The stage of optimizer step `step` (0-based: the step being computed)."""
    return [s for s in stages if s.at <= step][-1]
