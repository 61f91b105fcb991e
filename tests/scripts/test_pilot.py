"""scripts/pilot_m7c.sh: the M7C pilot's one command. DRY_RUN under a fake nvidia-smi shows the config chosen by
VRAM and the prepare, recall-corpus and compare commands it would run; a real run on a tiny config (CONFIG and
PILOT_ARGS on this CPU) trains the arms on the data mixture with recall documents and writes the report with
per-source losses, the needle test and the recall probe the arms trained for."""
from __future__ import annotations

import json
import shlex

import pytest

from tests.scripts.helpers import A100_40, H100_80, run_script


def dry(env) -> dict[str, str]:
    res = run_script("pilot_m7c.sh", env | {"DRY_RUN": "1"}, timeout=60)
    assert res.returncode == 0, res.stderr
    return dict(line.split(": ", 1) for line in res.stdout.splitlines())


@pytest.mark.parametrize("gpus, config, side_by_side", [
    ([H100_80], "configs/m7c_125m_80g.yaml", False),
    ([A100_40], "configs/m7c_125m_40g.yaml", False),
    ([H100_80] * 8, "configs/m7c_125m_80g.yaml", True),  # the arms train at once, one GPU each
])
def test_dry_run_prepares_fineweb_and_compares_the_three_arms_with_every_probe(fake_smi, script_env, tmp_path,
                                                                                gpus, config, side_by_side):
    fields = dry(script_env(fake_smi(gpus), PILOT_DATA=str(tmp_path / "fw"), PILOT_RECALL=str(tmp_path / "recall")))
    assert fields["config"].startswith(config)
    assert shlex.split(fields["prepare"])[1:] == ["-m", "train.data.prepare", "--source", "fineweb_edu", "--tokenizer",
                                                  "gpt2", "--out", str(tmp_path / "fw"), "--max-docs", "200000"]
    # the recall corpus in the arms' geometry (the M7C configs: nsa.w 512, seq_len 2048), prose lines, GPT-2 tokens
    assert shlex.split(fields["recall"])[1:] == ["-m", "train.recall", "make", "--out", str(tmp_path / "recall"),
                                                 "--window", "512", "--seq_len", "2048", "--max_windows", "4",
                                                 "--tokenizer", "gpt2", "--format",
                                                 "prose", "--train_tokens", "20000000", "--val_tokens", "500000"]
    compare = shlex.split(fields["compare"])
    mixture = (f"--data.mixture=[{{name: web, source: 'bin:{tmp_path / 'fw'}', weight: 0.9}}, "
               f"{{name: recall, source: 'bin:{tmp_path / 'recall'}', weight: 0.1}}]")
    assert mixture in compare
    compare = " ".join(compare)
    assert f"-m train.compare {config} --out {tmp_path / 'artifacts' / 'pilot_m7c'} --arms nsa,dense,window" in compare
    for part in ("--train.steps=3000", "--train.warmup_steps=300",
                 "--recall_probe --recall_format prose", "--needle 1,2,4", "--tasks hellaswag,arc_easy,arc_challenge,piqa,sciq,winogrande",
                 "--tasks_limit 500"):
        assert part in compare, part
    assert ("--side_by_side" in compare) == side_by_side


def test_a_staged_config_keeps_its_schedule_and_probes_at_its_last_length(script_env, tmp_path):
    """CONFIG=configs/m7c_125m_long.yaml (2k, then 8k / 16k / 32k): the config's own steps and warmup (its stages lie
    past the pilot's 3,000 steps), the recall corpus at 32k with buckets across it, the needle at 1 and 2 times 32k.
    PILOT_STEPS given is passed on (and a plan that cannot work is then the trainer's one-line refusal)."""
    env = script_env(CONFIG="configs/m7c_125m_long.yaml", PILOT_DATA=str(tmp_path / "fw"),
                     PILOT_RECALL=str(tmp_path / "recall"))
    fields = dry(env)
    recall = shlex.split(fields["recall"])
    assert recall[recall.index("--seq_len") + 1] == "32768" and recall[recall.index("--max_windows") + 1] == "64"
    compare = fields["compare"]
    assert "--train.steps" not in compare and "--train.warmup_steps" not in compare
    assert "--needle 16,32" in " ".join(shlex.split(compare))
    fields = dry(env | {"PILOT_STEPS": "60000", "PILOT_NEEDLE": "1"})
    assert "--train.steps=60000" in fields["compare"] and "--needle 1" in " ".join(shlex.split(fields["compare"]))


