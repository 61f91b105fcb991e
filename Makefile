# Runbook targets. Python comes from .venv (make setup creates it).
PY ?= .venv/bin/python
CONFIG ?= configs/train_showcase.yaml
RUN ?=
OUT ?=

.PHONY: setup test smoke smoke-nsa train monitor tb bench handoff preflight clean

setup:
	bash scripts/prime_bootstrap.sh

test:
	$(PY) -m pytest -q

STAMP := $(shell date +%Y%m%d_%H%M%S)

# 50 steps of the tiny showcase model; a fresh out_dir each time (artifacts/smoke_<stamp>)
smoke:
	$(PY) -m train configs/train_showcase.yaml --train.out_dir=$(or $(OUT),artifacts/smoke_$(STAMP))

smoke-nsa:
	$(PY) -m train configs/train_showcase_nsa.yaml --train.out_dir=$(or $(OUT),artifacts/smoke_nsa_$(STAMP))

train:
	bash scripts/train_m7c_prime.sh

monitor:
	bash scripts/monitor_run.sh $(MONITOR_ARGS) $(RUN)

tb:
	bash scripts/run_tensorboard.sh $(RUN)

bench:
	$(PY) bench/bench_train.py

handoff:
	$(PY) scripts/handoff.py $(RUN) $(HANDOFF_ARGS)

# the best-practices guide's pre-flight checklist for CONFIG (docs/PRODUCTION.md); e.g. PREFLIGHT_ARGS="--gpus 8"
preflight:
	$(PY) -m train.preflight $(CONFIG) $(PREFLIGHT_ARGS)

clean:
	rm -rf .pytest_cache artifacts/smoke* artifacts/showcase*
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
