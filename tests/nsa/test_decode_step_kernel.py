"""The one-launch decode kernel (nsa/attention/kernels/decode_step.py, nsa::decode_branches) against the static
step's torch ops (its oracle, nsa/attention/static_cache.py with nsa.kernel=torch), in Triton's interpreter on CPU:
whole-model decode steps on the same weights, the picks crossing compression, block, window and pick-count
boundaries; the kernel really runs (a spy counts its launches), and a perturbed kernel output is caught."""
from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from nsa.attention import ops
from nsa.config import ModelConfig, NSAConfig
from nsa.model import Transformer
from nsa.static_decode import StaticDecoder
from tests.nsa._nsa_helpers import KERNEL_DEVICE, kernels_unavailable

UNAVAILABLE = kernels_unavailable("decode_step")
if UNAVAILABLE is None:
    from nsa.attention.kernels import decode_step
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))
# l = 8, d = 4, l' = 16, n = 5, w = 32: past position 80 more blocks exist than picks; hd 16 (the kernel's minimum)
GEOMETRY = dict(l=8, d=4, l_sel=16, n_sel=5, w=32, gate_init="equal")


def _models(dtype: torch.dtype) -> tuple[Transformer, Transformer]:
    """(kernel=triton, kernel=torch) on the same weights."""
    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=1, n_heads=6, n_kv_heads=2, head_dim=16, ffn_dim=64,
                      max_seq_len=128, attention="nsa", nsa=NSAConfig(**GEOMETRY, kernel="triton"))
    torch.manual_seed(0)
    fused = Transformer(cfg).to(KERNEL_DEVICE, dtype).eval()
    with torch.no_grad():  # sharper attention than the init: picks that differ by query
        for name, p in fused.named_parameters():
            if name.endswith("kv_proj.weight") or name.endswith("q_proj.weight"):
                p.mul_(4)
    plain = Transformer(dataclasses.replace(cfg, nsa=dataclasses.replace(cfg.nsa, kernel="torch")))
    plain = plain.to(KERNEL_DEVICE, dtype).eval()
    plain.load_state_dict(fused.state_dict())
    return fused, plain


@contextlib.contextmanager
def _torch_path(model: Transformer):
    """The model's attention layers on the torch path inside (their cfg.kernel, read at every call)."""
    layers = [blk.attn for blk in model.blocks]
    saved = [layer.cfg for layer in layers]
    for layer in layers:
        layer.cfg = dataclasses.replace(layer.cfg, kernel="torch")
    try:
        yield
    finally:
        for layer, cfg in zip(layers, saved):
            layer.cfg = cfg


def _steps(model: Transformer, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Prefill ids[:, :prompt] into static caches of 120 positions, then step through the rest -> logits [B, n, V].
    The prefill runs on the torch path whatever the model's kernel (the same caches for both models: the steps are
    what differs; the prefill's kernels have their own tests, and in the interpreter they cost most of the time)."""
    decoder = StaticDecoder(model, ids.shape[0], 120, graphs=False)
    with torch.no_grad():
        with _torch_path(model):
            out = [decoder.prefill(ids[:, :prompt])]
        out += [decoder.step(ids[:, t]).clone() for t in range(prompt, ids.shape[1])]
    return torch.stack(out, dim=1)


class _GridSpy:
    """Stands in for a Triton kernel: records each launch's grid, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.seen = kernel, []

    def __getitem__(self, grid):
        self.seen.append(tuple(grid))
        return self.kernel[grid]


# steps at positions 5-8 (the first compressed token ends at 7) and 110-115 (a compressed token at 111, a new block at
# 112: 5 unforced blocks compete for 2 free picks; the window ring wrapped)
WINDOWS = ((5, 9), (110, 116))


@pytest.mark.parametrize("chunk_tokens, window_tile", [(64, 64), (8, 16)], ids=["one_chunk", "split"])
def test_the_kernel_steps_equal_the_torch_steps(monkeypatch, chunk_tokens, window_tile):
    """float64 (the interpreter's bf16 is emulated; the GPU harness compares bf16 on the device). one_chunk: the
    shipped split sizes, which at these sizes give one program per (row, KV head) for the compressed tokens and one
    for the window; split: 4 compressed programs of 8 tokens (2 blocks each: a block's first units read the last
    token of the program before) and 2 window tiles."""
    monkeypatch.setattr(decode_step, "MIN_CHUNK_TOKENS", chunk_tokens)
    monkeypatch.setattr(decode_step, "WINDOW_TILE", window_tile)
    grids = _GridSpy(decode_step.decode_partials_kernel)
    monkeypatch.setattr(decode_step, "decode_partials_kernel", grids)
    fused, plain = _models(torch.float64)
    launches = []
    real = ops._decode_branches
    monkeypatch.setattr(ops, "_decode_branches", lambda *a: launches.append(1) or real(*a))
    ids = torch.randint(0, 64, (2, 116), generator=torch.Generator().manual_seed(1)).to(KERNEL_DEVICE)
    for prompt, end in WINDOWS:
        want = _steps(plain, ids[:, :end], prompt)
        assert not launches  # the torch path takes its own ops
        got = _steps(fused, ids[:, :end], prompt)
        assert len(launches) == end - prompt  # every step ran the kernel
        launches.clear()
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # step 1's programs per (row, KV head): the 29 compressed slots of a 120-position cache in chunks, then the window
    assert set(grids.seen) == {(2 * 2, 1 + 1) if chunk_tokens == 64 else (2 * 2, 4 + 2)}


def test_a_perturbed_kernel_output_is_caught(monkeypatch):
    fused, plain = _models(torch.float64)
    ids = torch.randint(0, 64, (1, 113), generator=torch.Generator().manual_seed(2)).to(KERNEL_DEVICE)
    want = _steps(plain, ids, 110)
    real = ops._decode_branches
    monkeypatch.setattr(ops, "_decode_branches", lambda *a: real(*a) * torch.tensor([1.0, 1.01, 1.0], dtype=torch.float64).view(3, 1, 1, 1, 1))
    assert not torch.allclose(_steps(fused, ids, 110), want, rtol=1e-6, atol=1e-6)


def test_a_kernel_step_launches_its_four_kernels_and_never_waits_for_the_device():
    """Counted with the op opened (nsa.launch_count): each step launches the four kernels once per layer, and nothing
    in the launcher reads a value back to the host (the position stays on the device: a CUDA graph replays it)."""
    from nsa.launch_count import LaunchCounter

    fused, _ = _models(torch.float64)
    ids = torch.randint(0, 64, (1, 113), generator=torch.Generator().manual_seed(3)).to(KERNEL_DEVICE)
    decoder = StaticDecoder(fused, 1, 120, graphs=False)
    with torch.no_grad():
        decoder.prefill(ids[:, :111])
        with LaunchCounter(open_custom_ops=True) as count:
            for t in (111, 112):
                decoder.step(ids[:, t])
    kernels = {name: n for name, n in count.by_op.items() if name.startswith("triton.decode_")}
    assert kernels == {f"triton.decode_{k}_kernel": 2 for k in ("partials", "block_scores", "picks", "combine")}
    assert not count.syncs, dict(count.syncs)
