"""Strict config loading: unknown keys, wrong types, malformed YAML, overrides and aliases."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from train.core.config import load_config, parse_overrides
from train.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_every_shipped_config_loads():
    configs = sorted((REPO / "configs").glob("*.yaml"))
    assert len(configs) >= 10
    for path in configs:
        cfg = load_config(path)
        assert cfg.model.vocab_size % 64 == 0, path


def test_unknown_key_names_file_key_and_the_closest_key(tmp_path):
    path = write(tmp_path, "model:\n  dim: 64\n  n_kv_head: 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert msg == f"{path}: model: unknown key 'n_kv_head'; did you mean 'n_kv_heads'?"


def test_unknown_names_get_the_closest_suggestion_or_a_short_hint(tmp_path):
    """One line each, naming the closest valid name; with nothing close, where the names are (not all ~40)."""
    cases = [  # (YAML, overrides) -> the whole message after the file or flag
        (("train:\n  batchsize: 8\n", []), "train: unknown key 'batchsize'; did you mean 'batch_size'?"),
        (("train:\n  xyzzy: 8\n", []),
         "train: unknown key 'xyzzy'; no close match; `python -m train --help` lists the keys (docs/CONFIG.md)"),
        (("trian:\n  steps: 8\n", []), "unknown section 'trian'; did you mean 'train'?"),
        (("optim:\n  lr: 1\n", []), "unknown section 'optim'; valid sections: model, nsa, train, data, runtime"),
        (("", ["--train.batchsize=8"]), "unknown key 'batchsize' in section train; did you mean 'batch_size'?"),
        (("", ["--trian.steps=8"]), "unknown section 'trian'; did you mean 'train'?"),
        (("", ["--batchsize=8"]), "unknown option; did you mean --batch_size?"),
        (("", ["--warmup_step=8"]), "unknown option; did you mean --train.warmup_steps?"),
        (("", ["--no_such_key=1"]), "unknown option; use --section.key=value (sections: model, nsa, train, data, runtime)"),
    ]
    for (text, overrides), expected in cases:
        path = write(tmp_path, text)
        with pytest.raises(ConfigError) as err:
            load_config(path, overrides)
        msg = str(err.value)
        origin = overrides[0].split("=")[0] if overrides else str(path)
        assert msg == f"{origin}: {expected}" and "\n" not in msg, (text, overrides, msg)


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match="unknown section 'optim'"):
        load_config(write(tmp_path, "optim:\n  lr: 1\n"))


def test_wrong_type_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.steps: expected an integer"):
        load_config(write(tmp_path, "train:\n  steps: many\n"))
    with pytest.raises(ConfigError, match=r"model\.qk_norm: expected true/false"):
        load_config(write(tmp_path, "model:\n  qk_norm: 3\n"))
    with pytest.raises(ConfigError, match=r"train\.lr: expected a number"):
        load_config(write(tmp_path, "train:\n  lr: fast\n"))


def test_malformed_yaml_reports_line(tmp_path):
    with pytest.raises(ConfigError, match=r"malformed YAML at line \d+, column \d+"):
        load_config(write(tmp_path, "model:\n  dim: [64\n"))


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/nonexistent/cfg.yaml")


def test_config_path_that_is_a_directory_or_not_text(tmp_path):
    with pytest.raises(ConfigError, match=rf"^config path {tmp_path} is a directory, not a YAML file$"):
        load_config(tmp_path)
    binary = tmp_path / "model.pt"
    binary.write_bytes(b"PK\x03\x04\xff\xfe\x00")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text"):
        load_config(binary)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_config(tmp_path):
    path = write(tmp_path, "train:\n  steps: 3\n")
    path.chmod(0)
    with pytest.raises(ConfigError, match=r"^cannot read config file .*cfg\.yaml: Permission denied$"):
        load_config(path)


def test_override_errors_name_the_flag_not_the_yaml_file(tmp_path):
    path = write(tmp_path, "train:\n  steps: 10\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["--train.stepz=3"])
    msg = str(err.value)
    assert msg == "--train.stepz: unknown key 'stepz' in section train; did you mean 'steps'?"
    assert str(path) not in msg
    with pytest.raises(ConfigError, match=r"^--train\.steps: expected an integer, got 'abc'$"):
        load_config(path, ["--train.steps=abc"])
    with pytest.raises(ConfigError, match=r"^--max_iters \(train\.steps\): expected an integer"):
        load_config(path, ["--max_iters=abc"])
    with pytest.raises(ConfigError, match=r"^--lr \(train\.lr\): expected a number"):
        load_config(path, ["--lr=fast"])
    # a mistake in the YAML file is still the file's, whatever the command line says
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  stepz: 10\n")
    with pytest.raises(ConfigError, match=rf"^{bad}: train: unknown key 'stepz'; did you mean 'steps'\?$"):
        load_config(bad, ["--train.steps=3"])
    bad.write_text("train:\n  steps: many\n")
    with pytest.raises(ConfigError, match=rf"^{bad}: train\.steps: expected an integer"):
        load_config(bad, ["--train.lr=1e-3"])
    assert load_config(path, ["--gradient_checkpointing=false"]).runtime.gradient_checkpointing == 0


def test_nsa_section_without_nsa_attention_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="nsa"):
        load_config(write(tmp_path, "nsa:\n  l: 32\n"))


def test_rope_keys_ignored_by_learned_positions_are_rejected(tmp_path):
    with pytest.raises(ConfigError, match="rope_theta has no effect"):
        load_config(write(tmp_path, "model:\n  pos_emb: learned\n  rope_theta: 500000.0\n"))


def test_invalid_model_values(tmp_path):
    with pytest.raises(ConfigError, match="must divide"):
        load_config(write(tmp_path, "model:\n  n_heads: 12\n  n_kv_heads: 5\n"))
    with pytest.raises(ConfigError, match="model.norm="):
        load_config(write(tmp_path, "model:\n  norm: batchnorm\n"))
    with pytest.raises(ConfigError, match="d=5 must divide"):
        load_config(write(tmp_path, "model:\n  attention: nsa\nnsa:\n  d: 5\n"))


def test_overrides_section_leaf_and_aliases():
    cfg = load_config(None, [
        "--model.dim=96", "--n_layers=3", "--max_iters=7", "--batch_size", "5",
        "--gradient_accumulation_steps=4", "--block_size=64", "--learning_rate=3e-4", "--compile=False",
        "--dtype=bfloat16", "--eval_interval=3", "--eval_only=false", "--always_save_checkpoint=False",
        "--keep_all_checkpoints=True", "--init_from=resume", "--model.n_heads=4",
    ])
    assert cfg.model.dim == 96 and cfg.model.n_layers == 3
    assert cfg.train.steps == 7 and cfg.train.batch_size == 5 and cfg.train.accumulate_grad_batches == 4
    assert cfg.train.seq_len == 64 and cfg.train.lr == pytest.approx(3e-4)
    assert cfg.runtime.compile is False and cfg.runtime.precision == "bf16"
    assert cfg.train.eval_every == 3 and cfg.train.always_save_checkpoint is False
    assert cfg.train.keep_all_checkpoints is True and cfg.train.resume == "auto"
    assert load_config(None, ["--init_from=scratch"]).train.resume == "none"


def test_override_errors():
    with pytest.raises(ConfigError, match="unknown option"):
        parse_overrides(["--no_such_key=1"])
    with pytest.raises(ConfigError, match="unknown section"):
        parse_overrides(["--optim.lr=1"])
    with pytest.raises(ConfigError, match="unexpected argument"):
        parse_overrides(["stray"])
    with pytest.raises(ConfigError, match="expected an integer"):
        load_config(None, ["--train.steps=1.5"])


def test_yaml_then_override_precedence(tmp_path):
    path = write(tmp_path, "train:\n  steps: 10\n  lr: 1.0e-3\n")
    cfg = load_config(path, ["--train.steps=20"])
    assert cfg.train.steps == 20 and cfg.train.lr == pytest.approx(1e-3)


def test_gradient_checkpointing_accepts_bool_and_int(tmp_path):
    assert load_config(write(tmp_path, "runtime:\n  gradient_checkpointing: false\n")).runtime.gradient_checkpointing == 0
    assert load_config(write(tmp_path, "runtime:\n  gradient_checkpointing: true\n")).runtime.gradient_checkpointing == 1
    assert load_config(write(tmp_path, "runtime:\n  gradient_checkpointing: 3\n")).runtime.gradient_checkpointing == 3


def test_config_reference_is_current():
    """docs/CONFIG.md is generated from the dataclasses; regenerate it when a field changes."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_config_docs.py")], capture_output=True,
                         text=True, check=True).stdout
    assert (REPO / "docs" / "CONFIG.md").read_text() == out, "run: python scripts/gen_config_docs.py > docs/CONFIG.md"


