"""scripts/demo_64k.py runs end to end at a small size on CPU and reports consistent reads."""
from __future__ import annotations

import json
import subprocess
import sys


def test_demo_runs_small_and_reports_reads(repo_dir):
    steps, layers, S = 3, 2, 2048
    cmd = [sys.executable, str(repo_dir / "scripts" / "demo_64k.py"), "--S", str(S), "--layers", str(layers),
           "--dim", "128", "--heads", "4", "--kv_heads", "2", "--ffn_dim", "256", "--vocab", "512",
           "--decode_steps", str(steps), "--prefill_tile", "768", "--device", "cpu", "--dense_baseline", "1",
           "--use_fa2", "1"]  # the guide's spelling; a note on CPU
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=repo_dir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--use_fa2 1 has no effect on CPU" in proc.stdout
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # dense reads: every key so far at contexts S+1 .. S+steps, per layer
    assert result["dense_reads_total"] == layers * sum(S + i + 1 for i in range(steps))
    # NSA reads per layer at context t: N_c + n*l' + min(w, t) with the paper defaults
    expected = layers * sum((t - 32) // 16 + 1 + 16 * 64 + 512 for t in range(S + 1, S + steps + 1))
    assert result["reads_total"] == expected
    assert result["nsa"]["decode_ms_per_step"] > 0 and result["dense"]["decode_ms_per_step"] > 0
