"""Pack a training run for a person to look at: one tarball with the run record, logs, CSVs,
metrics, effective config, heartbeats, a checkpoint manifest (names, sizes, sha256) and PNG plots.

The command line, usage and details: scripts/handoff.py (its docstring).
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import tarfile
import tempfile
import time
from pathlib import Path

from train.analysis.compare_report import report_files_for
from train.core.artifacts import (
    ANOMALY,
    GATE_STATS,
    HALT,
    LATEST,
    RUN_DIR_FILES,
    RUN_INFO,
    TRAIN_CSV,
    VAL_CSV,
    checkpoint_files,
    heartbeat_name,
    nsa_statistics,
    read_csv,
    read_heartbeat,
    read_kv,
)
from train.observe.run_status import run_status

REPO = Path(__file__).resolve().parents[2]  # relative paths in run.info are from the repository root
RUN_FILES = RUN_DIR_FILES
OUT_SUFFIXES = (".csv", ".superseded", ".json", ".jsonl", ".yaml", ".txt", ".log")
OUT_FLAGS = {ANOMALY: "anomaly_type.txt", HALT: "HALT.flag"}


class HandoffError(Exception):
    pass


def resolve(target: Path) -> tuple[Path | None, Path]:
    info = target / RUN_INFO
    if info.is_file():
        out = read_kv(info).get("out_dir")
        if not out:
            raise HandoffError(f"{info} names no out_dir")
        p = Path(out)
        return target, p if p.is_absolute() else REPO / p
    if (target / TRAIN_CSV).exists() or (target / "metrics.json").exists() or any(target.glob("heartbeat_rank*.jsonl")):
        return None, target
    raise HandoffError(f"{target} is neither a run dir (run.info) nor a trainer out_dir (training.csv / metrics.json)")


def same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def lineage_segments(run_dir: Path | None, out: Path, artifacts: Path) -> list[Path]:
    """Every launch (run dir) that wrote to this out_dir, oldest first: a resumed run has one run dir per
    launch, each with its own run.info, smoke.log and train.log. Searched beside run_dir (or, for an
    out_dir target, under ARTIFACTS_DIR/train_runs)."""
    root = run_dir.parent if run_dir is not None else artifacts / "train_runs"
    found = []
    for info in sorted(root.glob(f"*/{RUN_INFO}")) if root.is_dir() else []:
        named = read_kv(info).get("out_dir")
        if named and same_dir(Path(named) if Path(named).is_absolute() else REPO / named, out):
            found.append(info.parent)
    if run_dir is not None and not any(same_dir(p, run_dir) for p in found):
        found.append(run_dir)
    return found


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def to_float(v) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def gate_series(out: Path) -> dict[str, list[tuple[int, float]]]:
    """gate entropy / collapse per step from rank 0's heartbeat 'train' records (the trainer's key names)."""
    series: dict[str, list[tuple[int, float]]] = {}
    for rec in read_heartbeat(out / heartbeat_name(0)):
        if rec.get("kind") != "train":
            continue
        for name, value in nsa_statistics(rec).items():
            if name in GATE_STATS and ("entropy" in name or "collapse" in name) and math.isfinite(value):
                series.setdefault(name, []).append((int(rec["step"]), value))
    return series


def make_plots(out: Path, dest: Path) -> list[str]:
    """PNG plots (matplotlib, Agg); returns notes for the manifest."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["plots skipped: matplotlib not installed (run bash scripts/prime_bootstrap.sh)"]
    rows = read_csv(out / TRAIN_CSV)
    val = read_csv(out / VAL_CSV)
    notes = []
    dest.mkdir(parents=True, exist_ok=True)

    def series(rs, key):
        pts = [(int(r["step"]), to_float(r.get(key))) for r in rs]
        return [p[0] for p in pts if p[1] is not None], [p[1] for p in pts if p[1] is not None]

    def plot(name, title, ylabel, lines, logy=False):
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
        drawn = False
        for xs, ys, label, style in lines:
            if xs:
                ax.plot(xs, ys, style, label=label, linewidth=1.2, markersize=3)
                drawn = True
        if not drawn:
            plt.close(fig)
            notes.append(f"{name}: no data")
            return
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if logy:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(dest / name)
        plt.close(fig)

    tx, ty = series(rows, "loss")
    vx, vy = series(val, "val_loss")
    plot("loss.png", f"loss - {out.name}", "loss", [(tx, ty, "train", "-"), (vx, vy, "val", "o-")])
    sx, sy = series(rows, "toks_per_s")
    plot("throughput.png", f"tokens/s - {out.name}", "tokens/s (all GPUs)", [(sx, sy, "toks_per_s", "-")])
    lx, ly = series(rows, "lr")
    plot("lr.png", f"learning rate - {out.name}", "lr", [(lx, ly, "lr", "-")])
    gates = gate_series(out)
    if gates:
        plot("gates.png", f"NSA gate health - {out.name}", "value",
             [([s for s, _ in pts], [v for _, v in pts], name, "-") for name, pts in sorted(gates.items())])
    else:
        notes.append("gates.png: no gate_* keys in the heartbeat (dense model or stats not logged)")
    return notes


