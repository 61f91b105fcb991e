"""Twin comparison: an NSA config against its dense twin and its window-only control, same data, seed and
token budget.

The command line, usage and details: train/compare.py (its docstring).
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
import threading
from pathlib import Path

import yaml

from train.analysis.compare_report import GAP_KEYS, build_report, write_report
from train.core.artifacts import read_metrics
from train.core.config import TrainConfig, data_mixture, dump_config, load_config
from train.core.env import one_gpu_environment
from train.core.mixture import Mixture
from train.core.errors import ConfigError, DataError, UserError
from train.evaluation.evaluate import EvalRequest, default_name, evaluate, stage_weighted_result
from train.evaluation.needle import TRIALS as NEEDLE_TRIALS
from train.evaluation.needle import needle_checkpoint, refuse_byte_tokenizer
from train.evaluation.recall import RopeAtLength, probe_checkpoint, recall_spec_of
from train.evaluation.tasks_checkpoint import RESULT_FILE as TASKS_FILE
from train.evaluation.tasks_checkpoint import TasksRequest, evaluate_tasks, task_specs
from train.evaluation.tasks_checkpoint import default_name as tasks_name
from train.evaluation.tasks_data import load_task
from dataclasses import replace

from train.data.recall import DEFAULT_FORMAT, FORMATS, RecallSpec

# nsa: the config itself; its controls (the report's GAP_KEYS): dense (model.attention: dense, no nsa section)
# and window (nsa.gates: window: the same layer with its gates pinned to the sliding-window branch)
CONTROLS = tuple(GAP_KEYS)
ARMS = ("nsa", *CONTROLS)
ROLE = {"dense": "dense twin", "window": "window-only control"}
RESUMABLE_KEYS = {"train.steps"}  # may differ from DIR's configs on a relaunch (every arm trains on)
EVAL_SPLIT = "val"


def probe_or_not_scorable(out_dir: Path, **probe) -> dict:
    """probe_checkpoint's result, or {"not_scorable": its one line} where the probe refuses the arm (documents that
    hold no query in its tokenizer's lines): the report keeps every other result and says why this one is missing."""
    try:
        return probe_checkpoint(out_dir, **probe)
    except DataError as exc:
        return {"not_scorable": str(exc), "length_multiple": probe.get("length", 1)}


