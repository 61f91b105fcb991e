"""Sequence-length stages (train.seq_stages, train/core/seq_stages.py): each stage trains at its own length with the
tokens per step kept, the model takes its RoPE and window (equal to a model built with them), resume across a stage
boundary is exact after .HALT and kill -9 and on another world size, and a plan that cannot work is one line before
anything is written."""
from __future__ import annotations

import json

import pytest
import torch

from nsa.config import ModelConfig, NSAConfig
from nsa.model import Transformer
from train.core.config import load_config
from train.core.errors import ConfigError
from train.trainer.runner import run_training

from .helpers import (REPO, TINY_CLI, byte_dir, cli, halt_while_step_runs, kill9_after, one_rank_then_two, read_csv,
                      read_jsonl, tiny_config)

STAGES = "--train.seq_stages=[{at: 4, seq_len: 64, rope_theta: 40000}, {at: 7, seq_len: 128, rope_scale: 2.0}]"
STAGED = ["--model.max_seq_len=128", STAGES, "--train.steps=10", "--train.log_every=1", "--train.eval_every=5"]


def test_each_stage_trains_at_its_length_with_the_tokens_per_step_kept(tmp_path):
    out = tmp_path / "run"
    assert run_training(tiny_config(out, *STAGED)) == 0  # seq 32 x 4 rows: 128 tokens a step
    rows = read_csv(out / "training.csv")
    assert [int(r["seq_len"]) for r in rows] == [32] * 4 + [64] * 3 + [128] * 3
    assert [int(r["tokens_seen"]) for r in rows] == [128 * s for s in range(1, 11)]
    stages = [r for r in read_jsonl(out / "heartbeat_rank0.jsonl") if r["kind"] == "stage"]
    assert [(r["step"], r["seq_len"], r["batch_size"], r["rope_theta"], r["rope_scale"]) for r in stages] == \
        [(4, 64, 2, 40000.0, 1.0), (7, 128, 1, 40000.0, 2.0)]
    ckpt = torch.load(out / "checkpoint_step10.pt", weights_only=False)
    assert ckpt["config"]["model"]["rope_theta"] == 10000.0  # the run's config stays as given: the stages say the rest
    assert ckpt["data"][0]["global_batch"] == 1 and ckpt["data"][0]["step"] == 10


@pytest.mark.parametrize("attention", ["dense", "nsa"])
def test_a_models_stage_equals_a_model_built_with_it(attention):
    nsa = NSAConfig(l=8, d=4, l_sel=8, n_sel=3, w=8)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=128,
                      attention=attention, nsa=nsa)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    x = torch.randint(0, 64, (2, 96))
    before = model(x)
    model.set_positions(40000.0, 2.0)
    if attention == "nsa":
        model.set_window(16)
    after = model(x)
    built = Transformer(ModelConfig(**{**cfg.__dict__, "rope_theta": 40000.0, "rope_scale": 2.0,
                                       "nsa": NSAConfig(**{**nsa.__dict__, "w": 16 if attention == "nsa" else 8})}))
    built.load_state_dict(model.state_dict())
    torch.testing.assert_close(after, built.eval()(x), rtol=0, atol=0)
    assert not torch.allclose(before, after)  # the change reaches the output
    assert cfg.rope_theta == 10000.0 and cfg.nsa.w == 8  # the config it was built from is left as it was


