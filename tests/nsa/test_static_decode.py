"""Decoding over static caches (nsa/static_decode.py, nsa/attention/static_cache.py): every step's logits equal a
full forward's at that position (float64), for NSA and dense models, across compression, block, window and
pick-count boundaries; refusals in one line. The CUDA graph replay itself runs on a GPU (bench/gpu_nsa_speed.py's
decode section compares it with the eager step before timing)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from nsa.config import ModelConfig, NSAConfig
from nsa.gate_health import distance_capped, knock_out
from nsa.model import Transformer
from nsa.static_decode import StaticDecodeError, StaticDecoder, static_decode_problem
from tests.nsa._nsa_helpers import distinct_ids

# l = 8, d = 4, l' = 8, n = 4, w = 8: a step every 4 positions ends a compressed block, every 8 a selection block,
# the window ring wraps every 8, and from position 32 on more blocks exist than picks
GEOMETRY = dict(l=8, d=4, l_sel=8, n_sel=4, w=8)


def _model(attention: str = "nsa", nsa: dict | None = None, **overrides) -> Transformer:
    fields = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64, max_seq_len=96,
                  attention=attention, nsa=NSAConfig(**{**GEOMETRY, "gate_init": "equal", **(nsa or {})}))
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**fields, **overrides})).double().eval()
    with torch.no_grad():  # larger query/key weights than the init: sharper attention, picks that differ by query
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "kv_proj.weight", "qkv.weight")):
                p.mul_(6)
    return model


def _decode(model, ids: torch.Tensor, prompt: int, max_len: int) -> torch.Tensor:
    """Prefill ids[:, :prompt] into a StaticDecoder (chunks of 13), then feed ids[:, prompt:] a step at a time
    -> logits [B, T, V] of every position from prompt - 1 on."""
    return _decode_with(StaticDecoder(model, ids.shape[0], max_len, graphs=False), ids, prompt, chunk=13)


@pytest.mark.parametrize("prompt", [1, 5, 21, 40])  # before the first compressed token, mid-block, past n blocks
@pytest.mark.parametrize("variant", ["plain", "qk_norm_bias"])
def test_nsa_static_steps_equal_a_full_forward(prompt, variant):
    model = _model(**(dict(qk_norm=True, bias=True) if variant == "qk_norm_bias" else {}))
    ids = torch.randint(0, 64, (2, 80), generator=torch.Generator().manual_seed(prompt))  # two different rows
    with torch.no_grad():
        full = model(ids)  # [B, T, V]
        steps = _decode(model, ids, prompt, max_len=90)  # caches larger than the sequence: unused slots masked
    torch.testing.assert_close(steps, full[:, prompt - 1:], rtol=0, atol=1e-10)


@pytest.mark.parametrize("gates", ["knocked_out", "forced"])
def test_static_steps_take_the_layers_gates_as_a_full_forward_does(gates):
    """The static step runs q_proj, kv_proj and the gate MLP's first layer as one matmul (fused_input_projection)
    and gates from its output (gates_from): a branch knocked out (nsa.gate_health.knock_out) or gates pinned
    (forced_gates) reach the step as they reach a full forward."""
    model = _model()
    ids = torch.randint(0, 64, (2, 60), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), contextlib.ExitStack() as stack:
        if gates == "knocked_out":
            stack.enter_context(knock_out(model, ("sel",)))
        else:
            for blk in model.blocks:
                blk.attn.forced_gates = (0.2, 0.7, 0.9)
        full = model(ids)
        steps = _decode(model, ids, 21, max_len=64)
        unchanged = Transformer(model.cfg).double().eval()  # the same weights with the gates the model learned
        unchanged.load_state_dict(model.state_dict())
        learned = unchanged(ids)
    torch.testing.assert_close(steps, full[:, 20:], rtol=0, atol=1e-10)
    assert (full - learned).abs().amax() > 1e-3  # the gates changed what the model computes


INDEXER = dict(selector="indexer", indexer_heads=2, indexer_dim=8)


@pytest.mark.parametrize("nsa", [
    dict(INDEXER), dict(INDEXER, indexer_pool="scores"), dict(INDEXER, indexer_every=2),
    dict(sel_distance_cap=12), dict(INDEXER, indexer_pool="scores", sel_distance_cap=12)],
    ids=["indexer-keys", "indexer-scores", "indexer-every-2", "distance-cap", "indexer-distance-cap"])
def test_indexer_reuse_and_distance_cap_static_steps_equal_a_full_forward(nsa):
    """The learned indexer's picks (a block key a running max, or every token's key), index reuse every 2 layers
    (the picks threaded through the blocks) and the selected branch's distance cap, over static caches."""
    model = _model(nsa=nsa, n_layers=3)
    with torch.no_grad():  # indexer scores of both signs and sizes: picks that differ from pooled ones
        for name, p in model.named_parameters():
            if ".indexer." in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3), dtype=p.dtype))
    ids = distinct_ids(2, 60, 64, seed=4)  # no exact tie between indexer scores (distinct_ids)
    with torch.no_grad():
        full = model(ids)
        for prompt in (9, 30):
            torch.testing.assert_close(_decode(model, ids, prompt, max_len=64), full[:, prompt - 1:], rtol=0,
                                       atol=1e-10)
        if nsa.get("selector") == "indexer":  # the indexer's warm-up: pooled picks, nothing passed on
            model.set_indexer_selects(False)
            torch.testing.assert_close(_decode(model, ids, 21, max_len=64), model(ids)[:, 20:], rtol=0, atol=1e-10)


