"""The NSA layer's launch budget (issue 19): a constant number of ops per layer, whatever T.

Counted on the meta device with nsa.launch_count (views, _unsafe_view, detach, alias, empty* and promote_types
not counted; a custom op counts once), one layer at M7C-125M shapes, batch 1, forward + backward. The count inside
the selection ops on the Triton path (their index ops and Triton launches) is tests/nsa/test_launch_count_triton.py's.
"""
from __future__ import annotations

import pytest
import torch

from nsa.config import ModelConfig, NSAConfig
from nsa.launch_count import LaunchCounter, attention_layer_launches

M7C = dict(dim=768, n_heads=12, n_kv_heads=2, head_dim=64)  # configs/m7c_125m_*.yaml
NSA_M7C = NSAConfig(l=32, d=16, l_sel=64, n_sel=16, w=512)
# 75 (79 with packed documents) at 2026-11-29 (eighth session; 78 / 82 before the custom ops stopped zero-filling
# their log-sum-exps' unused gradients; 148 at the sixth's end with _unsafe_view / promote_types counted): RoPE's
# ~30 ops forward + backward became nsa::rotary, one op per direction and call; the gated sum's ~20 (products, sums,
# the gate slices' zero-filled gradients, the transpose copy, three contiguous copies for the branch backwards)
# nsa::gated_combine; the compressed keys' RoPE rows a strided view. This is the torch path (phi in torch ops, ~32);
# issue 50's goal (<= 80 launches with the Triton kernels and the ops' insides counted) is
# tests/nsa/test_launch_count_triton.py's.
BUDGET = 80
SEQ = (2048, 8192, 32768, 65536)


@pytest.fixture(scope="module")
def counts():
    nsa = ModelConfig(**M7C, attention="nsa", nsa=NSA_M7C)
    dense = ModelConfig(**M7C)
    return {T: (attention_layer_launches(nsa, T), attention_layer_launches(dense, T)) for T in SEQ}


def test_nsa_layer_launches_stay_within_budget_at_every_length(counts):
    for T, (nsa, dense) in counts.items():
        assert nsa.total <= BUDGET, (T, nsa.total, nsa.by_op.most_common(8))
        assert nsa.total < 2 * dense.total, (T, nsa.total, dense.total)
    assert counts[65536][0].total <= 1.25 * counts[2048][0].total


def test_each_nsa_stage_is_one_custom_op(counts):
    """The stages are fused ops, each dispatched exactly once per forward (and its backward once)."""
    ops = {name: n for name, n in counts[65536][0].by_op.items() if name.startswith("nsa.")}
    assert ops == {
        "nsa.rotary": 4,  # queries with the selection and window keys, the compressed keys; each one backward
        "nsa.gated_combine": 1, "nsa.gated_combine_backward": 1,
        "nsa.select_blocks": 1,
        "nsa.compressed_attention": 1, "nsa.compressed_attention_backward": 1,
        "nsa.selected_attention": 1, "nsa.selected_attention_backward": 1,
        "nsa.window_attention": 1, "nsa.window_attention_backward": 1,
    }


DOCUMENTS = (1, 8, 64)


def test_packed_documents_keep_the_layer_constant_in_length_and_document_count():
    """Document masking (issue 28): the same ops per layer at every length and for 1, 8 or 64 documents per
    window, within the budget (the document layout is built once per batch, outside the layers)."""
    nsa = ModelConfig(**M7C, attention="nsa", nsa=NSA_M7C)
    totals = {(T, n): attention_layer_launches(nsa, T, documents=n).total for T in (2048, 65536) for n in DOCUMENTS}
    assert len(set(totals.values())) == 1, totals
    assert next(iter(totals.values())) <= BUDGET


def test_document_count_changes_no_op_count_on_real_values():
    """On the meta device values cannot matter; on CPU they do (the torch path reads the frame), and the count
    of dispatched ops still does not move with the number of documents."""
    small = ModelConfig(dim=64, n_heads=4, n_kv_heads=2, head_dim=16, attention="nsa",
                        nsa=NSAConfig(l=16, d=8, l_sel=32, n_sel=4, w=64))
    counts = {n: attention_layer_launches(small, 1024, documents=n, device="cpu") for n in DOCUMENTS}
    assert len({c.total for c in counts.values()}) == 1, {n: c.total for n, c in counts.items()}
    ops = {name: k for name, k in counts[64].by_op.items() if name.startswith("nsa.")}
    assert ops["nsa.selected_attention"] == 1 and ops["nsa.select_blocks"] == 1


def test_the_indexer_layer_is_four_ops_over_pooled_nsa_at_every_length(counts):
    """nsa.selector=indexer, its KL term's backward counted (M7C shapes, 2k and 64k, every pool and target): the
    projection's matmul each way, the picks and the KL each way (its target inside), less pooled selection's op
    (issue 51's budget: at most 4), with and without packed documents. It was
    +102 / +228 ops (compressed / dense target, the KL term's backward not counted) before the indexer became ops."""
    import dataclasses

    for T in (2048, 65536):
        for pool, target in (("keys", "compressed"), ("scores", "dense")):
            nsa = dataclasses.replace(NSA_M7C, selector="indexer", indexer_pool=pool, indexer_target=target)
            count = attention_layer_launches(ModelConfig(**M7C, attention="nsa", nsa=nsa), T)
            assert count.total - counts[T][0].total == 4, (T, pool, target, count.by_op.most_common(10))
            packed = attention_layer_launches(ModelConfig(**M7C, attention="nsa", nsa=nsa), T, documents=8)
            pooled = attention_layer_launches(ModelConfig(**M7C, attention="nsa", nsa=NSA_M7C), T, documents=8)
            assert packed.total - pooled.total == 4, (T, pool, target, "documents", packed.by_op.most_common(10))
            assert count.by_op["nsa.indexer_kl"] == count.by_op["nsa.indexer_kl_backward"] == 1
            assert "nsa.select_blocks" not in count.by_op


def test_the_counter_records_what_makes_the_host_wait_and_nothing_else():
    """LaunchCounter.syncs (what the no-host-sync checks of the layer and the decode step read) sees a scalar read
    back, a boolean-mask index, nonzero and repeat_interleave by counts without output_size; not an integer index,
    repeat_interleave given its output size, or arithmetic."""
    x = torch.randn(8)
    with LaunchCounter() as waits:
        _ = x[x > 0], x.nonzero(), float(x.sum()), torch.repeat_interleave(torch.tensor([1, 2]))
    with LaunchCounter() as free:
        _ = x[torch.tensor([1, 2])], torch.repeat_interleave(torch.tensor([1, 2]), output_size=3), x * 2
        _ = torch.repeat_interleave(x, 2), x.sort().values
    assert waits.syncs == {"aten.index": 1, "aten.nonzero": 1, "aten._local_scalar_dense": 1,
                           "aten.repeat_interleave": 1}
    assert not free.syncs
