"""The twin comparison's report, built only from what the arms' out_dirs and evaluations recorded.

    report.json  arms (nsa, and the controls run: dense, window): params, steps, tokens, tokens/s, last train
                 loss, train and val curves, whole-split loss and bits/byte; nsa: its settings and gate /
                 selection statistics per logged step (with the selection health: sel_recall,
                 sel_outside_window, gate_mean_*, and per layer under `<name>_layers`); the gaps; verdict;
                 when asked for: recall (the probe per distance bucket, trained_on_task or zero-shot), tasks
                 (downstream scores with standard errors; McNemar's paired test of NSA against each control on
                 the items both scored, from their items files), needle (accuracy per context length and depth)
    report.md    the same as tables, for people
    report.png   train and val loss of every arm in one plot; NSA gate shares over training
Gaps, in percent (negative: NSA is better), None when that control did not run:
    gap_pct = (NSA - dense) / dense                   gap_bits_per_byte_pct: the same on bits/byte
    gap_window_pct = (NSA - window) / window          gap_window_bits_per_byte_pct
on the whole-split loss. Against dense: what NSA's sparsity costs. Against its own window: what the compressed
and selected branches add to the sliding window they are mixed with (docs/NSA.md, "NSA vs its dense twin").
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import yaml

from train.core.artifacts import (
    CONFIG_YAML,
    GATE_STATS,
    TRAIN_CSV,
    VAL_CSV,
    heartbeat_name,
    layer_key,
    nsa_layer_statistics,
    nsa_statistics,
    read_csv,
    read_heartbeat,
    read_items,
    read_metrics,
)
from train.data.recall import DEFAULT_FORMAT
from train.analysis.paired import paired_test
from train.observe.telemetry import write_json_atomic

TOOL = "train.compare"
REPORT_FILES = ("report.json", "report.md", "report.png")
WITHIN_PCT = 1.0  # the verdict's "matches" band (issue 21's goal)
SHARES = tuple(k for k in GATE_STATS if k.startswith("gate_share_"))  # cmp, sel, win
# control arm -> its report.json keys: (gap on the whole-split loss, gap on bits/byte), and its name in the verdict
GAP_KEYS = {"dense": ("gap_pct", "gap_bits_per_byte_pct"), "window": ("gap_window_pct", "gap_window_bits_per_byte_pct")}
CONTROL_NAMES = {"dense": "dense", "window": "its window-only control"}
ARM_COLORS = {"nsa": "tab:red", "dense": "tab:blue", "window": "tab:green"}


def _floats(rows: list[dict], key: str) -> list[tuple[int, float]]:
    out = []
    for row in rows:
        try:
            out.append((int(row["step"]), float(row[key])))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def arm_summary(out_dir: Path, score: dict) -> dict:
    metrics = read_metrics(out_dir)
    train_rows, val_rows = read_csv(out_dir / TRAIN_CSV), read_csv(out_dir / VAL_CSV)
    rates = [v for _, v in _floats(train_rows, "toks_per_s")]
    losses = _floats(train_rows, "loss")
    return {
        "out_dir": str(out_dir),
        "status": metrics.get("status"),
        "params": metrics.get("params"),
        "params_non_embedding": metrics.get("params_non_embedding"),
        "step": metrics.get("step"),
        "tokens_seen": metrics.get("tokens_seen"),
        "tokens_per_s_median": statistics.median(rates) if rates else None,
        "device": metrics.get("device"),
        "last_train_loss": losses[-1][1] if losses else None,
        "train_loss": losses,
        "val_loss": _floats(val_rows, "val_loss"),
        "eval": {k: score.get(k) for k in ("split", "tokens", "loss", "bits_per_token", "bits_per_byte", "step",
                                           "file", "max_tokens")},
        # a data mixture: each source's own whole-split loss and bits per byte (eval is their weighted sum, weighted as
        # the stage in force at the evaluated step: eval_weights, eval_stage)
        "eval_sources": {name: {k: result.get(k) for k in ("tokens", "loss", "bits_per_byte")}
                         for name, result in (score.get("sources") or {}).items()},
        **({"eval_weights": score["weights"], "eval_stage": score.get("stage")} if score.get("sources") else {}),
    }


def nsa_over_time(out_dir: Path) -> list[dict]:
    """Gate and selection statistics of every logged step (rank 0's heartbeat): the means over layers, and the
    selection health per layer under `<name>_layers`."""
    rows = []
    for record in read_heartbeat(out_dir / heartbeat_name(0)):
        if record.get("kind") != "train":
            continue
        stats = nsa_statistics(record)
        if stats:
            layers = {layer_key(name): values for name, values in nsa_layer_statistics(record).items()}
            rows.append({"step": record.get("step"), **stats, **layers})
    return rows


def verdict(gaps: dict[str, float | None], max_tokens: int | None) -> str:
    """One line: how NSA's held-out loss compares with each control arm's. gaps: control arm (GAP_KEYS) -> its
    loss gap in % (None: a held-out loss is missing)."""
    if all(gap is None for gap in gaps.values()):
        return "no verdict: a held-out loss is missing"
    on = f"the first {max_tokens:,} validation tokens" if max_tokens else "the whole validation split"
    parts = []
    for control, gap in gaps.items():
        name = CONTROL_NAMES[control]
        if gap is None:
            parts.append(f"no verdict against {name} (a held-out loss is missing)")
        elif abs(gap) <= WITHIN_PCT:
            parts.append(f"matches {name} within {WITHIN_PCT:g}% ({gap:+.2f}%)")
        else:
            parts.append(f"{'behind' if gap > 0 else 'ahead of'} {name} by {abs(gap):.2f}%")
    return f"NSA {', '.join(parts)} on {on}"


def _gap_pct(nsa: float | None, control: float | None) -> float | None:
    """(nsa - control) / control in %, None when either is missing."""
    return 100.0 * (nsa - control) / control if nsa is not None and control else None


def build_report(out: Path, out_dirs: dict[str, Path], scores: dict[str, dict], recall: dict[str, dict] | None = None,
                 tasks: dict[str, dict] | None = None, needle: dict[str, list[dict]] | None = None, *,
                 trained_on_recall: bool = True, recall_lengths: dict[str, list[dict]] | None = None,
                 positions: dict[str, dict] | None = None) -> dict:
    """out_dirs, scores: per arm run (nsa and one or both controls), in ARMS order. recall: per arm, the recall
    probe's result (train/evaluation/recall.py) when the data is a recall corpus (trained_on_recall) or the
    comparison asked for it zero-shot. tasks: per arm, train.tasks' result (train/evaluation/tasks_checkpoint.py)
    when the comparison names downstream tasks. needle: per arm, the needle test's result at each context length
    (train/evaluation/needle.py) when the comparison asked for it."""
    arms = {arm: arm_summary(path, scores[arm]) for arm, path in out_dirs.items()}
    nsa_cfg = (yaml.safe_load((out_dirs["nsa"] / CONFIG_YAML).read_text(encoding="utf-8")) or {})
    nsa_eval = arms["nsa"]["eval"]
    gaps = {}
    for control, (loss_key, bpb_key) in GAP_KEYS.items():
        ev = arms[control]["eval"] if control in arms else {}
        gaps[loss_key] = _gap_pct(nsa_eval["loss"], ev.get("loss"))
        gaps[bpb_key] = _gap_pct(nsa_eval["bits_per_byte"], ev.get("bits_per_byte"))
    notes = []
    budgets = {arm: summary["tokens_seen"] for arm, summary in arms.items()}
    if len(set(budgets.values())) > 1:
        notes.append("token budgets differ: " + ", ".join(f"{arm} {tokens}" for arm, tokens in budgets.items()))
    return {
        "tool": TOOL,
        "dir": str(out),
        "arms": arms,
        "nsa": {"settings": nsa_cfg.get("nsa", {}), "seq_len": (nsa_cfg.get("train") or {}).get("seq_len"),
                "over_time": nsa_over_time(out_dirs["nsa"])},
        **gaps,
        "verdict": verdict({c: gaps[keys[0]] for c, keys in GAP_KEYS.items() if c in arms}, nsa_eval["max_tokens"]),
        **({"recall": {**recall_summary(recall), "trained_on_task": trained_on_recall,
                       "format": recall["nsa"].get("format", DEFAULT_FORMAT)}} if recall else {}),
        **({"tasks": tasks_summary(tasks)} if tasks else {}),
        **({"needle": needle_summary(needle)} if needle else {}),
        **({"recall_by_length": recall_length_summary(recall_lengths)} if recall_lengths else {}),
        **({"loss_by_position": position_summary(positions)} if positions else {}),
        "notes": notes,
    }


def recall_length_summary(by_arm: dict[str, list[dict]]) -> dict:
    """Per arm (and 'dense+rope': the dense arm scored with its RoPE interpolated by the length multiple) and length
    multiple: far accuracy with its standard error and each distance bucket's accuracy."""
    first = next(iter(by_arm.values()))
    scored = [r for results in by_arm.values() for r in results if NOT_SCORABLE not in r]

    def one(r: dict) -> dict:
        if NOT_SCORABLE in r:
            return {NOT_SCORABLE: r[NOT_SCORABLE]}
        return {"far_accuracy": r["far_accuracy"], "far_stderr": r["far_stderr"], "near_accuracy": r["near_accuracy"],
                "buckets": {b: v["accuracy"] for b, v in r["buckets"].items()}, "file": r["file"]}

    return {"training_length": scored[0]["training_length"] if scored else None,
            "multiples": [r["length_multiple"] for r in first],
            "arms": {arm: {str(r["length_multiple"]): one(r) for r in results} for arm, results in by_arm.items()}}


def position_summary(by_arm: dict[str, dict]) -> dict:
    """Per arm: the validation loss by position in a window longer than training (train.evaluate --by_position)."""
    first = next(iter(by_arm.values()))
    return {"seq_len": first["seq_len"], "training_length": first["training_length"],
            "arms": {arm: [{k: row[k] for k in ("from", "to", "loss", "beyond_training")} for row in r["by_position"]]
                     for arm, r in by_arm.items()}}


RECALL_FIELDS = ("near_accuracy", "far_accuracy", "far_stderr", "far_answer_loss", "far_items", "chance", "buckets", "file")
NOT_SCORABLE = "not_scorable"  # an arm the probe refused (train/workflows/compare.py probe_or_not_scorable): its line


def recall_summary(recall: dict[str, dict]) -> dict:
    """Per arm the probe's scores (or {not_scorable: why}), and NSA's far accuracy as a share of each control's (None
    when a control's is 0 or either was not scorable)."""
    out = {"arms": {arm: {NOT_SCORABLE: result[NOT_SCORABLE]} if NOT_SCORABLE in result
                    else {k: result.get(k) for k in RECALL_FIELDS} for arm, result in recall.items()}}
    nsa_far = recall["nsa"].get("far_accuracy")
    for control in GAP_KEYS:
        far = recall.get(control, {}).get("far_accuracy")
        out[f"far_vs_{control}"] = nsa_far / far if far and nsa_far is not None else None
    return out


def needle_summary(needle: dict[str, list[dict]]) -> dict:
    """Per arm and context length S: the mean accuracy over depths, each depth's, the trials per depth and the
    result file; the lengths as multiples of the training length."""
    first = next(iter(needle.values()))
    return {"lengths": [r["S"] for r in first], "multiples": [r["S"] / r["train_seq_len"] for r in first],
            "trials": first[0]["trials"],
            "arms": {arm: {str(r["S"]): {"mean_accuracy": r["mean_accuracy"],
                                         "by_depth": {str(d["depth"]): d["accuracy"] for d in r["results"]},
                                         "file": r["file"]} for r in results}
                     for arm, results in needle.items()}}


TASK_FIELDS = ("primary_metric", "primary", "primary_stderr", "acc", "acc_stderr", "acc_norm", "acc_norm_stderr",
               "items", "chance")
SIGNIFICANT_Z = 2.0  # a difference counts when it exceeds this many standard errors of the difference


def tasks_summary(tasks: dict[str, dict]) -> dict:
    """Per arm and task the primary metric with its standard error; per task and control NSA's difference in the
    primary metric, its standard error sqrt(se_nsa^2 + se_control^2) and whether it exceeds SIGNIFICANT_Z of
    them (on 500 items a 0.5-point difference does not); and, when both arms wrote items files, `mcnemar`:
    McNemar's exact test on the primary metric over the items both scored (b: only NSA right, c: only the
    control right; train/evaluation/tasks_items.py)."""
    arms = {arm: {name: {k: m.get(k) for k in TASK_FIELDS} for name, m in result["tasks"].items()}
            for arm, result in tasks.items()}
    items = {arm: read_items(Path(result["items_file"])) for arm, result in tasks.items()
             if result.get("items_file") and Path(result["items_file"]).is_file()}
    differences = {}
    for name, nsa in arms["nsa"].items():
        for control in GAP_KEYS:
            other = arms.get(control, {}).get(name)
            if other is None:
                continue
            diff = nsa["primary"] - other["primary"]
            stderr = (nsa["primary_stderr"] ** 2 + other["primary_stderr"] ** 2) ** 0.5
            entry = {"difference": diff, "stderr": stderr, "significant": bool(abs(diff) > SIGNIFICANT_Z * stderr)}
            if "nsa" in items and control in items:
                entry["mcnemar"] = paired_test(items["nsa"], items[control], name, nsa["primary_metric"])
            differences.setdefault(name, {})[control] = entry
    return {"arms": arms, "differences": differences,
            "step": {arm: result.get("step") for arm, result in tasks.items()},
            "limit": tasks["nsa"].get("limit")}


def _fmt(value, spec: str = ",") -> str:
    if value is None:
        return "-"
    return format(value, spec)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}%"


