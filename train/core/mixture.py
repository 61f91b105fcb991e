"""A data mixture and its stages, as a config describes them (data.mixture, data.stages): parsed and checked once,
here, for the loader, the launch's start checks, preflight and the plan alike (docs/DATA.md "Mixtures").

    data:
      mixture:
        - {name: web, source: bin:data/fineweb_edu, weight: 0.9}
        - {name: recall, source: bin:data/recall, weight: 0.1, max_epochs: 4}
      stages:
        - {at: decay, weights: {web: 0.7, recall: 0.3}}    # from the first step of the WSD decay on

`Mixture.weights_at(step)` gives each source's share of the rows of that optimizer step; which source a row draws
from is a pure function of (seed, step, row, weights) (train/data/mixture.py). A config without data.mixture is
a mixture of one: `data.source` under the name "data".
"""
from __future__ import annotations

from dataclasses import dataclass

from train.core.data_config import DataConfig, WINDOW_STARTS, check_source
from train.core.errors import DataError

SOURCE_KEYS = ("name", "source", "weight", "val_source", "window_start", "max_epochs")
STAGE_KEYS = ("at", "weights")
DECAY = "decay"  # a stage that begins with the WSD decay (the usual cooldown mix)
SINGLE = "data"  # the name of data.source when there is no mixture
WORLD_SIZE_FREE = ("bin", "synthetic")  # source kinds whose batches are a function of (step, row): any world size


@dataclass(frozen=True)
class MixtureSource:
    name: str
    source: str  # the syntax of data.source: bin:DIR | synthetic | a stream (text:, jsonl:, parquet:, hf:, fineweb_edu)
    weight: float  # before normalising; the first stage's share is weight / sum(weights)
    val_source: str | None = None  # a stream source's separate validation source (else its hashed-out documents)
    window_start: str = "any"  # bin: sources: any | document (data.window_start, per source)
    max_epochs: float | None = None  # refuse a plan that reads more than this many epochs of the source

    @property
    def kind(self) -> str:
        return self.source.split(":", 1)[0]


@dataclass(frozen=True)
class Stage:
    start: int  # first optimizer step of the stage (0-based)
    weights: tuple[float, ...]  # one share per source, summing to 1
    at: str  # as configured: "0" for the first, a step, or "decay"


@dataclass(frozen=True)
class Mixture:
    sources: tuple[MixtureSource, ...]
    stages: tuple[Stage, ...]  # by start; stages[0].start == 0
    steps: int  # the run's optimizer steps (train.steps): the last stage ends there

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sources)

    @property
    def any_world_size(self) -> bool:
        """Every source is a function of (step, row): resume on any world size (a stream's position is per rank)."""
        return all(s.kind in WORLD_SIZE_FREE for s in self.sources)

    @property
    def single(self) -> bool:
        """One source and no stages: data.source as it always was (batches identical to a run without a mixture)."""
        return len(self.sources) == 1

    def stage_at(self, step: int) -> Stage:
        found = self.stages[0]
        for stage in self.stages[1:]:
            if step >= stage.start:
                found = stage
        return found

    def weights_at(self, step: int) -> tuple[float, ...]:
        return self.stage_at(step).weights

    def identity(self) -> dict:
        """What a checkpoint records and a resume compares: the sources (by name and kind: a directory may move
        between machines, as a single bin: source's may) and every stage."""
        return {"sources": [{"name": s.name, "kind": s.kind, "window_start": s.window_start} for s in self.sources],
                "stages": [{"start": st.start, "weights": [round(w, 12) for w in st.weights]} for st in self.stages]}

    def stage_spans(self) -> list[tuple[Stage, int, int]]:
        """(stage, first step, end step exclusive) of each stage of the run."""
        ends = [st.start for st in self.stages[1:]] + [self.steps]
        return [(st, st.start, end) for st, end in zip(self.stages, ends)]

    def plan(self, *, seq_len: int, global_batch: int, source_tokens: dict[str, int | None]) -> list[dict]:
        """Expected tokens and epochs per source per stage: one row {stage, steps, source, share, tokens, epochs}
        (epochs None where the source's size is unknown, e.g. synthetic). A row draws seq_len training tokens."""
        rows = []
        for i, (stage, first, end) in enumerate(self.stage_spans()):
            for source, share in zip(self.sources, stage.weights):
                tokens = (end - first) * global_batch * share * seq_len
                size = source_tokens.get(source.name)
                rows.append({"stage": i, "at": stage.at, "steps": (first, end), "source": source.name, "share": share,
                             "tokens": tokens, "epochs": tokens / size if size else None})
        return rows

    def epochs_refusal(self, plan: list[dict]) -> str | None:
        """One line when the plan reads a source more epochs than its max_epochs allows; None otherwise. Sampling
        draws windows at random with replacement, so a source is never exhausted: max_epochs is how a small
        source says how often it may repeat, checked before the launch."""
        for source in self.sources:
            epochs = sum(r["epochs"] or 0.0 for r in plan if r["source"] == source.name)
            if source.max_epochs is not None and epochs > source.max_epochs:
                return (f"data.mixture: source {source.name!r} would be read {epochs:.2f} epochs over the run, above its "
                        f"max_epochs={source.max_epochs:g}; lower its weight, give it more data or raise max_epochs")
        return None


