"""Muon (train.optimizer=muon, train/trainer/muon.py): the split of the parameters by name, the masked step against
torch.optim.Muon, a skipped step that changes nothing (caused for real: a loss spike from bad data), exact resume
across a real .HALT and a real kill -9, 1 rank against 2 (DDP) and ZeRO-1, the refusals, and that it trains."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nsa.model import Transformer
from train.core.config import dump_config, load_config
from train.core.versions import torch_refusal

if refusal := torch_refusal("train.optimizer=muon"):  # an older torch refuses Muon: tests/tools/test_versions.py
    pytest.skip(refusal, allow_module_level=True)

from train.trainer.muon import ROW_SPLITS, MuonAdamW, SkippableMuon  # noqa: E402
from train.trainer.optim import build_optimizer, set_lr, step_unless_nonfinite  # noqa: E402
from train.core.param_groups import muon_names  # noqa: E402
from train.trainer.runner import run_training  # noqa: E402

from .helpers import (REPO, TINY_CLI, halt_while_step_runs, kill9_after, read_csv, read_jsonl,
                      run_reference_and_resume, tiny_config)
from .test_spikes import garbage_bin, spike_args, spiked_steps  # noqa: F401 (garbage_bin: a fixture)
from .test_wsd import tree_hashes

MUON = ("--train.optimizer=muon",)


def load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def same_tree(a, b) -> bool:
    """Nested dicts / lists of tensors and plain values, bitwise."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def same_weights_and_state(a: Path, b: Path) -> bool:
    ca, cb = load(a), load(b)
    return same_tree(ca["model"], cb["model"]) and same_tree(ca["optimizer"]["state"], cb["optimizer"]["state"])


# ---- the split, by name --------------------------------------------------------------------------------------

DENSE = ["--model.attention=dense", "--model.n_layers=2", "--model.dim=32", "--model.n_heads=4", "--model.n_kv_heads=2",
         "--model.ffn_dim=48", "--model.vocab_size=64", "--model.max_seq_len=64", "--train.seq_len=16"]


def split(model) -> tuple[list[str], list[str]]:
    muon = muon_names(model)
    return muon, [n for n, _ in model.named_parameters() if n not in muon]


def test_the_split_of_a_dense_model_by_name():
    """Untied head, biases, LayerNorm, learned positions: Muon gets the attention and MLP matrices only."""
    cfg = load_config(None, [*DENSE, "--model.bias=true", "--model.norm=layernorm", "--model.pos_emb=learned",
                             "--model.mlp=gelu"])
    muon, adamw = split(Transformer(cfg.model))
    assert muon == [f"blocks.{i}.{m}.weight" for i in (0, 1) for m in ("attn.qkv", "attn.proj", "mlp.w_in", "mlp.w_out")]
    block = ["attn_norm.weight", "attn_norm.bias", "attn.qkv.bias", "attn.proj.bias", "mlp_norm.weight", "mlp_norm.bias",
             "mlp.w_in.bias", "mlp.w_out.bias"]
    assert adamw == ["tok_emb.weight", "pos_emb.weight", *(f"blocks.{i}.{n}" for i in (0, 1) for n in block),
                     "norm.weight", "norm.bias", "lm_head.weight"]
    tied = Transformer(load_config(None, [*DENSE, "--model.tie_embeddings=true"]).model)
    assert split(tied)[1] == ["tok_emb.weight", "blocks.0.attn_norm.weight", "blocks.0.mlp_norm.weight",
                              "blocks.1.attn_norm.weight", "blocks.1.mlp_norm.weight", "norm.weight"]


