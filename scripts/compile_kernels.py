#!/usr/bin/env python3
"""Compile every Triton kernel of the project ahead of time for sm_80 (A100) and sm_90 (H100), on a CPU.

    python scripts/compile_kernels.py [--shapes shipped|paper|harness|all] [--targets 80,90] [--markdown FILE] [--json FILE]

For each kernel module in KERNEL_MODULES, each shape (shipped: every configs/*.yaml with
model.attention: nsa that can run on a GPU (not runtime.device: cpu), at its train.seq_len; paper: head dims 64/128/192, G 6/16, l=32 d=16 l'=64 n=16,
64k tokens; harness: the layouts and geometries bench/gpu_nsa_speed.py times, 64k tokens), each dtype (bf16, fp32) and each target, the module's real host wrappers run on meta
tensors while their launches are recorded (scripts/kernel_capture.py); each recorded launch is compiled
for the target with the ptxas bundled in triton. Prints one table: shared memory (bytes, % of the
target's limit), registers and spills (`ptxas -v`), warps, pipeline stages and the tensor-core
instruction family (PTX wgmma / mma.sync; none: FMA dots, e.g. fp32 in IEEE precision). Compiles use
Triton's cache: the first run takes minutes, later ones seconds.

Exit status 1 when: a wrapper or a kernel fails to compile, a module defines a kernel its wrappers never
launch (at a shape where the ops use the module: an exercise function returns False where they do not), a kernel needs more shared memory than the target allows (the launcher would raise
OutOfResources), or a bf16 kernel spills registers at a shipped shape. Other spills are reported only.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from train.core.env import disable_triton_interpreter

if __name__ == "__main__":  # before triton is imported: with the switch on, its own library functions are
    disable_triton_interpreter()  # built as interpreted functions and no kernel using them compiles for a GPU

import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


def _sibling(name: str):
    """scripts/<name>.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_capture = _sibling("kernel_capture")
Launch, capture_launches, compile_with_usage, mma_family = (
    _capture.Launch, _capture.capture_launches, _capture.compile_with_usage, _capture.mma_family)

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"

