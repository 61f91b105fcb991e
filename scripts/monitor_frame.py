#!/usr/bin/env python3
"""One monitor frame for a training run: progress, ETA, loss, throughput, validation, downstream tasks, GPUs,
heartbeats, NSA gate and selection statistics (and selection health), checkpoints, flags and alerts. Standard library and
this checkout only (train/core/artifacts.py names and reads every file; no torch); scripts/monitor_run.sh
calls it in a loop.

    python3 scripts/monitor_frame.py RUN_OR_OUT_DIR [--window 20] [--stale-s 300]

RUN_OR_OUT_DIR is a run directory (artifacts/train_runs/m7c_*, holding run.info, which names the
out_dir) or a trainer out_dir (training.csv, heartbeat_rank*.jsonl, metrics.json; docs/ARTIFACTS.md).

Alerts. The trainer decides and records its own (train/observe/alerts.py: loss below the floor early, loss
spikes, throughput drops, gate collapse and low gate entropy, with the run's thresholds); the monitor
shows them from the heartbeat and recomputes none of them. It adds only what a trainer cannot say
about itself (WINDOW and STALE_S also come from the environment):
  trainer     'alert' records the trainer wrote to the heartbeat in the current session
  crashed     the trainer is gone while metrics.json still says running (train/observe/run_status.py)
  stale       no heartbeat line for STALE_S (300) seconds while the run is not finished
  nan         a non-finite loss, newly skipped non-finite steps, or an anomaly halt
  spike       newly spike-skipped steps (train.spike_skip_*), or a halt on spike skips in a row
  watchdog    the trainer's watchdog fired (no step for runtime.watchdog_s) in the current session
"""
from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

from train.core.artifacts import (
    ANOMALY, BPB_PREFIX, CONFIG_YAML, CRASHED, GATE_STATS, HALT, HEARTBEAT_GLOB, RUN_INFO, SELECTION_HEALTH,
    ROWS_PREFIX, SELECTION_STATS, SHARE_PREFIX, STACKDUMP_GLOB, TASKS_CSV, TRAIN_CSV, VAL_CSV, VAL_LOSS_PREFIX, WRITE_FAILED,
    checkpoint_files, heartbeat_name, latest_task_rows, nsa_layer_statistics, nsa_statistics, read_csv, read_heartbeat,
    read_kv, read_metrics, task_label,
)
from train.core.env import number, text
from train.observe.run_status import run_status


def resolve(target: Path, repo: Path | None = None) -> tuple[Path | None, Path]:
    """-> (run_dir or None, out_dir). A run dir's out_dir is relative to the repository root."""
    info = target / RUN_INFO
    if info.is_file():
        out = read_kv(info).get("out_dir")
        if out:
            p = Path(out)
            if not p.is_absolute():
                p = (repo or Path(__file__).resolve().parents[1]) / p
            return target, p
        return target, target
    return None, target


def to_float(v) -> float | None:
    if v is None or v == "":
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def config_steps(path: Path) -> int | None:
    """train.steps from config.yaml (yaml.safe_dump output: 'train:' then '  steps: N')."""
    section = None
    try:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line and not line.startswith(" ") and line.endswith(":"):
                section = line[:-1]
            elif section == "train" and line.strip().startswith("steps:"):
                return int(float(line.split(":", 1)[1]))
    except (OSError, ValueError):
        pass
    return None


# ---- formatting -------------------------------------------------------------------------------
def fmt_num(v: float | None, digits: int = 4) -> str:
    if v is None:
        return "-"
    if not math.isfinite(v):
        return str(v)
    return f"{v:.{digits}f}"


def fmt_int(v: float | None) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:,.0f}"


