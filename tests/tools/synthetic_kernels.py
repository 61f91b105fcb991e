"""Two synthetic Triton kernels compiled for sm_80 / sm_90 through scripts/compile_kernels.py's own functions:
one that needs more shared memory than either target has (16 pipeline stages) and fits with 2, and one that
does not compile. Run as its own process (tests/tools/test_compile_kernels.py does), because a real compile
cannot happen in a process that imported triton with TRITON_INTERPRET=1: triton's own library functions
(triton.language.standard) are then built as interpreted functions, and a pytest worker that collected
tests/nsa (whose conftest sets the switch) is such a process.

    python -m tests.tools.synthetic_kernels      # prints {case: [Row as a dict, one per target]} as JSON
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

if os.environ.get("TRITON_INTERPRET"):
    sys.exit("run without TRITON_INTERPRET: kernels compiled for a GPU cannot be built by the interpreter")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compile_kernels.py"


def load_script():
    spec = importlib.util.spec_from_file_location("compile_kernels", SCRIPT)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@triton.jit
def tile_dot(A, B, C, K, BM: tl.constexpr, BK: tl.constexpr):
    """C [BM, BM] = A [BM, K] @ B [K, BM]; the K loop is software-pipelined over num_stages shared-memory
    buffers of A [BM, BK] and B [BK, BM] tiles (bf16: 2 * BM * BK * 2 bytes per stage)."""
    om = tl.arange(0, BM)
    ok = tl.arange(0, BK)
    acc = tl.zeros([BM, BM], dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(A + om[:, None] * K + (k + ok)[None, :])
        b = tl.load(B + (k + ok)[:, None] * BM + om[None, :])
        acc += tl.dot(a, b)
    tl.store(C + om[:, None] * BM + om[None, :], acc)


@triton.jit
def bad_arange(X):
    tl.store(X + tl.arange(0, 3), 0.0)  # arange length must be a power of 2: a compile error


def launch_tile_dot(stages: int) -> None:
    """A host wrapper: 64 x 1024 @ 1024 x 64 in bf16 with 128-wide K tiles and `stages` pipeline stages."""
    a = torch.empty(64, 1024, dtype=torch.bfloat16, device="meta")
    b = torch.empty(1024, 64, dtype=torch.bfloat16, device="meta")
    c = torch.empty(64, 64, dtype=torch.float32, device="meta")
    tile_dot[(1,)](a, b, c, a.shape[1], BM=64, BK=128, num_stages=stages)


def launch_bad_arange() -> None:
    bad_arange[(1,)](torch.empty(4, dtype=torch.float32, device="meta"))


CASES = {"tile_dot_16_stages": lambda: launch_tile_dot(16), "tile_dot_2_stages": lambda: launch_tile_dot(2),
         "bad_arange": launch_bad_arange}


def rows(ck, wrapper) -> list:
    with ck.capture_launches() as launches:
        wrapper()
    (launch,) = launches
    return [ck.compile_row(f"test.{launch.name}", launch, "synthetic", "bf16", target, shipped=True)
            for target in ck.TARGETS]


if __name__ == "__main__":
    ck = load_script()
    print(json.dumps({case: [asdict(r) for r in rows(ck, wrapper)] for case, wrapper in CASES.items()}))
