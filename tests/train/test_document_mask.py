"""data.document_mask (issue 28): on by default for new runs on EOS-bearing data, kept as trained on resume
(one line when that differs from a new run's default), refused in one line where there is no EOS, and
recorded in the checkpoint so evaluation applies the same rule."""
from __future__ import annotations

import pytest
import torch

from train.__main__ import main as train_main
from train.checkpoint import io as ckpt_io
from train.core.data_config import resolve_document_mask
from train.core.errors import DataError
from train.trainer.runner import run_training

from .helpers import read_csv, tiny_config

NSA_TINY = ("--model.attention=nsa", "--nsa.l=8", "--nsa.d=4", "--nsa.l_sel=16", "--nsa.n_sel=4", "--nsa.w=16")


def test_resolution_rules():
    assert resolve_document_mask(None, 256, None) == (True, None)  # new run, EOS: on
    assert resolve_document_mask(None, None, None) == (False, None)  # new run, no EOS: off
    assert resolve_document_mask(False, 256, None) == (False, None)
    on, note = resolve_document_mask(None, 256, {"tokenizer": "byte"})  # a checkpoint from before the key
    assert on is False and "resuming without document masking" in note
    assert resolve_document_mask(None, 256, {"document_mask": True}) == (True, None)
    on, note = resolve_document_mask(True, 256, {"document_mask": False})
    assert on is True and "continues with it" in note
    with pytest.raises(DataError, match="needs data whose tokenizer has an EOS"):
        resolve_document_mask(True, None, None)


def _bin_args(kjv_bin, *extra):
    return (f"--data.source=bin:{kjv_bin}", "--data.tokenizer=byte", "--train.seq_len=64", *NSA_TINY, *extra)


def test_new_run_masks_documents_and_records_the_rule(tmp_path, kjv_bin):
    out = tmp_path / "run"
    assert run_training(tiny_config(out, *_bin_args(kjv_bin, "--train.steps=2"))) == 0
    ckpt = ckpt_io.load_checkpoint(ckpt_io.resolve_checkpoint(out))
    assert ckpt["config"]["data"]["document_mask"] is True
    assert ckpt[ckpt_io.DOCUMENT_EOS_KEY] == 256
    model, _ = ckpt_io.model_from_checkpoint(out)
    assert model.document_eos_id == 256
    window = torch.tensor([[65, 66, 256, 67, 68, 69]])
    docs = model.documents_of(window)
    assert docs.start.tolist() == [[0, 0, 2, 2, 2, 2]]


def test_resume_keeps_the_checkpoints_rule_and_says_so(tmp_path, kjv_bin, capsys):
    out = tmp_path / "run"
    assert run_training(tiny_config(out, *_bin_args(kjv_bin, "--train.steps=4", "--train.stop_after=2",
                                                   "--data.document_mask=false"))) == 0
    capsys.readouterr()
    assert run_training(tiny_config(out, *_bin_args(kjv_bin, "--train.steps=4"))) == 0  # the key left to default
    assert "resuming without document masking" in capsys.readouterr().out
    ckpt = ckpt_io.load_checkpoint(ckpt_io.resolve_checkpoint(out))
    assert ckpt["step"] == 4 and ckpt["config"]["data"]["document_mask"] is False
    assert ckpt[ckpt_io.DOCUMENT_EOS_KEY] is None
    assert [r["step"] for r in read_csv(out / "training.csv")][-1] == "4"


def test_masking_without_an_eos_is_one_line_and_exit_2(tmp_path, capsys):
    out = tmp_path / "run"
    code = train_main([f"--train.out_dir={out}", "--data.document_mask=true", "--runtime.device=cpu",
                       "--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--model.n_kv_heads=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "data.document_mask=true needs data whose tokenizer has an EOS" in err[0]
    assert not (out / "training.csv").exists()