@pytest.mark.parametrize("aux", [[], ["--nsa.aux_decay=false", "--nsa.aux_lr_scale=3"]], ids=["plain", "aux_decay+lr"])
def test_the_split_of_an_nsa_model_keeps_gates_and_phi_on_adamw(aux):
    """NSA's q_proj / kv_proj / proj and the MLP go to Muon; the gate MLP, phi (fc_in, fc_out, pos_enc), norms, the
    (tied) embedding to AdamW, whatever nsa.aux_decay / aux_lr_scale say."""
    cfg = load_config(None, [*DENSE[1:], "--model.attention=nsa", "--model.qk_norm=true", "--model.tie_embeddings=true",
                             "--nsa.l=8", "--nsa.d=4", "--nsa.l_sel=8", "--nsa.n_sel=3", "--nsa.w=16", *aux])
    model = Transformer(cfg.model)
    muon, adamw = split(model)
    assert muon == [f"blocks.{i}.{m}.weight" for i in (0, 1)
                    for m in ("attn.q_proj", "attn.kv_proj", "attn.proj", "mlp.w_in", "mlp.w_out")]
    phi = [f"{b}.{n}" for b in ("compress_k", "compress_v") for n in ("pos_enc", "fc_in.weight", "fc_out.weight")]
    gate = ["gate_mlp.0.weight", "gate_mlp.0.bias", "gate_mlp.2.weight", "gate_mlp.2.bias"]
    block = ["attn_norm.weight", *(f"attn.{n}" for n in [*phi, *gate, "q_norm.weight", "k_norm.weight"]),
             "mlp_norm.weight"]
    assert sorted(adamw) == sorted(["tok_emb.weight", "norm.weight", *(f"blocks.{i}.{n}" for i in (0, 1) for n in block)])
    # the optimizer's groups: AdamW's (decay / no decay / lr-scaled) over the rest, then one Muon group
    opt = build_optimizer(model, load_config(None, list(MUON)).train, "cpu")
    assert isinstance(opt, MuonAdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    kinds = [(g["optimizer"], [names[id(p)] for p in g["params"]]) for g in opt.param_groups]
    assert kinds[-1] == ("muon", muon) and all(kind == "adamw" for kind, _ in kinds[:-1])
    assert sorted(n for _, group in kinds[:-1] for n in group) == sorted(adamw)
    scaled = [group for kind, group in kinds[:-1] if opt.param_groups[kinds.index((kind, group))]["lr_scale"] != 1]
    assert bool(scaled) == bool(aux) and all(".gate_mlp." in n or ".compress_" in n for g in scaled for n in g)


# ---- the masked step ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_the_masked_step_is_torchs_muon_bit_for_bit_when_not_skipped(nesterov, adjust):
    gen = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((48, 32), (16, 40))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kw = dict(lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust)
    a, b = SkippableMuon(ours, **kw), torch.optim.Muon(theirs, **kw)
    for _ in range(3):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        a.found_inf = torch.zeros(())
        a.step()
        b.step()
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))
    assert all(torch.equal(a.state[p]["momentum_buffer"], b.state[q]["momentum_buffer"]) for p, q in zip(ours, theirs))


@pytest.mark.parametrize("skippable", [False, True], ids=["no-flag", "flag-0"])
def test_a_fused_matrix_steps_like_its_projections_apart(skippable):
    """A weight stacking projections (ROW_SPLITS, e.g. dense qkv: q, k, v of unequal rows under GQA) takes, row block
    by row block, exactly the step torch's Muon gives each projection as its own matrix (orthogonalised and its lr
    adjusted by its own shape); without the split the fused step differs."""
    gen = torch.Generator().manual_seed(1)
    rows = (32, 16, 16)
    fused = torch.nn.Parameter(torch.randn(sum(rows), 24, generator=gen))
    setattr(fused, ROW_SPLITS, rows)
    apart = [torch.nn.Parameter(piece.detach().clone()) for piece in fused.split(rows)]
    plain = torch.nn.Parameter(fused.detach().clone())
    kw = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    ours, theirs, whole = SkippableMuon([fused], **kw), torch.optim.Muon(apart, **kw), torch.optim.Muon([plain], **kw)
    for _ in range(3):
        fused.grad = torch.randn(fused.shape, generator=gen)
        plain.grad = fused.grad.clone()
        for p, g in zip(apart, fused.grad.split(rows)):
            p.grad = g.clone()
        if skippable:
            ours.found_inf = torch.zeros(())
        ours.step()
        theirs.step()
        whole.step()
    assert torch.equal(fused.detach(), torch.cat([p.detach() for p in apart]))
    assert not torch.equal(fused.detach(), plain.detach())


