"""Plan a run: tokens per iteration, iterations for a token target, FLOPs per token, wall time.

    python -m train.plan CONFIG [--section.key=value ...] [--tokens 82e9] [--gpus 8] [--gpu H100-80GB]
        [--toks-per-s 300000 | --mfu 0.40 --peak-device "NVIDIA B200"] [--hours 50] [--json]

The arithmetic of the B200 MFU guide, from the config instead of by hand:
    tokens/iteration = batch_size x accumulate_grad_batches x gpus x seq_len
    iterations       = ceil(tokens / tokens per iteration)     (enough to reach the target)
The seed's "≈" figures are the same quotient rounded to nearest; `iterations_rounded` reports
that number too (82e9 / 4,194,304 = 19,550.32: ceil 19,551, seed ≈ 19,550).
FLOPs per token are nsa.flops v3 (component_summation_v2025, training = 3 x forward). Wall time
needs a global tokens/s: measured (--toks-per-s, e.g. from python -m train.analyze) or implied by
an assumed MFU on a known GPU: tokens/s = MFU x peak x gpus / FLOPs per token.
Without --tokens the target is the config's own steps. --gpu NAME adds the peak memory per rank
(train/planning/memory.py) and whether it fits that GPU, with the knob that fixes it when it does not.
"""
from __future__ import annotations

import argparse
import json
import sys

from train.core.config import load_config
from train.core.env import launch_ranks
from train.core.errors import UserError, print_error
from train.planning.memory import GPU_MIB, gpu_name, render_memory, verdict
from train.planning.plan import make_plan, render


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.plan", allow_abbrev=False,
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="the run's YAML config; overrides (--section.key=value) may follow")
    parser.add_argument("--tokens", type=float, default=None, help="target training tokens, e.g. 82e9 "
                        "(default: the config's steps)")
    parser.add_argument("--gpu", default=None, help="GPU for the memory estimate: " + ", ".join(GPU_MIB))
    parser.add_argument("--gpus", type=int, default=None, help="GPUs (default $WORLD_SIZE or 1)")
    parser.add_argument("--toks-per-s", type=float, default=None, help="measured global tokens/s")
    parser.add_argument("--mfu", type=float, default=None, help="assumed MFU (0-1); needs --peak-device")
    parser.add_argument("--peak-device", default=None, help='GPU name for the dense peak, e.g. "NVIDIA B200"')
    parser.add_argument("--hours", type=float, default=None, help="also: iterations that fit in this many hours")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(args.config, overrides)
        gpus = args.gpus if args.gpus is not None else launch_ranks()[0]
        plan = make_plan(cfg, tokens=args.tokens, gpus=gpus, toks_per_s=args.toks_per_s, mfu=args.mfu,
                         peak_device=args.peak_device, hours=args.hours)
        if args.gpu is not None:
            plan["memory"] = verdict(cfg, gpus, gpu_name(args.gpu))
    except UserError as exc:
        print_error(exc)
        return exc.exit_code
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        print(render(plan) + ("\n" + render_memory(plan["memory"]) if "memory" in plan else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
