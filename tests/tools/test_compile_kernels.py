"""scripts/compile_kernels.py: every Triton kernel of nsa/ compiles ahead of time for sm_80 and sm_90 on this
CPU machine at the shape of every shipped config that can run on a GPU, in bf16 and fp32, within the targets'
limits; and the check fails when a kernel needs more shared memory than a target has or does not compile (caused
by real kernels compiled through the script's own functions, not mocked).

The shipped run is two subprocesses side by side, one per target (~10 s with Triton's cache warm; a cold cache
compiles everything: 704 compiles, 640 s on one core of this 2-core VM, 740 s inside the cold suite: most of the
cold suite's extra time, docs/BENCHMARKS.md "The test suite's time"). conftest.py starts this file first, so that
it runs beside the rest."""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nsa.triton_support import triton_unavailable
from train.core.config import load_config

if problem := triton_unavailable():  # no Triton, or one older than the kernels support: nothing to compile with
    pytest.skip(problem, allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "compile_kernels.py"
spec = importlib.util.spec_from_file_location("compile_kernels", SCRIPT)
ck = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
spec.loader.exec_module(ck)

pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")  # Triton 3.9's notice of a 3.10 change
SELECTION_KERNELS = {"_fwd_kernel", "_dq_kernel", "_dkv_kernel", "_dkv_reduce_kernel"}


def _is_triton_jit(decorator: ast.expr) -> bool:
    node = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(node, ast.Attribute) and node.attr == "jit" and getattr(node.value, "id", "") == "triton"


def jit_kernels(path: Path) -> set[str]:
    """The @triton.jit functions of a source file that no other of them calls (those are launched)."""
    funcs = [f for f in ast.walk(ast.parse(path.read_text())) if isinstance(f, ast.FunctionDef)
             and any(_is_triton_jit(d) for d in f.decorator_list)]
    called = {c.func.id for f in funcs for c in ast.walk(f) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
    return {f.name for f in funcs} - called


def modules_with_kernels() -> dict[str, set[str]]:
    """module name -> kernels, for every file of nsa/ with a @triton.jit function."""
    out = {}
    for path in sorted((REPO / "nsa").rglob("*.py")):
        kernels = jit_kernels(path)
        if kernels:
            out[".".join(path.relative_to(REPO).with_suffix("").parts)] = kernels
    return out


def shipped_configs() -> dict[str, dict]:
    """config name -> the Shape fields its NSA kernels are compiled at: every NSA config that can run on a GPU
    (one pinned to runtime.device: cpu launches no Triton kernel)."""
    out = {}
    for path in sorted((REPO / "configs").glob("*.yaml")):
        cfg = load_config(path)
        m = cfg.model
        if m.attention == "nsa" and cfg.runtime.device != "cpu":
            out[path.stem] = dict(hd=m.head_dim, G=m.n_heads // m.n_kv_heads, H_kv=m.n_kv_heads, l=m.nsa.l,
                                  d=m.nsa.d, l_sel=m.nsa.l_sel, n=m.nsa.n_sel, T=cfg.train.seq_len)
    return out


@pytest.fixture(scope="module")
def shipped_run(tmp_path_factory) -> list[tuple]:
    """The script at the shipped shapes, one process per target (sm_80, sm_90) run side by side: a cold cache's
    ~11 CPU-minutes in two halves, each well inside its time limit on a slow or busy machine (one process of both
    once ran past 900 s inside a cold suite on a busy VM). -> [(completed process, its JSON report, its markdown)]."""
    out = tmp_path_factory.mktemp("compile_kernels")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # tests/conftest.py sets it
    runs = {}
    for target in (80, 90):
        files = (out / f"k{target}.json", out / f"k{target}.md")
        runs[target] = files, subprocess.Popen(
            [sys.executable, str(SCRIPT), "--shapes", "shipped", "--targets", str(target), "--json", str(files[0]),
             "--markdown", str(files[1])], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    parts = []
    try:
        for target, ((json_file, md_file), process) in runs.items():
            stdout, stderr = process.communicate(timeout=2400)  # a hang's bound, not a speed check
            proc = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
            assert json_file.exists(), f"sm_{target}: " + stdout[-3000:] + stderr[-3000:]
            parts.append((proc, json.loads(json_file.read_text()), md_file.read_text()))
    finally:
        for _, process in runs.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    return parts


def test_every_kernel_module_is_listed_in_the_script():
    found = modules_with_kernels()
    assert SELECTION_KERNELS <= found["nsa.attention.kernels.selected_attention"]
    listed = {name for name, _ in ck.KERNEL_MODULES}
    assert set(found) <= listed, f"add these modules to KERNEL_MODULES: {sorted(set(found) - listed)}"


def test_table_covers_every_kernel_config_target_and_dtype(shipped_run):
    (proc80, doc, md80), (proc90, doc90, md90) = shipped_run
    assert doc["shapes"] == doc90["shapes"]
    shapes = {s["name"]: s for s in doc["shapes"]}
    rows = {(r["kernel"], r["shape"], r["dtype"], r["target"]) for d in (doc, doc90) for r in d["rows"] if not r["error"]}
    configs = shipped_configs()
    assert {"m7c_125m_24g", "m7c_125m_80g", "train_showcase_nsa"} <= set(configs)  # the pilot's and the showcase's
    for config, fields in configs.items():
        (shape,) = [s for s in shapes.values() if config in s["sources"]]
        assert {k: shape[k] for k in fields} == fields, config
        for module, kernels in modules_with_kernels().items():
            assert module in doc["kernels"], f"{module} not compiled"
            for kernel in kernels:
                label = f"{module.rsplit('.', 1)[-1]}.{kernel}"
                for dtype in ("bf16", "fp32"):
                    for target in (80, 90):
                        assert (label, shape["name"], dtype, target) in rows, (label, config, dtype, target)
                assert all(label in proc.stdout and label in md for proc, md in ((proc80, md80), (proc90, md90)))


def test_shipped_shapes_pass(shipped_run):
    for proc, doc, _ in shipped_run:
        assert {r["target"] for r in doc["rows"]} == {int(proc.args[proc.args.index("--targets") + 1])}
        failed = [f"{r['kernel']} {r['shape']} {r['dtype']} sm_{r['target']}: {r['failures']}" for r in doc["rows"]
                  if r["failures"]]
        assert proc.returncode == 0 and not failed, "\n".join(failed) + "\n" + proc.stderr[-2000:]


def test_compile_time_is_attributed_to_every_module_within_the_total(shipped_run):
    """Each row's seconds (a compile, or a cache read) sum per module, most first, to no more than the run's time."""
    for proc, doc, _ in shipped_run:
        by_module = doc["seconds_by_module"]
        assert set(by_module) == {r["kernel"].split(".", 1)[0] for r in doc["rows"]}
        assert all(r["compile_s"] >= 0 for r in doc["rows"])
        assert list(by_module.values()) == sorted(by_module.values(), reverse=True)
        assert 0 < sum(by_module.values()) <= doc["seconds"] + 0.05 * len(by_module)
        assert "seconds by module: " + next(iter(by_module)) in proc.stdout


# ---------------------------------------------------------------- the check fails when it should
@pytest.fixture(scope="module")
def synthetic_rows() -> dict[str, list]:
    """tests/tools/synthetic_kernels.py's compiles, in a process of their own without TRITON_INTERPRET (in
    this one, if tests/nsa was collected, triton was imported with it set and cannot compile for a GPU)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.tools.synthetic_kernels"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {case: [ck.Row(**row) for row in rows] for case, rows in json.loads(proc.stdout).items()}


def test_shared_memory_over_the_target_limit_fails(synthetic_rows):
    for row in synthetic_rows["tile_dot_16_stages"]:  # 16 stages x 32 KB > 232448 B and > 166912 B
        limit = ck.TARGETS[row.target][1]
        assert row.num_stages == 16 and row.shared > limit, (row.target, row.shared)
        assert row.failures == [f"shared memory {row.shared} B > {limit} B"]
    for row in synthetic_rows["tile_dot_2_stages"]:  # the same kernel with 2 stages fits
        assert row.num_stages == 2 and row.failures == [] and row.mma in ("mma.sync", "wgmma")


def test_a_compile_error_fails(synthetic_rows):
    for row in synthetic_rows["bad_arange"]:
        assert row.error.startswith("compile error:") and row.failures == [row.error]


# ---------------------------------------------------------------- scripts/kernel_loops.py: the loops' SASS counted
SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDS R2, [R3] ;
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0030*/               @P0 BRA `(.L_x_1) ;
        /*0040*/                   SHFL.BFLY PT, R4, R2, 0x1, 0x1f ;
.L_x_1:
        /*0050*/                   MUFU.EX2 R5, R4 ;
        /*0060*/              @!P1 BRA `(.L_x_0) ;
        /*0070*/                   EXIT ;
"""


def test_kernel_loops_reads_a_loop_from_its_backward_branch():
    """A backward branch spans its loop (the forward branch inside is part of the body, not a loop); predicated
    opcodes count by family."""
    spec = importlib.util.spec_from_file_location("kernel_loops", REPO / "scripts" / "kernel_loops.py")
    kl = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(kl)
    whole, loops = kl.sass_loops(SASS)
    assert whole.instructions == 8 and whole.families == {"BAR": 1, "LDS": 1, "SHFL": 1, "MUFU": 1}
    assert [(loop.first, loop.last, loop.instructions) for loop in loops] == [(1, 6, 6)]
    assert loops[0].families == {"BAR": 1, "LDS": 1, "SHFL": 1, "MUFU": 1}


def test_kernel_loops_counts_the_selection_kernels(shipped_run, tmp_path):
    """The script on the real kernels at the shipped M7C shape (compiled above: Triton's cache), sm_90: the fused
    selection kernel's chunk loop waits on more barriers than the two-launch design's scores loop (the reason for
    that design, docs/BENCHMARKS.md); both loops hold the chunk's MMA and exps; the top-n kernel's one loop is its
    bisection (a loop since 2026-12-07, not unrolled), with no barrier in it: a row's count stays within its warp."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "kernel_loops.py"), "--T", "2048", "--json",
                           str(tmp_path / "loops.json")], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kernels = json.loads((tmp_path / "loops.json").read_text())["kernels"]
    assert set(kernels) == {"fused", "two_pass_scores", "two_pass_top_n", "two_pass_scores_documents",
                            "two_pass_top_n_documents"}
    fused, scores = kernels["fused"]["loops"][0]["families"], kernels["two_pass_scores"]["loops"][0]["families"]
    assert fused["BAR"] > scores["BAR"] > 0, (fused, scores)
    for loop in (fused, scores):
        assert loop.get("HGMMA", 0) + loop.get("HMMA", 0) > 0 and loop["MUFU"] > 0
    top_n = kernels["two_pass_top_n"]
    assert len(top_n["loops"]) == 1 and top_n["loops"][0]["families"].get("BAR", 0) == 0, top_n["loops"]
    assert top_n["families"]["BAR"] > 0
    assert "| fused | _select_topk_kernel |" in proc.stdout


def test_harness_shapes_are_what_the_speed_harness_times():
    """--shapes harness: bench/gpu_nsa_speed.py's layouts at its geometries (fla's only at the paper's layout), 64k,
    read from the harness itself; not shipped, so their spills are reported, not failed."""
    spec = importlib.util.spec_from_file_location("gpu_nsa_speed", REPO / "bench" / "gpu_nsa_speed.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    shapes = ck.select_shapes("harness")
    assert sorted(src for sources in shapes.values() for src in sources) == [
        "harness_m7c", "harness_paper", "harness_paper_fla_geometry"]
    for shape, (source,) in shapes.items():
        layout = harness.LAYOUTS[source.split("_")[1]]
        geometry = harness.FLA_GEOMETRY if source.endswith("fla_geometry") else harness.NSA_GEOMETRY
        assert (shape.hd, shape.G * shape.H_kv, shape.H_kv) == (layout["head_dim"], layout["n_heads"], layout["n_kv_heads"])
        assert (shape.l, shape.d, shape.l_sel, shape.n, shape.T) == (geometry["l"], geometry["d"], geometry["l_sel"],
                                                                     geometry["n_sel"], 65536)
        assert not ck.is_shipped([source])
    assert set(shapes) <= set(ck.select_shapes("all"))
