"""Dense Transformer: every ModelConfig field takes effect, causality by perturbation, backends agree,
decode with a KV cache equals a full forward."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from nsa.attention.dense import causal_attention, manual_attention
from nsa.config import ModelConfig
from nsa.model import Transformer

TINY = dict(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=32)

# field -> a value different from TINY/defaults; a field missing here fails test_table_covers_every_field
ALTERNATIVES = {
    "vocab_size": 128, "dim": 48, "n_layers": 3, "n_heads": 8, "n_kv_heads": 4, "head_dim": 16, "ffn_dim": 64,
    "max_seq_len": 16, "norm": "layernorm", "norm_eps": 1e-2, "mlp": "gelu", "pos_emb": "learned",
    "rope_theta": 500.0, "rope_scale": 4.0, "rope_scaling": "yarn", "qk_norm": True, "tie_embeddings": True, "bias": True,
    "attention": "nsa", "attn_backend": "manual", "dropout": 0.5, "init_std": 0.2, "nsa": None, "loss_chunk": 0,
}
# fields that change the function without changing parameter shapes; checked through outputs
SAME_SHAPES = {"norm", "norm_eps", "rope_theta", "rope_scale", "rope_scaling", "attn_backend", "dropout", "init_std"}


def build(**overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**TINY, **overrides})).double()


def shapes(model: Transformer) -> dict:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_table_covers_every_field():
    assert set(ALTERNATIVES) == {f.name for f in dataclasses.fields(ModelConfig)}


@pytest.mark.parametrize("name", sorted(set(ALTERNATIVES) - {"nsa", "attention", "loss_chunk"}))  # loss_chunk: tests/nsa/test_loss.py
def test_every_model_field_takes_effect(name):
    stretched = {"rope_scale": 4.0} if name == "rope_scaling" else {}  # a scaling only acts on a scale > 1
    base = build(**stretched)
    changed = build(**stretched, **{name: ALTERNATIVES[name]})
    assert getattr(changed.cfg, name) == ALTERNATIVES[name]
    if name == "max_seq_len":  # only learned positions have a table; the limit itself is enforced
        with pytest.raises(ValueError):
            build(pos_emb="learned", max_seq_len=16)(torch.zeros(1, 17, dtype=torch.long))
        assert shapes(build(pos_emb="learned", max_seq_len=16)) != shapes(build(pos_emb="learned"))
        return
    if name not in SAME_SHAPES:
        if name == "tie_embeddings":
            assert changed.lm_head.weight is changed.tok_emb.weight and base.lm_head.weight is not base.tok_emb.weight
        else:
            assert shapes(changed) != shapes(base), name
        return
    idx = torch.randint(0, TINY["vocab_size"], (2, 16))
    if name == "dropout":
        changed.train()
        assert not torch.equal(changed(idx), build()(idx))
        return
    if name == "attn_backend":  # same function, different kernel: must agree, and the flag is stored
        assert changed.blocks[0].attn.backend == "manual"
        torch.testing.assert_close(changed(idx), base(idx))
        return
    if name == "init_std":
        assert changed.tok_emb.weight.std() > 5 * base.tok_emb.weight.std()
        return
    if name == "norm_eps":  # visible once activations are small compared with eps
        base.tok_emb.weight.data.mul_(1e-2)
        changed.tok_emb.weight.data.copy_(base.tok_emb.weight.data)
    changed.load_state_dict(base.state_dict())
    assert not torch.allclose(changed(idx), base(idx)), name


def test_gqa_is_really_grouped():
    model = build(n_heads=4, n_kv_heads=1)
    qkv = model.blocks[0].attn.qkv.weight
    assert qkv.shape[0] == (4 + 2 * 1) * model.cfg.head_dim


@pytest.mark.parametrize("backend", ["auto", "sdpa", "manual"])
@pytest.mark.parametrize("preset", [
    dict(), dict(norm="layernorm", mlp="gelu", pos_emb="learned", tie_embeddings=True, bias=True),
    dict(qk_norm=True, n_kv_heads=1, norm_eps=1e-6, rope_theta=1e6),
])
def test_dense_causality_by_perturbation(backend, preset):
    model = build(attn_backend=backend, **preset).eval()
    T = 24
    idx = torch.randint(0, TINY["vocab_size"], (2, T))
    ref = model(idx)
    for t in (0, 1, 7, 15, T - 2):
        perturbed = idx.clone()
        perturbed[:, t + 1:] = torch.randint(0, TINY["vocab_size"], (2, T - t - 1))
        out = model(perturbed)
        assert torch.equal(out[:, : t + 1], ref[:, : t + 1]), (backend, t)
        assert not torch.allclose(out[:, t + 1:], ref[:, t + 1:])


def test_dense_jacobian_has_no_future_dependence():
    model = build().eval()
    x = torch.randn(1, 12, TINY["dim"], dtype=torch.float64, requires_grad=True)
    attn = model.blocks[0].attn
    rope = model.rope(torch.arange(12))
    out = attn(x, rope)
    for t in (0, 5, 10):
        (grad,) = torch.autograd.grad(out[0, t].sum(), x, retain_graph=True)
        assert torch.count_nonzero(grad[0, t + 1:]) == 0
        assert torch.count_nonzero(grad[0, : t + 1]) > 0


def test_single_query_attends_to_all_past_keys():
    """The earlier systems' bug: SDPA is_causal with one query sees only key 0."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 1, 8, dtype=torch.float64)
    k, v = torch.randn(1, 2, 6, 8, dtype=torch.float64), torch.randn(1, 2, 6, 8, dtype=torch.float64)
    expected = (q @ k.transpose(-1, -2) / 8 ** 0.5).softmax(-1) @ v
    torch.testing.assert_close(causal_attention(q, k, v, "sdpa"), expected)
    torch.testing.assert_close(manual_attention(q, k, v), expected)


def test_chunked_queries_align_bottom_right():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 10, 8, dtype=torch.float64) for _ in range(3))
    full = manual_attention(q, k, v)
    torch.testing.assert_close(causal_attention(q[:, :, 6:], k, v, "sdpa"), full[:, :, 6:])
    torch.testing.assert_close(causal_attention(q[:, :, 6:], k, v, "manual"), full[:, :, 6:])


@pytest.mark.parametrize("preset", [dict(), dict(pos_emb="learned", norm="layernorm", mlp="gelu", bias=True)])
def test_decode_with_cache_equals_full_forward(preset):
    model = build(**preset).eval()
    idx = torch.randint(0, TINY["vocab_size"], (2, 20))
    full = model(idx)
    caches = model.new_caches()
    parts = [model(idx[:, :7], start_pos=0, caches=caches)]
    parts += [model(idx[:, t:t + 1], start_pos=t, caches=caches) for t in range(7, 20)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full)


def test_rope_scale_interpolates_positions():
    a, b = build(rope_scale=2.0).eval(), build().eval()
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, TINY["vocab_size"], (1, 8))
    # position p under scale 2 is position p/2 unscaled: compare via the rotary tables directly
    cos_a, _ = a.rope(torch.arange(0, 8, 2))
    cos_b, _ = b.rope(torch.arange(0, 4))
    torch.testing.assert_close(cos_a, cos_b)
    assert not torch.allclose(a(idx), b(idx))