@pytest.mark.parametrize("preset", [dict(), dict(pos_emb="learned", norm="layernorm", mlp="gelu", bias=True)])
def test_dense_static_steps_equal_a_full_forward(preset):
    model = _model("dense", **preset)
    ids = torch.randint(0, 64, (3, 50), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids)
        steps = _decode(model, ids, 17, max_len=50)  # filled to the last slot
    torch.testing.assert_close(steps, full[:, 16:], rtol=0, atol=1e-10)


def test_a_step_reads_what_the_growing_cache_reads():
    """The static caches after a prefill hold what the growing caches hold; a later perturbation of a key a step
    must not read (a selection key of a block it does not pick, outside its window) leaves its output unchanged,
    and one of a key it reads changes it."""
    model = _model()
    ids = torch.randint(0, 64, (1, 70), generator=torch.Generator().manual_seed(5))
    decoder = StaticDecoder(model, 1, 80, graphs=False)
    with torch.no_grad():
        decoder.prefill(ids[:, :69])
        before = decoder.step(ids[:, 69]).clone()
        decoder.prefill(ids[:, :69])
        layer = decoder.caches[0]
        layer.sel_k[:, :, 70:] += 100.0  # after the position: masked
        layer.cmp_k[:, :, -1] += 100.0  # the scratch slot and the compressed slots past the position
        assert torch.equal(decoder.step(ids[:, 69]), before)
        decoder.prefill(ids[:, :69])
        decoder.caches[0].win_k[:, :, (69 - 3) % 8] += 1.0  # position 66: in the window of position 69
        assert not torch.allclose(decoder.step(ids[:, 69]), before)


@pytest.mark.parametrize("attention, nsa", [
    ("nsa", {}), ("nsa", dict(INDEXER, indexer_every=2, sel_distance_cap=12)), ("dense", {})],
    ids=["pooled", "indexer-reuse-cap", "dense"])