def test_effective_config_round_trips(tmp_path):
    from train.core.config import dump_config

    for name in ("full_gpt2_1.36b.yaml", "full_qwen3_1.8b_optimal.yaml", "m7c_125m_80g.yaml"):
        cfg = load_config(REPO / "configs" / name, ["--train.steps=7"])
        path = tmp_path / f"effective_{name}"
        path.write_text(dump_config(cfg))
        again = load_config(path)
        assert again.to_dict() == cfg.to_dict(), name


def test_seed_flags_flash_attn_and_gradient_log_interval(capsys):
    """The 2xA6000 guide's --flash_attn=True and --gradient_log_interval=50 are accepted: the first sets the
    attention backend, the second is a no-op that says so."""
    cfg = load_config(None, ["--flash_attn=False", "--gradient_log_interval=50", "--max_iters=7"])
    assert cfg.model.attn_backend == "sdpa" and cfg.train.steps == 7
    assert "--gradient_log_interval=50 has no effect" in capsys.readouterr().err
    assert load_config(None, ["--flash_attn=True"]).model.attn_backend == "auto"


def test_help_lists_every_config_key_with_default_and_meaning():
    import dataclasses
    import subprocess
    import sys

    from train.core.config import SECTIONS

    out = subprocess.run([sys.executable, "-m", "train", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    keys = [line.split()[0] for line in out.stdout.splitlines() if line.startswith("  --") and "=" in line.split()[0]]
    listed = {key.split("=", 1)[0] for key in keys}
    every = {f"--{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls) if f.name != "nsa"}
    assert listed == every
    assert "--train.steps=1000" in out.stdout and "optimizer steps" in out.stdout  # default and meaning
    assert "--max_iters" in out.stdout  # the aliases too


def test_settings_without_effect_are_errors(tmp_path):
    """model.attn_backend on an NSA model and stream-loader keys on a bin: source change nothing: errors
    naming the key; the dumped effective config of such runs leaves them out and loads again."""
    from train.core.config import dump_config

    with pytest.raises(ConfigError, match="model.attn_backend has no effect with model.attention='nsa'"):
        load_config(None, ["--model.attention=nsa", "--model.attn_backend=sdpa"])
    with pytest.raises(ConfigError, match="model.attn_backend has no effect"):
        load_config(None, ["--model.attention=nsa", "--use_flash=true"])  # the alias sets the same key
    for key in ("num_workers=4", "val_fraction=0.1", "text_sample_by=line", "prefetch_factor=4"):
        with pytest.raises(ConfigError, match=f"data.{key.split('=')[0]} has no effect with a bin: source"):
            load_config(None, ["--data.source=bin:some/dir", f"--data.{key}"])
    assert load_config(None, ["--data.source=text:x.txt", "--data.num_workers=4"]).data.num_workers == 4
    for args in (["--model.attention=nsa"], ["--data.source=bin:some/dir", "--data.pin_memory=false"]):
        cfg = load_config(None, args)
        dumped = tmp_path / "dumped.yaml"
        dumped.write_text(dump_config(cfg))
        assert load_config(dumped).to_dict() == cfg.to_dict()