# compute capability -> (GPU, shared memory per block the launcher allows, bytes)
TARGETS = {
    80: ("A100", 166912),
    90: ("H100", 232448),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PAPER = "paper"  # source name of the paper's shapes

# Triton 3.9 warns that its FP-fusion default changes in 3.10; the compile uses the same default a launch does
warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")


# ---------------------------------------------------------------- shapes
@dataclass(frozen=True)
class Shape:
    """What the kernels are specialized on: head dim, heads, NSA block sizes; T only through whether the
    lengths derived from it divide by 16 (meta tensors make a long T free)."""

    hd: int  # head dim
    G: int  # query heads per KV head
    H_kv: int  # KV heads
    l: int  # compression block length
    d: int  # compression stride
    l_sel: int  # selection block length l'
    n: int  # selected blocks per query
    T: int  # sequence length (Tq = Tk): the config's train.seq_len

    @property
    def name(self) -> str:
        return f"hd{self.hd} G{self.G} Hkv{self.H_kv} l{self.l} d{self.d} lsel{self.l_sel} n{self.n} T{self.T}"


def shipped_shapes() -> dict[Shape, list[str]]:
    """Shape -> the configs/*.yaml (model.attention: nsa) training with it on a GPU, read with the trainer's loader.
    A config that pins runtime.device: cpu (m7c_cpu, nsa_twin_kjv) never launches a Triton kernel: not compiled."""
    from train.core.config import load_config

    shapes: dict[Shape, list[str]] = {}
    for path in sorted(CONFIGS.glob("*.yaml")):
        cfg = load_config(path)
        m = cfg.model
        if m.attention == "nsa" and cfg.runtime.device != "cpu":
            shape = Shape(m.head_dim, m.n_groups, m.n_kv_heads, m.nsa.l, m.nsa.d, m.nsa.l_sel, m.nsa.n_sel, cfg.train.seq_len)
            shapes.setdefault(shape, []).append(path.stem)
    return shapes


def paper_shapes() -> dict[Shape, list[str]]:
    """The paper's kernel shapes: head dims 64/128/192, GQA groups 6 and 16, l=32 d=16 l'=64 n=16, 64k tokens."""
    return {Shape(hd, G, 4, 32, 16, 64, 16, 65536): [PAPER] for hd in (64, 128, 192) for G in (6, 16)}


HARNESS = "harness"  # source name prefix of the speed harness's shapes


def harness_shapes() -> dict[Shape, list[str]]:
    """The layouts and geometries bench/gpu_nsa_speed.py times on a GPU (read from it), at its longest length (64k):
    M7C's with the paper's geometry, the paper's layout with the paper's and fla's geometry. Compiled before a GPU
    session, a kernel that cannot compile there fails here first."""
    spec = importlib.util.spec_from_file_location("gpu_nsa_speed", REPO / "bench" / "gpu_nsa_speed.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    shapes: dict[Shape, list[str]] = {}
    for layout_name, layout in harness.LAYOUTS.items():
        geometries = [("", harness.NSA_GEOMETRY)] + [("_fla_geometry", harness.FLA_GEOMETRY)] * (layout_name == "paper")
        for suffix, g in geometries:
            shape = Shape(layout["head_dim"], layout["n_heads"] // layout["n_kv_heads"], layout["n_kv_heads"], g["l"],
                          g["d"], g["l_sel"], g["n_sel"], 65536)
            shapes.setdefault(shape, []).append(f"{HARNESS}_{layout_name}{suffix}")
    return shapes


SHAPE_SETS = {"shipped": [shipped_shapes], "paper": [paper_shapes], "harness": [harness_shapes],
              "all": [shipped_shapes, paper_shapes, harness_shapes]}


def select_shapes(which: str) -> dict[Shape, list[str]]:
    shapes: dict[Shape, list[str]] = {}
    parts = SHAPE_SETS[which]
    for part in parts:
        for shape, sources in part().items():
            shapes.setdefault(shape, []).extend(sources)
    return shapes


def is_shipped(sources: list[str]) -> bool:
    """A shape some config trains with (its bf16 spills fail the check), not only the paper's or the harness's."""
    return any(s != PAPER and not s.startswith(HARNESS) for s in sources)


# ---------------------------------------------------------------- kernel modules and their wrappers
def _meta(*size: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*size, dtype=dtype, device="meta")


def exercise_selection(shape: Shape, dtype: torch.dtype) -> None:
    """selected attention forward then backward, called as nsa/attention/ops.py calls them (q_start 0, the
    module's kv_tile / block_rows defaults), on both forward/dQ paths (query-centric and block-centric,
    forced with the module's SELECTION_PATH; by default G < 16 takes the block-centric one), without and
    with a document frame (the kernels' HAS_FRAME variants), so every kernel is compiled at every shape."""
    from nsa.attention.kernels import selected_attention as ts

    T = shape.T
    q = _meta(1, shape.H_kv, shape.G, T, shape.hd, dtype=dtype)  # [B, H_kv, G, Tq, hd]
    k = _meta(1, shape.H_kv, T, shape.hd, dtype=dtype)  # [B, H_kv, Tk, hd]
    v = _meta(1, shape.H_kv, T, shape.hd, dtype=dtype)
    block_idx = _meta(1, shape.H_kv, T, shape.n, dtype=torch.long)  # [B, H_kv, Tq, n] as select_blocks returns
    default = ts.SELECTION_PATH
    try:
        for frame in (None, _meta(3, 1, T, dtype=torch.long)):  # [3, B, Tq] (q_pos, k_base, c_base)
            for path in ("query", "block"):
                ts.SELECTION_PATH = path
                o, lse = ts.selected_attention_fwd(q, k, v, block_idx, 0, shape.l_sel, frame=frame)
                ts.selected_attention_bwd(q, k, v, block_idx, o, lse, torch.empty_like(o), 0, shape.l_sel, frame=frame)
    finally:
        ts.SELECTION_PATH = default


def exercise_rotary(shape: Shape, dtype: torch.dtype) -> None:
    """The rotary kernel as the layer calls it (nsa/attention/ops.py): queries and the selection and window keys in
    one tensor, positions shared by the batch rows or per row (packed documents), forward and inverse (backward); and
    packed documents' compressed keys, their rows read through an index."""
    from nsa.attention.kernels.rotary import rotary

    T, half = shape.T, shape.hd // 2
    qk = _meta(1, shape.H_kv * (shape.G + 2), T, shape.hd, dtype=dtype)  # [B, H + 2 H_kv, T, hd]
    for angles in (_meta(T, half, dtype=torch.float32), _meta(1, T, half, dtype=torch.float32)):
        for inverse in (False, True):
            rotary(qk, angles, angles, inverse)
    ck = _meta(1, shape.H_kv, T // shape.d, shape.hd, dtype=dtype)  # packed documents' compressed keys: rows by index
    for inverse in (False, True):
        rotary(ck, _meta(1, T, half, dtype=torch.float32), _meta(1, T, half, dtype=torch.float32), inverse,
               at=_meta(1, T // shape.d, dtype=torch.long))


def exercise_gated_combine(shape: Shape, dtype: torch.dtype) -> None:
    """The gated combination forward and backward as nsa/attention/ops.py calls them (gates [B, T, H, 3] in the
    branches' dtype, branch outputs [B, H, T, hd])."""
    from nsa.attention.kernels.gated_combine import gated_combine_bwd, gated_combine_fwd

    H, T = shape.H_kv * shape.G, shape.T
    gates = _meta(1, T, H, 3, dtype=dtype)
    branches = [_meta(1, H, T, shape.hd, dtype=dtype) for _ in range(3)]
    y = gated_combine_fwd(gates, *branches)
    gated_combine_bwd(y, gates, *branches)


def exercise_compress_blocks(shape: Shape, dtype: torch.dtype) -> bool | None:
    """phi for keys and values forward and backward as nsa/attention/ops.py calls them: raw keys and values strided
    views of one projection (as the layer's `project` makes them), parameters in float32 (autocast's master weights),
    without and with bias, without and with a packed documents' layout. False for a head dim the kernels are not
    tiled for (the ops run phi's torch ops there)."""
    from nsa.attention.impl.compression import num_compressed
    from nsa.attention.kernels.compress_blocks import compress_blocks_bwd, compress_blocks_fwd, fits

    T, hd, H_kv = shape.T, shape.hd, shape.H_kv
    if not fits(hd):  # ops.compress_blocks runs phi's torch ops there: nothing of this module launches
        return False
    kv = _meta(1, T, 6, H_kv, hd, dtype=dtype).permute(2, 0, 3, 1, 4)  # [6, B, H_kv, T, hd]
    raw_k, raw_v = kv[0], kv[1]
    f32 = torch.float32
    for bias in (False, True):
        phi = [_meta(shape.l, hd, dtype=f32), _meta(hd, shape.l * hd, dtype=f32), _meta(hd, dtype=f32) if bias else None,
               _meta(hd, hd, dtype=f32), _meta(hd, dtype=f32) if bias else None]
        count = num_compressed(T, shape.l, shape.d)
        ck, cv, a = compress_blocks_fwd(raw_k, raw_v, phi, phi, 0, count, shape.l, shape.d)
        compress_blocks_bwd(ck, cv, raw_k, raw_v, phi, phi, a, 0, shape.l, shape.d)
        C = T // shape.d
        block_start, valid = _meta(1, C, dtype=torch.long), _meta(1, C, dtype=torch.bool)
        ck, cv, a = compress_blocks_fwd(raw_k, raw_v, phi, phi, 0, C, shape.l, shape.d, block_start, valid)
        compress_blocks_bwd(ck, cv, raw_k, raw_v, phi, phi, a, 0, shape.l, shape.d, block_start, valid,
                            _meta(3, 1, T, dtype=torch.long))


def exercise_row_dot(shape: Shape, dtype: torch.dtype) -> None:
    """The selection backward's delta (sum over hd of dO * O) as selected_attention_bwd takes it."""
    from nsa.attention.kernels.row_dot import row_dot

    o = _meta(1, shape.H_kv, shape.G, shape.T, shape.hd, dtype=dtype)
    row_dot(o, o)


def exercise_decode_step(shape: Shape, dtype: torch.dtype) -> None:
    """The decode step's branches over static caches (nsa/attention/static_cache.py) of T positions at batch 1, and
    of 64k positions at batch 1 and 16 (bench/bench_decode_model.py's points; the split sizes follow the caches')."""
    from nsa.attention.impl.compression import num_compressed
    from nsa.attention.kernels.decode_step import decode_branches

    for batch, T in ((1, shape.T), (1, 65536), (16, 65536)):
        C, n_keys = num_compressed(T, shape.l, shape.d), -(-T // shape.l_sel) * shape.l_sel
        qg = _meta(batch, shape.H_kv, shape.G, shape.hd, dtype=dtype)
        cmp, sel, win = (_meta(batch, shape.H_kv, n, shape.hd, dtype=dtype) for n in (C + 1, n_keys, 512))
        pos = torch.empty((), dtype=torch.long, device="meta")
        decode_branches(qg, cmp, cmp, sel, sel, win, win, pos, shape.l, shape.d, shape.l_sel, shape.n)


def exercise_select_topk(shape: Shape, dtype: torch.dtype) -> None:
    """Fused block selection, called as nsa/attention/ops.py calls it (with the compressed branch's log-sum-exps) and
    on its own, without and with a document frame; and the indexer's compressed target for its KL rows."""
    from nsa.attention.impl.compression import num_compressed
    from nsa.attention.indexer import KL_ROWS
    from nsa.attention.kernels.select_topk import fused_select_blocks, pooled_block_mass_rows

    T = shape.T
    q = _meta(1, shape.H_kv, shape.G, T, shape.hd, dtype=dtype)  # [B, H_kv, G, Tq, hd]
    ck = _meta(1, shape.H_kv, num_compressed(T, shape.l, shape.d), shape.hd, dtype=dtype)  # [B, H_kv, N_c, hd]
    lse = _meta(1, shape.H_kv, shape.G, T, dtype=torch.promote_types(dtype, torch.float32))  # [B, H_kv, G, Tq]
    for given in (None, lse):
        pooled_block_mass_rows(q, ck, min(T, KL_ROWS), shape.l, shape.d, shape.l_sel, -(-T // shape.l_sel), lse=given)
        fused_select_blocks(q, ck, 0, shape.l, shape.d, shape.l_sel, shape.n, lse=given)
        fused_select_blocks(q, ck, 0, shape.l, shape.d, shape.l_sel, shape.n, frame=_meta(3, 1, T, dtype=torch.long),
                            lse=given)


def exercise_select_two_pass(shape: Shape, dtype: torch.dtype) -> bool:
    """Block selection in two launches, as nsa/attention/ops.py calls it (with the compressed branch's log-sum-exps,
    and without them; without and with a document frame), at the shape's length and at 64k (the top-n kernel is
    specialised on the padded block count: 1,024 blocks a row at l' = 64)."""
    from nsa.attention.impl.compression import num_compressed
    from nsa.attention.kernels import select_two_pass

    ran = False
    for T in sorted({shape.T, 65536}):
        if not select_two_pass.applies(0, T, shape.l_sel):
            continue
        q = _meta(1, shape.H_kv, shape.G, T, shape.hd, dtype=dtype)  # [B, H_kv, G, Tq, hd]
        ck = _meta(1, shape.H_kv, num_compressed(T, shape.l, shape.d), shape.hd, dtype=dtype)  # [B, H_kv, N_c, hd]
        lse = _meta(1, shape.H_kv, shape.G, T, dtype=torch.promote_types(dtype, torch.float32))
        for frame in (None, _meta(3, 1, T, dtype=torch.long)):
            for given in (None, lse):
                select_two_pass.two_pass_select_blocks(q, ck, 0, shape.l, shape.d, shape.l_sel, shape.n, frame=frame,
                                                       lse=given)
        ran = True
    return ran


def exercise_indexer_topk(shape: Shape, dtype: torch.dtype) -> None:
    """The learned indexer's picks (nsa.selector=indexer), as ops.indexer_picks calls them, at the indexer's default
    sizes (NSAConfig: heads, dim) with one key per block and one per token."""
    from nsa.attention.kernels.indexer_topk import fused_indexer_picks
    from nsa.config import NSAConfig

    T, h, e = shape.T, NSAConfig.indexer_heads, NSAConfig.indexer_dim
    q = _meta(1, T, shape.H_kv, h, e, dtype=dtype)  # [B, Tq, H_kv, h, e]
    w = _meta(1, T, shape.H_kv, h, dtype=dtype)
    for per_token in (False, True):
        keys = _meta(1, T if per_token else -(-T // shape.l_sel), e, dtype=dtype)
        fused_indexer_picks(q, w, keys, 0, shape.l_sel, shape.n, per_token)
    fused_indexer_picks(q, w, _meta(1, T, e, dtype=dtype), 0, shape.l_sel, shape.n, False, token_keys=True)
    frame = _meta(3, 1, T, dtype=torch.long)  # packed documents (token keys)
    for per_token in (False, True):
        fused_indexer_picks(q, w, _meta(1, T, e, dtype=dtype), 0, shape.l_sel, shape.n, per_token, token_keys=True,
                            frame=frame)


def exercise_indexer_kl(shape: Shape, dtype: torch.dtype) -> None:
    """The learned indexer's KL term forward and backward (nsa.selector=indexer), as ops.indexer_kl calls them, at the
    indexer's default sizes with one key per block and one per token, over the layer's KL rows."""
    from nsa.attention.impl.compression import num_compressed
    from nsa.attention.indexer import KL_ROWS
    from nsa.attention.kernels.indexer_kl import indexer_kl_backward, indexer_kl_forward
    from nsa.config import NSAConfig

    T, h, e = shape.T, NSAConfig.indexer_heads, NSAConfig.indexer_dim
    R = min(T, KL_ROWS)
    out = _meta(1, T, shape.H_kv * h * (e + 1) + e, dtype=dtype)
    target = _meta(1, shape.H_kv, R, -(-T // shape.l_sel), dtype=torch.float32)
    stats = _meta(1, shape.H_kv, R, 2, dtype=torch.promote_types(dtype, torch.float32))
    for per_token in (False, True):
        indexer_kl_forward(out, target, shape.H_kv, h, e, R, shape.l_sel, per_token, 1.0)
        q = _meta(1, shape.H_kv, shape.G, T, shape.hd, dtype=dtype)  # the target in the same launch
        ck = _meta(1, shape.H_kv, num_compressed(T, shape.l, shape.d), shape.hd, dtype=dtype)
        lse = _meta(1, shape.H_kv, shape.G, T, dtype=torch.promote_types(dtype, torch.float32))
        frame = _meta(3, 1, T, dtype=torch.long)  # packed documents, and the KL's counted rows
        counted = torch.empty((), dtype=torch.long, device="meta")
        for source in (("compressed", q, ck, lse, shape.l, shape.d), ("dense", q, _meta(1, shape.H_kv, T, shape.hd,
                                                                                         dtype=dtype), None, 0, 0)):
            for f in (None, frame):
                indexer_kl_forward(out, None, shape.H_kv, h, e, R, shape.l_sel, per_token, 1.0, source, f, counted)
        for f in (None, frame):
            indexer_kl_backward(torch.empty((), dtype=torch.float32, device="meta"), out, target, stats, shape.H_kv, h,
                                e, R, shape.l_sel, per_token, 1.0, frame=f, counted=counted)


def exercise_dense_mass(shape: Shape, dtype: torch.dtype) -> None:
    """The learned indexer's dense target for the KL's rows (nsa.indexer_target=dense), as ops.dense_mass_rows calls
    it."""
    from nsa.attention.indexer import KL_ROWS
    from nsa.attention.kernels.dense_mass import dense_block_mass_rows

    T = shape.T
    q = _meta(1, shape.H_kv, shape.G, T, shape.hd, dtype=dtype)
    k = _meta(1, shape.H_kv, T, shape.hd, dtype=dtype)
    dense_block_mass_rows(q, k, min(T, KL_ROWS), shape.l_sel, -(-T // shape.l_sel))


# Every module with Triton kernels, and a function running its wrappers once. A module not present
# (not landed yet) is skipped with a notice; tests/tools/test_compile_kernels.py checks that every
# module of nsa/ with @triton.jit is listed here.
KERNEL_MODULES = (
    ("nsa.attention.kernels.selected_attention", exercise_selection),
    ("nsa.attention.kernels.block_centric", exercise_selection),  # launched by selected_attention's wrappers
    ("nsa.attention.kernels.index_tiles", exercise_selection),  # launched by selected_attention's index
    ("nsa.attention.kernels.select_topk", exercise_select_topk),
    ("nsa.attention.kernels.select_two_pass", exercise_select_two_pass),
    ("nsa.attention.kernels.indexer_topk", exercise_indexer_topk),
    ("nsa.attention.kernels.indexer_kl", exercise_indexer_kl),
    ("nsa.attention.kernels.dense_mass", exercise_dense_mass),
    ("nsa.attention.kernels.rotary", exercise_rotary),
    ("nsa.attention.kernels.gated_combine", exercise_gated_combine),
    ("nsa.attention.kernels.compress_blocks", exercise_compress_blocks),
    ("nsa.attention.kernels.row_dot", exercise_row_dot),
    ("nsa.attention.kernels.decode_step", exercise_decode_step),
)


def available_modules() -> list[tuple[object, object]]:
    """The KERNEL_MODULES present, imported (their kernels must be JITFunctions: TRITON_INTERPRET unset)."""
    found = []
    for name, exercise in KERNEL_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if not name.startswith(exc.name or "\0"):
                raise  # the module exists but one of its imports is missing
            print(f"note: {name} not present, skipped", file=sys.stderr)
            continue
        if any(isinstance(f, InterpretedFunction) for f in vars(module).values()):
            raise RuntimeError(f"{name} was imported with TRITON_INTERPRET set; its kernels cannot be compiled")
        found.append((module, exercise))
    return found


def module_kernels(module) -> list[str]:
    """The @triton.jit functions a module defines that no other of its JIT functions calls (those are
    device functions, compiled inside their callers)."""
    jit = {n: f for n, f in vars(module).items() if isinstance(f, JITFunction) and f.module == module.__name__}
    called = {n for n in jit for other, f in jit.items() if other != n and f"{n}(" in f.src}
    return sorted(set(jit) - called)


# ---------------------------------------------------------------- compile and judge
@dataclass
class Row:
    kernel: str  # module.kernel
    shape: str
    dtype: str
    target: int  # compute capability
    shared: int | None = None  # bytes of shared memory per program
    registers: int | None = None  # per thread
    spill_stores: int | None = None  # bytes
    spill_loads: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    mma: str = ""
    error: str = ""
    failures: list[str] = field(default_factory=list)
    compile_s: float = 0.0  # seconds this row took: a fresh compile, or a read of Triton's cache

    @property
    def spills(self) -> bool:
        return bool(self.spill_stores or self.spill_loads)


def judge(row: Row, shipped: bool) -> list[str]:
    """Why this row fails the check (empty: it passes)."""
    if row.error:
        return [row.error]
    out = []
    limit = TARGETS[row.target][1]
    if row.shared > limit:
        out.append(f"shared memory {row.shared} B > {limit} B")
    if shipped and row.dtype == "bf16" and row.spills:
        out.append("bf16 register spills at a shipped shape")
    return out


def _short_error(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[-1][:200] if lines else ''}"


def compile_row(label: str, launch: Launch, shape: str, dtype: str, capability: int, shipped: bool) -> Row:
    """Compile one recorded launch for sm_<capability> and judge it."""
    row = Row(label, shape, dtype, capability)
    start = time.perf_counter()
    try:
        kernel, usage = compile_with_usage(launch, capability)
    except Exception as exc:  # a compile error is a result of the check, not a crash of it
        row.error = "compile error: " + _short_error(exc)
    else:
        row.shared, row.registers = kernel.metadata.shared, usage.registers
        row.spill_stores, row.spill_loads = usage.spill_stores, usage.spill_loads
        row.num_warps, row.num_stages, row.mma = kernel.metadata.num_warps, kernel.metadata.num_stages, mma_family(kernel)
    row.failures = judge(row, shipped)
    row.compile_s = round(time.perf_counter() - start, 3)
    return row


def label_variants(prefix: str, launches: list[Launch]) -> list[tuple[str, Launch]]:
    """One launch per distinct (kernel, keyword arguments); a kernel launched with two different
    constexpr sets is listed twice, as name and name#2. A kernel's document-frame variant (HAS_FRAME=True)
    is named name[frame], the selection kernel given the compressed branch's log-sum-exps (HAS_LSE) name[lse]."""
    seen: dict[str, list[str]] = {}
    out = []
    for launch in launches:
        name = launch.name + ("[frame]" if launch.kwargs.get("HAS_FRAME") else "") + (
            "[lse]" if launch.kwargs.get("HAS_LSE") else "")
        variants = seen.setdefault(name, [])
        key = repr(sorted(launch.kwargs.items()))
        if key not in variants:
            variants.append(key)
            suffix = "" if len(variants) == 1 else f"#{len(variants)}"
            out.append((f"{prefix}.{name}{suffix}", launch))
    return out


def check_module(module, exercise, shape: Shape, dtype: str, targets: list[int], shipped: bool) -> list[Row]:
    """Capture one module's launches at one shape and dtype, compile each for every target."""
    prefix = module.__name__.rsplit(".", 1)[-1]
    try:
        with capture_launches() as launches:
            used = exercise(shape, DTYPES[dtype]) is not False  # False: the ops never launch this module here
    except Exception as exc:
        error = "wrapper failed under capture: " + _short_error(exc)
        return [Row(f"{prefix}.<wrappers>", shape.name, dtype, t, error=error, failures=[error]) for t in targets]
    launches = [launch for launch in launches if launch.kernel.module == module.__name__]  # its own kernels
    rows = [compile_row(label, launch, shape.name, dtype, t, shipped)
            for label, launch in label_variants(prefix, launches) for t in targets]
    for name in sorted(set(module_kernels(module)) - {launch.name for launch in launches} if used else ()):
        error = "never launched by the module's wrappers (add it to the exercise function)"
        rows += [Row(f"{prefix}.{name}", shape.name, dtype, t, error=error, failures=[error]) for t in targets]
    return rows


def check_all(shapes: dict[Shape, list[str]], targets: list[int]) -> tuple[list[Row], dict[str, list[str]]]:
    rows, kernels = [], {}
    for module, exercise in available_modules():
        kernels[module.__name__] = module_kernels(module)
        for shape, sources in shapes.items():
            for dtype in DTYPES:
                rows += check_module(module, exercise, shape, dtype, targets, is_shipped(sources))
    return rows, kernels


# ---------------------------------------------------------------- report
def _status(row: Row) -> str:
    if row.failures:
        return "FAIL: " + "; ".join(row.failures)
    return "ok (spills)" if row.spills else "ok"


def _pct(row: Row) -> str:
    return "" if row.shared is None else f"{100 * row.shared / TARGETS[row.target][1]:.1f}%"


def _opt(value) -> str:
    return "" if value is None else str(value)


COLUMNS = (  # header, cell
    ("kernel", lambda r: r.kernel),
    ("shape", lambda r: r.shape),
    ("dtype", lambda r: r.dtype),
    ("target", lambda r: f"sm_{r.target} ({TARGETS[r.target][0]})"),
    ("smem B", lambda r: _opt(r.shared)),
    ("smem %", _pct),
    ("regs", lambda r: _opt(r.registers)),
    ("spill st/ld B", lambda r: "" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}"),
    ("warps", lambda r: _opt(r.num_warps)),
    ("stages", lambda r: _opt(r.num_stages)),
    ("MMA", lambda r: r.mma),
    ("status", _status),
)


def text_table(rows: list[Row]) -> str:
    cells = [[h for h, _ in COLUMNS]] + [[cell(r) for _, cell in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells)


def markdown_table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(h for h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r) for _, cell in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def legend(shapes: dict[Shape, list[str]]) -> list[str]:
    limits = ", ".join(f"sm_{c} ({gpu}) {limit} B" for c, (gpu, limit) in TARGETS.items())
    out = [f"shape {s.name}: {', '.join(src)}" for s, src in shapes.items()]
    return out + [f"shared-memory limits: {limits}"]


def seconds_by_module(rows: list[Row]) -> dict[str, float]:
    """Compile seconds per kernel module, most first: where a cold cache's time goes (a warm one reads each row back)."""
    total: dict[str, float] = {}
    for row in rows:
        module = row.kernel.split(".", 1)[0]
        total[module] = total.get(module, 0.0) + row.compile_s
    return {m: round(s, 1) for m, s in sorted(total.items(), key=lambda item: -item[1])}


def write_json(path: Path, shapes, kernels, rows: list[Row], seconds: float) -> None:
    doc = {
        "targets": {c: {"gpu": gpu, "shared_limit": limit} for c, (gpu, limit) in TARGETS.items()},
        "shapes": [{"name": s.name, **asdict(s), "sources": src} for s, src in shapes.items()],
        "kernels": kernels,
        "rows": [asdict(r) for r in rows],
        "failures": sum(bool(r.failures) for r in rows),
        "seconds": round(seconds, 1),
        "seconds_by_module": seconds_by_module(rows),
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", choices=tuple(SHAPE_SETS), default="shipped",
                    help="shipped: the configs' (default); paper: the paper's head dims and groups; harness: what "
                         "bench/gpu_nsa_speed.py times (before a GPU session); all")
    ap.add_argument("--targets", default=",".join(map(str, TARGETS)), help="compute capabilities, e.g. 80,90")
    ap.add_argument("--markdown", type=Path, help="also write the table as markdown here")
    ap.add_argument("--json", type=Path, help="also write every row as JSON here")
    args = ap.parse_args(argv)
    targets = [int(t) for t in args.targets.split(",")]
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        ap.error(f"--targets: no shared-memory limit known for {unknown}; known: {sorted(TARGETS)}")

    start = time.perf_counter()
    shapes = select_shapes(args.shapes)
    rows, kernels = check_all(shapes, targets)
    seconds = time.perf_counter() - start

    print("\n".join(legend(shapes)))
    print(text_table(rows))
    failed = [r for r in rows if r.failures]
    print(f"{len(rows)} kernel compiles ({args.shapes} shapes) in {seconds:.1f} s; {len(failed)} failed")
    print("seconds by module: " + ", ".join(f"{m} {s:.1f}" for m, s in seconds_by_module(rows).items()))
    if args.markdown:
        args.markdown.write_text("\n".join(f"- {line}" for line in legend(shapes)) + "\n\n" + markdown_table(rows) + "\n")
    if args.json:
        write_json(args.json, shapes, kernels, rows, seconds)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
