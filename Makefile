# Runbook targets. Python comes from .venv (make setup creates it).
PY ?= .venv/bin/python
CONFIG ?= configs/train_showcase.yaml
RUN ?=
OUT ?=

.PHONY: setup test test-reverse test-random test-isa test-stack smoke smoke-nsa train pilot monitor tb bench handoff preflight compare clean

setup:
	bash scripts/prime_bootstrap.sh

# two workers (pytest-xdist), one test file each at a time: the subprocess tests of a file stay in order. One intra-op
# thread per worker and per process they start (OMP_NUM_THREADS=1): two workers fill two cores, and OpenMP threads
# spinning on an oversubscribed CPU cost 20% of the suite's time (8:05 -> 6:38 measured on 2 idle cores).
# test-reverse and test-random run at torch's default thread count: no test may depend on either. Files start in
# tests/conftest.py's order (the longest first: LONG_FIRST); --no-loadscope-reorder keeps xdist from reordering them.
test:
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# the suite's test files in reverse order in one process: every file runs after the ones it used to precede
# (order independence: no test may depend on what an earlier file left in the process)
test-reverse:
	$(PY) -m pytest -q -p no:xdist --file-order=reverse

# the suite on another software stack, on CPU (scripts/test_stack.sh: gpu-image or floor; builds .stacks/<STACK> once
# from the package index; not part of CI; results in docs/STACKS.md)
STACK ?= gpu-image
test-stack:
	bash scripts/test_stack.sh $(STACK)

# the suite on an AVX2-only (ISA=avx2) or vectorless (ISA=novec) CPU's kernels (scripts/test_isa.sh; docs/DEVELOPING.md)
ISA ?= avx2
test-isa:
	bash scripts/test_isa.sh $(ISA)

# the suite's test files in a seeded random order in one process (SEED=N reproduces an order; default: today's date)
SEED ?= $(shell date +%Y%m%d)
test-random:
	$(PY) -m pytest -q -p no:xdist --file-order=random:$(SEED)

STAMP := $(shell date +%Y%m%d_%H%M%S)

# 50 steps of the tiny showcase model; a fresh out_dir each time (artifacts/smoke_<stamp>). The checkpoints it
# writes (and resumes nothing from) are removed after a passing smoke: a smoke's weights are noise, ~85 MB each.
# KEEP_CHECKPOINTS=1 keeps them; SMOKE_ARGS="--section.key=value ..." adds overrides.
SMOKE_OUT = $(or $(OUT),artifacts/smoke_$(STAMP))
SMOKE_NSA_OUT = $(or $(OUT),artifacts/smoke_nsa_$(STAMP))
drop_smoke_weights = $(if $(filter 1,$(KEEP_CHECKPOINTS)),true,rm -f $(1)/checkpoint_step*.pt $(1)/latest.pt) && \
	echo "smoke ok: $(1) ($(if $(filter 1,$(KEEP_CHECKPOINTS)),checkpoints kept,checkpoints removed; KEEP_CHECKPOINTS=1 keeps them))"

smoke:
	$(PY) -m train configs/train_showcase.yaml --train.out_dir=$(SMOKE_OUT) $(SMOKE_ARGS)
	@$(call drop_smoke_weights,$(SMOKE_OUT))

smoke-nsa:
	$(PY) -m train configs/train_showcase_nsa.yaml --train.out_dir=$(SMOKE_NSA_OUT) $(SMOKE_ARGS)
	@$(call drop_smoke_weights,$(SMOKE_NSA_OUT))

train:
	bash scripts/train_m7c_prime.sh

# NSA, dense and window-only at M7C scale on FineWeb-Edu, with every probe (docs/NSA.md, "The M7C pilot")
pilot:
	bash scripts/pilot_m7c.sh

monitor:
	bash scripts/monitor_run.sh $(MONITOR_ARGS) $(RUN)

tb:
	bash scripts/run_tensorboard.sh $(RUN)

bench:
	$(PY) bench/bench_train.py

handoff:
	$(PY) scripts/handoff.py $(RUN) $(HANDOFF_ARGS)

# an NSA config against its dense twin and window-only control (docs/NSA.md, "NSA vs its dense twin"); CONFIG defaults to the
# small KJV twin here; OUT defaults to artifacts/compare_<stamp>; COMPARE_ARGS="--section.key=value ..."
COMPARE_CONFIG = $(if $(filter command line environment,$(origin CONFIG)),$(CONFIG),configs/nsa_twin_kjv.yaml)
compare:
	$(PY) -m train.compare $(COMPARE_CONFIG) --out $(or $(OUT),artifacts/compare_$(STAMP)) $(COMPARE_ARGS)

# the best-practices guide's pre-flight checklist for CONFIG (docs/PRODUCTION.md); e.g. PREFLIGHT_ARGS="--gpus 8"
preflight:
	$(PY) -m train.preflight $(CONFIG) $(PREFLIGHT_ARGS)

clean:
	rm -rf .pytest_cache artifacts/smoke* artifacts/showcase*
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