def test_the_models_fused_projections_are_declared_for_muon():
    """Dense attention's qkv and NSA's kv_proj carry their projections' rows once the Muon optimizer is built."""
    nsa = ["--model.attention=nsa", "--nsa.l=8", "--nsa.d=4", "--nsa.l_sel=8", "--nsa.n_sel=3", "--nsa.w=16"]
    for attention, args in (("dense", DENSE), ("nsa", [*DENSE[1:], *nsa])):
        model = Transformer(load_config(None, list(args)).model)
        build_optimizer(model, load_config(None, list(MUON)).train, "cpu")
        fused = {n: getattr(p, ROW_SPLITS) for n, p in model.named_parameters() if hasattr(p, ROW_SPLITS)}
        assert fused and all(sum(r) == dict(model.named_parameters())[n].shape[0] for n, r in fused.items())
        assert all(n.endswith("attn.qkv.weight" if attention == "dense" else "attn.kv_proj.weight") for n in fused)


def snapshot(model, opt) -> tuple[dict, dict]:
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    return params, state


def test_a_skipped_step_with_nonfinite_gradients_changes_no_weight_and_no_state(tmp_path):
    """MuonAdamW through step_unless_nonfinite (the loop's call) on gradients with a NaN: weights, momentum
    buffers, AdamW moments and step counts stay bitwise; the same step with finite gradients changes them."""
    cfg = tiny_config(tmp_path / "x", *MUON)
    with torch.random.fork_rng():  # the process's RNG stays as it was
        torch.manual_seed(0)
        model = Transformer(cfg.model)
        idx = torch.randint(0, 320, (2, 16))
    opt = build_optimizer(model, cfg.train, "cpu")
    set_lr(opt, 3e-3)

    def backward(poison: bool) -> torch.Tensor:
        model(idx, idx).backward()
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        if poison:
            model.blocks[0].attn.qkv.weight.grad[0, 0] = float("nan")
            norm = torch.tensor(float("nan"))
        return (~torch.isfinite(norm)).float()

    step_unless_nonfinite(opt, backward(False))  # every state exists from here on
    opt.zero_grad()
    before = snapshot(model, opt)
    found_inf = backward(True)
    assert found_inf.item() == 1.0
    step_unless_nonfinite(opt, found_inf)
    opt.zero_grad()
    assert same_tree(snapshot(model, opt), before)
    step_unless_nonfinite(opt, backward(False))
    after = snapshot(model, opt)
    assert not same_tree(after[0]["blocks.0.attn.qkv.weight"], before[0]["blocks.0.attn.qkv.weight"])
    assert not same_tree(after[1]["blocks.0.attn.qkv.weight"], before[1]["blocks.0.attn.qkv.weight"])
    assert float(after[1]["tok_emb.weight"]["step"]) == 2.0  # AdamW's count: the skipped step not counted


