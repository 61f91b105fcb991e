"""Twin comparison: an NSA config against its dense twin, same data, seed and token budget.

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

from train.analysis.compare_report import build_report, write_report
from train.core.artifacts import read_metrics
from train.core.config import dump_config, load_config
from train.core.env import one_gpu_environment
from train.core.errors import ConfigError, UserError
from train.evaluation.evaluate import EvalRequest, default_name, evaluate

ARMS = ("nsa", "dense")
RESUMABLE_KEYS = {"train.steps"}  # may differ from DIR's configs on a relaunch (both arms train on)
EVAL_SPLIT = "val"


def arm_configs(config: Path, overrides: list[str], out: Path) -> dict[str, dict]:
    """{'nsa': the config with overrides, 'dense': its twin} as YAML documents, out_dirs under `out`."""
    cfg = load_config(config, overrides)
    if cfg.model.attention != "nsa":
        raise ConfigError(f"{config}: model.attention is {cfg.model.attention!r}; train.compare takes an NSA config "
                          "and derives the dense twin from it")
    if cfg.data.source_kind != "bin":
        raise ConfigError(f"{config}: data.source={cfg.data.source!r}; train.compare scores both arms on the whole "
                          "validation split of a prepared directory: --data.source=bin:DIR "
                          "(python -m train.data.prepare --source text:FILE --out DIR)")
    twin = copy.deepcopy(cfg)
    twin.model.attention = "dense"  # dump_config leaves out the nsa section of a dense model
    arms = {"nsa": yaml.safe_load(dump_config(cfg)), "dense": yaml.safe_load(dump_config(twin))}
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


def reuse_dense(arms: dict[str, dict], dense_from: Path) -> Path:
    """The dense out_dir of an earlier comparison, if its config is this twin's (out_dir aside) and it finished."""
    path = dense_from / "dense.yaml"
    if not path.is_file():
        raise UserError(f"--dense_from {dense_from}: no dense.yaml there (a train.compare directory holds one)")
    diff = _first_difference(path, arms["dense"], {"train.out_dir"})
    if diff:
        raise ConfigError(f"--dense_from {dense_from}: its dense arm is not this config's twin ({diff[0]}: "
                          f"{diff[1]!r} there, {diff[2]!r} here)")
    out_dir = Path(yaml.safe_load(path.read_text(encoding="utf-8"))["train"]["out_dir"])  # itself reused, maybe
    status = read_metrics(out_dir).get("status")
    if status != "finished":
        raise UserError(f"--dense_from {dense_from}: its dense arm ({out_dir}) is {status or 'not started'}, not "
                        f"finished; finish that comparison first")
    arms["dense"]["train"]["out_dir"] = str(out_dir)
    return out_dir


def write_arm_configs(out: Path, arms: dict[str, dict]) -> dict[str, Path]:
    """DIR/<arm>.yaml; a DIR holding other configs is refused (except RESUMABLE_KEYS)."""
    paths = {arm: out / f"{arm}.yaml" for arm in ARMS}
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


def train_arms(paths: dict[str, Path], out: Path, out_dirs: dict[str, Path], side_by_side: bool,
               arms: tuple[str, ...] = ARMS) -> None:
    """python -m train on each arm's YAML (a finished arm returns at once); raises on a failing arm."""
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    groups = [list(arms)] if side_by_side else [[arm] for arm in arms]
    for group in groups:
        procs = {}
        for gpu, arm in enumerate(group):
            env = one_gpu_environment(gpu) if side_by_side else None
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


class ArmFailed(Exception):
    def __init__(self, arm: str, code: int, log: Path, why: str | None = None):
        super().__init__(f"the {arm} arm {why or f'exited {code}'} (see {log}); the same command resumes it")
        self.exit_code = code if code > 0 else 1


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


def compare_twins(config: Path, overrides: list[str], out: Path, *, side_by_side: bool = False,
                  dense_from: Path | None = None, eval_max_tokens: int | None = None) -> tuple[dict, list[Path]]:
    """Train (or resume) both arms, score them on the whole validation split, write the report.
    Returns (report, files written). Raises UserError for bad input and ArmFailed when an arm's trainer fails."""
    if side_by_side:
        import torch

        if torch.cuda.device_count() < 2:
            raise UserError(f"--side_by_side needs 2 GPUs, {torch.cuda.device_count()} visible; "
                            "leave it out to train the arms one after the other")
    if eval_max_tokens is not None and eval_max_tokens < 2:
        raise UserError(f"--eval_max_tokens must be >= 2, got {eval_max_tokens}")
    arms = arm_configs(config, overrides, out)
    out_dirs = {arm: out / arm for arm in ARMS}
    if dense_from is not None:
        out_dirs["dense"] = reuse_dense(arms, dense_from)
    paths = write_arm_configs(out, arms)
    to_train = ARMS if dense_from is None else ("nsa",)
    train_arms(paths, out, out_dirs, side_by_side and len(to_train) == 2, to_train)
    data_spec = arms["nsa"]["data"]["source"]
    scores = {arm: evaluate_arm(out_dirs[arm], data_spec, eval_max_tokens) for arm in ARMS}
    report = build_report(out, out_dirs, scores)
    return report, write_report(out, report)
