"""Training time lost per checkpoint save, synchronous vs asynchronous (train.async_checkpoint), on CPU.

    python bench/bench_async_checkpoint.py [--config configs/train_showcase.yaml --steps 60 --save-every 10]

One process, the config's model and optimizer (AdamW, as the trainer builds it), synthetic batches. Three passes of
the same steps: no saves (the baseline step time), a synchronous save every N steps (train/checkpoint/io.py
save_checkpoint: temp file, fsync, rename, latest, retention), an asynchronous one (stage_to_host, then the
AsyncWriter thread runs write_checkpoint). Lost per save = the save call (sync: the whole write; async: the staging
copy, plus any wait for the previous write) + the extra time of the step right after it over the pass's median step
(the steps the writer thread overlaps share the CPU with it; a write here is shorter than a step). The wait for the
last write after the final step is reported apart (the run's final save waits anyway). On a shared machine step times
are noisy: the save-call times are the steady part, the overlap term is an estimate.
Writes one JSON object to stdout and, with --out, to a file.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/train_showcase.yaml")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="")
    args = p.parse_args()

    import torch

    from nsa.model import Transformer
    from train.checkpoint import io as ckpt_io
    from train.checkpoint.async_writer import AsyncWriter, stage_to_host
    from train.core.config import load_config
    from train.trainer.optim import build_optimizer

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, ["--runtime.device=cpu"])
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    opt = build_optimizer(model, cfg.train, "cpu", zero1=False)
    B, T, V = cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size

    def step() -> None:
        idx = torch.randint(0, V, (B, T))
        model(idx, idx).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def state() -> dict:
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "config": cfg.to_dict()}

    for _ in range(3):
        step()  # warm-up; the optimizer's moments exist from here on
    out_dir = Path(tempfile.mkdtemp(prefix="bench_async_ckpt_"))
    keep = 2

    def run(mode: str) -> dict:
        writer = AsyncWriter() if mode == "async" else None
        step_s, save_s = [], []
        t0 = time.perf_counter()
        for i in range(1, args.steps + 1):
            s0 = time.perf_counter()
            step()
            step_s.append(time.perf_counter() - s0)
            if mode != "none" and i % args.save_every == 0:
                s0 = time.perf_counter()
                if writer is None:
                    ckpt_io.save_checkpoint(out_dir, i, state(), keep, False)
                else:
                    payload = stage_to_host(ckpt_io.checkpoint_payload(i, state()))
                    writer.submit(f"step {i}", lambda i=i, payload=payload: ckpt_io.write_checkpoint(
                        out_dir, i, payload, keep, False))
                save_s.append(time.perf_counter() - s0)
        wall = time.perf_counter() - t0
        t1 = time.perf_counter()
        if writer is not None:
            writer.wait()
        return {"wall_s": wall, "step_s": step_s, "save_call_s": save_s, "tail_wait_s": time.perf_counter() - t1}

    base = run("none")
    median = statistics.median(base["step_s"])
    result = {"config": args.config, "params": sum(p.numel() for p in model.parameters()),
              "steps": args.steps, "save_every": args.save_every, "threads": args.threads,
              "baseline_step_s": round(median, 4)}
    for mode in ("sync", "async"):
        r = run(mode)
        saves = len(r["save_call_s"])
        after = [i for i in range(args.save_every, args.steps) if i % args.save_every == 0]  # 0-based: step i+1
        others = [t for i, t in enumerate(r["step_s"]) if i not in after and i > 0]
        typical = statistics.median(others)
        overlap = statistics.mean(r["step_s"][i] - typical for i in after) if after else 0.0
        result[mode] = {
            "lost_per_save_s": round(statistics.mean(r["save_call_s"]) + overlap, 4),
            "overlap_step_excess_s": round(overlap, 4), "median_step_s": round(typical, 4),
            "save_call_s_median": round(statistics.median(r["save_call_s"]), 4),
            "tail_wait_s": round(r["tail_wait_s"], 4), "saves": saves, "wall_s": round(r["wall_s"], 3),
        }
    files = sorted(out_dir.glob("checkpoint_step*.pt"))
    result["checkpoint_mb"] = round(files[-1].stat().st_size / 2**20, 1) if files else None
    for f in out_dir.iterdir():
        f.unlink()
    out_dir.rmdir()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