def test_a_prepared_directory_is_used_as_it_is_and_empty_knobs_drop_their_probe(fake_smi, script_env, tmp_path):
    (tmp_path / "fw").mkdir()
    (tmp_path / "fw" / "meta.json").write_text("{}")
    fields = dry(script_env(fake_smi([H100_80]), PILOT_DATA=str(tmp_path / "fw"), PILOT_TASKS="", PILOT_NEEDLE="",
                            PILOT_RECALL_WEIGHT=""))
    assert "prepare" not in fields and fields["data"] == f"{tmp_path / 'fw'} (prepared)"
    assert "--tasks" not in fields["compare"] and "--needle" not in fields["compare"]
    # no recall documents: FineWeb-Edu alone, the recall probe zero-shot
    assert "recall" not in fields and f"--data.source=bin:{tmp_path / 'fw'}" in fields["compare"]
    (tmp_path / "recall").mkdir()
    (tmp_path / "recall" / "meta.json").write_text("{}")
    fields = dry(script_env(fake_smi([H100_80]), PILOT_DATA=str(tmp_path / "fw"), PILOT_RECALL=str(tmp_path / "recall")))
    assert fields["recall"] == f"{tmp_path / 'recall'} (written)"


@pytest.mark.parametrize("env, message", [
    ({}, "no GPU found: the pilot trains three 125M models on GPUs; set CONFIG"),
    ({"CONFIG": "configs/none.yaml"}, "config configs/none.yaml not found"),
    ({"CONFIG": "configs/nsa_twin_kjv.yaml", "PILOT_STEPS": "0"}, "PILOT_STEPS=0 must be a positive integer"),
    ({"CONFIG": "configs/nsa_twin_kjv.yaml", "PILOT_WARMUP": "x"}, "PILOT_WARMUP=x must be a non-negative integer"),
    ({"CONFIG": "configs/nsa_twin_kjv.yaml", "PILOT_RECALL_WEIGHT": "1.5"}, "PILOT_RECALL_WEIGHT=1.5 must be a share"),
])
def test_bad_settings_are_one_line_and_exit_2(script_env, tmp_path, env, message):
    res = run_script("pilot_m7c.sh", script_env(**env, PILOT_DATA=str(tmp_path / "fw")), timeout=60)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and message in res.stderr, res.stderr
    assert not (tmp_path / "artifacts").exists() and not (tmp_path / "fw").exists()


def test_a_tiny_pilot_runs_for_real_and_writes_the_report(script_env, tmp_path, kjv_gpt2):
    tiny = ("--data.tokenizer=gpt2 --model.vocab_size=50304 --model.dim=32 --model.n_layers=1 --model.n_heads=2 "
            "--model.n_kv_heads=1 --model.head_dim=16 --model.ffn_dim=64 --train.seq_len=128 --model.max_seq_len=128 "
            "--train.batch_size=2 --train.log_every=1 --train.eval_every=2 --train.eval_steps=1 --train.save_every=2 "
            "--runtime.threads=1 --nsa.w=32")
    env = script_env(CONFIG="configs/nsa_twin_kjv.yaml", PILOT_DATA=str(kjv_gpt2), PILOT_STEPS="2", PILOT_WARMUP="1",
                     PILOT_TASKS="", PILOT_NEEDLE="1", PILOT_ARMS="nsa,window", PILOT_ARGS=tiny + " --needle_trials 1",
                     PILOT_RECALL=str(tmp_path / "recall"), PILOT_RECALL_TOKENS="40000")
    res = run_script("pilot_m7c.sh", env, timeout=400)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = tmp_path / "artifacts" / "pilot_m7c"
    report = json.loads((out / "report.json").read_text())
    assert list(report["arms"]) == ["nsa", "window"] and report["arms"]["nsa"]["step"] == 2
    # trained on the mixture of KJV (standing in for FineWeb-Edu) and prose recall documents: the probe is its task
    assert report["recall"]["trained_on_task"] is True and report["recall"]["format"] == "prose"
    for arm in ("nsa", "window"):
        sources = report["arms"][arm]["eval_sources"]
        assert set(sources) == {"web", "recall"} and all(s["loss"] > 0 for s in sources.values())
        ev = report["arms"][arm]["eval"]
        assert ev["loss"] == pytest.approx(0.9 * sources["web"]["loss"] + 0.1 * sources["recall"]["loss"])
    assert "| recall: loss |" in (out / "report.md").read_text()
    assert report["needle"]["lengths"] == [128]
    for arm in ("nsa", "window"):
        assert (out / arm / "needle_step2_S128.json").is_file() and (out / arm / "recall_step2_prose.json").is_file()
    assert "[pilot_m7c] comparing -> " in res.stdout and "Needle in a haystack" in (out / "report.md").read_text()
