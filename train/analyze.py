"""Summarise a run from its run_YYYYMMDD_HHMMSS.json and plot it (the quick-start guide's analysis snippet, as a tool).

    python -m train.analyze RUN [--target-tokens 82e9] [--skip-steps 50] [--json] [--no-plots]

RUN is a trainer out_dir (its newest run_*.json is read) or the path of a run_*.json. Prints the
average and peak MFU after warm-up, tokens/s, memory, time per iteration and, with
--target-tokens, the iterations and wall time for that many tokens at the measured rate. Writes
RUN/analysis/summary.json and PNG plots (loss.png with val loss, throughput.png, mfu.png when the
run measured MFU) with matplotlib's Agg backend.

Warm-up: log intervals ending at step <= --skip-steps (default 50, as the quick-start guide) are left out of
the averages. A run shorter than that drops only its first interval (it includes start-up).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from train.analysis.analyze import DEFAULT_SKIP_STEPS, analyze, render
from train.core.errors import UserError, print_error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.analyze", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="trainer out_dir or run_*.json")
    parser.add_argument("--target-tokens", type=float, default=None, help="extrapolate iterations and time, e.g. 82e9")
    parser.add_argument("--skip-steps", type=int, default=DEFAULT_SKIP_STEPS, help="warm-up steps left out of averages")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    args = parser.parse_args(argv)
    try:
        summary, path, files = analyze(args.run, skip_steps=args.skip_steps, target_tokens=args.target_tokens,
                                       plots=not args.no_plots)
    except UserError as exc:
        print_error(exc)
        return exc.exit_code
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(render(summary, path))
        for f in files:
            print(f"  plot              {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
