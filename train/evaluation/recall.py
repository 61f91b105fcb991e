"""Score a model on the recall task (train/data/recall.py): accuracy and loss of the answer tokens, by distance.

Each probe document (the longest the spec allows) is fed as one window, preceded by EOS as in the corpus
(the document's first token sits at position 1, as after a packed document's EOS). An answer counts as
recalled when every one of its tokens is the model's argmax given the true prefix (teacher forced: what
greedy decoding would produce); its loss is the sum of its tokens' negative log-likelihoods. Items are
reported per distance bucket (train/data/recall.py: RecallSpec.buckets): the `<1w` bucket lies inside the
sliding window and is reported apart from the far buckets, whose pooled accuracy is `far_accuracy`.
Chance: 1 / len(VALUES) (every value equally likely, independent of the rest of the document).
"""
from __future__ import annotations

import contextlib
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from nsa.gate_health import distance_capped, knock_out, selected_blocks
from train.checkpoint.io import (
    config_as_trained,
    load_checkpoint,
    model_from_checkpoint,
    resolve_checkpoint,
)
from train.core.errors import DataError, UserError
from train.data.meta import read_meta
from train.data.recall import (
    DEFAULT_FORMAT,
    META_KEY,
    VALUES,
    RecallEncoder,
    RecallSpec,
    bucket_name,
    check_queries_fit,
    probe_document,
)
from train.data.tokenizers import load_tokenizer
from train.evaluation.evaluate import pick_device
from train.observe.telemetry import write_json_atomic

PROBE_SEED = 1_000_003  # probe documents come from their own seed, never the corpus's


@dataclass
class _Tally:
    hits: int = 0
    items: int = 0
    nll: float = 0.0

    def add(self, hits: np.ndarray, nll: np.ndarray) -> None:
        self.hits += int(hits.sum())
        self.items += len(hits)
        self.nll += float(nll.sum())

    def row(self) -> dict:
        if not self.items:
            return {"items": 0, "accuracy": None, "stderr": None, "answer_loss": None}
        p = self.hits / self.items
        return {"items": self.items, "accuracy": p, "stderr": math.sqrt(p * (1 - p) / self.items),
                "answer_loss": self.nll / self.items}


@torch.inference_mode()
def score_recall(model: torch.nn.Module, tokenizer, spec: RecallSpec, *, documents: int = 64, batch_size: int = 8,
                 seed: int = PROBE_SEED, device: torch.device | str = "cpu") -> dict:
    """The recall report of `model` on `documents` probe documents: per bucket and pooled beyond the window. A spec
    whose documents hold no query (every line a fact) is refused, as `make` refuses it: DataError, one line."""
    encoder = RecallEncoder(tokenizer, spec.format)
    check_queries_fit(spec, encoder)
    rng = random.Random(seed)
    docs = [probe_document(rng, spec, encoder) for _ in range(documents)]
    buckets = spec.buckets()
    tallies = {bucket_name(lo, hi, spec.window): _Tally() for lo, hi in buckets}
    edges = np.asarray([lo for lo, _ in buckets[1:]])
    names = list(tallies)
    for first in range(0, len(docs), batch_size):
        batch = docs[first:first + batch_size]
        length = 1 + max(len(d.ids) for d in batch)
        x = torch.full((len(batch), length), tokenizer.eos_id, dtype=torch.long)  # [B, L]: EOS, document, EOS pad
        for row, doc in enumerate(batch):
            x[row, 1:1 + len(doc.ids)] = torch.from_numpy(doc.ids)
        logp = F.log_softmax(model(x.to(device)).float(), dim=-1).cpu()  # [B, L, V]
        for row, doc in enumerate(batch):
            hits, nll = _answers(logp[row], x[row], doc.answer_start + 1, doc.answer_len)
            which = np.searchsorted(edges, doc.distance, side="right")  # bucket index of each item
            for b in np.unique(which):
                tallies[names[b]].add(hits[which == b], nll[which == b])
    far = _Tally(*(sum(getattr(tallies[name], f) for name in names[1:]) for f in ("hits", "items", "nll")))
    return {"window": spec.window, "format": spec.format, "documents": documents, "seed": seed, "chance": 1 / len(VALUES),
            "buckets": {name: tally.row() for name, tally in tallies.items()},
            "near_accuracy": tallies[names[0]].row()["accuracy"], "far_accuracy": far.row()["accuracy"],
            "far_stderr": far.row()["stderr"], "far_answer_loss": far.row()["answer_loss"], "far_items": far.items}


