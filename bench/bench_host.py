"""Host time of NSA's Triton path, measured on a CPU: what Python and the dispatcher cost around the kernels.

    TRITON_INTERPRET=1 .venv/bin/python bench/bench_host.py [--repeats 30] [--json FILE]

On a GPU a layer's host work (Python, the custom ops' dispatch and autograd, ATen's dispatch, Triton's launcher) runs
while the device computes; where it takes longer than the kernels, the GPU waits (the second GPU session: 32.9 ms of
CPU against 5.8 ms of GPU for one layer forward + backward at 8k, under the profiler). Here the Triton kernels are
built for the interpreter and their execution is skipped (the interpreter's launch returns at once: outputs hold
whatever the allocator held; every size on this path comes from shapes, never from data, so the same ops run), on
tiny tensors so that ATen's own arithmetic is small: what is left is the host path. Not in it: Triton's compiled
launcher (a GPU's: ~10-30 µs a launch) and FlexAttention's compiled wrappers (on a CPU the compressed and window
branches run the torch path's ops: SDPA over tiny tensors, in the time here).

Measured, median of --repeats after warm-up: one NSA layer forward + backward (M7C's head layout 12 / 2 and geometry
l=32 d=16 l'=64 n=16 w=512, head dim 16, T=64; host_ms leaves out the torch path's compressed and window branches,
cpu_branches_ms, which a GPU runs as FlexAttention), and one whole-model decode step over static caches (eager, the
decode kernels; per layer, a 2-layer model less a 1-layer one). Also the custom-op calls and Triton launches each
makes (the host work scales with them), and both again with every nsa:: op call through the dispatcher
(`*_dispatched`: the custom ops as torch.library calls them, which eager calls skip since nsa/custom_op.py), the two
alternating call by call. One JSON line.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nsa.config import ModelConfig, NSAConfig
from nsa.custom_op import through_dispatcher

GEOMETRY = dict(l=32, d=16, l_sel=64, n_sel=16, w=512, kernel="triton")
# the torch path's compressed and window branches, which a CPU runs in their place (FlexAttention on CUDA): their time
# is arithmetic of this CPU's SDPA, not the host path a GPU pays, and is reported apart
CPU_ONLY_OPS = ("compressed_attention", "compressed_attention_backward", "window_attention", "window_attention_backward")
LAYOUT = dict(n_heads=12, n_kv_heads=2, head_dim=16, dim=192)


class _OpTimer(TorchDispatchMode):
    """The nsa:: op calls dispatched inside it, and the seconds spent in CPU_ONLY_OPS."""

    def __init__(self):
        super().__init__()
        self.op_calls, self.cpu_only_s = 0, 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.op_calls += func.namespace == "nsa"
        t = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        if func.namespace == "nsa" and func.name().split("::")[1].split(".")[0] in CPU_ONLY_OPS:
            self.cpu_only_s += time.perf_counter() - t
        return out


class _Skipped:
    """Triton's interpreter with kernel execution skipped (its launch point returns at once); `launches` counts the
    launches."""

    def __enter__(self):
        from nsa.launch_count import triton_launch_points

        self._cls, self._name = triton_launch_points()["interpreted"]
        self.launches, self._launch = 0, getattr(self._cls, self._name)

        def skip(executor, *args, **kwargs):
            self.launches += 1

        setattr(self._cls, self._name, skip)
        return self

    def __exit__(self, *exc):
        setattr(self._cls, self._name, self._launch)


def _median_ms(fn, repeats: int) -> tuple[float, float]:
    """Median ms of fn as the ops are called (eager: directly, nsa/custom_op.py) and with every nsa:: op call
    through the dispatcher (the custom ops, as before the direct path), the two alternating call by call so that
    this machine's drift falls on both alike."""
    times = {False: [], True: []}
    for i in range(2 * (repeats + 3)):
        dispatched = bool(i % 2)
        with through_dispatcher() if dispatched else contextlib.nullcontext():
            t = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t
        if i >= 6:  # three warm-up calls each
            times[dispatched].append(elapsed)
    return statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3


def layer_host(repeats: int, skipped: _Skipped) -> dict:
    from nsa.layers import RotaryEmbedding
    from nsa.model import build_attention

    torch.manual_seed(0)
    cfg = ModelConfig(**LAYOUT, attention="nsa", nsa=NSAConfig(**GEOMETRY))
    layer = build_attention(cfg)
    T = 64
    x = torch.randn(1, T, cfg.dim)
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)(torch.arange(T))

    def step():
        xi = x.detach().requires_grad_(True)
        y = layer(xi, rope)
        y.backward(torch.ones_like(y))

    ms, ms_dispatched = _median_ms(step, repeats)
    cpu_only = []
    for _ in range(5):
        skipped.launches = 0
        with _OpTimer() as ops:
            step()
        cpu_only.append(ops.cpu_only_s * 1e3)
    branches = statistics.median(cpu_only)
    return {"host_ms": round(ms - branches, 3), "cpu_branches_ms": round(branches, 3), "total_ms": round(ms, 3),
            "host_ms_dispatched": round(ms_dispatched - branches, 3), "triton_launches": skipped.launches,
            "nsa_op_calls": ops.op_calls}


def decode_host(repeats: int) -> dict:
    from nsa.model import Transformer
    from nsa.static_decode import StaticDecoder

    per = {}
    for n_layers in (1, 2):
        torch.manual_seed(0)
        model = Transformer(ModelConfig(**LAYOUT, vocab_size=512, n_layers=n_layers, ffn_dim=256, max_seq_len=1024,
                                        attention="nsa", nsa=NSAConfig(**GEOMETRY))).eval()
        decoder = StaticDecoder(model, 1, 1024, graphs=False)
        decoder.pos.fill_(1000)
        decoder.t = 1000
        token = torch.zeros(1, dtype=torch.long)

        def step():
            decoder.pos.fill_(1000)
            decoder.t = 1000
            with torch.no_grad():
                decoder.step(token)

        per[n_layers] = _median_ms(step, repeats)
    (one, one_d), (two, two_d) = per[1], per[2]
    return {"host_ms_per_layer": round(two - one, 3), "host_ms_besides": round(2 * one - two, 3),
            "host_ms_per_layer_dispatched": round(two_d - one_d, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", help="also write the JSON here")
    args = ap.parse_args()
    try:
        from nsa.attention.kernels.interpreter import interpreter_active
    except ImportError as exc:
        raise SystemExit(f"error: the Triton kernels need triton, which failed to import ({exc})") from None
    if not interpreter_active():
        raise SystemExit("error: run with TRITON_INTERPRET=1 (the kernels are skipped in Triton's interpreter)")
    torch.set_num_threads(1)
    with _Skipped() as skipped:
        result = {"bench": "host", "threads": 1, "layer_fwd_bwd": layer_host(args.repeats, skipped),
                  "decode_step": decode_host(args.repeats)}
    line = json.dumps(result)
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
