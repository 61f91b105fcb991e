"""Downstream-task parity: our scorer against `transformers` run directly and against lm-evaluation-harness.

    PYTHONPATH=/tmp/lmeval_t python bench/bench_tasks_parity.py RUN_DIR [--limit 200] [--tasks ...]

RUN_DIR is a dense run with an exportable tokenizer (e.g. configs/train_showcase.yaml trained on
text:../shared/corpus/kjv.txt with the gpt2 tokenizer). The script exports it with train.export_hf into a temporary
directory, then scores the same items (the seeded subset of `limit` docs per task, rows cut to the same
max_len: the run's seq_len) two ways:
  ours       train.evaluation.tasks.score_tasks on the checkpoint (the product's path)
  lm_eval    lm-evaluation-harness's HFLM(pretrained=export).loglikelihood on the same (context, continuation)
             requests: its tokenisation (_encode_pair), batching and log-softmax
and reports per task the largest |difference| of per-request log-likelihoods and both accuracies (acc = argmax of
the summed log-likelihood; acc_norm = lm-eval's: divided by the length in characters of the choice without one
leading space, the product's own rule: tasks_metrics.norm_chars). lm-eval is not a dependency of the product:
install it apart, without its dependencies, e.g.
`pip install --target /tmp/lmeval_t --no-deps lm_eval accelerate`, and put that directory on PYTHONPATH. Prints one JSON
object; --out writes it (bench/results/tasks_parity.json).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from train.checkpoint.io import model_from_checkpoint, resolve_checkpoint
from train.data.tokenizers import load_tokenizer
from train.evaluation.tasks import score_tasks
from train.evaluation.tasks_data import load_task
from train.evaluation.tasks_metrics import norm_chars

TASKS = "hellaswag,arc_easy,arc_challenge,piqa,sciq,winogrande"


def lm_eval_logliks(export_dir: Path, requests: list[tuple[str, str]], batch_size: int, max_len: int) -> np.ndarray:
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    lm = HFLM(pretrained=str(export_dir), device="cpu", batch_size=batch_size, dtype="float32", max_length=max_len)
    instances = [Instance(request_type="loglikelihood", doc={}, arguments=req, idx=i) for i, req in enumerate(requests)]
    return np.array([ll for ll, _ in lm.loglikelihood(instances, disable_tqdm=True)])


def accuracies(task, doc_index: np.ndarray, loglik: list[np.ndarray]) -> dict:
    acc, acc_norm = [], []
    for i, ll in zip(doc_index, loglik):
        doc = task.docs[i]
        lengths = np.array([max(norm_chars(cont), 1) for _, cont in doc.requests], dtype=np.float64)
        acc.append(int(np.argmax(ll)) == doc.gold)
        acc_norm.append(int(np.argmax(ll / lengths)) == doc.gold)
    return {"acc": float(np.mean(acc)), "acc_norm": float(np.mean(acc_norm))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path)
    p.add_argument("--tasks", default=TASKS)
    p.add_argument("--limit", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    try:
        import lm_eval  # noqa: F401  (installed apart: see the module docstring)
    except ImportError:
        print("bench_tasks_parity: lm_eval is not importable; install it apart and put it on PYTHONPATH "
              "(see this script's docstring)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    checkpoint = resolve_checkpoint(args.run).resolve()
    model, cfg = model_from_checkpoint(checkpoint, "cpu")
    tokenizer = load_tokenizer(cfg["data"]["tokenizer"])
    max_len = min(int(cfg["train"]["seq_len"]), model.cfg.max_seq_len)
    report = {"checkpoint": str(checkpoint), "tokenizer": cfg["data"]["tokenizer"], "limit": args.limit,
              "max_len": max_len, "tasks": {}}
    with tempfile.TemporaryDirectory() as tmp:
        export_dir = Path(tmp) / "hf"
        subprocess.run([sys.executable, "-m", "train.export_hf", str(checkpoint), str(export_dir)], check=True)
        for spec in args.tasks.split(","):
            task = load_task(spec)
            started = time.perf_counter()
            result = score_tasks(model, tokenizer, [task], limit=args.limit, device=torch.device("cpu"),
                                 max_len=max_len)[task.name]
            ours_s = time.perf_counter() - started
            requests = [req for i in result.doc_index for req in task.docs[i].requests]
            started = time.perf_counter()
            theirs = lm_eval_logliks(export_dir, requests, args.batch_size, max_len)
            lm_eval_s = time.perf_counter() - started
            ours = np.concatenate(result.loglik)
            splits = np.cumsum([len(x) for x in result.loglik])[:-1]
            ours_acc = accuracies(task, result.doc_index, result.loglik)
            theirs_acc = accuracies(task, result.doc_index, np.split(theirs, splits))
            report["tasks"][task.name] = {
                "docs": len(result.doc_index), "requests": len(requests),
                "max_abs_loglik_diff": float(np.max(np.abs(ours - theirs))),
                "max_rel_loglik_diff": float(np.max(np.abs(ours - theirs) / np.maximum(np.abs(theirs), 1e-9))),
                "ours": {**ours_acc, "metrics_acc": result.metrics["acc"], "metrics_acc_norm": result.metrics["acc_norm"],
                         "seconds": round(ours_s, 2)},
                "lm_eval": {**theirs_acc, "seconds": round(lm_eval_s, 2)},
                "truncated": result.metrics.get("truncated"),
            }
            print(json.dumps({task.name: report["tasks"][task.name]}), file=sys.stderr)
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
