"""runtime.compile=true: the trainer compiles each block in place (regional compilation, inductor on CPU here).
The run's losses equal the eager run's, and its checkpoint has the eager model's parameter names, so a compiled
run's checkpoint loads into an eager model and back. Also catches a custom op whose real output layout differs
from its fake (inductor asserts strides: nsa::select_blocks returned a slice once)."""
from __future__ import annotations

import torch

from tests.train.helpers import TINY_MODEL, cli, read_csv

NSA = ["--model.attention=nsa", "--nsa.l=8", "--nsa.d=4", "--nsa.l_sel=16", "--nsa.n_sel=3", "--nsa.w=16"]


def test_compiled_nsa_run_equals_eager_and_keeps_parameter_names(tmp_path):
    runs = {}
    for compiled in (False, True):
        out = tmp_path / f"compile_{compiled}"
        proc = cli(*TINY_MODEL, *NSA, f"--train.out_dir={out}", "--train.steps=3", "--train.seq_len=32",
                   "--train.batch_size=2", "--train.log_every=1", "--train.eval_every=0", "--train.warmup_steps=1",
                   "--runtime.device=cpu", "--runtime.threads=1", f"--runtime.compile={str(compiled).lower()}",
                   timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[compiled] = (read_csv(out / "training.csv"), torch.load(out / "latest.pt", weights_only=False)["model"])
    (eager_rows, eager_state), (compiled_rows, compiled_state) = runs[False], runs[True]
    assert [r["step"] for r in compiled_rows] == ["1", "2", "3"]
    for a, b in zip(eager_rows, compiled_rows):
        assert abs(float(a["loss"]) - float(b["loss"])) <= 1e-4 * abs(float(a["loss"])), (a["loss"], b["loss"])
    assert list(compiled_state) == list(eager_state)  # no _orig_mod. prefixes: in-place compile