def _answers(logp: torch.Tensor, x: torch.Tensor, start: np.ndarray, length: np.ndarray):
    """logp [L, V], x [L]; answers at x[start : start + length] -> (all tokens argmax [q] bool, NLL sum [q])."""
    longest = int(length.max()) if len(length) else 0
    offsets = np.arange(longest)[None, :]  # [1, m]
    valid = offsets < length[:, None]  # [q, m]
    at = torch.from_numpy(np.where(valid, start[:, None] + offsets, start[:, None]))  # [q, m] target positions
    target = x[at]  # [q, m]
    predicted = logp[at - 1]  # [q, m, V]: the distribution that predicts each target
    nll = -predicted.gather(-1, target[..., None])[..., 0]  # [q, m]
    right = predicted.argmax(-1) == target  # [q, m]
    valid_t = torch.from_numpy(valid)
    return ((right | ~valid_t).all(-1)).numpy(), (nll * valid_t).sum(-1).numpy()


def recall_spec_of(data_source: str) -> RecallSpec | None:
    """The RecallSpec of a run's data source when it is a recall corpus (bin:DIR whose meta.json names one)."""
    kind, _, arg = data_source.partition(":")
    if kind != "bin":
        return None
    try:
        raw = read_meta(Path(arg)).raw
    except DataError:
        return None
    if META_KEY not in raw:
        return None
    return RecallSpec(**{k: v for k, v in raw[META_KEY].items() if k in RecallSpec.__dataclass_fields__})


def result_name(step: int, knockout: tuple[str, ...] = (), line_format: str = DEFAULT_FORMAT, length: int = 1,
                rope: str = "", n_sel: int | None = None, distance_cap: int | None = None) -> str:
    """recall_step<N>.json; recall_step<N>_without_<branches>.json for a probe with NSA branches knocked out;
    _<format> before .json for lines in another format than kv; _x<M> for documents M times the training length;
    _<rope> for a RoPE changed at scoring time (RopeAtLength.tag); _nsel<K> for K blocks selected at scoring time;
    _cap<D> for the selected branch's distances capped at D."""
    return (f"recall_step{step}" + (f"_without_{'_'.join(sorted(knockout))}" if knockout else "")
            + (f"_{line_format}" if line_format != DEFAULT_FORMAT else "") + (f"_x{length}" if length != 1 else "")
            + (f"_{rope}" if rope else "") + (f"_nsel{n_sel}" if n_sel is not None else "")
            + (f"_cap{distance_cap}" if distance_cap is not None else "") + ".json")


@dataclass(frozen=True)
class RopeAtLength:
    """A RoPE change made only for scoring at a longer length (what a user of a dense model does before any
    training at that length): scale: linear position interpolation by this factor, "length" (by the length
    multiple) or "yarn" (YaRN by the length multiple: nsa/layers.py RotaryEmbedding); theta: this RoPE base, or "ntk"
    (NTK-aware: base x multiple^(hd / (hd - 2))). None: as trained."""

    scale: float | str | None = None
    theta: float | str | None = None

    def overrides(self, model_cfg: dict, multiple: int) -> dict:
        out = {}
        if self.scale is not None:
            factor = multiple if self.scale in ("length", "yarn") else self.scale
            out["rope_scale"] = float(factor) * model_cfg.get("rope_scale", 1.0)
            if self.scale == "yarn":  # the trained context: max_seq_len (set to the probe's length) / rope_scale
                out["rope_scaling"] = "yarn"
        if self.theta is not None:
            base = float(model_cfg.get("rope_theta", 10000.0))
            hd = model_cfg.get("head_dim") or model_cfg["dim"] // model_cfg["n_heads"]
            out["rope_theta"] = base * multiple ** (hd / (hd - 2)) if self.theta == "ntk" else float(self.theta)
        return out

    @property
    def tag(self) -> str:
        return "_".join(part for part in (f"scale{self.scale}" if self.scale is not None else "",
                                          f"theta{self.theta}" if self.theta is not None else "") if part)


