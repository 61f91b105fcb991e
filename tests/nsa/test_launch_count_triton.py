"""The launch count of NSA's Triton path (nsa/launch_count.py, open_custom_ops): the selection ops opened, their
index-building ATen ops and every Triton kernel they launch counted, run in Triton's interpreter on CPU tensors.

A layer with M7C's group size (G = 6: the block-centric kernels) at small sizes, forward + backward.
"""
from __future__ import annotations

import dataclasses

import pytest

from nsa.config import ModelConfig, NSAConfig
from nsa.launch_count import OPENED, TRITON, attention_layer_launches

try:
    from nsa.attention.kernels import selected_attention as ts
except ImportError as exc:
    pytest.skip(f"triton is not importable ({exc})", allow_module_level=True)
if not ts.interpreter_active():
    pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=1 before the kernels are imported)",
                allow_module_level=True)

SMALL_G6 = ModelConfig(dim=96, n_heads=6, n_kv_heads=1, head_dim=16, attention="nsa",
                       nsa=NSAConfig(l=8, d=4, l_sel=16, n_sel=4, w=32, kernel="triton"))
SEQ = (64, 128)


@pytest.fixture(scope="module")
def opened():
    return {T: attention_layer_launches(SMALL_G6, T, device="cpu", open_custom_ops=True) for T in SEQ}


def test_every_triton_kernel_of_the_selection_path_is_counted_once(opened):
    kernels = {name[len(TRITON):]: n for name, n in opened[SEQ[0]].by_op.items() if name.startswith(TRITON)}
    # selection (block scores, then each row's top-n: kernels/select_two_pass.py), then selected attention's forward
    # and backward launches for G = 6, and
    # the layout of its two inverted indexes (the forward's by-slot index, the dK/dV kernel's block-major one)
    attention = {"block_fwd_kernel": 1, "slot_merge_kernel": 1, "block_dq_kernel": 1, "slot_sum_kernel": 1,
                 "_dkv_kernel": 1, "_dkv_reduce_kernel": 1}
    assert kernels == {"_block_scores_kernel": 1, "_top_n_kernel": 1, **attention, "segment_keys_kernel": 2, "sorted_entries_kernel": 2,
                       "tile_layout_kernel": 2,
                       "rotary_kernel": 4, "phi_fwd_kernel": 1, "phi_dblock_kernel": 1, "phi_draw_kernel": 1,
                       "phi_dweight_kernel": 1, "gated_combine_fwd_kernel": 1, "gated_combine_bwd_kernel": 1,
                       "row_dot_kernel": 1}
    assert set(ts.launched_kernels(6)) == {name.removesuffix("_kernel").removeprefix("_") for name in attention}


def test_opened_ops_are_replaced_by_what_they_run_and_the_interpreters_copies_are_not_counted(opened):
    count = opened[SEQ[0]]
    assert not any(name.replace(".", "::", 1) in OPENED for name in count.by_op)  # opened, not counted as ops
    # the compressed and window branches stay one op per direction (FlexAttention on CUDA: module docstring)
    assert count.by_op["nsa.compressed_attention"] == count.by_op["nsa.window_attention_backward"] == 1
    # the interpreter moves every kernel argument through host copies: none of that is a launch on a GPU
    assert "aten.set_" not in count.by_op and "aten.copy_" not in count.by_op
    closed = attention_layer_launches(SMALL_G6, SEQ[0], device="cpu")
    assert closed.triton == 0 and closed.by_op["nsa.selected_attention"] == 1
    # the index the kernels read is built by ATen ops the closed count never sees (sorts, cumsums)
    assert count.by_op["aten.sort"] >= 1 and "aten.sort" not in closed.by_op
    assert count.total - count.triton > closed.total - len(OPENED)


def test_phi_runs_in_its_kernels_and_no_unused_gradient_is_zero_filled(opened):
    """phi for keys and values is four launches (nsa::compress_blocks): none of its torch ops remain; the custom
    ops' unused outputs (log-sum-exps, the slot index, phi's pre-activations) get no zero-filled gradients (the only
    zero fills left are the segment counts' two)."""
    count = opened[SEQ[0]].by_op
    assert not {"aten.gelu", "aten.gelu_backward", "aten.mean", "aten.unfold_backward"} & set(count)
    assert count["aten.zeros"] == 2


def test_the_backward_reuses_the_forwards_slot_index(opened):
    """Two sorts per layer forward + backward: the by-slot index (built in the forward, read again by dQ) and the
    dK/dV kernel's block-major index; building the slot index again in the backward would make three."""
    assert opened[SEQ[0]].by_op["aten.sort"] == 2


# ATen ops and Triton launches per layer forward + backward on the Triton path at this size: 72 on 2026-11-29 (78 with
# packed documents; 80 under bf16 autocast, its weight casts included), the same as at M7C's shape (273 before the backward reused the forward's slot index, the index's
# keys, counts and tile layout became a launch each, RoPE and the gated sum one op each; 109 before phi became four
# launches, the custom ops stopped zero-filling their unused outputs' gradients, each sorted entry's query and the
# backward's delta became one launch each; .to() conversions counted since). Issue 50's goal: <= 80, projections
# included.
TRITON_PATH_BUDGET = 80


