"""Pre-flight: passes on a good setup, and catches each planted fault with a ✗ (or ⚠ where advisory)."""
from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import pytest

from tests.tools.conftest import bin_args
from tests.train.helpers import tiny_config
from train.checkpoint import io as ckpt_io
from train.workflows.preflight import FAIL, OK, WARN, checkpoint_bytes, checkpoints_on_disk, run_preflight
from train.preflight import main
from train.trainer.safety import stale_halt_message

GOOD_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
PLENTY = lambda path: 10**15  # noqa: E731 - free-space stub


def make_cfg(tmp_path: Path, data_dir: Path, *extra: str):
    return tiny_config(tmp_path / "out", "--train.save_every=4", *bin_args(data_dir), *extra)


def check(cfg, **kw):
    args = dict(gpus=1, free_bytes=PLENTY, env=GOOD_ENV, cuda=False) | kw
    return run_preflight(cfg, **args)


def status(result, name: str) -> set[str]:
    found = result.find(name)
    assert found, f"no check named {name!r}: {[c.name for c in result.checks]}"
    return {c.status for c in found}


@pytest.fixture
def data_copy(tmp_path, kjv_bin) -> Path:
    dest = tmp_path / "data"
    shutil.copytree(kjv_bin, dest)
    return dest


def test_good_setup_passes_every_item(tmp_path, kjv_bin):
    result = check(make_cfg(tmp_path, kjv_bin))
    assert result.ok, result.render()
    for name in ("metadata", "vocab", "sizes", "checksums", "eye test", "sampler", "token dtype", "dataloader",
                 "zero1", "allocator", "checkpoint cadence", "wandb", "disk", "out_dir"):
        assert status(result, name) == {OK}, name
    assert len(result.eye_test) == 4  # start and end of train and val
    assert result.eye_test[0].startswith("train start @0: ")
    text = result.render()
    assert "✓ sizes" in text and "pre-flight PASS" in text and "✗" not in text


def test_wrong_dtype_in_metadata(tmp_path, data_copy):
    meta = json.loads((data_copy / "meta.json").read_text())
    meta["dtype"] = "uint32"  # the files hold uint16
    (data_copy / "meta.json").write_text(json.dumps(meta))
    result = check(make_cfg(tmp_path, data_copy))
    assert status(result, "sizes") == {FAIL}
    assert WARN in status(result, "eye test")  # pairs of bytes read as one id decode to nothing sensible
    assert not result.ok


def test_uint16_cannot_hold_a_large_vocabulary(tmp_path, data_copy):
    meta = json.loads((data_copy / "meta.json").read_text())
    meta["vocab_size"] = 151669
    (data_copy / "meta.json").write_text(json.dumps(meta))
    result = check(make_cfg(tmp_path, data_copy))
    assert FAIL in status(result, "token dtype")
    assert status(result, "vocab") == {FAIL}  # 151669 > the tiny model's 320


def test_vocab_mismatch(tmp_path, kjv_bin):
    result = check(make_cfg(tmp_path, kjv_bin, "--model.vocab_size=256"))  # byte tokenizer has 257 ids
    assert status(result, "vocab") == {FAIL}
    assert "257" in result.find("vocab")[0].detail


def test_truncated_bin(tmp_path, data_copy):
    path = data_copy / "train.bin"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 10)
    result = check(make_cfg(tmp_path, data_copy))
    assert status(result, "sizes") == {FAIL}
    assert "train.bin" in result.find("sizes")[0].detail


def test_altered_bin_fails_checksums_unless_skipped(tmp_path, data_copy):
    path = data_copy / "val.bin"
    data = bytearray(path.read_bytes())
    data[100] = (data[100] + 1) % 200  # same size, different content
    path.write_bytes(bytes(data))
    cfg = make_cfg(tmp_path, data_copy)
    assert status(check(cfg), "checksums") == {FAIL}
    skipped = check(cfg, checksums=False)
    assert status(skipped, "checksums") == {WARN} and skipped.ok


def test_tokenizer_that_does_not_match_the_data(tmp_path, kjv_bin):
    result = check(make_cfg(tmp_path, kjv_bin, "--data.tokenizer=gpt2", "--model.vocab_size=50304"))
    assert status(result, "tokenizer") == {FAIL}


def valid_checkpoint(out: Path, step: int, cfg) -> Path:
    """A small file that passes the trainer's checkpoint validation and resumes cfg's architecture."""
    out.mkdir(parents=True, exist_ok=True)
    return ckpt_io.save_checkpoint(out, step, {"model": {}, "optimizer": {}, "config": cfg.to_dict()},
                                   keep_last=1, keep_all=True)


