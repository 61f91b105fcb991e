"""bench/bench_host.py's plumbing on CPU: the host path of an NSA layer and of a decode step with the Triton kernels'
execution skipped (Triton's interpreter), the launches and nsa:: op calls counted as the launch counter counts them,
the torch path's branches reported apart; refused in one line without the interpreter."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nsa.triton_support import triton_unavailable

if problem := triton_unavailable():  # no Triton the kernels support: nothing to skip the execution of
    pytest.skip(problem, allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "bench_host.py"


def run(tmp: Path, interpret: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": interpret}
    return subprocess.run([sys.executable, str(SCRIPT), "--repeats", "2", "--json", str(tmp / "host.json")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)


def test_the_host_path_is_timed_with_the_triton_path_s_kernels_skipped(tmp_path):
    proc = run(tmp_path, "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "host.json").read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result
    layer = result["layer_fwd_bwd"]
    # the Triton path's kernels (25: bench/results/launches_m7c_cpu.json's triton_kernels) and the nsa:: op calls
    assert layer["triton_launches"] == 25 and layer["nsa_op_calls"] == 15
    assert layer["host_ms"] > 0 and layer["cpu_branches_ms"] > 0 and layer["host_ms_dispatched"] > 0
    assert abs(layer["host_ms"] + layer["cpu_branches_ms"] - layer["total_ms"]) < 1e-2
    assert {"host_ms_per_layer", "host_ms_per_layer_dispatched"} <= set(result["decode_step"])


def test_refuses_without_the_interpreter(tmp_path):
    proc = run(tmp_path, "0")
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1] == (
        "error: run with TRITON_INTERPRET=1 (the kernels are skipped in Triton's interpreter)")
    assert not (tmp_path / "host.json").exists()
