"""train/launch.py's rule for its exit code when torchrun's workers fail (the end-to-end runs: a full disk in
tests/scripts/test_run_record.py, a SIGTERM in tests/scripts/test_runner_e2e.py)."""
from __future__ import annotations

from train.launch import describe, exit_code_of


def test_the_code_the_failed_ranks_agree_on_is_kept_and_anything_else_is_torchruns_1():
    assert exit_code_of({0: 4, 1: 4}) == 4  # a full disk on every rank
    assert exit_code_of({0: 4, 1: -15}) == 4  # torchrun stopped the other rank: its signal does not count
    assert exit_code_of({1: 75}) == 75 and exit_code_of({0: 3}) == 3 and exit_code_of({0: 2, 1: 2}) == 2
    assert exit_code_of({0: 4, 1: 3}) == 1  # ranks that disagree
    assert exit_code_of({0: 1}) == 1  # a crash with a traceback is not one of the trainer's codes
    assert exit_code_of({0: 137}) == 1 and exit_code_of({0: -9, 1: -15}) == 1  # killed: no code of the trainer's
    assert describe({1: -15, 0: 4}) == "rank 0 exit 4, rank 1 SIGTERM"