def test_out_dir_under_resume_auto_and_none(tmp_path, kjv_bin):
    cfg = make_cfg(tmp_path, kjv_bin)
    out = Path(cfg.train.out_dir)
    assert status(check(cfg), "out_dir") == {OK}  # does not exist yet
    out.mkdir()
    (out / "training.csv").write_text("step,loss\n")
    result = check(cfg)
    found = result.find("out_dir")  # an attempt that crashed before its first checkpoint
    assert [c.status for c in found] == [WARN, OK] and result.ok
    assert "an attempt without a valid checkpoint (training.csv); its files move to " in found[0].detail
    assert f"{out}/attempts/" in found[0].detail and found[0].detail.endswith("training starts fresh")
    assert found[1].detail == f"{out}: fresh run"
    valid_checkpoint(out, 4, cfg)
    (out / "checkpoint_step8.pt").write_bytes(b"not a checkpoint")  # newer, garbage
    found = check(cfg).find("out_dir")
    assert [c.status for c in found] == [WARN, OK]
    assert found[0].detail == (f"checkpoint_step8.pt failed validation and moves to {out}/corrupt/ (resuming from "
                               f"checkpoint_step4.pt): {ckpt_io.checkpoint_problem(out / 'checkpoint_step8.pt')}")
    assert found[1].detail == f"{out}: continuing from checkpoint_step4.pt (step 4, train.resume=auto)"
    (found,) = check(make_cfg(tmp_path, kjv_bin, "--train.resume=none")).find("out_dir")
    assert found.status == FAIL and "already holds a run" in found.detail and "--train.resume=auto" in found.detail
    (out / ".HALT").write_text("")
    (found,) = check(cfg).find("out_dir")
    assert found.status == FAIL and found.detail == stale_halt_message(out)


def test_out_dir_with_only_invalid_checkpoints_starts_fresh(tmp_path, kjv_bin):
    cfg = make_cfg(tmp_path, kjv_bin)
    out = Path(cfg.train.out_dir)
    out.mkdir()
    (out / "checkpoint_step4.pt").write_bytes(b"")
    found = check(cfg).find("out_dir")
    assert [c.status for c in found] == [WARN, OK]
    assert "checkpoint_step4.pt failed validation and moves to" in found[0].detail and "fresh run" in found[1].detail


def test_resume_path_must_be_a_valid_checkpoint(tmp_path, kjv_bin, capsys, monkeypatch):
    garbage = tmp_path / "checkpoint_step5.pt"
    garbage.write_bytes(b"\0" * 4096)
    (found,) = check(make_cfg(tmp_path, kjv_bin, f"--train.resume={garbage}")).find("out_dir")
    assert found.status == FAIL and found.detail == ckpt_io.checkpoint_problem(garbage)
    assert "checkpoint_step5.pt" in found.detail and "continuing" not in found.detail
    (found,) = check(make_cfg(tmp_path, kjv_bin, f"--train.resume={tmp_path / 'nope.pt'}")).find("out_dir")
    assert found.status == FAIL and found.detail == f"checkpoint not found: {tmp_path / 'nope.pt'}"
    good = valid_checkpoint(tmp_path / "elsewhere", 5, make_cfg(tmp_path, kjv_bin))
    (found,) = check(make_cfg(tmp_path, kjv_bin, f"--train.resume={good}")).find("out_dir")
    assert found.status == OK and found.detail == f"{tmp_path / 'out'}: continuing from {good} (step 5, train.resume=PATH)"
    # the command line: a garbage resume file is a failed pre-flight, not a PASS
    config = tmp_path / "run.yaml"
    config.write_text("")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    args = [str(config), f"--train.out_dir={tmp_path / 'out'}", "--gpus", "1", "--model.vocab_size=320",
            "--model.dim=32", "--model.n_layers=2", "--model.n_heads=4", "--model.ffn_dim=64", "--train.save_every=4",
            "--train.steps=8", *bin_args(kjv_bin)]
    assert main([*args, f"--train.resume={garbage}"]) == 1
    text = capsys.readouterr().out
    assert "✗ out_dir" in text and "pre-flight PASS" not in text