def corpus_spec(checkpoint) -> RecallSpec:
    """The RecallSpec of the corpus a checkpoint (file or run directory) trained on; UserError when it is none."""
    source = load_checkpoint(resolve_checkpoint(Path(checkpoint)))["config"]["data"]["source"]
    spec = recall_spec_of(source)
    if spec is None:
        raise UserError(f"{checkpoint}: trained on {source}, not a recall corpus (python -m train.recall make); "
                        f"pass --window and --doc_tokens to probe it anyway")
    return spec


def probe_checkpoint(checkpoint, *, spec: RecallSpec | None = None, documents: int = 64, seed: int = PROBE_SEED,
                     device: str = "auto", knockout: tuple[str, ...] = (), length: int = 1,
                     rope: RopeAtLength = RopeAtLength(), n_sel: int | None = None,
                     distance_cap: int | None = None) -> dict:
    """Score a checkpoint (file or run directory) on the recall probe; write recall_step<N>.json beside it
    (result_name; an earlier file of the same checkpoint, documents, seed and spec is returned instead of scoring
    again). spec None: the run's own corpus's (its data.source must be a recall corpus). knockout: NSA branches (cmp,
    sel, win) whose gates are zeroed while scoring (nsa.gate_health.knock_out), written to their own file.
    length: probe documents this many times the training length (spec.doc_tokens + 1), distance buckets extended to
    them (RecallSpec.at_length); a RoPE model is scored at any length (its max_seq_len raised for the probe), learned
    positions only within theirs. rope: a RoPE change made for scoring only. n_sel: NSA layers select this many blocks
    per query while scoring (nsa.gate_health.selected_blocks; None: as trained), written to its own file. distance_cap:
    NSA's selected branch reads keys further back than this as this far back (nsa.gate_health.distance_capped)."""
    if documents < 1:
        raise UserError(f"--documents must be >= 1, got {documents}")
    if length < 1:
        raise UserError(f"--lengths must be >= 1, got {length}")
    path = resolve_checkpoint(Path(checkpoint)).resolve()
    step = load_checkpoint(path)["step"]
    base = spec if spec is not None else corpus_spec(path)
    spec = base.at_length(length)
    done = path.parent / result_name(step, knockout, spec.format, length, rope.tag, n_sel, distance_cap)
    if done.exists():
        try:
            prior = json.loads(done.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            prior = {}
        if (prior.get("checkpoint"), prior.get("documents"), prior.get("seed"), prior.get("spec")) == \
                (str(path), documents, seed, spec.to_dict()):
            return prior
    dev = pick_device(device)
    stored = config_as_trained(load_checkpoint(path))["model"]
    overrides = rope.overrides(stored, length)
    if stored.get("pos_emb", "rope") == "rope" and spec.doc_tokens + 1 > stored["max_seq_len"]:
        overrides["max_seq_len"] = spec.doc_tokens + 1  # RoPE: positions beyond training are computed, not learned
    model, cfg = model_from_checkpoint(path, str(dev), **overrides)
    if spec.doc_tokens + 1 > model.cfg.max_seq_len:
        raise UserError(f"recall documents of {spec.doc_tokens} tokens do not fit the model's max_seq_len "
                        f"{model.cfg.max_seq_len} (learned positions end there)")
    started = time.perf_counter()
    with contextlib.ExitStack() as probes:
        for flag, probe in (("--n_sel", selected_blocks(model, n_sel)), ("--knockout", knock_out(model, knockout)),
                            ("--distance_cap", distance_capped(model, distance_cap))):
            try:
                probes.enter_context(probe)
            except ValueError as exc:  # a branch name, an n_sel or a distance cap the model refuses
                raise UserError(f"{flag}: {exc}") from None
        result = score_recall(model, load_tokenizer(cfg["data"]["tokenizer"]), spec, documents=documents, seed=seed,
                              device=dev)
    result.update(tool="train.recall", checkpoint=str(path), step=step, attention=cfg["model"]["attention"],
                  spec=spec.to_dict(), length_multiple=length, training_length=base.doc_tokens + 1,
                  **({"rope_overrides": {k: v for k, v in overrides.items() if k != "max_seq_len"}} if rope.tag else {}),
                  seconds=round(time.perf_counter() - started, 3),
                  **({"knockout": sorted(knockout)} if knockout else {}),
                  **({"n_sel": n_sel} if n_sel is not None else {}),
                  **({"distance_cap": distance_cap} if distance_cap is not None else {}),
                  file=str(done))
    write_json_atomic(Path(result["file"]), result)
    return result
