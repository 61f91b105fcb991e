"""Training time lost per checkpoint save, synchronous vs asynchronous (train.async_checkpoint), on CPU.

    python bench/bench_async_checkpoint.py [--config configs/train_showcase.yaml --steps 20 --save-every 5 --rounds 3]

One process, the config's model and optimizer (AdamW, as the trainer builds it), synthetic batches. Each round runs
the same steps three ways, back to back: no saves, a synchronous save every N steps (train/checkpoint/io.py
save_checkpoint: temp file, fsync, rename, latest, retention), an asynchronous one (stage_to_host, then the
AsyncWriter thread runs write_checkpoint). Lost per save = (the pass's wall time - the no-save pass's of the same
round) / saves: for async it counts the staging copy and any slow-down of the steps the writer thread overlaps (it
shares the CPU and the memory bandwidth); the wait for the last write after the final step is reported apart (the
run's final save waits anyway). The median over rounds is reported: other work on the machine moves step times.
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
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
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
        save_s = []
        t0 = time.perf_counter()
        for i in range(1, args.steps + 1):
            step()
            if mode != "none" and i % args.save_every == 0:
                s0 = time.perf_counter()
                if writer is None:
                    ckpt_io.save_checkpoint(out_dir, i, state(), keep, False)
                else:
                    payload = stage_to_host(ckpt_io.checkpoint_payload(i, state()))
                    writer.submit(f"step {i}", lambda i=i, payload=payload: ckpt_io.write_checkpoint(
                        out_dir, i, payload, keep, False))
                    del payload
                save_s.append(time.perf_counter() - s0)
        wall = time.perf_counter() - t0
        t1 = time.perf_counter()
        if writer is not None:
            writer.wait()
        return {"wall_s": wall, "save_call_s": save_s, "tail_wait_s": time.perf_counter() - t1}

    rounds = {"none": [], "sync": [], "async": []}
    for _ in range(args.rounds):
        for mode in rounds:
            rounds[mode].append(run(mode))
    saves = args.steps // args.save_every
    result = {"config": args.config, "params": sum(p.numel() for p in model.parameters()),
              "steps": args.steps, "save_every": args.save_every, "saves_per_pass": saves, "rounds": args.rounds,
              "threads": args.threads, "torch": torch.__version__,
              "no_save_step_s": round(statistics.median(r["wall_s"] for r in rounds["none"]) / args.steps, 4)}
    for mode in ("sync", "async"):
        lost = [(r["wall_s"] - base["wall_s"]) / saves for r, base in zip(rounds[mode], rounds["none"])]
        result[mode] = {
            "lost_per_save_s": round(statistics.median(lost), 4),
            "lost_per_save_s_each_round": [round(x, 4) for x in lost],
            "save_call_s_median": round(statistics.median(x for r in rounds[mode] for x in r["save_call_s"]), 4),
            "tail_wait_s_median": round(statistics.median(r["tail_wait_s"] for r in rounds[mode]), 4),
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