def select_arms(spec: str) -> tuple[str, ...]:
    """--arms 'nsa,dense,window' (comma separated, any order) -> the arms in ARMS order; nsa always runs, and at
    least one control arm must (there is nothing to compare NSA with otherwise)."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in ARMS]
    if unknown:
        raise UserError(f"--arms: unknown arm {unknown[0]!r}; valid: {', '.join(ARMS)}")
    if not set(names) & set(CONTROLS):
        raise UserError(f"--arms {spec!r} names no control arm ({', '.join(CONTROLS)}): nothing to compare NSA with")
    return tuple(arm for arm in ARMS if arm == "nsa" or arm in names)


def arm_configs(config: Path, overrides: list[str], out: Path) -> dict[str, dict]:
    """{'nsa': the config with overrides, 'dense': its twin, 'window': its window-only control} as YAML documents,
    out_dirs under `out`."""
    cfg = load_config(config, overrides)
    if cfg.model.attention != "nsa":
        raise ConfigError(f"{config}: model.attention is {cfg.model.attention!r}; train.compare takes an NSA config "
                          "and derives the dense twin from it")
    if cfg.model.nsa.window_only:
        raise ConfigError(f"{config}: nsa.gates is 'window'; train.compare takes an NSA config (nsa.gates: learned) "
                          "and derives the window-only control from it")
    if any(source.kind != "bin" for source in data_mixture(cfg).sources):
        raise ConfigError(f"{config}: data.source={cfg.data.source!r}; train.compare scores every arm on the whole "
                          "validation split of a prepared directory (of each, for a data.mixture): --data.source=bin:DIR "
                          "(python -m train.data.prepare --source text:FILE --out DIR)")
    twin = copy.deepcopy(cfg)
    twin.model.attention = "dense"  # dump_config leaves out the nsa section of a dense model
    window = copy.deepcopy(cfg)
    window.model.nsa.gates = "window"  # dump_config keeps only the nsa keys a window-only layer reads
    arms = {"nsa": yaml.safe_load(dump_config(cfg)), "dense": yaml.safe_load(dump_config(twin)),
            "window": yaml.safe_load(dump_config(window))}
    for arm, doc in arms.items():
        doc["train"]["out_dir"] = str(out / arm)
    return arms


def _flat(doc: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in doc.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _first_difference(path: Path, doc: dict, ignored: set[str]) -> tuple[str, object, object] | None:
    """The first key whose value differs between the YAML at `path` and `doc` (None: the same)."""
    try:  # through the loader, so that a key added since (at its default) is no difference
        before = _flat(yaml.safe_load(dump_config(load_config(path))))
    except UserError:
        before = _flat(yaml.safe_load(path.read_text(encoding="utf-8")) or {})
    now = _flat(doc)
    changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k) and k not in ignored)
    return (changed[0], before.get(changed[0]), now.get(changed[0])) if changed else None


def _matching_arm(arms: dict[str, dict], arm: str, source: Path) -> tuple[Path | None, str]:
    """(the out_dir of `arm` in the earlier comparison `source`, "") when its config is this one's key by key
    (out_dir aside), else (None, why not)."""
    path = source / f"{arm}.yaml"
    if not path.is_file():
        return None, f"no {arm}.yaml there (a train.compare directory holds one per arm)"
    diff = _first_difference(path, arms[arm], {"train.out_dir"})
    if diff:
        return None, f"its {arm} arm is not this config's {ROLE[arm]} ({diff[0]}: {diff[1]!r} there, {diff[2]!r} here)"
    return Path(yaml.safe_load(path.read_text(encoding="utf-8"))["train"]["out_dir"]), ""  # itself reused, maybe


def _reuse(arms: dict[str, dict], arm: str, out_dir: Path, flag: str, source: Path) -> Path:
    """Point this comparison's `arm` at a matching earlier arm's out_dir; it must have finished."""
    status = read_metrics(out_dir).get("status")
    if status != "finished":
        raise UserError(f"{flag} {source}: its {arm} arm ({out_dir}) is {status or 'not started'}, not "
                        f"finished; finish that comparison first")
    arms[arm]["train"]["out_dir"] = str(out_dir)
    print(f"compare: taking the {ROLE[arm]} from {source} ({out_dir}): its config matches key by key", flush=True)
    return out_dir


def reuse_dense(arms: dict[str, dict], dense_from: Path) -> Path:
    """--dense_from: the dense out_dir of an earlier comparison, which must be this config's twin and finished."""
    found, why = _matching_arm(arms, "dense", dense_from)
    if found is None:
        raise UserError(f"--dense_from {dense_from}: {why}")
    return _reuse(arms, "dense", found, "--dense_from", dense_from)


def reuse_controls(arms: dict[str, dict], wanted: tuple[str, ...], sources: list[Path]) -> dict[str, Path]:
    """--reuse_from: for each control arm in `wanted`, the first of the earlier comparisons `sources` whose arm
    is this config's key by key (out_dir aside) gives its out_dir (it must have finished); an arm none of them
    matches is trained here. Refused when no arm matches at all (the flag would reuse nothing)."""
    reused, why_not = {}, []
    for arm in wanted:
        for source in sources:
            found, why = _matching_arm(arms, arm, source)
            if found is not None:
                reused[arm] = _reuse(arms, arm, found, "--reuse_from", source)
                break
            why_not.append(f"{source}: {why}")
    if wanted and not reused:
        raise ConfigError(f"--reuse_from: no arm to reuse ({why_not[0]})")
    for arm in wanted:
        if arm not in reused:
            print(f"compare: no earlier {ROLE[arm]} matches; training it here", flush=True)
    return reused