def test_the_fp16_scaler_sequence_skips_an_overflow_on_the_device_through_muon():
    """The loop's fp16 order (unscale_, then GradScaler.step, which hands MuonAdamW its found_inf since the fused
    AdamW part supports it): an overflow skips both parts and halves the scale; CPU GradScaler, the same calls."""
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8)])
    model.head = torch.nn.Linear(8, 3)
    cfg = load_config(None, list(MUON)).train
    opt = build_optimizer(model, cfg, "cpu")
    assert [(g["optimizer"], len(g["params"])) for g in opt.param_groups] == [("adamw", 1), ("adamw", 2), ("muon", 1)]
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    gen = torch.Generator().manual_seed(0)

    def step(overflow: bool) -> tuple[bool, float]:
        loss = model.head(model.blocks[0](torch.randn(5, 8, generator=gen))).square().sum()
        scaler.scale(loss * (float("inf") if overflow else 1.0)).backward()
        scaler.unscale_(opt)
        before = snapshot(model, opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return not same_tree(snapshot(model, opt), before), scaler.get_scale()

    assert step(False) == (True, 1024.0)
    assert step(True) == (False, 512.0)
    assert float(opt._parts["muon"].found_inf) == 1.0  # the scaler's flag reached Muon (no host-side check)
    assert step(False) == (True, 512.0)


def test_spikes_from_bad_data_are_skipped_and_leave_weights_and_muon_state_as_they_were(garbage_bin, tmp_path):
    """A real run with spike skipping on over a data file with a region of random tokens (tests/train/test_spikes.py):
    each skipped step's checkpoint equals the one before it, Muon's momentum buffers and AdamW's moments included."""
    out = tmp_path / "run"
    assert run_training(load_config(None, spike_args(garbage_bin, out, *MUON, "--train.save_every=1",
                                                     "--train.keep_all_checkpoints=true"))) == 0
    spiked = spiked_steps(out)
    assert spiked, "no step of the random region was a spike"
    for step in spiked:
        a, b = load(out / f"checkpoint_step{step - 1}.pt"), load(out / f"checkpoint_step{step}.pt")
        assert same_tree(a["model"], b["model"]) and same_tree(a["optimizer"]["state"], b["optimizer"]["state"]), step
        assert any("momentum_buffer" in s for s in b["optimizer"]["state"].values())
    accepted = next(s for s in range(spiked[0] + 1, 80) if s not in spiked)
    a, b = load(out / f"checkpoint_step{accepted - 1}.pt"), load(out / f"checkpoint_step{accepted}.pt")
    assert not same_tree(a["optimizer"]["state"], b["optimizer"]["state"])


# ---- exact resume ----------------------------------------------------------------------------------------------

ROW_KEYS = ("step", "loss", "grad_norm", "lr")


def rows(out: Path) -> list[tuple]:
    return [tuple(r[k] for k in ROW_KEYS) for r in read_csv(out / "training.csv")]


def test_halt_then_resume_is_bit_for_bit_the_uninterrupted_run(tmp_path, monkeypatch):
    from train.data.synthetic import SyntheticStream

    args = (*MUON, "--train.steps=10", "--train.log_every=1", "--model.dropout=0.1", "--train.muon_ns_steps=4")
    full, split_ = tmp_path / "full", tmp_path / "split"
    assert run_training(tiny_config(full, *args)) == 0
    original = halt_while_step_runs(monkeypatch, split_, 4)
    assert run_training(tiny_config(split_, *args)) == 0
    monkeypatch.setattr(SyntheticStream, "next_batch", original)
    assert [int(r["step"]) for r in read_csv(split_ / "training.csv")] == [1, 2, 3, 4]
    (split_ / ".HALT").unlink()
    assert run_training(tiny_config(split_, *args)) == 0
    assert rows(split_) == rows(full)
    assert same_weights_and_state(full / "checkpoint_step10.pt", split_ / "checkpoint_step10.pt")


def test_kill9_mid_run_resumes_bit_for_bit(tmp_path):
    args = [*TINY_CLI, *MUON, "--train.steps=150", "--train.warmup_steps=5", "--train.save_every=10"]
    reference, out = tmp_path / "reference", tmp_path / "killed"
    assert 60 <= kill9_after(args, out, "checkpoint_step60.pt") < 150
    run_reference_and_resume(args, reference, out)
    assert rows(out) == rows(reference)
    assert same_weights_and_state(reference / "checkpoint_step150.pt", out / "checkpoint_step150.pt")


# ---- data parallelism (gloo, 2 CPU ranks) -----------------------------------------------------------------------

DIST = [*DENSE, "--model.vocab_size=128", "--train.steps=16", "--train.log_every=1", "--train.seq_len=16",
        "--train.warmup_steps=2", "--train.lr=3e-3", "--runtime.device=cpu", *MUON]


def heartbeat_losses(out: Path) -> dict[int, float]:
    """step -> loss at full precision (the heartbeat's JSON), the last record of a step logged twice."""
    return {b["step"]: b["loss"] for b in read_jsonl(out / "heartbeat_rank0.jsonl") if b["kind"] == "train"}


def torchrun(out: Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "train", *DIST,
           f"--train.out_dir={out}", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_two_ranks_and_zero1_train_like_one_rank_and_resume_across_them(tmp_path):
    """Global batch 8 as 1 x 8, and as 2 x 4 on two ranks: DDP for steps 1-8, then resumed with ZeRO-1 (each rank
    steps the whole matrices it owns); and ZeRO-1 for steps 1-8, its gathered checkpoint (every parameter's state)
    resumed on one rank. All three give the one-rank losses to the 1-vs-2-rank tolerance of
    tests/train/test_distributed.py."""
    one, ddp, zero = tmp_path / "one", tmp_path / "ddp_then_zero1", tmp_path / "zero1_then_one"
    assert run_training(load_config(None, [*DIST, f"--train.out_dir={one}", "--train.batch_size=8"])) == 0
    torchrun(ddp, "--train.batch_size=4", "--train.stop_after=8")
    torchrun(ddp, "--train.batch_size=4", "--runtime.zero1=true")
    torchrun(zero, "--train.batch_size=4", "--runtime.zero1=true", "--train.stop_after=8")
    ck = load(zero / "checkpoint_step8.pt")
    muon = [n for n, s in ck["optimizer"]["state"].items() if "momentum_buffer" in s]
    assert len(ck["optimizer"]["state"]) == len(ck["model"]) and len(muon) == 8  # 2 blocks x qkv, proj, w_in, w_out
    assert run_training(load_config(None, [*DIST, f"--train.out_dir={zero}", "--train.batch_size=8"])) == 0
    a, b, c = heartbeat_losses(one), heartbeat_losses(ddp), heartbeat_losses(zero)
    assert sorted(a) == sorted(b) == sorted(c) == list(range(1, 17))
    # 1 x 8 and 2 x 4 sum the gradient in different orders (and, on another CPU, with other vector widths): float32
    # rounding (~1e-7 of a loss of ~4.8) that Muon's Newton-Schulz iterations amplify over 16 steps; measured up to
    # 1.05e-5 with ATen's AVX2 kernels (under 1e-5 with AVX-512), so 5e-5: a rank's half-batch gradient left out of
    # the update moves the loss by ~1e-3 by step 16
    assert max(abs(a[s] - b[s]) for s in a) < 5e-5, (a, b)
    assert max(abs(a[s] - c[s]) for s in a) < 5e-5, (a, c)


# ---- refusals ------------------------------------------------------------------------------------------------------

BAD = [
    (["--train.optimizer=muon", "--runtime.fsdp=true"],
     "train.optimizer=muon does not run with runtime.fsdp (FSDP2 shards each matrix across ranks; Muon orthogonalizes "
     "whole matrices): use DDP (the default) or runtime.zero1=true"),
    (["--train.muon_momentum=0.9"], "train.muon_momentum has no effect with train.optimizer='adamw'"),
    (["--train.muon_adjust_lr=original"], "train.muon_adjust_lr has no effect with train.optimizer='adamw'"),
    (["--train.optimizer=muon", "--train.muon_adjust_lr=moonlight"],
     "train.muon_adjust_lr='moonlight'; valid: match_rms_adamw, original"),
    (["--train.optimizer=muon", "--train.muon_momentum=-0.1"], "train.muon_momentum must be in [0, 1), got -0.1"),
    (["--train.optimizer=muon", "--train.muon_ns_steps=0"], "train.muon_ns_steps must be in 1..99, got 0"),
    (["--train.optimizer=muon", "--train.muon_lr_ratio=0"], "train.muon_lr_ratio must be a positive number, got 0.0"),
    (["--train.optimizer=sgd"], "train.optimizer='sgd'; valid: adamw, muon"),
]


@pytest.mark.parametrize("args, message", BAD)
def test_bad_muon_settings_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, args, message):
    from train.__main__ import main

    out = tmp_path / "run"
    assert main([*TINY_CLI, f"--train.out_dir={out}", "--train.steps=4", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("first, then", [("adamw", "muon"), ("muon", "adamw")])
def test_resuming_with_the_other_optimizer_is_refused_in_one_line_and_moves_nothing(tmp_path, capsys, first, then):
    from train.__main__ import main

    out = tmp_path / "run"
    base = [*TINY_CLI, f"--train.out_dir={out}"]
    assert main([*base, "--train.steps=2", f"--train.optimizer={first}"]) == 0
    before = tree_hashes(out, skip=(".lock",))  # .lock records each start's holder
    capsys.readouterr()
    assert main([*base, "--train.steps=4", f"--train.optimizer={then}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: checkpoint ") and \
        f"was trained with train.optimizer={first} but this run has train.optimizer={then}" in err[0], err
    assert tree_hashes(out, skip=(".lock",)) == before


def test_eval_only_scores_a_muon_checkpoint_under_the_default_optimizer(tmp_path):
    """Evaluation never steps: a Muon run's checkpoint is scored with a config that leaves train.optimizer at adamw
    (the weights load, the moments are not needed), and the score is the one the run logged at that step."""
    out = tmp_path / "run"
    assert run_training(tiny_config(out, *MUON, "--train.steps=4", "--train.eval_every=4")) == 0
    logged = float(read_csv(out / "val.csv")[-1]["val_loss"])
    assert run_training(tiny_config(out, "--train.steps=4", "--train.eval_only=true")) == 0
    assert json.loads((out / "eval_step4.json").read_text())["val_loss"] == pytest.approx(logged, abs=1e-5)


def test_the_effective_config_keeps_the_muon_keys_only_with_muon(tmp_path):
    for extra in ([], [*MUON, "--train.muon_momentum=0.9", "--train.muon_adjust_lr=original"]):
        cfg = tiny_config(tmp_path / "x", *extra)
        path = tmp_path / "effective.yaml"
        path.write_text(dump_config(cfg))
        assert load_config(path).to_dict() == cfg.to_dict()
        assert ("muon_momentum" in path.read_text()) == bool(extra)


# ---- it trains ---------------------------------------------------------------------------------------------------

def test_muon_trains_a_tiny_model(garbage_bin, tmp_path):
    """The 16-token cycle of test_spikes' data file: the loss falls from ~5.6 (uniform over 320) to under 1 in 40
    steps, and the checkpoint holds a momentum buffer for each Muon matrix (MuonAdamW stepped them)."""
    out = tmp_path / "run"
    args = [a for a in spike_args(garbage_bin, out, *MUON, "--train.steps=40", "--train.log_every=10")
            if not a.startswith("--train.spike_skip")]  # spike skipping off; later flags win over earlier ones
    assert run_training(load_config(None, args)) == 0
    losses = [float(r["loss"]) for r in read_csv(out / "training.csv")]
    assert losses[0] > 3 and losses[-1] < 1, losses
    ck = load(out / "checkpoint_step40.pt")
    buffers = {n for n, s in ck["optimizer"]["state"].items() if set(s) == {"momentum_buffer"}}
    assert buffers == {n for n in ck["model"] if n.startswith("blocks.") and n.endswith("weight") and ck["model"][n].dim() == 2}


def test_the_benchmarks_tokens_to_reach_interpolates_between_evaluations():
    """bench/bench_muon.py's headline number: the first crossing of the target, linear between evaluations."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_muon", REPO / "bench" / "bench_muon.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    points = [{"tokens": 100, "val_loss": 4.0}, {"tokens": 200, "val_loss": 3.0}, {"tokens": 300, "val_loss": 3.2},
              {"tokens": 400, "val_loss": 2.0}]
    assert bench.tokens_to_reach(points, 3.5) == 150.0
    assert bench.tokens_to_reach(points, 3.0) == 200.0 and bench.tokens_to_reach(points, 4.5) == 100.0
    assert bench.tokens_to_reach(points, 2.5) == pytest.approx(300 + 100 * 0.7 / 1.2)  # after the rise at 300
    assert bench.tokens_to_reach(points, 1.0) is None
