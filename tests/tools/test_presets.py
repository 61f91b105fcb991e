"""Production presets: B200 Qwen3 phases and 50 h run (the best-practices and B200 MFU guides), 2x A6000 per model (the quick-start guide)."""
from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from train.core.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
QWEN3 = "full_qwen3_1.8b_optimal.yaml"

# derived preset -> (base preset, per-GPU batch, accumulation): the quick-start guide's 2x A6000 commands, with the
# micro-batch split where the guide's does not fit 48 GB (same global batch; tests/tools/test_memory.py)
A6000 = {
    "full_gpt2_1.36b_2xa6000.yaml": ("full_gpt2_1.36b.yaml", 4, 32),
    "full_llama2_1.36b_2xa6000.yaml": ("full_llama2_1.36b.yaml", 6, 32),
    "full_llama3_1.5b_optimal_2xa6000.yaml": ("full_llama3_1.5b_optimal.yaml", 4, 48),  # seed: 8 x 24
    "full_llama3_2.2b_chinchilla_2xa6000.yaml": ("full_llama3_2.2b_chinchilla.yaml", 2, 64),  # seed: 4 x 32
    "full_qwen3_1.8b_optimal_2xa6000.yaml": (QWEN3, 3, 64),  # seed: 6 x 32
}


def load(name: str, *overrides: str):
    return load_config(CONFIGS / name, list(overrides))


def same_model(a, b) -> bool:
    return dataclasses.asdict(a.model) == dataclasses.asdict(b.model)


@pytest.mark.parametrize("name", sorted(A6000))
def test_2xa6000_presets(name):
    base, batch, accum = A6000[name]
    cfg = load(name)
    assert same_model(cfg, load(base)), f"{name}: model section drifted from {base}"
    assert (cfg.train.batch_size, cfg.train.accumulate_grad_batches) == (batch, accum)
    assert cfg.runtime.zero1 and cfg.train.steps == 2000
    assert cfg.train.out_dir != load(base).train.out_dir


def test_b200_optimal_is_seed_002_phase_1():
    cfg = load("full_qwen3_1.8b_b200_optimal.yaml")
    assert same_model(cfg, load(QWEN3))
    # the B200 MFU guide's 64 x 4 global batch as 16 x 16: 64 x 2048-token micro-batches do not fit a B200
    assert (cfg.train.batch_size, cfg.train.accumulate_grad_batches, cfg.train.seq_len) == (16, 16, 2048)
    assert cfg.data.source_kind == "bin" and cfg.runtime.zero1 and not cfg.runtime.cuda_graphs  # no loader workers on bin:
    assert cfg.data.source in ("bin:data/slimpajama_6b_qwen3", "bin:data/slimpajama_627b_qwen3")
    assert cfg.data.tokenizer == "hf:tokenizers/qwen3"


def _phase_overrides(name: str) -> dict[str, list[str]]:
    """'#   Phase N  --k=v ...' lines of a preset's comment header -> {N: [overrides]}."""
    phases = {}
    for line in (CONFIGS / name).read_text().splitlines():
        m = re.match(r"#\s+Phase (\d)\s+(--.*?)\s{2,}", line)
        if m:
            phases[m.group(1)] = shlex.split(m.group(2))
    return phases


def test_documented_phases_2_and_3_load():
    phases = _phase_overrides("full_qwen3_1.8b_b200_optimal.yaml")
    assert set(phases) == {"2", "3"}
    p2 = load("full_qwen3_1.8b_b200_optimal.yaml", *phases["2"])
    p3 = load("full_qwen3_1.8b_b200_optimal.yaml", *phases["3"])
    assert (p2.train.batch_size, p2.train.accumulate_grad_batches) == (96, 2)
    assert (p3.train.batch_size, p3.train.accumulate_grad_batches, p3.runtime.cuda_graphs) == (128, 2, True)
    assert p2.runtime.gradient_checkpointing == p3.runtime.gradient_checkpointing == 1


def test_50h_run_and_its_smoke_twin():
    run, smoke = load("full_qwen3_1.8b_b200_50h.yaml"), load("full_qwen3_1.8b_b200_50h_smoke.yaml")
    assert same_model(run, load(QWEN3)) and same_model(smoke, run)
    assert run.data == smoke.data and run.data.source == "bin:data/slimpajama_627b_qwen3"
    for key in ("seq_len", "batch_size", "accumulate_grad_batches"):
        assert getattr(run.train, key) == getattr(smoke.train, key), key
    assert run.runtime.zero1 and smoke.runtime.zero1 and run.runtime.wandb
    assert run.train.save_every > 0 and run.train.keep_all_checkpoints
    # smoke: 100 iterations, eval at start, a checkpoint before the end, logging, W&B off
    t = smoke.train
    assert t.steps == 100 and t.eval_at_start and 0 < t.eval_every <= 100
    assert 0 < t.save_every < 100 and t.log_every <= 10 and not smoke.runtime.wandb
    assert smoke.train.out_dir != run.train.out_dir
