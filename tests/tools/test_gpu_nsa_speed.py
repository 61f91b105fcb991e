"""bench/gpu_nsa_speed.py's plumbing on CPU (Triton's interpreter, tiny shapes): the correctness section passes on
the real kernels and fails on a perturbed one, every arm and stage is timed with its counted FLOPs and bytes, the
summary names each ratio, and a second call merges into the same results file without losing the first's sections."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.scripts.helpers import GPU_IMAGE_LACKS, blocking_site

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_nsa_speed.py"
# the window branch's output scaled by 0.9 (a kernel that is wrong by 10%): the check must catch it
PERTURBED = """
import runpy, sys
from nsa.attention import ops
real = ops.window_attention
ops.window_attention = lambda *a, **k: real(*a, **k) * 0.9
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def image_env(tmp: Path) -> dict[str, str]:
    """The subprocess environment with GPU_IMAGE_LACKS's imports failing, as on the GPU machine's image."""
    site = blocking_site(tmp / "image_site", GPU_IMAGE_LACKS, "is not on the GPU machine's image")
    return {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}


def run(out: Path, *args: str, code: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *(["-c", code] if code else []), str(SCRIPT), "--out", str(out), "--device", "cpu", "--tiny",
           *args]
    env = env or {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def results(out: Path) -> dict:
    (path,) = out.glob("gpu_nsa_speed_cpu_*.json")
    return json.loads(path.read_text())


def test_tiny_run_checks_then_times_every_arm_and_stage_and_merges(tmp_path):
    env = image_env(tmp_path)  # as on the GPU machine's image: no datasets, no flash-attn
    for package in GPU_IMAGE_LACKS:
        probe = subprocess.run([sys.executable, "-c", f"import {package}"], env=env, capture_output=True, text=True)
        assert "not on the GPU machine's image" in probe.stderr, probe.stderr[-500:]
    out = tmp_path / "out"
    proc = run(out, env=env)  # every section
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = results(out)
    assert report["device"] == "cpu" and report["tiny"] is True
    sections = report["sections"]
    correct = sections["correctness"]
    assert correct["ok"] and set(correct["cases"]) == {"m7c", "paper"}
    slack = correct["slack"]  # the interpreter's truncating bf16 casts (gpu_nsa_speed.correctness)
    assert slack == 2.5
    for case in correct["cases"].values():  # both kernel families (G = 6 block-centric, G = 16 query-centric)
        assert 0 < case["reference_out"] < slack * correct["tolerance"]["reference_out"]
        assert 0 < case["out"] < slack * correct["tolerance"]["out"] and case["worst"][1] <= 1
        assert "x" in case["grad"] and "compress_k.fc_in.weight" in case["grad"]  # every gradient compared
        assert all(0 < g["triton_bf16"] <= g["bound"] for g in case["grad"].values())
    assert sections["ceilings"]["copy_bytes_per_s"] > 0 and sections["ceilings"]["bf16_matmul_flops_per_s"] > 0
    rows = sections["attention"]["rows"]
    assert "partial" not in sections["attention"]  # the section's last save replaces the partial ones
    assert {(r["layout"], r["T"]) for r in rows} == {(layout, T) for layout in ("m7c", "paper") for T in (96, 160)}
    for r in rows:
        for arm in ("nsa", "sdpa"):
            assert r[f"{arm}_fwd_ms"] > 0 and r[f"{arm}_fwd_bwd_ms"] > 0, r
        assert r["flex_fwd_ms"] > 0 and "flex_fwd_bwd_ms" not in r  # FlexAttention has no backward on CPU
        backward = {f"{stage}_fwd_bwd" for stage in ("compress", "compressed", "selected", "window")} | (
            {"compressed_unfolded_fwd_bwd"} if r["layout"] == "m7c" else set())  # the fold compared at M7C's layout
        assert set(r["stages"]) == {"compress", "compressed", "select", "select_fused", "selected", "window"} | backward
        # the one-launch selection kernel timed beside the layer's (the torch path's on CPU): the same picks here
        assert r["stages"]["select_fused"]["fwd_ms"] > 0 and r["stages"]["select_fused"]["rows_differing"] <= 0.02
        assert all(r["stages"][name]["fwd_bwd_ms"] > 0 for name in backward), r["stages"]
        # the selected branch reads n*l' keys per query at most: its counted FLOPs are below dense causal's
        assert 0 < r["stages"]["selected"]["flops"] and 0 < r["stages"]["selected"]["roofline_fraction"]
        # against the bytes its own order moves (block order for M7C's G = 6, partials included): a higher floor
        sel = r["stages"]["selected"]
        assert sel["order"] == ("bytes_block_order" if r["layout"] == "m7c" else "bytes_query_order")
        assert sel["roofline_fraction_as_built"] >= sel["roofline_fraction"]
    for r in rows:  # issue 51: NSA with the learned indexer (its KL differentiated too) beside pooled NSA, at M7C's
        if r["layout"] == "m7c":
            for arm in ("indexer", "indexer_scores"):
                assert r[f"{arm}_fwd_ms"] > 0 and r[f"{arm}_fwd_bwd_ms"] > 0, r
                assert r[f"{arm}_extra_fwd_bwd"] == round(r[f"{arm}_fwd_bwd_ms"] / r["nsa_fwd_bwd_ms"] - 1, 3)
        else:
            assert "indexer_fwd_ms" not in r
    busy = sections["attention"]["busy"]
    assert busy["wall_ms"] >= busy["host_issue_ms"] > 0
    assert busy["wall_ms_dispatched"] >= busy["host_issue_ms_dispatched"] > 0  # the ops through the dispatcher
    summary = report["summary"]
    assert summary["m7c_nsa_over_sdpa_fwd_bwd_160"] == next(
        r["nsa_over_sdpa_fwd_bwd"] for r in rows if r["layout"] == "m7c" and r["T"] == 160)
    assert "paper_nsa_over_flex_fwd_160" in summary
    m7c_160 = next(r for r in rows if r["layout"] == "m7c" and r["T"] == 160)["stages"]["selected"]
    assert summary["m7c_selected_fwd_roofline_fraction_as_built_160"] == m7c_160["roofline_fraction_as_built"]
    assert summary["m7c_indexer_scores_extra_fwd_bwd_160"] == next(
        r["indexer_scores_extra_fwd_bwd"] for r in rows if r["layout"] == "m7c" and r["T"] == 160)
    runs = sections["train"]["runs"]  # a tiny M7C and its dense twin through the trainer, tokens/s from the heartbeat
    assert runs["nsa_128"]["toks_per_s"] > 0 and runs["dense_128"]["toks_per_s"] > 0
    assert runs["ideal_128"] == round(runs["dense_128"]["flops_per_token"] / runs["nsa_128"]["flops_per_token"], 3)
    assert summary["train_nsa_over_dense_128"] == round(runs["nsa_128"]["toks_per_s"] / runs["dense_128"]["toks_per_s"], 3)
    decode = sections["decode"]  # the whole model over static caches, checked against a full forward first
    assert decode["ok"] and decode["model"]["summary"]["checks_ok"]
    assert {(r["model"], r["S"], r["B"]) for r in decode["model"]["rows"]} == {
        (m, S, B) for m in ("nsa", "dense") for S in (96, 160) for B in (1, 2)}
    for kind in ("nsa", "dense"):
        assert 0 < decode["model"]["checks"][kind]["eager_vs_full"] < 1e-5  # float32 on CPU
    assert summary["decode_nsa_over_dense_160_b2_eager"] == decode["model"]["summary"]["decode_nsa_over_dense_160_b2_eager"]
    assert summary["decode_layer_nsa_over_dense_160_b1"] == decode["layer"]["summary"]["speedup_160"]
    mfu = sections["mfu"]  # the dense ~1B run through the trainer: eager on a CPU, so no compiled MFU in the summary
    assert mfu["ok"] and mfu["toks_per_s"] > 0 and mfu["compiled"] is False
    assert "dense_1b_mfu_compiled" not in summary

    # a later call replaces its own sections and keeps the others
    proc = run(out, "--only", "ceilings")
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = results(out)
    assert again["sections"]["attention"] == sections["attention"] and again["summary"] == summary
    assert again["sections"]["ceilings"] != sections["ceilings"]  # measured again


def test_a_call_killed_inside_the_attention_section_keeps_the_rows_it_finished(tmp_path):
    """The device kills a command at its time limit: the attention section is saved after its busy step and after each
    row (`partial: true`), so a SIGKILL after the first row leaves a whole results file holding that row."""
    cmd = [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--device", "cpu", "--tiny", "--only", "attention",
           "--arms", "flex"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rows, deadline = [], time.time() + 300
    try:
        while not rows and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
            files = list(tmp_path.glob("gpu_nsa_speed_cpu_*.json"))
            if files:
                rows = json.loads(files[0].read_text())["sections"]["attention"]["rows"]
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]  # still running: the kill lands mid-section
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    section = results(tmp_path)["sections"]["attention"]  # a whole JSON file (written to a temporary, then renamed)
    assert section["partial"] is True and section["busy"]["wall_ms"] > 0
    assert 1 <= len(section["rows"]) < 4 and section["rows"][0]["nsa_fwd_bwd_ms"] > 0


def test_refuses_cpu_without_the_interpreter(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--device", "cpu", "--tiny"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --device cpu runs the Triton kernels in Triton's interpreter: set TRITON_INTERPRET=1"]
    assert not list(tmp_path.iterdir())  # nothing written


def test_correctness_fails_on_a_perturbed_kernel(tmp_path):
    proc = run(tmp_path, "--only", "correctness", code=PERTURBED)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    correct = results(tmp_path)["sections"]["correctness"]
    assert not correct["ok"]
    assert all(case["reference_out"] > correct["slack"] * correct["tolerance"]["reference_out"]
               for case in correct["cases"].values())


def test_summary_names_graphed_training_apart():
    """--train_graphs' runs (key suffix _graphs) get their own ratio; the plain ones keep theirs."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_nsa_speed", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    runs = {"nsa_8192": {"toks_per_s": 150.0}, "dense_8192": {"toks_per_s": 300.0}, "ideal_8192": 2.0,
            "nsa_8192_graphs": {"toks_per_s": 240.0}, "dense_8192_graphs": {"toks_per_s": 320.0},
            "nsa_2048_graphs": {"exit": 1, "output": "..."}, "dense_2048_graphs": {"toks_per_s": 1.0}}
    summary = bench.summarise({"train": {"runs": runs}})
    assert summary == {"train_nsa_over_dense_8k": 0.5, "train_nsa_over_dense_8k_graphs": 0.75}
    # the dense ~1B MFU enters the summary only from a compiled run (issue 50's key is the compiled one)
    assert bench.summarise({"mfu": {"ok": True, "mfu": 0.41, "compiled": True}}) == {"dense_1b_mfu_compiled": 0.41}
    assert bench.summarise({"mfu": {"ok": True, "mfu": 0.31, "compiled": False}}) == {}


def test_the_gpu_session_calls_cover_every_section_and_name_only_real_ones(tmp_path):
    """scripts/gpu_session.sh N (DRY_RUN=1 prints its commands): each call runs the harness or the acceptance with
    sections they have, every harness section is in some call, and the runbook item is in the last."""
    import importlib.util
    import shlex

    loaded = {}
    for name in ("gpu_nsa_speed", "gpu_acceptance"):
        spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
        loaded[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded[name])
    choices = {"bench/gpu_nsa_speed.py": set(loaded["gpu_nsa_speed"].SECTIONS),
               "bench/gpu_acceptance.py": set(loaded["gpu_acceptance"].ITEMS) | set(loaded["gpu_acceptance"].FIRST_PASS)}
    covered = {script: set() for script in choices}
    for call in "1234":
        proc = subprocess.run(["bash", "scripts/gpu_session.sh", call], cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path)}, timeout=60)
        assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr
        for line in proc.stdout.splitlines():
            argv = shlex.split(line)
            script, only = argv[1], argv[argv.index("--only") + 1:]
            assert argv[argv.index("--out") + 1].startswith(str(tmp_path))  # only $OUT comes back from the device
            assert only and set(only) <= choices[script], (call, line)
            covered[script] |= set(only)
    assert covered["bench/gpu_nsa_speed.py"] == choices["bench/gpu_nsa_speed.py"]
    assert covered["bench/gpu_acceptance.py"] == {"runbook"} and "runbook" in line  # call 4's last command
    bad = subprocess.run(["bash", "scripts/gpu_session.sh", "5"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("usage: ")
