"""Knocking an NSA branch out of a trained model (nsa.gate_health.knock_out, the recall probe's --knockout): the
branch's gate becomes exactly 0 and the other gates stay as learned, so the knocked-out branch's keys and values
change nothing (perturbation), the output is the learned gates' mix without that branch, and the layer is
restored afterwards, even when the block raises."""
from __future__ import annotations

import pytest
import torch

from nsa.gate_health import knock_out
from tests.nsa._nsa_helpers import DEVICE, HEAD_DIM, KV_HEADS, make_input, make_layer, rope_for

BRANCH_SLOT = {"cmp": 0, "sel": 1, "win": 2}  # kv_proj's rows: (cmp k, cmp v, sel k, sel v, win k, win v)


def _perturb_branch_kv(layer, branch: str) -> None:
    rows = 2 * KV_HEADS * HEAD_DIM
    start = BRANCH_SLOT[branch] * rows
    with torch.no_grad():
        layer.kv_proj.weight[start:start + rows] += torch.randn_like(layer.kv_proj.weight[start:start + rows])


@pytest.mark.parametrize("branch", ["cmp", "sel"])
def test_knocked_out_branch_changes_nothing_and_others_still_do(branch):
    layer = make_layer(seed=3, nsa_overrides={"gate_init": "equal"})
    T = 64
    x, rope = make_input(2, T, seed=4), rope_for(T)
    with torch.no_grad():
        with knock_out(layer, (branch,)):
            y = layer(x, rope)
        y_full = layer(x, rope)
        assert not torch.allclose(y, y_full)  # the branch contributed before it was knocked out
        _perturb_branch_kv(layer, branch)
        with knock_out(layer, (branch,)):
            assert torch.equal(layer(x, rope), y)  # ... and its keys and values no longer matter
        other = "sel" if branch == "cmp" else "cmp"
        _perturb_branch_kv(layer, other)
        with knock_out(layer, (branch,)):
            assert not torch.allclose(layer(x, rope), y)  # the other sparse branch still counts


def test_gates_are_the_learned_ones_times_the_mask():
    layer = make_layer(seed=5, nsa_overrides={"gate_init": "equal"})
    x = make_input(1, 16, seed=6)
    with torch.no_grad():
        learned = layer.gates(x)
        with knock_out(layer, ("sel",)) as changed:
            masked = layer.gates(x)
    assert changed == 1
    assert torch.equal(masked[..., 1], torch.zeros_like(masked[..., 1]))
    assert torch.equal(masked[..., [0, 2]], learned[..., [0, 2]])


def test_restored_after_the_block_even_on_error():
    layer = make_layer(seed=7)
    with pytest.raises(RuntimeError):
        with knock_out(layer, ("cmp", "sel")):
            assert layer.knocked_out == {"cmp", "sel"}
            raise RuntimeError("probe failed")
    assert layer.knocked_out == frozenset()


def test_refusals():
    layer = make_layer(seed=8)
    with pytest.raises(ValueError, match="unknown NSA branch"):
        with knock_out(layer, ("selected",)):
            pass
    window_only = make_layer(seed=8, nsa_overrides={"gates": "window"}).to(DEVICE)
    with pytest.raises(ValueError, match="no NSA layer with learned gates"):
        with knock_out(window_only, ("sel",)):
            pass


def test_selected_blocks_changes_the_picks_count_and_restores_the_layer():
    """nsa.gate_health.selected_blocks (the recall probe's --n_sel): inside, every query selects K blocks (its
    forced ones plus K - 3 by the trained scores: the trained picks among them); outside, the trained count again."""
    from nsa.gate_health import selected_blocks

    layer = make_layer(seed=9)
    trained = layer.cfg.n_sel
    T = 64
    x, rope = make_input(1, T, seed=10), rope_for(T)
    with torch.no_grad():
        _, idx = layer(x, rope, return_indices=True)  # [B, H_kv, T, n]
        with selected_blocks(layer, trained + 2) as changed:
            _, more = layer(x, rope, return_indices=True)
        assert changed == 1 and layer.cfg.n_sel == trained
        assert more.shape[-1] == trained + 2
        for t in range(T):  # every block picked with n is still picked with n + 2 (the same ranking)
            for h in range(idx.shape[1]):
                before = set(idx[0, h, t].tolist()) - {-1}
                assert before <= set(more[0, h, t].tolist()), (t, h)
        _, again = layer(x, rope, return_indices=True)
    assert torch.equal(again, idx)
    with pytest.raises(ValueError, match="n_sel=2 must be >= 3"):
        with selected_blocks(layer, 2):
            pass
    assert layer.cfg.n_sel == trained
