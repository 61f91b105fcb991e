"""train/planning/memory.py: the peak-memory estimate behind `python -m train.plan --gpu` and the pre-flight."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nsa.flops import param_count
from train.core.config import load_config
from train.planning.memory import GPU_MIB, estimate_memory, fit_advice, gpu_name, verdict
from train.plan import main as plan_main
from train.workflows.preflight import FAIL, OK, run_preflight

REPO = Path(__file__).resolve().parents[2]
QWEN_B200 = REPO / "configs" / "full_qwen3_1.8b_b200_optimal.yaml"


def test_states_are_sharded_as_each_mode_shards_them():
    cfg = load_config(QWEN_B200, ["--runtime.zero1=false"])
    P = param_count(cfg.model)
    ddp = estimate_memory(cfg, 8)
    assert (ddp.params, ddp.grads, ddp.optimizer) == (4 * P, 4 * P, 8 * P)
    zero1 = estimate_memory(load_config(QWEN_B200, ["--runtime.zero1=true"]), 8)
    assert (zero1.params, zero1.grads, zero1.optimizer) == (4 * P, 4 * P, 8 * P / 8)
    fsdp = estimate_memory(load_config(QWEN_B200, ["--runtime.zero1=false", "--runtime.fsdp=true"]), 8)
    assert fsdp.optimizer == 8 * P / 8 and 4 * P / 8 < fsdp.params < 4 * P / 4
    assert estimate_memory(load_config(QWEN_B200, ["--runtime.zero1=true"]), 1).optimizer == 8 * P  # one rank: nothing to shard


def test_activations_scale_with_tokens_and_checkpointing_keeps_block_inputs():
    base = load_config(QWEN_B200, ["--train.batch_size=8"])
    one, two = estimate_memory(base, 8), estimate_memory(load_config(QWEN_B200, ["--train.batch_size=16"]), 8)
    assert two.activations == pytest.approx(2 * one.activations)
    ckpt = estimate_memory(load_config(QWEN_B200, ["--train.batch_size=8", "--runtime.gradient_checkpointing=1"]), 8)
    L, tokens = base.model.n_layers, 8 * base.train.seq_len
    assert ckpt.activations_per_layer_checkpointed == 4 * base.model.dim * tokens
    assert ckpt.activations < one.activations / 5
    # bf16 autocast saves less than fp32
    fp32 = estimate_memory(load_config(QWEN_B200, ["--train.batch_size=8", "--runtime.precision=fp32"]), 8)
    assert fp32.activations > one.activations
    assert L * one.activations_per_layer < one.activations  # plus the backward's gradients and embeddings


def test_chunked_loss_path_is_far_smaller_than_full_logits():
    cfg = load_config(QWEN_B200, ["--train.batch_size=8", "--model.loss_chunk=2048"])
    chunked = estimate_memory(cfg, 8)
    full = estimate_memory(load_config(QWEN_B200, ["--train.batch_size=8", "--model.loss_chunk=0"]), 8)
    V, D, N = cfg.model.vocab_size, cfg.model.dim, 8 * cfg.train.seq_len
    gradients = 4 * V * D + 4 * N * D  # the head's weight gradient and the hidden states' gradient: both paths
    assert chunked.loss - gradients == 2 * 4 * 2048 * V
    assert (full.loss - gradients) >= 8 * (chunked.loss - gradients)


def test_the_seed_shape_of_the_b200_preset_does_not_fit_and_the_advice_fixes_it():
    """The B200 MFU guide's phase 1 (64 x 2048 tokens per micro-batch, no checkpointing) cannot fit a B200:
    the shipped preset uses the advice, and the advice fits."""
    seed_shape = load_config(QWEN_B200, ["--train.batch_size=64", "--train.accumulate_grad_batches=4"])
    v = verdict(seed_shape, 8, "B200-192GB")
    assert not v["fits"] and v["total"] > GPU_MIB["B200-192GB"] * 2**20
    assert v["fix"].startswith("--train.batch_size=16 --train.accumulate_grad_batches=16")
    shipped = load_config(QWEN_B200)
    assert verdict(shipped, 8, "B200-192GB")["fits"]
    t = shipped.train
    assert t.batch_size * t.accumulate_grad_batches == 64 * 4  # the guide's global batch is kept


@pytest.mark.parametrize("config, gpu, world", [
    ("full_gpt2_1.36b_2xa6000.yaml", "A6000-48GB", 2), ("full_llama2_1.36b_2xa6000.yaml", "A6000-48GB", 2),
    ("full_llama3_1.5b_optimal_2xa6000.yaml", "A6000-48GB", 2),
    ("full_llama3_2.2b_chinchilla_2xa6000.yaml", "A6000-48GB", 2),
    ("full_qwen3_1.8b_optimal_2xa6000.yaml", "A6000-48GB", 2),
    ("full_qwen3_1.8b_b200_optimal.yaml", "B200-192GB", 8), ("full_qwen3_1.8b_b200_50h.yaml", "B200-192GB", 8),
    ("full_qwen3_1.8b_b200_50h_smoke.yaml", "B200-192GB", 8),
    ("m7c_125m_24g.yaml", "4090-24GB", 1), ("m7c_125m_40g.yaml", "A100-40GB", 1), ("m7c_125m_80g.yaml", "A100-80GB", 1),
    ("m7c_125m_2xa100_production.yaml", "A100-80GB", 2),
])
def test_every_preset_fits_its_named_hardware(config, gpu, world):
    v = verdict(load_config(REPO / "configs" / config), world, gpu)
    assert v["fits"], (config, v["total"] / 1e9, v.get("fix"))


def test_advice_order_prefers_the_free_knobs():
    cfg = load_config(QWEN_B200, ["--train.batch_size=64", "--model.loss_chunk=0"])
    assert fit_advice(cfg, 8, 400e9).startswith("--model.loss_chunk=")
    # a 4096-token micro-batch is not split further: checkpointing next, FSDP2 when that is not enough
    small = load_config(QWEN_B200, ["--train.batch_size=2", "--runtime.zero1=false"])
    assert fit_advice(small, 8, 40 * 2**30).startswith("--runtime.gradient_checkpointing=1")
    assert fit_advice(load_config(QWEN_B200, ["--train.batch_size=2"]), 8, 20 * 2**30).startswith("--use_fsdp=true")
    assert fit_advice(load_config(QWEN_B200, ["--train.batch_size=2"]), 8, 5 * 2**30) is None  # nothing fits


def test_plan_cli_prints_memory_and_rejects_unknown_gpus(capsys):
    assert plan_main([str(QWEN_B200), "--gpus", "8", "--gpu", "b200"]) == 0
    out = capsys.readouterr().out
    assert "memory per rank on B200-192GB" in out and "verdict           fits" in out
    assert plan_main([str(QWEN_B200), "--gpus", "8", "--gpu", "H100", "--train.batch_size=64",
                      "--train.accumulate_grad_batches=4", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert memory["gpu"] == "H100-80GB" and memory["fits"] is False and "fix" in memory
    assert plan_main([str(QWEN_B200), "--gpu", "TPUv9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown GPU" in err[0]
    assert gpu_name("a100-40") == "A100-40GB" and gpu_name("4090") == "4090-24GB"


def test_preflight_fails_a_config_that_does_not_fit_the_gpu(tmp_path):
    cfg = load_config(QWEN_B200, ["--train.batch_size=64", "--train.accumulate_grad_batches=4",
                                  f"--train.out_dir={tmp_path / 'out'}", "--data.source=synthetic"])
    res = run_preflight(cfg, gpus=8, cuda=True, gpu_bytes=GPU_MIB["B200-192GB"] * 2**20, checksums=False)
    (item,) = res.find("gpu memory")
    assert item.status == FAIL and "does not fit" in item.detail and "--train.batch_size=16" in item.detail
    ok = load_config(QWEN_B200, [f"--train.out_dir={tmp_path / 'out'}", "--data.source=synthetic"])
    (item,) = run_preflight(ok, gpus=8, cuda=True, gpu_bytes=GPU_MIB["B200-192GB"] * 2**20, checksums=False).find("gpu memory")
    assert item.status == OK


MEASURE = """
import json, sys
from pathlib import Path
import torch
from nsa.model import Transformer
from train.core.config import load_config
from train.planning.memory import estimate_memory
def kib(f):
    return next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(f + ":"))