def write_arm_configs(out: Path, arms: dict[str, dict], names: tuple[str, ...] = ARMS) -> dict[str, Path]:
    """DIR/<arm>.yaml for the arms `names`; a DIR holding other configs is refused (except RESUMABLE_KEYS). A DIR
    without some arm's YAML (made before that arm existed, or with fewer --arms) gets it."""
    paths = {arm: out / f"{arm}.yaml" for arm in names}
    for arm, path in paths.items():
        diff = _first_difference(path, arms[arm], RESUMABLE_KEYS) if path.exists() else None
        if diff:
            raise ConfigError(f"{out} compares another config ({diff[0]}: {diff[1]!r} there, {diff[2]!r} now); "
                              f"use another --out")
    out.mkdir(parents=True, exist_ok=True)
    for arm, path in paths.items():
        tmp = path.with_suffix(".yaml.partial")
        tmp.write_text(yaml.safe_dump(arms[arm], sort_keys=False), encoding="utf-8")
        tmp.replace(path)
    return paths


def _pump(proc: subprocess.Popen, log: Path, prefix: str) -> None:
    with open(log, "a", encoding="utf-8") as f:
        for line in proc.stdout:
            f.write(line)
            f.flush()
            print(f"{prefix}{line}", end="", flush=True)


def train_arms(paths: dict[str, Path], out: Path, out_dirs: dict[str, Path], arms: tuple[str, ...],
               at_once: int = 1) -> None:
    """python -m train on each arm's YAML, `at_once` arms at a time, one GPU each when more than one; raises on a
    failing arm."""
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    groups = [list(arms[i:i + at_once]) for i in range(0, len(arms), at_once)]
    for group in groups:
        procs = {}
        for gpu, arm in enumerate(group):
            env = one_gpu_environment(gpu) if at_once > 1 else None
            print(f"compare: training the {arm} arm -> {out_dirs[arm]} (log {logs / arm}.log)", flush=True)
            proc = subprocess.Popen([sys.executable, "-m", "train", str(paths[arm])], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, env=env)
            pump = threading.Thread(target=_pump, args=(proc, logs / f"{arm}.log", f"[{arm}] "), daemon=True)
            pump.start()
            procs[arm] = (proc, pump)
        for arm, (proc, pump) in procs.items():
            code = proc.wait()
            pump.join()
            if code != 0:
                raise ArmFailed(arm, code, logs / f"{arm}.log")
            status = read_metrics(out_dirs[arm]).get("status")
            if status != "finished":
                raise ArmFailed(arm, 1, logs / f"{arm}.log", f"ended {status!r}, not finished")


def _finished(arm: str, out_dir: Path, doc: dict) -> bool:
    """Whether the arm's out_dir finished its config's train.steps (then there is nothing to launch; a raised
    train.steps trains on)."""
    metrics = read_metrics(out_dir)
    done = metrics.get("status") == "finished" and (metrics.get("step") or 0) >= doc["train"]["steps"]
    if done:
        print(f"compare: the {arm} arm finished at step {metrics['step']} ({out_dir}): nothing to train", flush=True)
    return done


class ArmFailed(Exception):
    def __init__(self, arm: str, code: int, log: Path, why: str | None = None):
        super().__init__(f"the {arm} arm {why or f'exited {code}'} (see {log}); the same command resumes it")
        self.exit_code = code if code > 0 else 1


def evaluate_sources(out_dir: Path, mixture: Mixture, max_tokens: int | None) -> dict:
    """evaluate_arm on each source's whole validation split (data.source alone, or every source of data.mixture);
    one source: its result as it is, several: their stage_weighted_result at the arm's evaluated step
    (train/evaluation/evaluate.py, as train.evaluate --data mixture gives)."""
    results = {s.name: evaluate_arm(out_dir, s.source, max_tokens) for s in mixture.sources}
    if len(results) == 1:
        return next(iter(results.values()))
    return stage_weighted_result(results, mixture, int(next(iter(results.values()))["step"]))


