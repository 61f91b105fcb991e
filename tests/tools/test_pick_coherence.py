"""bench/pick_coherence.py's count: the union of consecutive queries' picks, against sets built by hand."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("pick_coherence", REPO / "bench" / "pick_coherence.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_union_sizes_count_distinct_blocks_per_tile_and_skip_empty_slots_and_early_queries():
    union_sizes = _module().union_sizes
    idx = torch.tensor([[[[0, -1, -1],  # query 0: skipped (before `first`)
                          [0, 1, -1],  # query 1: skipped
                          [0, 1, 2], [0, 2, 3],  # tile {0, 1, 2, 3}: 4 blocks, 3 picks a query
                          [0, 3, 4], [0, 3, 4],  # tile {0, 3, 4}: 3 blocks
                          [5, 6, 7]]]])  # a partial tile of one query: left out
    union, picks = union_sizes(idx, Q=2, first=2)
    assert union == (4 + 3) / 2 and picks == 3
    union, picks = union_sizes(idx, Q=1, first=2)  # one query a tile: its own picks
    assert union == picks == 3
    # tiles are aligned to Q: from query 0 one tile of 4 (queries 0-3, early rows with empty slots included) ...
    assert union_sizes(idx, Q=4, first=0) == (4.0, (1 + 2 + 3 + 3) / 4)
    # ... from query 1 the first aligned tile starts at 4 and would end past the last query: nothing counted
    assert all(x != x for x in union_sizes(idx, Q=4, first=1))
    # empty slots are never a block
    assert union_sizes(torch.tensor([[[[1, -1], [2, -1]]]]), Q=2, first=0) == (2.0, 1.0)
