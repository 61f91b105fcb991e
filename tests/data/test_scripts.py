"""Pre-flight scripts and benchmarks run offline on local data."""
import importlib.util
import json

from tests.data.conftest import write_texts
from train.data.prepare import main as prepare_main


def _load(repo_dir, rel):
    spec = importlib.util.spec_from_file_location(rel.replace("/", "_")[:-3], repo_dir / rel)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_check_fwe_stream_on_a_local_source(repo_dir, tmp_path, docs, capsys):
    source = write_texts(tmp_path / "t", docs[:6])
    check = _load(repo_dir, "scripts/datasets/check_fwe_stream.py")
    assert check.main(["--source", source, "--seq-len", "64", "--batches", "2"]) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("ok batch")]
    assert lines == ["ok batch[0] lens: [64, 64] eos: [0, 0]", "ok batch[1] lens: [64, 64] eos: [0, 0]"]
    assert check.main(["--source", f"text:{tmp_path}/none/*.txt", "--batches", "1"]) == 2
    assert "matched no files" in capsys.readouterr().err


def test_prepare_cli_and_eye_test(repo_dir, tmp_path, docs, capsys):
    source = write_texts(tmp_path / "t", docs[:8])
    out = tmp_path / "data" / "kjv8"
    assert prepare_main(["--source", source, "--tokenizer", "byte", "--out", str(out), "--val-fraction", "0.3", "--workers", "1"]) == 0
    assert capsys.readouterr().out.startswith(f"ok {out}: train ")
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == "byte" and meta["eos_id"] == 256
    eye = _load(repo_dir, "scripts/datasets/eye_test.py")
    assert eye.main([str(out), "--tokens", "40"]) == 0
    text = capsys.readouterr().out
    assert text.count("=====") == 8 and docs[0][:20] in text  # start/end of train and val
    assert prepare_main(["--source", "synthetic", "--out", str(tmp_path / "x"), "--workers", "1"]) == 2