def checkpoint_manifest(out: Path) -> list[dict]:
    return [{"name": p.name, "step": s, "bytes": p.stat().st_size, "sha256": sha256(p)} for s, p in checkpoint_files(out)]


def build(target: Path, out_root: Path, weights: str = "none", now: float | None = None,
          artifacts: Path | None = None) -> tuple[Path, str]:
    """-> (tarball path, MANIFEST text)."""
    run_dir, out = resolve(target)
    if not out.is_dir():
        raise HandoffError(f"out_dir {out} does not exist")
    name = (run_dir or out).resolve().name
    stamp = time.strftime("%Y%m%d_%H%M%S", time.localtime(now))
    base = f"{name}_{stamp}"
    files: list[tuple[Path, str]] = []  # (source, path inside base/)
    if run_dir is not None:
        files += [(run_dir / f, f"run/{f}") for f in RUN_FILES if (run_dir / f).is_file()]
    segments = lineage_segments(run_dir, out, artifacts or REPO / "artifacts")
    for seg in segments:  # every launch of this out_dir (a resumed run), the packed one included
        files += [(seg / f, f"segments/{seg.name}/{f}") for f in RUN_FILES if (seg / f).is_file()]
    for p in sorted(out.iterdir()):
        if p.is_file() and not p.is_symlink() and p.suffix in OUT_SUFFIXES and not p.name.startswith("."):
            files.append((p, f"out/{p.name}"))
        elif p.name in OUT_FLAGS and p.is_file():
            files.append((p, f"out/{OUT_FLAGS[p.name]}"))
    files += [(p, f"compare/{p.name}") for p in report_files_for(out)]  # an arm of python -m train.compare
    ckpts = checkpoint_manifest(out)
    if weights != "none" and ckpts:
        chosen = ckpts if weights == "all" else ckpts[-1:]
        files += [(out / c["name"], f"weights/{c['name']}") for c in chosen]

    with tempfile.TemporaryDirectory(prefix="handoff_") as tmp:
        staging = Path(tmp)
        (staging / "checkpoints.json").write_text(json.dumps(
            {"out_dir": str(out), "checkpoints": ckpts,
             "latest": os.readlink(out / LATEST) if (out / LATEST).is_symlink() else None}, indent=2))
        files.append((staging / "checkpoints.json", "checkpoints.json"))
        notes = make_plots(out, staging / "plots")
        files += [(p, f"plots/{p.name}") for p in sorted((staging / "plots").glob("*.png"))]

        entries = [(src, arc, src.stat().st_size, sha256(src)) for src, arc in files]
        lines = [f"# handoff {base}", f"# created {time.strftime('%Y-%m-%dT%H:%M:%S%z', time.localtime(now))}",
                 f"# source run dir: {run_dir if run_dir else '-'}", f"# out_dir: {out}",
                 f"# status: {run_status(out, read_kv(run_dir / RUN_INFO) if run_dir else None).line()}",
                 f"# segments (launches of this out_dir, oldest first): {' '.join(p.name for p in segments) or '-'}",
                 f"# weights: {weights}", "# files: bytes  sha256  path"]
        lines += [f"{size:>12}  {digest}  {arc}" for _, arc, size, digest in entries]
        lines.append("# checkpoints (in out_dir; weights/ holds them only with --with-weights/--all-weights)")
        if ckpts:
            lines += [f"{c['bytes']:>12}  {c['sha256']}  {c['name']}" for c in ckpts]
        else:
            lines.append("# (none)")
        lines += [f"# note: {n}" for n in notes]
        manifest = "\n".join(lines) + "\n"

        out_root.mkdir(parents=True, exist_ok=True)
        tar_path = out_root / f"{base}.tar.gz"
        tmp_tar = out_root / f".{base}.tar.gz.tmp"
        with tarfile.open(tmp_tar, "w:gz") as tar:
            data = manifest.encode()
            ti = tarfile.TarInfo(f"{base}/MANIFEST.txt")
            ti.size, ti.mtime, ti.mode = len(data), int(time.time()), 0o644
            tar.addfile(ti, io.BytesIO(data))
            for src, arc, _, _ in entries:
                tar.add(src, arcname=f"{base}/{arc}", recursive=False)
        os.replace(tmp_tar, tar_path)
    return tar_path, manifest
