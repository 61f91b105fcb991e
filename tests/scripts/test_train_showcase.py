"""scripts/train_showcase.py (the seed-003 entry point) needs a config: without one it would train the
trainer's default model, so it refuses with one line that says how to choose one."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.scripts.helpers import REPO


def showcase(*args: str, config: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CONFIG"}
    if config is not None:
        env["CONFIG"] = config
    return subprocess.run([sys.executable, "scripts/train_showcase.py", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_no_config_is_a_one_line_error(tmp_path):
    for res in (showcase("--dataset", "synthetic", "--steps", "2", f"--train.out_dir={tmp_path / 'out'}", config=None),
                showcase("--steps", "2", f"--train.out_dir={tmp_path / 'out'}", config="")):
        assert res.returncode == 2 and res.stdout == ""
        (line,) = res.stderr.splitlines()
        assert line.startswith("error: no config: set CONFIG=configs/<name>.yaml (e.g. configs/")
        examples = re.findall(r"configs/[\w.]+\.yaml", line)
        assert len(examples) >= 2 and all((REPO / e).is_file() for e in examples), line
        assert not (tmp_path / "out").exists()  # nothing trained


def test_a_config_flag_is_used(tmp_path):
    res = showcase("--config", str(tmp_path / "missing.yaml"), config=None)
    assert res.returncode == 2 and res.stderr.strip() == f"error: config file not found: {tmp_path / 'missing.yaml'}"