def evaluate_arm(out_dir: Path, data_spec: str, max_tokens: int | None) -> dict:
    """train.evaluate on the arm's newest checkpoint, whole validation split; an earlier result for the
    same step and token limit is reused."""
    step = read_metrics(out_dir).get("step")
    done = out_dir / f"eval_{default_name(data_spec, EVAL_SPLIT, step)}.json"
    if done.exists():
        try:
            prior = json.loads(done.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            prior = {}
        if prior.get("step") == step and prior.get("max_tokens") == max_tokens:
            print(f"compare: reusing {done}", flush=True)
            return prior
    print(f"compare: scoring {out_dir.name} on the whole {EVAL_SPLIT} split of {data_spec}", flush=True)
    return evaluate(EvalRequest(checkpoint=out_dir, data=data_spec, split=EVAL_SPLIT, max_tokens=max_tokens))


def score_arm_tasks(out_dir: Path, specs: list[str], limit: int | None) -> dict:
    """train.tasks on the arm's newest checkpoint (the same docs for every arm: the seeded subset of `limit`);
    an earlier result for the same step, tasks and limit is reused when its items file is there."""
    step = read_metrics(out_dir).get("step")
    done = out_dir / TASKS_FILE.format(name=tasks_name(specs, limit, step))
    if done.exists():
        try:
            prior = json.loads(done.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            prior = {}
        if prior.get("step") == step and prior.get("limit") == limit and prior.get("items_file") \
                and Path(prior["items_file"]).is_file():
            print(f"compare: reusing {done}", flush=True)
            return prior
    print(f"compare: scoring {out_dir.name} on {', '.join(specs)} (train.tasks)", flush=True)
    return evaluate_tasks(TasksRequest(checkpoint=out_dir, tasks=",".join(specs), limit=limit))


def needle_lengths(spec: str, doc: dict) -> list[int]:
    """--needle '1,2,4' -> the context lengths (multiples of the arms' train.seq_len) the needle test runs at;
    UserError for a spelling, tokenizer or model the test cannot run with."""
    try:
        multiples = [float(m) for m in spec.split(",") if m.strip()]
    except ValueError:
        multiples = []
    if not multiples or any(m <= 0 for m in multiples):
        raise UserError(f"--needle {spec!r}: positive multiples of train.seq_len, comma separated (e.g. 1,2,4)")
    refuse_byte_tokenizer(doc["data"]["tokenizer"], "--needle")
    lengths = sorted({int(m * doc["train"]["seq_len"]) for m in multiples})
    model = doc["model"]
    if model.get("pos_emb") != "rope" and lengths[-1] > model["max_seq_len"]:
        raise UserError(f"--needle {spec!r}: S={lengths[-1]} is beyond the learned positions "
                        f"(model.max_seq_len {model['max_seq_len']})")
    return lengths


def zero_shot_recall_spec(doc: dict, line_format: str) -> RecallSpec:
    """--recall_probe on data that is no recall corpus: probe documents as long as a training window, distances
    in multiples of the NSA window, lines in `line_format` (every arm is scored on the same documents, none
    trained on the task)."""
    seq_len, window = doc["train"]["seq_len"], doc["nsa"]["w"]
    doc_tokens = seq_len - 1  # + the EOS before the document
    if doc_tokens < 2 * window:
        raise UserError(f"--recall_probe: nsa.w={window} leaves no distance beyond the window inside a "
                        f"{seq_len}-token window (it needs seq_len > 2 * nsa.w)")
    spec = RecallSpec(window=window, doc_tokens=doc_tokens, max_windows=doc_tokens // window, format=line_format)
    spec.validate()
    return spec


def probe_spec(doc: dict, zero_shot: bool, line_format: str | None) -> tuple[RecallSpec | None, bool]:
    """(the recall probe's spec, whether the arms trained on the task) for a comparison of `doc`'s arms: a recall
    corpus's own spec (its lines in line_format when given); with zero_shot on other data, zero_shot_recall_spec;
    else (None, False). UserError for a format that does not exist or has no probe to spell."""
    data = [entry["source"] for entry in doc["data"].get("mixture") or []] or [doc["data"]["source"]]
    spec = next((found for source in data if (found := recall_spec_of(source))), None)
    trained = spec is not None  # a recall corpus is the data, or one source of its mixture
    if line_format is not None and line_format not in FORMATS:
        raise UserError(f"--recall_format {line_format!r}: one of {', '.join(FORMATS)}")
    if line_format is not None and not (zero_shot or trained):
        raise UserError("--recall_format spells the recall probe's lines: with --recall_probe or a recall corpus")
    if zero_shot and not trained:
        spec = zero_shot_recall_spec(doc, line_format or DEFAULT_FORMAT)
    elif spec is not None and line_format is not None:
        spec = replace(spec, format=line_format)
    return spec, trained


def _multiples(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise UserError(f"{flag} {text!r}: comma-separated whole numbers >= 1, e.g. 1,2,4,8")
    return values


def compare_twins(config: Path, overrides: list[str], out: Path, *, side_by_side: bool = False,
                  dense_from: Path | None = None, reuse_from: list[Path] | tuple[Path, ...] = (),
                  eval_max_tokens: int | None = None, arms: tuple[str, ...] = ARMS,
                  tasks: str | None = None, tasks_limit: int | None = None, needle: str | None = None,
                  needle_trials: int | None = None, recall_probe: bool = False,
                  recall_format: str | None = None, recall_lengths: str | None = None,
                  positions: str | None = None) -> tuple[dict, list[Path]]:
    """Train (or resume) the arms `arms` (nsa and at least one control: select_arms), score them on the whole
    validation split, write the report. dense_from: reuse that comparison's dense arm (it must match);
    reuse_from: reuse every control arm that matches in one of these comparisons, train the others here.
    tasks: comma-separated downstream tasks (train.tasks) every arm is scored on, tasks_limit docs each.
    needle: multiples of train.seq_len ('1,2,4') every arm takes the needle test at, needle_trials per depth (default
    train/evaluation/needle.py's TRIALS).
    recall_probe: every arm takes the recall probe even when the data is no recall corpus (zero-shot).
    recall_format: the probe's lines in this format (train/data/recall.py FORMATS; default: the corpus's, or kv).
    recall_lengths: multiples of the training length ('1,2,4,8') every arm takes the recall probe at, the dense arm
    also with its RoPE interpolated by the multiple ('dense+rope'). positions: 'M,K': every arm's validation loss at
    M times the training length in K slices of the window (train.evaluate --by_position).
    Returns (report, files written). Raises UserError for bad input and ArmFailed when an arm's trainer fails."""
    gpus = 1
    if side_by_side:
        import torch

        gpus = torch.cuda.device_count()
        if gpus < 2:
            raise UserError(f"--side_by_side needs 2 GPUs, {gpus} visible; "
                            "leave it out to train the arms one after the other")
    if eval_max_tokens is not None and eval_max_tokens < 2:
        raise UserError(f"--eval_max_tokens must be >= 2, got {eval_max_tokens}")
    if "nsa" not in arms or not set(arms) & set(CONTROLS) or set(arms) - set(ARMS):
        raise UserError(f"arms {arms!r}: nsa and at least one of {', '.join(CONTROLS)} (select_arms)")
    if dense_from is not None and "dense" not in arms:
        raise UserError("--dense_from reuses the dense arm, which --arms leaves out")
    specs = task_specs(tasks) if tasks is not None else []
    if tasks_limit is not None and (not specs or tasks_limit < 1):
        raise UserError(f"--tasks_limit {tasks_limit}: a positive number of docs per task, with --tasks")
    for spec in specs:  # a task that does not exist is refused before any arm trains
        load_task(spec)
    if needle_trials is not None and (needle is None or needle_trials < 1):
        raise UserError(f"--needle_trials {needle_trials}: a positive number of trials per depth, with --needle")
    docs = arm_configs(config, overrides, out)
    lengths = needle_lengths(needle, docs["nsa"]) if needle is not None else []
    multiples = _multiples(recall_lengths, "--recall_lengths") if recall_lengths is not None else []
    position_plan = _multiples(positions, "--positions") if positions is not None else []
    if position_plan and len(position_plan) != 2:
        raise UserError(f"--positions {positions!r}: M,K (M times the training length, K slices), e.g. 4,8")
    mixture = data_mixture(load_config(config, overrides))
    recall_spec, trained_on_recall = probe_spec(docs["nsa"], recall_probe, recall_format)
    if multiples and recall_spec is None:
        raise UserError("--recall_lengths probes with the recall task: a recall corpus, or --recall_probe")
    out_dirs = {arm: out / arm for arm in arms}
    if dense_from is not None:
        out_dirs["dense"] = reuse_dense(docs, dense_from)
    if reuse_from:
        wanted = tuple(arm for arm in arms if arm in CONTROLS and not (arm == "dense" and dense_from is not None))
        out_dirs.update(reuse_controls(docs, wanted, list(reuse_from)))
    paths = write_arm_configs(out, docs, arms)
    to_train = tuple(arm for arm in arms if out_dirs[arm] == out / arm and not _finished(arm, out_dirs[arm], docs[arm]))
    train_arms(paths, out, out_dirs, to_train, at_once=min(gpus, len(to_train)) or 1)
    scores = {arm: evaluate_sources(out_dirs[arm], mixture, eval_max_tokens) for arm in arms}
    recall = None
    if recall_spec is not None:  # a recall corpus, or --recall_probe: every arm takes the probe
        how = "its training task" if trained_on_recall else "zero-shot, none trained on it"
        print(f"compare: probing every arm with the recall task ({how}; train.recall score)", flush=True)
        recall = {arm: probe_or_not_scorable(out_dirs[arm], spec=recall_spec) for arm in arms}
    needles = None
    if lengths:
        print(f"compare: the needle test on every arm at S = {', '.join(map(str, lengths))}", flush=True)
        trials = needle_trials or NEEDLE_TRIALS
        needles = {arm: [needle_checkpoint(out_dirs[arm], S=S, trials=trials) for S in lengths] for arm in arms}
    by_length = None
    if multiples:
        print(f"compare: the recall probe on every arm at x{', x'.join(map(str, multiples))} the training length",
              flush=True)
        by_length = {arm: [probe_or_not_scorable(out_dirs[arm], spec=recall_spec, length=m) for m in multiples]
                     for arm in arms}
        if "dense" in arms:  # what a dense user does before training long: positions interpolated by the multiple
            by_length["dense+rope"] = [probe_or_not_scorable(out_dirs["dense"], spec=recall_spec, length=m,
                                                        rope=RopeAtLength(scale="length") if m > 1 else RopeAtLength())
                                       for m in multiples]
    by_position = None
    if position_plan:
        m, k = position_plan
        seq_len = m * int((docs["nsa"].get("train") or {}).get("seq_len", TrainConfig.seq_len))
        print(f"compare: every arm's validation loss by position at {seq_len} tokens", flush=True)
        first_source = mixture.sources[0].source  # a mixture: its first source's validation split
        by_position = {arm: evaluate(EvalRequest(checkpoint=out_dirs[arm], data=first_source, split=EVAL_SPLIT,
                                                 seq_len=seq_len, by_position=k, max_tokens=eval_max_tokens,
                                                 name=f"positions_x{m}")) for arm in arms}
    task_scores = {arm: score_arm_tasks(out_dirs[arm], specs, tasks_limit) for arm in arms} if specs else None
    report = build_report(out, out_dirs, scores, recall, task_scores, needles, trained_on_recall=trained_on_recall,
                          recall_lengths=by_length, positions=by_position)
    return report, write_report(out, report)