def fmt_dur(s: float | None) -> str:
    if s is None or not math.isfinite(s) or s < 0:
        return "-"
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def gpu_lines(nvidia_smi: str) -> list[str]:
    query = "--query-gpu=index,name,memory.used,memory.total,utilization.gpu"
    try:
        res = subprocess.run([nvidia_smi, query, "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    if res.returncode != 0:
        return []
    lines = []
    for row in res.stdout.strip().splitlines():
        parts = [p.strip() for p in row.split(",")]
        if len(parts) < 5:
            continue
        idx, name, used, total, util = parts[:5]
        try:
            lines.append(f"gpu{idx} {name}: {float(used) / 1024:.1f}/{float(total) / 1024:.1f} GiB, util {util}%")
        except ValueError:
            lines.append(f"gpu{idx} {name}: {used}/{total} MiB, util {util}%")
    return lines


# ---- the frame --------------------------------------------------------------------------------


def stack_dump_files(out: Path) -> list[Path]:
    """stackdump_rank{R}_{pid}[_watchdog].txt files that hold at least one dump, oldest change first.
    Each trainer process opens its files at start (a header line); faulthandler appends the dumps."""
    found = []
    for path in out.glob(STACKDUMP_GLOB):
        try:
            if "(most recent call first)" in path.read_text(encoding="utf-8", errors="replace"):
                found.append((path.stat().st_mtime, path.name, path))
        except OSError:  # removed by a run that ended cleanly
            continue
    return [path for *_, path in sorted(found)]


def tasks_line(rows: list[dict]) -> str | None:
    """The downstream tasks' latest scores (tasks.csv, train.eval_tasks), each with its first evaluation's:
    'tasks       step 800: hellaswag:rc_0shot acc_per_char 0.281 ± 0.020 (0.250 at step 0) | ...'; None without rows."""
    latest, first = latest_task_rows(rows), {}
    for row in rows:
        first.setdefault(row.get("task"), row)
    if not latest:
        return None
    step = max(int(r["step"]) for r in latest.values())
    parts = []
    for task, row in latest.items():
        text = (f"{task_label(task)} {row.get('primary_metric') or '-'} {fmt_num(to_float(row.get('primary')), 3)} ± "
                f"{fmt_num(to_float(row.get('primary_stderr')), 3)}")
        if int(row["step"]) != step:
            text += f" at step {row['step']}"
        start = first[task]
        if start is not row:
            text += f" ({fmt_num(to_float(start.get('primary')), 3)} at step {start['step']})"
        parts.append(text)
    return f"tasks       step {step}: " + " | ".join(parts)


def mixture_line(val_rows: list[dict], train_rows: list[dict]) -> str | None:
    """A data mixture's sources: each one's latest validation loss and bits per byte (val.csv), its share of the last
    logged interval's training rows and its rows so far (training.csv); None without a mixture."""
    last_val = val_rows[-1] if val_rows else {}
    last_train = train_rows[-1] if train_rows else {}
    names = [k[len(SHARE_PREFIX):] for k in last_train if k.startswith(SHARE_PREFIX)]
    names = names or [k[len(VAL_LOSS_PREFIX):] for k in last_val if k.startswith(VAL_LOSS_PREFIX)]
    if not names:
        return None
    parts = []
    for name in names:
        share, rows = to_float(last_train.get(SHARE_PREFIX + name)), to_float(last_train.get(ROWS_PREFIX + name))
        part = f"{name} {share:.1%} of the interval's rows" if share is not None else name
        if rows is not None:
            part += f" ({rows:,.0f} so far)"
        if VAL_LOSS_PREFIX + name in last_val:
            part += (f", val loss {fmt_num(to_float(last_val.get(VAL_LOSS_PREFIX + name)))} bpb "
                     f"{fmt_num(to_float(last_val.get(BPB_PREFIX + name)))}")
        parts.append(part)
    return "sources     " + " | ".join(parts)


def data_reads_line(beats: dict) -> str | None:
    """Stream sources: each rank's retried reads so far and the time it waited (its latest heartbeat 'train' record),
    'data        retries 7 (stalls 1, waited 12s) | rank0 3 | rank1 4 | last: <the last failure>'; None without."""
    last = {}
    for path, records in beats.items():
        rec = next((r for r in reversed(records) if r.get("kind") == "train" and "data_retries" in r), None)
        if rec is not None:
            last[path.stem.replace("heartbeat_rank", "")] = rec
    if not last:
        return None
    newest = max(last.values(), key=lambda r: r.get("step", 0))
    by_rank = newest.get("data_retries_by_rank") or []
    parts = [f"retries {newest.get('data_retries', 0)} (stalls {newest.get('data_stalls', 0)}, waited "
             f"{fmt_dur(float(newest.get('data_wait_s') or 0.0))})"]
    parts += [f"rank{rank} {n}" for rank, n in enumerate(by_rank)]
    errors = [r.get("data_last_error") for r in last.values() if r.get("data_last_error")]
    if errors:
        parts.append(f"last: {errors[-1]}")
    return "data        " + " | ".join(parts)


def build_frame(target: Path, *, window: int = 20, stale_s: float = 300.0, nvidia_smi: str | None = "nvidia-smi",
                now: float | None = None) -> tuple[str, list[str]]:
    """-> (frame text, alerts)."""
    now = time.time() if now is None else now
    run_dir, out = resolve(target)
    lines: list[str] = []
    alerts: list[str] = []
    head = f"== {out}"
    if run_dir is not None:
        head += f"  (run {run_dir})"
    lines.append(head + f"  {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))}")
    if run_dir is not None:
        ri = read_kv(run_dir / RUN_INFO)
        bits = [f"config {ri.get('config', '?')}", f"gpus {ri.get('gpu_count', '?')}"]
        if ri.get("resume_from"):
            bits.append(f"resume {ri['resume_from']}")
        if ri.get("exit_code"):
            bits.append(f"launcher exit {ri['exit_code']}")
        lines.append("run         " + " | ".join(bits))
    if not out.is_dir():
        lines.append(f"out_dir     {out} does not exist yet (training not started)")
        return "\n".join(lines), alerts

    metrics = read_metrics(out)
    rows = read_csv(out / TRAIN_CSV)
    val_rows = read_csv(out / VAL_CSV)
    beats = {p: read_heartbeat(p) for p in sorted(out.glob(HEARTBEAT_GLOB))}
    rank0 = beats.get(out / heartbeat_name(0)) or (next(iter(beats.values())) if beats else [])
    starts = [i for i, r in enumerate(rank0) if r.get("kind") == "start"]
    session = rank0[starts[-1]:] if starts else rank0
    session_start_step = int(session[0].get("step", 0)) if starts else 0
    last_kind = rank0[-1].get("kind") if rank0 else None

    run = run_status(out, read_kv(run_dir / RUN_INFO) if run_dir is not None else None)
    status = run.line() if run.status != "not started" or not rank0 else "starting"
    ended = run.ended or last_kind in ("end", "anomaly")
    if last_kind == "end" and run.status == "running":
        status = "ended"
    if run.status == CRASHED:
        ckpts_now = checkpoint_files(out)
        resume = f"a relaunch resumes from {ckpts_now[-1][1].name}" if ckpts_now else "no checkpoint: a relaunch starts fresh"
        alerts.append(f"crashed: the trainer is gone ({status}); {resume}")
    if run.status == WRITE_FAILED:  # exit 4: the trainer's one line, from its heartbeat record
        said = next((b.get("message") for b in reversed(rank0) if b.get("kind") == WRITE_FAILED), None)
        alerts.append(f"stopped: {said or 'a file could not be written (train.log has the line)'}")
    steps = metrics.get("steps") or config_steps(out / CONFIG_YAML)
    step = max([int(metrics.get("step") or 0)] + [int(r["step"]) for r in rows[-1:]]
               + [int(r.get("step") or 0) for r in rank0[-1:]])

    # progress and ETA (wall time between this session's train records: includes eval/checkpoints)
    train_recs = [r for r in session if r.get("kind") == "train"]
    sec_per_step = None
    recent = train_recs[-(window + 1):]
    if len(recent) >= 2 and recent[-1]["step"] > recent[0]["step"]:
        sec_per_step = (recent[-1]["ts"] - recent[0]["ts"]) / (recent[-1]["step"] - recent[0]["step"])
    elif rows:
        dts = [to_float(r.get("dt_step_s")) for r in rows[-window:]]
        dts = [d for d in dts if d is not None]
        sec_per_step = sum(dts) / len(dts) if dts else None
    prog = f"step {step:,}"
    if steps:
        prog += f" / {int(steps):,} ({100.0 * step / int(steps):.1f}%)"
        if not ended and sec_per_step:
            eta = (int(steps) - step) * sec_per_step
            prog += f" | ETA {fmt_dur(eta)} ({sec_per_step:.3f} s/step)"
    lines.append(f"status      {status}")
    lines.append(f"progress    {prog}")

    # loss and throughput over the window of this session's rows
    session_rows = [r for r in rows if int(r["step"]) > session_start_step]
    win = session_rows[-window:] or rows[-window:]
    losses = [to_float(r.get("loss")) for r in win]
    finite = [x for x in losses if x is not None and math.isfinite(x)]
    if rows:
        last_loss = to_float(rows[-1].get("loss"))
        mean = sum(finite) / len(finite) if finite else None
        lines.append(f"loss        last {fmt_num(last_loss)} | mean of last {len(win)} {fmt_num(mean)}"
                     f" | grad norm {fmt_num(to_float(rows[-1].get('grad_norm')), 3)}"
                     f" | lr {rows[-1].get('lr') or '-'}")
        tps = [to_float(r.get("toks_per_s")) for r in win]
        tps = [t for t in tps if t is not None and math.isfinite(t)]
        last_tps = to_float(rows[-1].get("toks_per_s"))
        mean_tps = sum(tps) / len(tps) if tps else None
        per_gpu = to_float(rows[-1].get("toks_per_s_per_gpu"))
        mfu = to_float(rows[-1].get("mfu"))
        extra = f" | per GPU {fmt_int(per_gpu)}" if per_gpu is not None else ""
        extra += f" | MFU {mfu * 100:.1f}%" if mfu is not None else ""
        lines.append(f"tokens/s    last {fmt_int(last_tps)} | mean of last {len(tps)} {fmt_int(mean_tps)}{extra}")
        mem = to_float(rows[-1].get("mem_reserved_mib"))
        if mem is not None:
            lines.append(f"cuda mem    peak reserved {mem / 1024:.1f} GiB (rank 0)")
        # NaN / skipped steps
        if last_loss is None or not math.isfinite(last_loss):
            alerts.append(f"nan: non-finite loss at step {rows[-1]['step']}")
        skipped = [to_float(r.get("skipped_steps")) or 0 for r in win]
        if len(skipped) >= 2 and skipped[-1] > skipped[0]:
            alerts.append(f"nan: {skipped[-1] - skipped[0]:.0f} non-finite step(s) skipped in the window "
                          f"({skipped[-1]:.0f} in the run)")
        spiked = [to_float(r.get("spike_skipped_steps")) or 0 for r in win]  # absent in older training.csv files
        if spiked[-1]:
            lines.append(f"spikes      {spiked[-1]:.0f} step(s) skipped as loss / grad-norm spikes in the run, "
                         f"{spiked[-1] - spiked[0]:.0f} in the window")
        if len(spiked) >= 2 and spiked[-1] > spiked[0]:
            alerts.append(f"spike: {spiked[-1] - spiked[0]:.0f} step(s) skipped as loss / grad-norm spikes in the "
                          f"window ({spiked[-1]:.0f} in the run)")
    else:
        lines.append("loss        no training.csv rows yet")

    if val_rows:
        v = val_rows[-1]
        vals = [to_float(r.get("val_loss")) for r in val_rows]
        best = min((x for x in vals if x is not None and math.isfinite(x)), default=None)
        lines.append(f"val         step {v['step']} loss {fmt_num(to_float(v.get('val_loss')))} "
                     f"ppl {fmt_num(to_float(v.get('ppl')), 2)} | best {fmt_num(best)}")
    else:
        lines.append("val         -")
    if source_line := mixture_line(val_rows, rows):
        lines.append(source_line)
    if data := data_reads_line(beats):
        lines.append(data)
    outage = next((r for r in reversed(session) if r.get("kind") == "data_outage"), None)  # this launch's
    if outage is not None and run.status != "running":
        alerts.append(f"data outage at step {outage.get('step')}: {outage.get('message')}; every rank stopped with a "
                      f"checkpoint (exit 75) and the runner resumes after DATA_OUTAGE_WAIT_S")
    task_line = tasks_line(read_csv(out / TASKS_CSV))
    if task_line:
        lines.append(task_line)

    # GPUs
    if nvidia_smi:
        g = gpu_lines(nvidia_smi)
        lines.extend(("gpu         " if i == 0 else "            ") + s for i, s in enumerate(g))
        if not g:
            lines.append("gpu         n/a (no nvidia-smi or no GPU)")

    # heartbeats
    if beats:
        parts = []
        newest_age = math.inf
        for path, recs in beats.items():
            rank = path.stem.replace("heartbeat_rank", "")
            if not recs:
                parts.append(f"rank{rank}: empty")
                continue
            age = now - float(recs[-1].get("ts", now))
            newest_age = min(newest_age, age)
            parts.append(f"rank{rank}: {fmt_dur(age)} ago ({recs[-1].get('kind')}, step {recs[-1].get('step')})")
            if not ended and age > stale_s:
                alerts.append(f"stale: heartbeat rank {rank} silent for {fmt_dur(age)} (> {stale_s:.0f}s): "
                              "hung or crashed? kill -USR1 <pid> dumps stacks")
        lines.append("heartbeat   " + " | ".join(parts))
    else:
        lines.append("heartbeat   none yet")

    # NSA gate and selection statistics: every one the trainer wrote (train/core/artifacts.py names them)
    nsa_rec = next((r for r in reversed(train_recs or rank0) if r.get("kind") == "train" and nsa_statistics(r)), None)
    if nsa_rec is not None:
        stats = nsa_statistics(nsa_rec)
        gates = [f"{k.removeprefix('gate_')} {stats[k]:.3f}" for k in GATE_STATS if k in stats]
        selection = [f"{k.removeprefix('sel_')} {stats[k]:.3f}" for k in SELECTION_STATS if k in stats]
        lines.append(f"gates       step {nsa_rec.get('step')}: " + (" | ".join(gates) or "-"))
        lines.append(f"selection   step {nsa_rec.get('step')}: " + (" | ".join(selection) or "-"))
        health = [f"{k.removeprefix('gate_').removeprefix('sel_')} {stats[k]:.3f}" for k in SELECTION_HEALTH if k in stats]
        if health:  # one compact line: the means over layers, then sel_recall per layer
            by_layer = nsa_layer_statistics(nsa_rec).get("sel_recall")
            if by_layer:
                health.append("recall by layer " + " ".join(f"{v:.2f}" for v in by_layer))
            lines.append(f"sel health  step {nsa_rec.get('step')}: " + " | ".join(health))
    else:
        lines.append("gates       n/a (no NSA statistics in the heartbeat: dense model, or no log interval yet)")

    # checkpoints
    ckpts = checkpoint_files(out)
    if ckpts:
        s, p = ckpts[-1]
        st = p.stat()
        lines.append(f"checkpoint  {p.name} ({fmt_bytes(st.st_size)}, {fmt_dur(now - st.st_mtime)} ago) | "
                     f"{len(ckpts)} kept")
    else:
        lines.append("checkpoint  none yet")

    # flags
    flags = []
    if (out / HALT).exists():
        flags.append("HALT requested (remove .HALT before resuming)")
    anomaly = out / ANOMALY
    if anomaly.exists():
        text = anomaly.read_text(encoding="utf-8", errors="replace").strip()
        flags.append(f"ANOMALY: {text}")
        kind = "spike" if text.startswith("loss_spike_skips") else "nan"
        alerts.append(f"{kind}: the run halted on an anomaly: {text}")
    dumps = stack_dump_files(out)
    if dumps:
        flags.append(f"stack dumps in {len(dumps)} file(s), newest {dumps[-1].name}")
    lines.append("flags       " + (" | ".join(flags) if flags else "none"))

    for r in session:
        if r.get("kind") == "watchdog":
            alerts.append(f"watchdog: no step for {fmt_dur(to_float(r.get('idle_s')))} at step {r.get('step')} "
                          f"(stacks in {r.get('path')})")
        elif r.get("kind") == "alert":
            alerts.append(f"trainer: {r.get('alert')} at step {r.get('step')}: {r.get('message', '')}".rstrip(": "))
        elif r.get("kind") == "anomaly" and not anomaly.exists():
            alerts.append(f"nan: anomaly at step {r.get('step')}: {r.get('message', r.get('anomaly_type'))}")

    alerts = list(dict.fromkeys(alerts))
    if alerts:
        lines.extend(("ALERTS      " if i == 0 else "            ") + f"! {a}" for i, a in enumerate(alerts))
    else:
        lines.append("alerts      none")
    return "\n".join(lines), alerts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target", help="run dir (holding run.info) or trainer out_dir")
    ap.add_argument("--window", type=int, default=int(number("WINDOW", 20)))
    ap.add_argument("--stale-s", type=float, default=number("STALE_S", 300))
    ap.add_argument("--nvidia-smi", default=text("NVIDIA_SMI", "nvidia-smi"))
    args = ap.parse_args(argv)
    target = Path(args.target)
    if not target.exists():
        print(f"monitor: error: {target} does not exist (give a run dir or an out_dir)", file=sys.stderr)
        return 2
    frame, _ = build_frame(target, window=max(2, args.window), stale_s=args.stale_s, nvidia_smi=args.nvidia_smi)
    print(frame, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