def test_a_staged_checkpoint_loads_with_the_rope_its_weights_trained_with(tmp_path):
    """Inference tools (recall score, evaluate, needle, demo) build a checkpoint's model from its stored config: for a
    staged run, with the RoPE and window of the stage that ran its last step (the checkpoint at step 4 = `at` is
    still the first stage's), and the forward equals the trained model's at that step."""
    from train.checkpoint.io import model_from_checkpoint

    out = tmp_path / "staged"
    assert run_training(tiny_config(out, *STAGED, "--train.save_every=1", "--train.keep_all_checkpoints=true")) == 0
    seen = {}
    for step in (4, 5, 7, 8, 10):
        model, _ = model_from_checkpoint(out / f"checkpoint_step{step}.pt")
        seen[step] = (model.cfg.rope_theta, model.cfg.rope_scale)
    assert seen == {4: (10000.0, 1.0), 5: (40000.0, 1.0), 7: (40000.0, 1.0), 8: (40000.0, 2.0), 10: (40000.0, 2.0)}
    state = torch.load(out / "checkpoint_step10.pt", weights_only=False)
    trained = Transformer(ModelConfig(**{**state["config"]["model"], "rope_theta": 40000.0, "rope_scale": 2.0}))
    trained.load_state_dict(state["model"])
    tokens = torch.randint(0, 320, (2, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(tokens), trained.eval()(tokens))


def test_halt_then_resume_across_a_stage_boundary_is_bit_for_bit(tmp_path, monkeypatch):
    full, split = tmp_path / "full", tmp_path / "split"
    assert run_training(tiny_config(full, *STAGED)) == 0
    original = halt_while_step_runs(monkeypatch, split, step=6)  # in the second stage
    assert run_training(tiny_config(split, *STAGED)) == 0
    monkeypatch.setattr("train.data.synthetic.SyntheticStream.next_batch", original)
    (split / ".HALT").unlink()
    assert run_training(tiny_config(split, *STAGED)) == 0  # steps 7-10: over the boundary at 7
    keys = ("step", "loss", "grad_norm", "seq_len")
    assert [tuple(r[k] for k in keys) for r in read_csv(split / "training.csv")] == \
        [tuple(r[k] for k in keys) for r in read_csv(full / "training.csv")]
    a, b = (torch.load(d / "checkpoint_step10.pt", weights_only=True) for d in (full, split))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_kill9_resumes_across_a_stage_boundary_bit_for_bit(tmp_path):
    args = [*TINY_CLI, "--train.batch_size=4", "--model.max_seq_len=64", "--train.steps=60", "--train.save_every=10",
            "--train.warmup_steps=2",
            "--train.seq_stages=[{at: 25, seq_len: 32}, {at: 40, seq_len: 64, rope_theta: 20000}]"]
    reference, out = tmp_path / "reference", tmp_path / "killed"
    assert 20 <= kill9_after(args, out, "checkpoint_step20.pt") < 60
    for target in (reference, out):
        done = cli(*args, f"--train.out_dir={target}")
        assert done.returncode == 0, done.stderr[-2000:]
    keys = ("step", "loss", "grad_norm", "seq_len")
    assert [tuple(r[k] for k in keys) for r in read_csv(out / "training.csv")] == \
        [tuple(r[k] for k in keys) for r in read_csv(reference / "training.csv")]
    assert sorted({int(r["seq_len"]) for r in read_csv(out / "training.csv")}) == [16, 32, 64]


def test_a_bin_run_resumed_on_two_ranks_across_a_stage_trains_like_one_rank(tmp_path, corpus_path):
    """Global batch 8 x 16 tokens: one rank for 16 steps, against one rank for steps 1-6 resumed on two gloo ranks
    over the stage at 8 (seq 32, 4 rows): the same global batches, losses within the 1-vs-2-rank tolerance."""
    data = byte_dir(tmp_path / "kjv", corpus_path.read_text(encoding="utf-8")[:200_000])
    args = ["--model.vocab_size=320", "--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--model.ffn_dim=64",
            "--model.max_seq_len=32", "--train.seq_len=16", "--train.steps=16", "--train.log_every=1",
            "--train.warmup_steps=2", "--train.eval_every=0", "--runtime.device=cpu", "--runtime.threads=1",
            "--data.tokenizer=byte", f"--data.source=bin:{data}", "--train.seq_stages=[{at: 8, seq_len: 32}]"]
    x, y = one_rank_then_two(args, tmp_path / "one", tmp_path / "moved", stop_after=6)
    assert [r["seq_len"] for r in x] == [r["seq_len"] for r in y] == ["16"] * 8 + ["32"] * 8
    assert max(abs(float(p["loss"]) - float(q["loss"])) for p, q in zip(x, y)) < 1e-5
    assert [r["tokens_seen"] for r in x] == [r["tokens_seen"] for r in y]


def test_a_bin_mixture_resumed_on_two_ranks_across_a_stage_trains_like_one_rank(tmp_path, corpus_path):
    """A mixture of two bin: sources with a length stage at 8: one rank for 16 steps, against one rank for steps 1-6
    resumed on two gloo ranks over the stage. The same global batches (losses within the 1-vs-2-rank tolerance, the
    same tokens), and the realised shares are logged in both."""
    text = corpus_path.read_text(encoding="utf-8")
    a, b = byte_dir(tmp_path / "a", text[:100_000]), byte_dir(tmp_path / "b", text[100_000:200_000])
    args = ["--model.vocab_size=320", "--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--model.ffn_dim=64",
            "--model.max_seq_len=32", "--train.seq_len=16", "--train.steps=16", "--train.log_every=1",
            "--train.warmup_steps=2", "--train.eval_every=0", "--runtime.device=cpu", "--runtime.threads=1",
            "--data.tokenizer=byte", "--train.seq_stages=[{at: 8, seq_len: 32}]",
            f"--data.mixture=[{{name: a, source: 'bin:{a}', weight: 3}}, {{name: b, source: 'bin:{b}', weight: 1}}]"]
    x, y = one_rank_then_two(args, tmp_path / "one", tmp_path / "moved", stop_after=6)
    assert [r["seq_len"] for r in x] == [r["seq_len"] for r in y] == ["16"] * 8 + ["32"] * 8
    assert max(abs(float(p["loss"]) - float(q["loss"])) for p, q in zip(x, y)) < 2e-5  # one CSV rounding unit each
    assert [r["tokens_seen"] for r in x] == [r["tokens_seen"] for r in y]
    assert 0 < float(x[-1]["share_a"]) < 1 and x[-1]["share_a"] == y[-1]["share_a"]


@pytest.mark.parametrize("stages, message", [
    ("[{at: 12, seq_len: 64}]", "at=12 must be a step after the stage before's (0) and before train.steps=10"),
    ("[{at: 5, seq_len: 64}, {at: 5, seq_len: 128}]", "train.seq_stages[1]: at=5 must be a step after"),
    ("[{at: 5, seq_len: 48}]", "tokens per step cannot be kept"),
    ("[{at: 5, seq_len: 64, window: 8}]", "unknown key 'window'"),
    ("[{at: 5, seq_len: 64, nsa_w: 16}]", "nsa_w needs model.attention: nsa"),
    ("LEARNED", "seq_len 128 is above the learned positions (model.max_seq_len=64)"),
    ("STREAM", "train.seq_stages need bin: or synthetic sources, alone or in a mixture"),
    ("YARN", "rope_scale with model.rope_scaling=yarn"),
])
def test_a_stage_plan_that_cannot_work_is_one_line(tmp_path, stages, message):
    extra = []
    if stages == "LEARNED":
        stages, extra = "[{at: 5, seq_len: 128}]", ["--model.pos_emb=learned"]
    if stages == "YARN":
        stages, extra = "[{at: 5, seq_len: 64, rope_scale: 2.0}]", ["--model.rope_scaling=yarn"]
    if stages == "STREAM":
        stages, extra = "[{at: 5, seq_len: 64}]", ["--data.source=text:/nowhere/*.txt"]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")) as caught:
        tiny_config(tmp_path / "never", "--train.steps=10", f"--train.seq_stages={stages}", *extra)
    assert "\n" not in str(caught.value)


def test_the_trainer_refuses_a_bad_plan_with_exit_2_and_writes_nothing(tmp_path):
    out = tmp_path / "never"
    done = cli(*TINY_CLI, "--train.steps=10", "--train.seq_stages=[{at: 10, seq_len: 32}]", f"--train.out_dir={out}")
    assert done.returncode == 2 and "train.seq_stages[0]: at=10" in done.stderr
    assert not out.exists()


def test_preflight_and_the_plan_give_each_stage_its_line(tmp_path):
    """Memory per stage against the GPU: a stage whose micro-batch outgrows it fails by its own line (the first
    stage's line passes); train.plan prints each stage's steps, split and tokens."""
    from train.core.seq_stages import seq_stages, stage_config
    from train.planning.memory import estimate_memory
    from train.planning.plan import make_plan, render
    from train.workflows.preflight import FAIL, run_preflight

    cfg = tiny_config(tmp_path / "run", "--model.max_seq_len=4096", "--train.steps=10",
                      "--train.seq_stages=[{at: 5, seq_len: 4096, batch_size: 64}]")
    first, second = (estimate_memory(stage_config(cfg, s), 1).total for s in seq_stages(cfg))
    assert second > first * 1.2
    result = run_preflight(cfg, gpus=1, cuda=True, gpu_bytes=int((first + second) / 2), env={},
                           free_bytes=lambda p: 1 << 50)
    lines = {c.name: c for c in result.checks if c.name.startswith("gpu memory")}
    assert set(lines) == {"gpu memory (from step 0, seq_len 32)", "gpu memory (from step 5, seq_len 4096)"}
    assert lines["gpu memory (from step 0, seq_len 32)"].status != FAIL
    assert lines["gpu memory (from step 5, seq_len 4096)"].status == FAIL and not result.ok
    text = render(make_plan(cfg))
    assert "steps 0-5: seq_len 32, 4 x 1 rows per rank, 640 tokens" in text
    assert "steps 5-10: seq_len 4096, 64 x 1 rows per rank, 1,310,720 tokens" in text and "tokens per step changed" in text


def test_a_finished_run_extends_to_a_longer_context_with_its_lineage(tmp_path):
    """train.extend_from: the checkpoint's weights at a longer seq_len with another RoPE base and NSA window (fields
    init_from refuses), a fresh optimizer; the lineage in metrics.json and every checkpoint, kept on resume."""
    from train.trainer.build_run import Run

    nsa = ["--model.attention=nsa", "--nsa.l=8", "--nsa.d=4", "--nsa.l_sel=8", "--nsa.n_sel=3", "--nsa.w=8"]
    short, long_ = tmp_path / "short", tmp_path / "long"
    assert run_training(tiny_config(short, *nsa, "--train.steps=4")) == 0
    extend = [*nsa, f"--train.extend_from={short}", "--train.seq_len=64", "--model.max_seq_len=64",
              "--model.rope_theta=40000", "--nsa.w=16", "--train.steps=3", "--train.save_every=2"]
    with pytest.raises(ConfigError, match=r"train.init_from=.* does not match the run's model: rope_theta"):
        Run(tiny_config(tmp_path / "strict", *extend[:-7], f"--train.init_from={short}", *extend[-6:]))
    run = Run(tiny_config(long_, *extend))
    try:
        source = torch.load(short / "checkpoint_step4.pt", weights_only=True)["model"]
        assert all(torch.equal(run.raw_model.state_dict()[k], source[k]) for k in source)  # the weights, exactly
        assert run.raw_model.cfg.nsa.w == 16 and run.raw_model.cfg.rope_theta == 40000.0
    finally:
        run.close()
    assert run_training(tiny_config(long_, *extend)) == 0
    lineage = json.loads((long_ / "metrics.json").read_text())["extended_from"]
    assert lineage["checkpoint"] == str((short / "checkpoint_step4.pt").resolve()) and lineage["step"] == 4
    assert (lineage["seq_len"], lineage["rope_theta"], lineage["nsa_w"]) == (32, 10000.0, 8)
    assert torch.load(long_ / "checkpoint_step3.pt", weights_only=False)["extended_from"] == lineage
    (long_ / "checkpoint_step3.pt").unlink()  # resume from step 2: the lineage stays the first launch's
    (long_ / "latest.pt").unlink(missing_ok=True)
    assert run_training(tiny_config(long_, *extend)) == 0
    assert json.loads((long_ / "metrics.json").read_text())["extended_from"] == lineage


def test_the_m7c_long_context_config_plans_every_stage_within_one_gpu():
    """configs/m7c_125m_long.yaml: 2k then 8k / 16k / 32k with the tokens per step kept and the RoPE base raised; the
    planner's memory per rank is the same at every stage (the micro-batch's tokens never grow)."""
    from train.core.seq_stages import seq_stages, stage_config
    from train.planning.memory import estimate_memory

    cfg = load_config(REPO / "configs" / "m7c_125m_long.yaml", [])
    stages = seq_stages(cfg)
    assert [(s.at, s.seq_len, s.batch_size) for s in stages] == [(0, 2048, 16), (40000, 8192, 4), (45000, 16384, 2),
                                                                 (48000, 32768, 1)]
    assert {s.rows_per_rank() * s.seq_len for s in stages} == {32768} and stages[-1].rope_theta == 2e6
    memory = [estimate_memory(stage_config(cfg, s), 8).total for s in stages]
    assert max(memory) < 80e9 and max(memory) / min(memory) < 1.1
