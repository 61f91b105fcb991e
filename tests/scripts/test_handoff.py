"""scripts/handoff.py: the tarball holds exactly what its MANIFEST lists (sizes and sha256), the
checkpoint manifest, plots for a person to look at, weights only on request; run dir or out_dir."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile

from tests.scripts.helpers import REPO
from tests.scripts.test_monitor import HEALTHY_GATES, make_out

PY = sys.executable  # the venv's python (under the suite, the fork server's: tests/forkserver.py)


def handoff(*args, env=None):
    return subprocess.run([PY, "scripts/handoff.py", *map(str, args)], cwd=REPO, text=True, capture_output=True,
                          timeout=120, env=env)


def manifest_entries(text: str) -> dict[str, tuple[int, str]]:
    files, section = {}, None
    for line in text.splitlines():
        if line.startswith("# files"):
            section = "files"
        elif line.startswith("# checkpoints"):
            section = "ckpt"
        elif section == "files" and not line.startswith("#"):
            size, digest, path = line.split()
            files[path] = (int(size), digest)
    return files


def test_run_dir_handoff_matches_its_manifest(tmp_path):
    out = make_out(tmp_path, gates=HEALTHY_GATES)
    (out / "checkpoint_step50.pt").write_bytes(b"older" * 100)
    os.symlink("checkpoint_step100.pt", out / "latest.pt")
    (out / ".anomaly_type").write_text("nonfinite_loss\n")
    (out / ".launch.lock").write_text("")
    (out / "config.yaml").write_text("train:\n  steps: 1000\n")
    (out / "tb").mkdir()
    run = tmp_path / "train_runs" / "m7c_20250101_000000"
    run.mkdir(parents=True)
    (run / "run.info").write_text(f"config: configs/m7c_cpu.yaml\nout_dir: {out}\n")
    (run / "train.log").write_text("step 10 | loss 5.9\n")
    (run / "smoke.log").write_text("done\n")

    res = handoff(run, "--out-dir", tmp_path / "handoff")
    assert res.returncode == 0, res.stderr
    tar_path = tmp_path / "handoff" / res.stdout.strip().splitlines()[-1].split()[1].split("/")[-1]
    assert tar_path.name.startswith("m7c_20250101_000000_") and tar_path.exists()
    with tarfile.open(tar_path) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    base = tar_path.name[: -len(".tar.gz")]
    manifest = members.pop(f"{base}/MANIFEST.txt").decode()
    assert manifest in res.stdout  # printed for the operator too
    listed = manifest_entries(manifest)
    assert {f"{base}/{p}" for p in listed} == set(members)
    for path, (size, digest) in listed.items():
        data = members[f"{base}/{path}"]
        assert len(data) == size and hashlib.sha256(data).hexdigest() == digest, path
    for path in ("run/run.info", "run/train.log", "run/smoke.log", "out/training.csv", "out/val.csv",
                 "out/metrics.json", "out/config.yaml", "out/heartbeat_rank0.jsonl", "out/heartbeat_rank1.jsonl",
                 "out/anomaly_type.txt", "checkpoints.json", "plots/loss.png", "plots/throughput.png",
                 "plots/lr.png", "plots/gates.png"):
        assert path in listed, path
    assert not any(p.startswith("weights/") or p.endswith(".pt") or "lock" in p for p in listed)
    for png in ("loss", "throughput", "lr", "gates"):
        assert members[f"{base}/plots/{png}.png"].startswith(b"\x89PNG")
    ckpts = json.loads(members[f"{base}/checkpoints.json"])
    assert [c["name"] for c in ckpts["checkpoints"]] == ["checkpoint_step50.pt", "checkpoint_step100.pt"]
    assert ckpts["checkpoints"][1]["sha256"] == hashlib.sha256(b"x" * 2000).hexdigest()
    assert ckpts["latest"] == "checkpoint_step100.pt"
    assert f"{hashlib.sha256(b'x' * 2000).hexdigest()}  checkpoint_step100.pt" in manifest


def test_out_dir_with_weights(tmp_path):
    out = make_out(tmp_path)
    (out / "checkpoint_step50.pt").write_bytes(b"older")
    env = dict(os.environ, ARTIFACTS_DIR=str(tmp_path / "art"))
    res = handoff(out, "--with-weights", env=env)
    assert res.returncode == 0, res.stderr
    tars = list((tmp_path / "art" / "handoff").glob("out_*.tar.gz"))
    assert len(tars) == 1
    with tarfile.open(tars[0]) as tar:
        names = [m.name.split("/", 1)[1] for m in tar.getmembers()]
    assert "weights/checkpoint_step100.pt" in names and "weights/checkpoint_step50.pt" not in names
    assert "plots/gates.png" not in names  # no gate keys: noted in the manifest instead
    assert "note: gates.png: no gate_* keys" in res.stdout


def test_bad_target(tmp_path):
    res = handoff(tmp_path)
    assert res.returncode == 2 and "neither a run dir" in res.stderr
    res = handoff(env=dict(os.environ, ARTIFACTS_DIR=str(tmp_path)))
    assert res.returncode == 2 and "no run given" in res.stderr


def test_resumed_run_packs_every_segment(tmp_path):
    """Three launches wrote one out_dir (a run resumed twice) and an unrelated run sits beside them:
    the handoff of the last launch holds all three segments' run.info, smoke and train logs."""
    out = make_out(tmp_path)
    runs = tmp_path / "artifacts" / "train_runs"
    names = ["m7c_20250101_000000", "m7c_20250102_000000", "m7c_20250103_000000"]
    for i, name in enumerate(names):
        (runs / name).mkdir(parents=True)
        (runs / name / "run.info").write_text(f"out_dir: {out}\nresume_from: segment {i}\n")
        (runs / name / "train.log").write_text(f"segment {i} log\n")
        (runs / name / "smoke.log").write_text(f"segment {i} smoke\n")
    other = runs / "m7c_20250104_000000"
    other.mkdir()
    (other / "run.info").write_text(f"out_dir: {tmp_path / 'elsewhere'}\n")
    (other / "train.log").write_text("not this run\n")

    res = handoff(runs / names[-1], "--out-dir", tmp_path / "handoff")
    assert res.returncode == 0, res.stderr
    tar_path = next((tmp_path / "handoff").glob("*.tar.gz"))
    with tarfile.open(tar_path) as tar:
        members = {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    for i, name in enumerate(names):
        assert members[f"segments/{name}/train.log"] == f"segment {i} log\n".encode()
        assert members[f"segments/{name}/smoke.log"] == f"segment {i} smoke\n".encode()
        assert f"segment {i}".encode() in members[f"segments/{name}/run.info"]
    assert not any("m7c_20250104_000000" in m for m in members)
    assert f"segments (launches of this out_dir, oldest first): {' '.join(names)}" in res.stdout
    # an out_dir target finds the same launches under ARTIFACTS_DIR/train_runs
    res = handoff(out, "--out-dir", tmp_path / "handoff2", env={**os.environ, "ARTIFACTS_DIR": str(tmp_path / "artifacts")})
    assert res.returncode == 0 and f"oldest first): {' '.join(names)}" in res.stdout, res.stderr