def test_a_step_never_waits_for_the_device(attention, nsa):
    """A step's ops (inside the nsa:: ops too) read no value back to the host and size no output by the data
    (nsa.launch_count.LaunchCounter.syncs): what a CUDA graph replays has no host value in it. Positions in the
    warm-up and past it, before and after the window wraps."""
    from nsa.launch_count import LaunchCounter

    model = _model(attention, nsa, n_layers=3)
    decoder = StaticDecoder(model, 2, 64, graphs=False)
    ids = torch.randint(0, 64, (2, 50), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        decoder.prefill(ids[:, :3])
        with LaunchCounter(open_custom_ops=True) as count:
            for t in range(3, 50):
                decoder.step(ids[:, t])
    assert count.total > 0 and not count.syncs, dict(count.syncs)


def test_graphs_and_refusals_are_one_line():
    model = _model()
    with pytest.raises(StaticDecodeError, match="CUDA graphs need a CUDA model"):
        StaticDecoder(model, 1, 32, graphs=True)
    decoder = StaticDecoder(model, 2, 16, graphs=False)
    with pytest.raises(StaticDecodeError, match="prefill of 1 rows into a decoder built for batch 2"):
        decoder.prefill(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(StaticDecodeError, match=r"a prompt of 16 tokens: must be 1 \.\. 15"):
        decoder.prefill(torch.zeros(2, 16, dtype=torch.long))
    decoder.prefill(torch.zeros(2, 15, dtype=torch.long))
    decoder.step(torch.zeros(2, dtype=torch.long))
    with pytest.raises(StaticDecodeError, match="the caches are full: max_len=16"):
        decoder.step(torch.zeros(2, dtype=torch.long))
    assert "max_len=200 must be in 1 .. the model's max_seq_len=96" == static_decode_problem(model, 200)
    model.train()
    assert "training mode" in static_decode_problem(model)
    problem = static_decode_problem(_model(nsa=dict(gates="window")))
    assert problem.startswith("layer 0: nsa.gates=window") and "\n" not in problem
    with distance_capped(model.eval(), 12):
        assert static_decode_problem(model) == ("layer 0: a distance-cap probe: cached decoding is not supported (the "
                                                "probe runs full forwards only)")


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_the_compiled_step_equals_the_eager_step_and_compiles_once_for_every_block(backend):
    """compile=True: torch.compile of the embedding, one block and the head (fullgraph: a graph break fails), the
    block's graph reused by every block (regional compilation); its steps equal the eager steps. aot_eager: Dynamo's
    trace and AOTAutograd's functionalised cache writes, what this code decides; Inductor's code generation (a cold
    compile is ~30 s on 2 cores) runs in bench/bench_decode_model.py's check on the GPU, before any timing."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # no compiled code of an earlier test in this process (it would be reused: no new graphs)
    model = _model(n_layers=3)
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(9))
    graphs_before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        compiled = _decode_with(StaticDecoder(model, 2, 48, graphs=False, compile=True, backend=backend), ids, 29)
        eager = _decode_with(StaticDecoder(model, 2, 48, graphs=False), ids, 29)
    assert counters["stats"]["unique_graphs"] - graphs_before == 3  # embedding, block, head: not one per block
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-10)


def _decode_with(decoder: StaticDecoder, ids: torch.Tensor, prompt: int, chunk: int = 512) -> torch.Tensor:
    out = [decoder.prefill(ids[:, :prompt], chunk=chunk)]
    out += [decoder.step(ids[:, t]).clone() for t in range(prompt, ids.shape[1])]
    return torch.stack(out, dim=1)


def test_a_restarted_decoder_reads_nothing_of_the_old_document():
    """restart(): steps from position 0 over the same buffers equal a full forward of the new document alone, with
    every buffer filled with noise first (a step reads only slots it wrote in the new document)."""
    model = _model()
    old, new = (torch.randint(0, 64, (1, 50), generator=torch.Generator().manual_seed(s)) for s in (11, 12))
    decoder = StaticDecoder(model, 1, 64, graphs=False)
    with torch.no_grad():
        _decode_with(decoder, old, 30)
        decoder.restart()
        for cache in decoder.caches:
            for buf in vars(cache).values():
                if isinstance(buf, torch.Tensor) and buf.is_floating_point():
                    buf.normal_(generator=torch.Generator().manual_seed(0))
        steps = torch.stack([decoder.step(new[:, t]).clone() for t in range(new.shape[1])], dim=1)
        full = model(new)
    torch.testing.assert_close(steps, full, rtol=0, atol=1e-10)