def markdown(report: dict) -> str:
    a = report["arms"]
    names = list(a)  # nsa, then the controls run
    rows = [("params", "params", ","), ("steps", "step", ","), ("tokens seen", "tokens_seen", ","),
            ("tokens/s (median)", "tokens_per_s_median", ",.0f"), ("last train loss", "last_train_loss", ".4f")]
    lines = [f"# NSA vs {' and '.join(names[1:])}: {report['dir']}", "", f"**{report['verdict']}**", "",
             "| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(_fmt(a[arm][key], spec) for arm in names) + " |" for label, key, spec in rows]
    for label, key, spec in (("whole-split tokens", "tokens", ","), ("whole-split loss", "loss", ".4f"),
                             ("bits/byte", "bits_per_byte", ".4f")):
        lines.append(f"| {label} | " + " | ".join(_fmt(a[arm]["eval"][key], spec) for arm in names) + " |")
    for source in a[names[0]].get("eval_sources", {}):  # a data mixture: the whole-split figures weighted, and each
        for label, key in (("loss", "loss"), ("bits/byte", "bits_per_byte")):
            lines.append(f"| {source}: {label} | " + " | ".join(
                _fmt(a[arm]["eval_sources"].get(source, {}).get(key), ".4f") for arm in names) + " |")
    if a[names[0]].get("eval_weights"):  # which weights made the total: the stage in force at each arm's step
        lines.append("| mixture weights (stage at) | " + " | ".join(
            ", ".join(f"{n} {w:g}" for n, w in a[arm].get("eval_weights", {}).items())
            + f" ({a[arm].get('eval_stage')})" for arm in names) + " |")
    gaps = []
    for control, (loss_key, bpb_key) in GAP_KEYS.items():
        if control in a:
            loss, bpb = report[loss_key], report[bpb_key]
            gaps.append(f"gap vs {control}: {_pct(loss)} loss, {_pct(bpb)} bits/byte")
    lines += ["", "; ".join(gaps) + " ((NSA - control) / control)", ""]
    vals = {arm: dict(a[arm]["val_loss"]) for arm in names}
    steps = sorted(set().union(*vals.values()))
    if steps:
        lines += ["| step | " + " | ".join(f"val {arm}" for arm in names) + " |", "|---" * (len(names) + 1) + "|"]
        lines += [f"| {s} | " + " | ".join(_fmt(vals[arm].get(s), '.4f') for arm in names) + " |" for s in steps]
        lines.append("")
    settings = report["nsa"]["settings"]
    lines.append("NSA: " + ", ".join(f"{k}={settings[k]}" for k in ("l", "d", "l_sel", "n_sel", "w") if k in settings)
                 + f", seq_len={report['nsa']['seq_len']}")
    over = report["nsa"]["over_time"]
    if over:
        keys = [k for k in SHARES + ("gate_saturated_frac", "sel_free_frac", "sel_free_distance_mean", "sel_recall",
                                     "sel_outside_window") if k in over[0]]
        picks = sorted({0, len(over) // 4, len(over) // 2, 3 * len(over) // 4, len(over) - 1})
        lines += ["", "| step | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        lines += [f"| {over[i]['step']} | " + " | ".join(_fmt(over[i].get(k), '.3f') for k in keys) + " |" for i in picks]
        recall = over[-1].get(layer_key("sel_recall"))
        if recall:
            lines += ["", f"sel_recall by layer at step {over[-1]['step']}: " + " ".join(f"{v:.3f}" for v in recall)]
    if "recall" in report:
        lines += recall_markdown(report["recall"])
    if "tasks" in report:
        lines += tasks_markdown(report["tasks"])
    if "needle" in report:
        lines += needle_markdown(report["needle"])
    if "recall_by_length" in report:
        lines += recall_length_markdown(report["recall_by_length"])
    if "loss_by_position" in report:
        lines += position_markdown(report["loss_by_position"])
    lines += [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def _not_scorable_lines(arms: dict[str, dict], what: str) -> list[str]:
    return [f"- {what}: {arm} not scorable: {r[NOT_SCORABLE]}" for arm, r in arms.items() if NOT_SCORABLE in r]


def recall_markdown(recall: dict) -> list[str]:
    arms = {arm: r for arm, r in recall["arms"].items() if NOT_SCORABLE not in r}
    refused = _not_scorable_lines(recall["arms"], "recall probe")
    if not arms:
        return ["", "Recall probe: no arm scorable.", *refused]
    names = list(arms)
    buckets = list(next(iter(arms.values()))["buckets"])
    how = ("" if recall.get("trained_on_task", True) else "zero-shot: no arm trained on the task; ") \
        + f"{recall.get('format', DEFAULT_FORMAT)} lines; "
    lines = [*([""] + refused if refused else []),
             "", f"Recall probe ({how}accuracy of the answer, chance {next(iter(arms.values()))['chance']:.3f}; `<1w` lies "
             "inside the window):", "", "| distance | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for b in buckets:
        lines.append(f"| {b} | " + " | ".join(_fmt(arms[arm]["buckets"][b]["accuracy"], ".3f") for arm in names) + " |")
    lines.append("| far (all beyond the window) | " + " | ".join(
        f"{_fmt(arms[arm]['far_accuracy'], '.3f')} ± {_fmt(arms[arm]['far_stderr'], '.3f')}" for arm in names) + " |")
    shares = [f"{c} {recall[f'far_vs_{c}']:.1%}" for c in GAP_KEYS if recall.get(f"far_vs_{c}") is not None]
    if shares:
        lines += ["", "NSA's far accuracy as a share of: " + ", ".join(shares)]
    return lines


def recall_length_markdown(summary: dict) -> list[str]:
    """Far accuracy by distance bucket by evaluation length, one row per arm and length."""
    arms = summary["arms"]
    longest = str(summary["multiples"][-1])
    refused = [f"- recall at x{m}: {arm} not scorable: {r[NOT_SCORABLE]}" for arm, by_length in arms.items()
               for m, r in by_length.items() if NOT_SCORABLE in r]
    scored = [by_length[longest] for by_length in arms.values() if NOT_SCORABLE not in by_length[longest]]
    if not scored:
        return ["", "Recall beyond the training length: no arm scorable at the longest length.", *refused]
    buckets = list(scored[0]["buckets"])
    lines = ["", f"Recall beyond the training length ({summary['training_length']} tokens; documents x1 .. x{longest}, "
             "the distance buckets extended to them; dense+rope: the dense arm with its RoPE interpolated by the "
             "multiple; - : a distance the length does not reach):", "",
             "| arm | length | far | " + " | ".join(buckets) + " |", "|---" * (len(buckets) + 3) + "|"]
    for arm, by_length in arms.items():
        for m in summary["multiples"]:
            r = by_length[str(m)]
            if NOT_SCORABLE in r:
                continue
            lines.append(f"| {arm} | x{m} | {_fmt(r['far_accuracy'], '.3f')} ± {_fmt(r['far_stderr'], '.3f')} | "
                         + " | ".join(_fmt(r["buckets"].get(b), ".3f") for b in buckets) + " |")
    return lines + ([""] + refused if refused else [])


def position_markdown(summary: dict) -> list[str]:
    arms = summary["arms"]
    rows = next(iter(arms.values()))
    lines = ["", f"Validation loss by position in windows of {summary['seq_len']} tokens (trained at "
             f"{summary['training_length']}; * past the training length):", "",
             "| positions | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|"]
    for i, row in enumerate(rows):
        label = f"{row['from']}-{row['to']}" + (" *" if row["beyond_training"] else "")
        lines.append(f"| {label} | " + " | ".join(_fmt(arms[arm][i]["loss"], ".4f") for arm in arms) + " |")
    return lines


def needle_markdown(needle: dict) -> list[str]:
    arms = needle["arms"]
    names = list(arms)
    lines = ["", f"Needle in a haystack (greedy decoding of the planted number; mean accuracy over depths, "
             f"{needle['trials']} trials per depth):", "", "| S | x train length | " + " | ".join(names) + " |",
             "|---" * (len(names) + 2) + "|"]
    for S, multiple in zip(needle["lengths"], needle["multiples"]):
        lines.append(f"| {S:,} | {multiple:g} | " + " | ".join(_fmt(arms[arm][str(S)]["mean_accuracy"], ".2f")
                                                          for arm in names) + " |")
    return lines


def tasks_markdown(tasks: dict) -> list[str]:
    arms = tasks["arms"]
    names = list(arms)
    controls = [c for c in GAP_KEYS if c in arms]
    lines = ["", f"Downstream tasks (primary metric ± standard error; a difference counts beyond {SIGNIFICANT_Z:g} "
             "standard errors):", "",
             "| task | metric | chance | " + " | ".join(names) + " | " + " | ".join(f"NSA - {c}" for c in controls) + " |",
             "|---" * (3 + len(names) + len(controls)) + "|"]
    for name, nsa in arms["nsa"].items():
        cells = [f"{_fmt(arms[arm][name]['primary'], '.3f')} ± {_fmt(arms[arm][name]['primary_stderr'], '.3f')}"
                 for arm in names]
        diffs = []
        for control in controls:
            d = tasks["differences"].get(name, {}).get(control)
            diffs.append("-" if d is None else f"{d['difference']:+.3f} ± {d['stderr']:.3f}"
                         + (" (significant)" if d["significant"] else " (within noise)"))
        lines.append(f"| {name} | {nsa['primary_metric']} | {_fmt(nsa['chance'], '.3f')} | " + " | ".join(cells)
                     + " | " + " | ".join(diffs) + " |")
    paired = [(name, control, d["mcnemar"]) for name, by_control in tasks["differences"].items()
              for control, d in by_control.items() if "mcnemar" in d]
    if paired:
        lines += ["", "Paired on the items both arms scored (McNemar's exact test on the primary metric; b: items only "
                  "NSA gets right, c: items only the control gets right):", "",
                  "| task | control | metric | items | b | c | p |", "|---" * 7 + "|"]
        lines += [f"| {name} | {control} | {m['metric']} | {m['items']:,} | {m['b']:,} | {m['c']:,} | "
                  f"{m['p_value']:.3g} |" for name, control, m in paired]
    return lines


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    by_length = report.get("recall_by_length")
    fig, axes = plt.subplots(1, 3 if by_length else 2, figsize=(18 if by_length else 12, 4.5))
    ax, gx = axes[0], axes[1]
    if by_length:  # far accuracy by evaluation length, per arm
        rx = axes[2]
        for arm, results in by_length["arms"].items():
            ms = by_length["multiples"]
            rx.plot(ms, [results[str(m)].get("far_accuracy", math.nan) for m in ms], marker="o", label=arm,
                    color=ARM_COLORS.get(arm, ARM_COLORS.get("dense")), linestyle="--" if arm == "dense+rope" else "-")
        rx.set(xscale="log", xlabel="evaluation length / training length", ylabel="far accuracy",
               title="recall beyond the training length", ylim=(0, 1.02))
        rx.set_xticks(by_length["multiples"], [f"x{m}" for m in by_length["multiples"]])
        rx.legend()
    for arm in report["arms"]:
        color = ARM_COLORS[arm]
        train, val = report["arms"][arm]["train_loss"], report["arms"][arm]["val_loss"]
        if train:
            ax.plot(*zip(*train), color=color, alpha=0.5, label=f"{arm} train")
        if val:
            ax.plot(*zip(*val), color=color, marker="o", label=f"{arm} val")
    ax.set(xlabel="step", ylabel="loss")
    ax.set_title(report["verdict"], fontsize=8, wrap=True)
    ax.legend()
    over = report["nsa"]["over_time"]
    for key in SHARES:
        points = [(r["step"], r[key]) for r in over if key in r]
        if points:
            gx.plot(*zip(*points), label=key.removeprefix("gate_share_"))
    gx.set(xlabel="step", ylabel="mean gate share", title="NSA gate shares")
    if over:
        gx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_report(out: Path, report: dict) -> list[Path]:
    json_path, md_path, png_path = (out / name for name in REPORT_FILES)
    write_json_atomic(json_path, report)
    tmp = md_path.with_suffix(".md.partial")
    tmp.write_text(markdown(report), encoding="utf-8")
    tmp.replace(md_path)
    return [json_path, md_path] + ([png_path] if plot(report, png_path) else [])


def report_files_for(out_dir: Path) -> list[Path]:
    """The report files of the comparison whose arm `out_dir` is (its parent's report.json names it), for the
    handoff bundle; [] for a run that is no comparison's arm."""
    json_path = Path(out_dir).parent / REPORT_FILES[0]
    try:
        report = json.loads(json_path.read_text(encoding="utf-8"))
        arms = [Path(arm["out_dir"]).resolve() for arm in report["arms"].values()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    if report.get("tool") != TOOL or Path(out_dir).resolve() not in arms:
        return []
    return [p for p in (json_path.parent / name for name in REPORT_FILES) if p.is_file()]
