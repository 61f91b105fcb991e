"""train.postrun: eval-only validation of the final checkpoint, the record, and the archive."""
from __future__ import annotations

import json
import math
import shutil
import tarfile
from pathlib import Path

import pytest

from train import postrun
from train.workflows import postrun as postrun_lib


@pytest.fixture
def run_copy(tmp_path, tiny_run) -> Path:
    """A copy of the tiny run elsewhere: config.yaml's out_dir still names the original."""
    dest = tmp_path / "copied_run"
    shutil.copytree(tiny_run, dest, symlinks=True)
    return dest


def _members(tarball: Path) -> list[str]:
    with tarfile.open(tarball) as tar:
        return [Path(m.name).name for m in tar.getmembers()]


def test_validates_records_and_archives(run_copy, tmp_path, capsys):
    archive_dir = tmp_path / "archive"
    assert postrun.main([str(run_copy), "--archive-dir", str(archive_dir)]) == 0
    result = json.loads((run_copy / "eval_step8.json").read_text())
    assert result["step"] == 8 and math.isfinite(result["val_loss"])
    assert Path(result["checkpoint"]).parent == run_copy  # validated the copy, not the original
    record = json.loads((run_copy / "postrun.json").read_text())
    assert record["validation"]["val_loss"] == result["val_loss"]
    assert record["git_sha_run"] == json.loads((run_copy / "metrics.json").read_text())["git_sha"]
    assert record["analysis"]["calculation_method"] == "component_summation_v2025"
    tarballs = list(archive_dir.glob("*.tar.gz"))
    assert len(tarballs) == 1
    members = _members(tarballs[0])
    for name in ("config.yaml", "metrics.json", "eval_step8.json", "postrun.json", "training.csv"):
        assert name in members, name
    assert any(m.startswith("run_") and m.endswith(".json") for m in members)
    assert not any(m.endswith(".pt") for m in members)  # no weights unless --with-weights
    out = capsys.readouterr().out
    assert "✓ validated checkpoint_step8.pt" in out and "scripts/handoff.py" in out


def test_archive_without_validation(run_copy, tmp_path):
    assert postrun.main([str(run_copy), "--no-eval", "--archive-dir", str(tmp_path / "a")]) == 0
    (tarball,) = (tmp_path / "a").glob("*.tar.gz")
    members = _members(tarball)
    assert {"config.yaml", "metrics.json", "postrun.json"} <= set(members)
    assert any(m.startswith("run_") for m in members)
    assert not (run_copy / "eval_step8.json").exists()  # --no-eval
    assert json.loads((run_copy / "postrun.json").read_text())["validation"] is None


def test_no_checkpoint_is_a_one_line_error(run_copy, tmp_path, capsys):
    for ckpt in run_copy.glob("checkpoint_step*.pt"):
        ckpt.unlink()
    assert postrun.main([str(run_copy), "--archive-dir", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no checkpoint" in err and err.count("\n") == 1
    assert postrun.main([str(tmp_path / "nowhere")]) == 2


def test_run_config_of_a_learned_position_model_reloads(tmp_path):
    """The trainer's config.yaml lists rope_* and an nsa section for every model; the loader refuses
    them for a dense, learned-position model, so postrun drops those inert keys."""
    from tests.train.helpers import tiny_config
    from train.core.config import dump_config

    cfg = tiny_config(tmp_path / "out", "--model.pos_emb=learned")
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    loaded = postrun_lib.load_run_config(tmp_path, ["--train.eval_only=true"])
    assert loaded.model == cfg.model and loaded.train.eval_only