def plan_lines(plan: list[dict]) -> list[str]:
    """The plan as text, one line per stage and source (train.plan, preflight)."""
    lines = []
    for r in plan:
        epochs = "" if r["epochs"] is None else f", {r['epochs']:.2f} epochs"
        lines.append(f"stage {r['stage']} (steps {r['steps'][0]}-{r['steps'][1] - 1}, at {r['at']}): {r['source']} "
                     f"{r['share']:.1%} of rows, {_count(r['tokens'])} tokens{epochs}")
    return lines


def parse_mixture(data: DataConfig, *, steps: int, decay_start: int | None) -> Mixture:
    """data.mixture / data.stages -> Mixture; DataError (one line) on anything wrong. decay_start: the first step of
    the WSD decay (None: the schedule has none, and a stage `at: decay` is refused)."""
    if data.mixture is None:
        if data.stages:
            raise DataError("data.stages needs data.mixture (stages change the weights of named sources)")
        source = MixtureSource(SINGLE, data.source, 1.0, data.val_source, data.window_start)
        return Mixture((source,), (Stage(0, (1.0,), "0"),), steps)
    if not isinstance(data.mixture, list) or not data.mixture:
        raise DataError("data.mixture must be a non-empty list of {name, source, weight} entries")
    if data.source != "synthetic":
        raise DataError(f"data.source={data.source!r} and data.mixture are exclusive: name every source in the mixture")
    sources = tuple(_parse_source(i, entry, data) for i, entry in enumerate(data.mixture))
    names = [s.name for s in sources]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise DataError(f"data.mixture: source name {dupes[0]!r} appears twice; names must be unique")
    first = Stage(0, _normalised([s.weight for s in sources], "data.mixture weights"), "0")
    stages = [first]
    for i, entry in enumerate(data.stages or []):
        stages.append(_parse_stage(i, entry, names, steps=steps, decay_start=decay_start))
    stages.sort(key=lambda st: st.start)
    for a, b in zip(stages, stages[1:]):
        if a.start == b.start:
            raise DataError(f"data.stages: two stages start at step {b.start} ({a.at!r} and {b.at!r})")
    return Mixture(sources, tuple(stages), steps)