def test_the_triton_path_stays_within_its_budget(opened):
    assert opened[SEQ[0]].total <= TRITON_PATH_BUDGET, opened[SEQ[0]].by_op.most_common(10)
    assert opened[SEQ[0]].by_op["triton.rotary_kernel"] == 4  # forward and backward of both rotations


def test_the_triton_path_never_waits_for_the_device(opened):
    """No op of the layer's forward + backward, inside the opened ops too, reads a value back to the host or sizes an
    output by the data (LaunchCounter.syncs): the training step can be captured as a CUDA graph."""
    assert all(not count.syncs for count in opened.values()), {T: dict(c.syncs) for T, c in opened.items()}


def test_the_triton_path_launches_the_same_kernels_at_every_length(opened):
    assert len({c.total for c in opened.values()}) == 1, {T: c.total for T, c in opened.items()}
    assert opened[SEQ[0]].by_op == opened[SEQ[1]].by_op


def test_the_torch_path_opens_nothing_triton():
    torch_path = dataclasses.replace(SMALL_G6, nsa=dataclasses.replace(SMALL_G6.nsa, kernel="torch"))
    count = attention_layer_launches(torch_path, SEQ[0], device="cpu", open_custom_ops=True)
    assert count.triton == 0 and count.by_op["nsa.compressed_attention"] == 1


def test_packed_documents_stay_within_the_budget_whatever_their_count():
    """With packed documents the index keys blocks by their first key (one launch for every entry's aligned block and
    offset; run ends by one searchsorted) and the compressed keys' RoPE reads its rows through an index: the same
    launches for 1 or 4 documents, within the budget."""
    counts = {n: attention_layer_launches(SMALL_G6, SEQ[0], documents=n, device="cpu", open_custom_ops=True)
              for n in (1, 4)}
    assert counts[1].by_op == counts[4].by_op
    assert not counts[1].syncs and not counts[4].syncs, (counts[1].syncs, counts[4].syncs)  # no host syncs either
    assert counts[1].total <= TRITON_PATH_BUDGET, counts[1].by_op.most_common(10)
    assert counts[1].by_op["triton.frame_block_keys_kernel"] == 2 and "aten.gather" not in counts[1].by_op


def test_dtype_conversions_are_counted():
    """.to() that converts is a copy kernel: counted (aten.to declares it may alias, so a view test alone would call
    it free); a .to() that changes nothing is not. (Inside an opened op's body aten.to reaches the counter whole.)"""
    import torch

    from nsa.launch_count import LaunchCounter

    x = torch.arange(6)
    count = LaunchCounter()
    for dtype in (torch.int64, torch.int32):
        count.__torch_dispatch__(torch.ops.aten.to.dtype, (torch.Tensor,), (x, dtype))
    assert count.by_op == {"aten.to": 1}


INDEXER_EXTRA = 4  # issue 51's budget: at most 4 extra launches per layer forward + backward


@pytest.mark.parametrize("pool, target, documents", [("keys", "compressed", 0), ("scores", "dense", 0),
                                                      ("keys", "compressed", 4), ("scores", "dense", 4)])
def test_the_indexer_adds_its_kernels_and_nothing_else(opened, pool, target, documents):
    """nsa.selector=indexer on the Triton path, forward + backward with its KL term: pooled NSA's launches less its
    top-k kernel, plus the projection's two matmuls, the picks (scores, block keys pooled in the launch, top-n) and
    the KL forward (its rows' target computed in the same launch) and backward: one launch each (constant in T: the
    meta count at 2k and 64k, test_launch_budget.py); the same over 4 packed documents (each query's picks, target
    and KL within its own document, in the same launches)."""
    extra = {}
    for T in SEQ[:1]:
        cfg = dataclasses.replace(SMALL_G6, nsa=dataclasses.replace(SMALL_G6.nsa, selector="indexer", indexer_pool=pool,
                                                                    indexer_target=target))
        count = attention_layer_launches(cfg, T, documents=documents, device="cpu", open_custom_ops=True)
        pooled = (attention_layer_launches(SMALL_G6, T, documents=documents, device="cpu", open_custom_ops=True)
                  if documents else opened[T])
        diff = {name: count.by_op[name] - pooled.by_op[name]
                for name in set(count.by_op) | set(pooled.by_op) if count.by_op[name] != pooled.by_op[name]}
        extra[T] = count.total - pooled.total
        assert not count.syncs, dict(count.syncs)  # the indexer's picks and KL never wait for the device either
        # pooled selection's two kernels, gone (the scores' frame variant with documents)
        pooled_selection = {f"triton._block_scores{'_frame' if documents else ''}_kernel": -1, "triton._top_n_kernel": -1}
        assert diff == {"aten.mm": 2, "triton._indexer_topk_kernel": 1, "triton._kl_fwd_kernel": 1,
                        "triton._kl_bwd_kernel": 1, **pooled_selection}, (T, diff)
    assert max(extra.values()) <= INDEXER_EXTRA, extra
