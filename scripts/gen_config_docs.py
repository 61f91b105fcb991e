"""Regenerate docs/CONFIG.md from the config dataclasses (their inline comments are the docs).

    .venv/bin/python scripts/gen_config_docs.py > docs/CONFIG.md
"""
from __future__ import annotations

from train.core.config_docs import markdown

if __name__ == "__main__":
    print(markdown(), end="")