torch.set_num_threads(1)
cfg = load_config(None, sys.argv[1:] + ["--runtime.device=cpu", "--runtime.precision=fp32"])
model = Transformer(cfg.model)
for p in model.parameters():
    p.grad = torch.zeros_like(p)
idx = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len))
base = kib("VmRSS")
model(idx, idx).backward()
est = estimate_memory(cfg, 1, cuda=False)
print(json.dumps({"measured": (kib("VmHWM") - base) * 1024, "estimated": est.activations + est.loss}))
"""


def test_activation_and_loss_estimate_matches_a_measured_cpu_peak():
    """A fresh process: gradients allocated, then one fp32 forward + backward; the peak RSS growth is
    what the estimate's activations + loss path describe (within 15%)."""
    args = ["--model.vocab_size=4096", "--model.dim=256", "--model.n_layers=4", "--model.n_heads=4",
            "--model.n_kv_heads=2", "--model.ffn_dim=768", "--model.max_seq_len=1024", "--train.seq_len=1024",
            "--train.batch_size=2"]
    out = subprocess.run([sys.executable, "-c", MEASURE, *args], cwd=REPO, capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["estimated"] == pytest.approx(got["measured"], rel=0.15), got


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_optimizer_state_is_what_the_built_optimizer_holds_after_a_step(optimizer):
    """The estimate's optimizer bytes against the fp32 state tensors the trainer's own optimizer keeps after one
    step (Muon: one momentum buffer for the hidden matrices, AdamW's two moments for the rest), NSA model."""
    import torch

    from nsa.model import Transformer
    from train.trainer.optim import build_optimizer

    cfg = load_config(None, ["--model.attention=nsa", "--model.dim=64", "--model.n_layers=2", "--model.n_heads=2",
                             "--model.n_kv_heads=1", "--model.head_dim=32", "--model.ffn_dim=128",
                             "--model.vocab_size=256", "--train.seq_len=64", "--nsa.l=8", "--nsa.d=4",
                             "--nsa.l_sel=8", "--nsa.n_sel=3", "--nsa.w=16", f"--train.optimizer={optimizer}"])
    model = Transformer(cfg.model)
    opt = build_optimizer(model, cfg.train, "cpu")
    idx = torch.randint(0, 256, (1, 64))
    model(idx, targets=idx).backward()
    opt.step()
    held = sum(t.numel() * t.element_size() for state in opt.state.values() for t in state.values()
               if torch.is_tensor(t) and t.dim() > 0)  # the moments / momentum, not the 0-dim step counts
    assert estimate_memory(cfg, 1, cuda=False).optimizer == held