def test_missing_wandb_when_enabled(tmp_path, kjv_bin, monkeypatch):
    cfg = make_cfg(tmp_path, kjv_bin, "--runtime.wandb=true")
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    result = check(cfg)
    assert status(result, "wandb") == {FAIL}
    assert "pip install wandb" in result.find("wandb")[0].detail
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(__version__="0.test"))
    present = check(cfg, env={**GOOD_ENV, "WANDB_MODE": "offline"})
    assert status(present, "wandb") == {OK} and present.ok
    assert status(check(make_cfg(tmp_path, kjv_bin)), "wandb") == {OK}  # off: nothing to import


def test_too_little_disk(tmp_path, kjv_bin):
    cfg = make_cfg(tmp_path, kjv_bin)
    need = checkpoint_bytes(cfg) * checkpoints_on_disk(cfg)
    assert status(check(cfg, free_bytes=lambda p: need - 1), "disk") == {FAIL}
    assert status(check(cfg, free_bytes=lambda p: need), "disk") == {OK}


def test_checkpoint_disk_arithmetic(tmp_path, kjv_bin):
    cfg = make_cfg(tmp_path, kjv_bin)  # 8 steps, save every 4, keep_last 3
    assert checkpoint_bytes(cfg) == 39_072 * 12  # params x (fp32 weights + 2 AdamW moments)
    assert checkpoints_on_disk(cfg) == 2  # steps 4 and 8 only
    long = make_cfg(tmp_path, kjv_bin, "--train.steps=19551", "--train.save_every=2000")
    assert checkpoints_on_disk(long) == 4  # keep_last 3 + the one being written
    keep_all = make_cfg(tmp_path, kjv_bin, "--train.steps=19551", "--train.save_every=2000",
                        "--train.keep_all_checkpoints=true")
    assert checkpoints_on_disk(keep_all) == 10  # 2000, ..., 18000 and the final 19551


def test_checkpoint_cadence_must_be_defined(tmp_path, kjv_bin):
    result = check(make_cfg(tmp_path, kjv_bin, "--train.save_every=0"))
    assert status(result, "checkpoint cadence") == {FAIL}


def test_allocator_setting(tmp_path, kjv_bin):
    cfg = make_cfg(tmp_path, kjv_bin)
    assert status(check(cfg, env={}, cuda=True), "allocator") == {FAIL}
    assert status(check(cfg, env={}, cuda=False), "allocator") == {WARN}
    assert status(check(cfg, env={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, cuda=True), "allocator") == {FAIL}


def test_zero1_advised_with_accumulation_on_multi_gpu(tmp_path, kjv_bin):
    cfg = make_cfg(tmp_path, kjv_bin, "--train.accumulate_grad_batches=4")
    assert status(check(cfg, gpus=8), "zero1") == {WARN}
    assert status(check(cfg, gpus=None, env={**GOOD_ENV, "WORLD_SIZE": "8"}), "zero1") == {WARN}
    assert status(check(cfg, gpus=1), "zero1") == {OK}
    with_zero1 = make_cfg(tmp_path, kjv_bin, "--train.accumulate_grad_batches=4", "--use_zero1=true")
    assert status(check(with_zero1, gpus=8), "zero1") == {OK}


def test_stream_source_states_packing_and_loader_settings(tmp_path, corpus_path):
    cfg = tiny_config(tmp_path / "out", "--train.save_every=4", f"--data.source=text:{corpus_path}",
                      "--data.tokenizer=byte", "--data.pin_memory=false")
    result = check(cfg)
    assert "packed in order" in result.find("sampler")[0].detail
    assert status(result, "dataloader") == {WARN}  # num_workers=0
    assert status(result, "pin_memory") == {WARN}
    assert status(result, "source files") == {OK}
    missing = tiny_config(tmp_path / "out2", "--train.save_every=4", f"--data.source=text:{tmp_path}/none*.txt",
                          "--data.tokenizer=byte")
    assert status(check(missing), "source files") == {FAIL}


def test_cli_exit_codes(tmp_path, kjv_bin, capsys, monkeypatch):
    config = tmp_path / "run.yaml"
    config.write_text("")
    common = ["--model.vocab_size=320", "--model.dim=32", "--model.n_layers=2", "--model.n_heads=4",
              "--model.ffn_dim=64", "--train.save_every=4", "--train.steps=8", *bin_args(kjv_bin)]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert main([str(config), f"--train.out_dir={tmp_path / 'out'}", "--gpus", "1", *common]) == 0
    assert "pre-flight PASS" in capsys.readouterr().out
    assert main([str(config), f"--train.out_dir={tmp_path / 'out'}", "--model.vocab_size=256", *common[1:]]) == 1
    assert "✗ vocab" in capsys.readouterr().out
    assert main([str(config), "--train.nonsense=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