def _parse_source(i: int, entry, data: DataConfig) -> MixtureSource:
    where = f"data.mixture[{i}]"
    if not isinstance(entry, dict):
        raise DataError(f"{where}: expected a mapping {{name, source, weight}}, got {entry!r}")
    if unknown := sorted(set(entry) - set(SOURCE_KEYS)):
        raise DataError(f"{where}: unknown key {unknown[0]!r}; valid: {', '.join(SOURCE_KEYS)}")
    if missing := [k for k in ("name", "source", "weight") if k not in entry]:
        raise DataError(f"{where}: missing {missing[0]!r} (each source needs name, source and weight)")
    name = entry["name"]
    if not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum():
        raise DataError(f"{where}: name must be a word of letters, digits, - and _ (it names val.csv rows), got {name!r}")
    source = entry["source"]
    if not isinstance(source, str):
        raise DataError(f"{where}.source: expected text such as bin:DIR, got {source!r}")
    check_source(f"{where}.source", source)
    kind = source.split(":", 1)[0]
    weight = _number(entry["weight"], f"{where}.weight")
    if weight < 0:
        raise DataError(f"{where}.weight must be >= 0, got {entry['weight']!r}")
    window_start = entry.get("window_start", data.window_start)
    if window_start not in WINDOW_STARTS:
        raise DataError(f"{where}.window_start must be one of {', '.join(WINDOW_STARTS)}, got {window_start!r}")
    if window_start != "any" and kind != "bin":
        raise DataError(f"{where}.window_start={window_start} applies to bin: sources only")
    max_epochs = entry.get("max_epochs")
    if max_epochs is not None and not _number(max_epochs, f"{where}.max_epochs") > 0:
        raise DataError(f"{where}.max_epochs must be a positive number, got {max_epochs!r}")
    if max_epochs is not None and kind != "bin":
        raise DataError(f"{where}.max_epochs needs a bin: source (the size of a {kind} source is not known before it "
                        f"is read); drop the key")
    val_source = entry.get("val_source")
    if val_source is not None:
        if kind in WORLD_SIZE_FREE:
            raise DataError(f"{where}.val_source: a bin: or synthetic source validates on its own val split; drop the key")
        if not isinstance(val_source, str):
            raise DataError(f"{where}.val_source: expected text such as jsonl:GLOB, got {val_source!r}")
        check_source(f"{where}.val_source", val_source)
        if val_source.split(":", 1)[0] in WORLD_SIZE_FREE:
            raise DataError(f"{where}.val_source must be a stream source (text:/jsonl:/parquet:/hf:/fineweb_edu), "
                            f"got {val_source!r}")
    return MixtureSource(name, source, weight, val_source, window_start,
                         None if max_epochs is None else float(max_epochs))


def _parse_stage(i: int, entry, names: list[str], *, steps: int, decay_start: int | None) -> Stage:
    where = f"data.stages[{i}]"
    if not isinstance(entry, dict):
        raise DataError(f"{where}: expected a mapping {{at, weights}}, got {entry!r}")
    if unknown := sorted(set(entry) - set(STAGE_KEYS)):
        raise DataError(f"{where}: unknown key {unknown[0]!r}; valid: {', '.join(STAGE_KEYS)}")
    if missing := [k for k in STAGE_KEYS if k not in entry]:
        raise DataError(f"{where}: missing {missing[0]!r} (a stage needs at: STEP or decay, and weights)")
    at = entry["at"]
    if at == DECAY:
        if decay_start is None:
            raise DataError(f"{where}: at: decay needs train.lr_schedule=wsd (the stage begins with its decay)")
        start = decay_start
    elif isinstance(at, int) and not isinstance(at, bool):
        start = at
    else:
        raise DataError(f"{where}.at: expected a step or 'decay', got {at!r}")
    if not 0 < start < steps:
        raise DataError(f"{where}: stage at step {start} lies outside the run (steps 1 .. {steps - 1} of train.steps={steps})")
    weights = entry["weights"]
    if not isinstance(weights, dict) or not weights:
        raise DataError(f"{where}.weights: expected a mapping {{source name: weight}}, got {weights!r}")
    if unknown := sorted(set(weights) - set(names)):
        raise DataError(f"{where}.weights: unknown source {unknown[0]!r}; the mixture names {', '.join(names)}")
    values = [_number(weights.get(n, 0.0), f"{where}.weights.{n}") for n in names]  # a source left out: weight 0
    if any(v < 0 for v in values):
        bad = names[next(j for j, v in enumerate(values) if v < 0)]
        raise DataError(f"{where}.weights.{bad} must be >= 0, got {weights[bad]!r}")
    return Stage(start, _normalised(values, f"{where}.weights"), str(at))


def _count(n: float) -> str:
    return next((f"{n / unit:.2f}{name}" for unit, name in ((1e9, "B"), (1e6, "M")) if n >= unit), f"{n:,.0f}")


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DataError(f"{where}: expected a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise DataError(f"{where}: expected a finite number, got {value!r}")
    return float(value)


def _normalised(values: list[float], where: str) -> tuple[float, ...]:
    total = sum(values)
    if not total > 0:
        raise DataError(f"{where} sum to {total:g}; at least one must be positive")
    return tuple(v / total for v in values)
