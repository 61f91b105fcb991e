"""Seed-compatible entrypoint (the M7C runbook): a thin shim over `python -m train`.

    CONFIG=configs/m7c_125m_40g.yaml python -u scripts/train_showcase.py --dataset synthetic --steps 200
    CONFIG=... torchrun --nproc_per_node=2 scripts/train_showcase.py --dataset fineweb_edu \
        --resume artifacts/m7c_125m/checkpoint_step{N}.pt

The flags map onto config keys in FLAG_TO_CONFIG (the one place); any other argument is passed
through as a trainer override (--section.key=value). `python -m train` is the primary entrypoint.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from train.core.env import default_config


FLAG_TO_CONFIG = {
    "dataset": "data.source",
    "steps": "train.steps",
    "resume": "train.resume",
    "seq_len": "train.seq_len",
    "batch_size": "train.batch_size",
    "synthetic_on_fail": "data.synthetic_on_fail",
    "out_dir": "train.out_dir",
}


def to_overrides(argv: list[str]) -> tuple[str | None, list[str]]:
    parser = argparse.ArgumentParser(prog="scripts/train_showcase.py", allow_abbrev=False)
    parser.add_argument("--config", default=default_config(), help="YAML config (default: $CONFIG)")
    parser.add_argument("--dataset", help="synthetic | fineweb_edu | bin:DIR | text:GLOB | ...")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--resume", help="checkpoint path, or auto / none")
    parser.add_argument("--seq-len", dest="seq_len", type=int)
    parser.add_argument("--batch-size", dest="batch_size", type=int)
    parser.add_argument("--synthetic-on-fail", dest="synthetic_on_fail", action="store_true", default=None)
    parser.add_argument("--out-dir", dest="out_dir")
    args, passthrough = parser.parse_known_args(argv)
    overrides = [f"--{key}={str(getattr(args, flag)).lower() if isinstance(getattr(args, flag), bool) else getattr(args, flag)}"
                 for flag, key in FLAG_TO_CONFIG.items() if getattr(args, flag) is not None]
    return args.config, overrides + passthrough


def missing_config_message() -> str:
    """Without a config the trainer would build its default model: say which to choose instead."""
    configs = Path(__file__).resolve().parents[1] / "configs"
    names = [n for n in ("train_showcase.yaml", "m7c_125m_40g.yaml", "m7c_cpu.yaml") if (configs / n).is_file()]
    names = names or sorted(p.name for p in configs.glob("*.yaml"))[:3]
    examples = ", ".join(f"configs/{n}" for n in names)
    return f"no config: set CONFIG=configs/<name>.yaml (e.g. {examples}) or pass --config PATH"


def main(argv: list[str] | None = None) -> int:
    config, overrides = to_overrides(list(sys.argv[1:] if argv is None else argv))
    if not config:
        print(f"error: {missing_config_message()}", file=sys.stderr, flush=True)
        return 2
    from train.__main__ import main as train_main

    return train_main([config] + overrides)


if __name__ == "__main__":
    from train.core.console import survive_closed_console
    from train.trainer.stop import install_early_handlers

    install_early_handlers()  # a SIGTERM during start-up becomes a stop request (train/trainer/stop.py)
    survive_closed_console()  # a vanished console reader must not stop the run before its checkpoint
    from train.__main__ import exit_process

    exit_process(main())
