"""The twin comparison's report, built only from what the two arms' out_dirs and evaluations recorded.

    report.json  arms: params, steps, tokens, tokens/s, last train loss, val curve, whole-split loss and
                 bits/byte; nsa: its settings and gate / selection statistics per logged step (with the
                 selection health: sel_recall, sel_outside_window, gate_mean_*, and per layer under
                 `<name>_layers`); gap; verdict
    report.md    the same as tables, for people
    report.png   train and val loss of both arms in one plot; NSA gate shares over training
Gap = (NSA whole-split loss - dense whole-split loss) / dense, in percent: negative means NSA is better.
"""
from __future__ import annotations

import json
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
    read_metrics,
)
from train.observe.telemetry import write_json_atomic

TOOL = "train.compare"
REPORT_FILES = ("report.json", "report.md", "report.png")
WITHIN_PCT = 1.0  # the verdict's "matches dense" band (issue 21's goal)
SHARES = tuple(k for k in GATE_STATS if k.startswith("gate_share_"))  # cmp, sel, win


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


def verdict(gap_pct: float | None, max_tokens: int | None) -> str:
    """One line: how NSA's held-out loss compares with the dense twin's."""
    if gap_pct is None:
        return "no verdict: a held-out loss is missing"
    on = f"the first {max_tokens:,} validation tokens" if max_tokens else "the whole validation split"
    if abs(gap_pct) <= WITHIN_PCT:
        return f"NSA matches dense within {WITHIN_PCT:g}% ({gap_pct:+.2f}%) on {on}"
    return f"NSA {'behind' if gap_pct > 0 else 'ahead of'} dense by {abs(gap_pct):.2f}% on {on}"


def build_report(out: Path, out_dirs: dict[str, Path], scores: dict[str, dict]) -> dict:
    arms = {arm: arm_summary(path, scores[arm]) for arm, path in out_dirs.items()}
    nsa_cfg = (yaml.safe_load((out_dirs["nsa"] / CONFIG_YAML).read_text(encoding="utf-8")) or {})
    n_loss, d_loss = arms["nsa"]["eval"]["loss"], arms["dense"]["eval"]["loss"]
    gap = 100.0 * (n_loss - d_loss) / d_loss if n_loss is not None and d_loss else None
    n_bpb, d_bpb = arms["nsa"]["eval"]["bits_per_byte"], arms["dense"]["eval"]["bits_per_byte"]
    notes = []
    if arms["nsa"]["tokens_seen"] != arms["dense"]["tokens_seen"]:
        notes.append(f"token budgets differ: nsa {arms['nsa']['tokens_seen']}, dense {arms['dense']['tokens_seen']}")
    return {
        "tool": TOOL,
        "dir": str(out),
        "arms": arms,
        "nsa": {"settings": nsa_cfg.get("nsa", {}), "seq_len": (nsa_cfg.get("train") or {}).get("seq_len"),
                "over_time": nsa_over_time(out_dirs["nsa"])},
        "gap_pct": gap,
        "gap_bits_per_byte_pct": 100.0 * (n_bpb - d_bpb) / d_bpb if n_bpb is not None and d_bpb else None,
        "verdict": verdict(gap, arms["nsa"]["eval"]["max_tokens"]),
        "notes": notes,
    }


def _fmt(value, spec: str = ",") -> str:
    if value is None:
        return "-"
    return format(value, spec)


def markdown(report: dict) -> str:
    a = report["arms"]
    rows = [("params", "params", ","), ("steps", "step", ","), ("tokens seen", "tokens_seen", ","),
            ("tokens/s (median)", "tokens_per_s_median", ",.0f"), ("last train loss", "last_train_loss", ".4f")]
    lines = [f"# NSA vs dense twin: {report['dir']}", "", f"**{report['verdict']}**", "",
             "| | nsa | dense |", "|---|---|---|"]
    lines += [f"| {label} | {_fmt(a['nsa'][key], spec)} | {_fmt(a['dense'][key], spec)} |" for label, key, spec in rows]
    for label, key, spec in (("whole-split tokens", "tokens", ","), ("whole-split loss", "loss", ".4f"),
                             ("bits/byte", "bits_per_byte", ".4f")):
        lines.append(f"| {label} | {_fmt(a['nsa']['eval'][key], spec)} | {_fmt(a['dense']['eval'][key], spec)} |")
    gaps = [f"gap (loss): {report['gap_pct']:+.2f}%" if report["gap_pct"] is not None else "gap (loss): -"]
    if report["gap_bits_per_byte_pct"] is not None:
        gaps.append(f"gap (bits/byte): {report['gap_bits_per_byte_pct']:+.2f}%")
    lines += ["", ", ".join(gaps), ""]
    val_n, val_d = dict(a["nsa"]["val_loss"]), dict(a["dense"]["val_loss"])
    if val_n or val_d:
        lines += ["| step | val nsa | val dense |", "|---|---|---|"]
        lines += [f"| {s} | {_fmt(val_n.get(s), '.4f')} | {_fmt(val_d.get(s), '.4f')} |" for s in sorted(val_n | val_d)]
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
    lines += [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax, gx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm, color in (("nsa", "tab:red"), ("dense", "tab:blue")):
        train, val = report["arms"][arm]["train_loss"], report["arms"][arm]["val_loss"]
        if train:
            ax.plot(*zip(*train), color=color, alpha=0.5, label=f"{arm} train")
        if val:
            ax.plot(*zip(*val), color=color, marker="o", label=f"{arm} val")
    ax.set(xlabel="step", ylabel="loss", title=report["verdict"])
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
