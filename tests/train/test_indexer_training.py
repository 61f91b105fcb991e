"""nsa.selector=indexer through the trainer: the indexer's KL is logged, pooled scores pick during
nsa.indexer_warmup_steps and the indexer after, and a run killed with SIGKILL after the warm-up boundary resumes to
the uninterrupted run's losses and weights."""
from __future__ import annotations

import torch

from .helpers import TINY_CLI, cli, kill9_after, read_csv, read_jsonl, run_reference_and_resume

INDEXER = ["--model.attention=nsa", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.dim=32",
           "--model.max_seq_len=64", "--train.seq_len=64", "--nsa.l=8", "--nsa.d=4", "--nsa.l_sel=8", "--nsa.n_sel=4",
           "--nsa.w=8", "--nsa.selector=indexer", "--nsa.indexer_heads=2", "--nsa.indexer_dim=8",
           "--data.source=synthetic", "--train.warmup_steps=2", "--train.eval_every=0"]


def test_warm_up_then_indexer_resumes_bit_for_bit_after_kill9(tmp_path):
    args = [*TINY_CLI, *INDEXER, "--nsa.indexer_warmup_steps=30", "--train.steps=60", "--train.save_every=10",
            "--train.keep_all_checkpoints=true"]
    reference, out = tmp_path / "reference", tmp_path / "killed"
    assert 40 <= kill9_after(args, out, "checkpoint_step40.pt") < 60  # killed after the boundary (step 30)
    run_reference_and_resume(args, reference, out)
    keys = ("step", "loss", "grad_norm")
    assert [tuple(r[k] for k in keys) for r in read_csv(out / "training.csv")] == \
        [tuple(r[k] for k in keys) for r in read_csv(reference / "training.csv")]
    beats = [b for b in read_jsonl(reference / "heartbeat_rank0.jsonl") if b["kind"] == "train"]
    resumed = {b["step"]: b["indexer_kl"] for b in read_jsonl(out / "heartbeat_rank0.jsonl") if b["kind"] == "train"}
    assert len(beats) == 60 and all(b["indexer_kl"] > 0 for b in beats)  # logged at every interval
    assert all(resumed[b["step"]] == b["indexer_kl"] for b in beats if b["step"] > 40)
    a = torch.load(reference / "checkpoint_step60.pt", weights_only=True)["model"]
    b = torch.load(out / "checkpoint_step60.pt", weights_only=True)["model"]
    assert a.keys() == b.keys() and any(".indexer." in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    first = torch.load(reference / "checkpoint_step10.pt", weights_only=True)["model"]
    assert all(not torch.equal(first[k], a[k]) for k in a if ".indexer." in k)  # the indexer learns


def test_distance_cap_from_step_trains_uncapped_until_then(tmp_path):
    """nsa.sel_distance_cap_from_step: the steps before it are the uncapped run's (losses bit for bit), the steps
    from it on are not; a run killed with SIGKILL after the switch resumes to the uninterrupted run's losses."""
    base = [*TINY_CLI, *INDEXER, "--nsa.gate_init=equal", "--train.steps=30", "--train.save_every=10",
            "--train.keep_all_checkpoints=true"]  # equal gates: the selected branch weighs in the loss
    capped = [*base, "--nsa.sel_distance_cap=12", "--nsa.sel_distance_cap_from_step=15"]
    plain, reference, out = tmp_path / "plain", tmp_path / "reference", tmp_path / "killed"
    assert cli(*base, f"--train.out_dir={plain}").returncode == 0
    assert 20 <= kill9_after(capped, out, "checkpoint_step20.pt") < 30  # killed after the switch (step 15)
    run_reference_and_resume(capped, reference, out)
    losses = {name: [(int(r["step"]), r["loss"]) for r in read_csv(d / "training.csv")]
              for name, d in (("plain", plain), ("capped", reference), ("resumed", out))}
    assert losses["resumed"] == losses["capped"]
    before = [row for row in losses["capped"] if row[0] <= 15]
    assert before and before == [row for row in losses["plain"] if row[0] <= 15]
    assert [row for row in losses["capped"] if row[0] > 15] != [row for row in losses["plain"] if row[0] > 15]


def _to_three_projections(path):
    """Rewrite a checkpoint as one written before the indexer had one projection: each layer's `projection` weight
    and optimizer state split back into q_proj, w_proj and k_proj (in the optimizer's group order)."""
    ckpt = torch.load(path, weights_only=False)
    keys = [k for k in ckpt["model"] if k.endswith("indexer.projection.weight")]
    assert keys
    for key in keys:
        prefix = key[: -len("projection.weight")]
        weight = ckpt["model"].pop(key)
        sizes = (32, 4, 8)  # INDEXER: H_kv = 2, h = 2, e = 8: q 32 rows, w 4, k 8
        assert sum(sizes) == weight.shape[0], weight.shape
        names = [prefix + n for n in ("q_proj.weight", "w_proj.weight", "k_proj.weight")]
        ckpt["model"].update(zip(names, weight.split(sizes)))
        state = ckpt["optimizer"]["state"].pop(key)
        for i, name in enumerate(names):
            ckpt["optimizer"]["state"][name] = {k: v.split(sizes)[i] if torch.is_tensor(v) and v.dim() else v
                                                for k, v in state.items()}
        for group in ckpt["optimizer"]["param_groups"]:
            if key in group["params"]:
                at = group["params"].index(key)
                group["params"][at:at + 1] = names
    torch.save(ckpt, path)


def test_a_checkpoint_from_before_the_one_projection_resumes(tmp_path):
    """A run whose checkpoint holds the indexer's three former projections (weights and optimizer moments) resumes
    into the one projection: the same losses as the uninterrupted run."""
    args = [*TINY_CLI, *INDEXER, "--train.steps=20", "--train.save_every=10"]
    reference, out = tmp_path / "reference", tmp_path / "old"
    assert cli(*args, f"--train.out_dir={reference}").returncode == 0
    assert cli(*args, "--train.stop_after=10", f"--train.out_dir={out}").returncode == 0
    for path in {p.resolve() for p in out.glob("*.pt")}:  # latest.pt may link to the step's file
        _to_three_projections(path)
    done = cli(*args, f"--train.out_dir={out}")
    assert done.returncode == 0, done.stderr[-2000:]
    keys = ("step", "loss", "grad_norm")
    assert [tuple(r[k] for k in keys) for r in read_csv(out / "training.csv")] == \
        [tuple(r[k] for k in keys) for r in read_csv(reference / "training.csv")]
