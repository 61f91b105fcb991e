"""Checks shared by every BatchStream.load_state_dict: a state must come from a compatible stream."""
from __future__ import annotations

from train.errors import DataError

# stream ids: the same generator/sampler with another id gives disjoint draws (validation)
TRAIN_STREAM, VAL_STREAM = 0, 1


def expect_state(state: dict, **expected) -> None:
    """Raise DataError if `state` was saved by a stream with different identity fields."""
    if not isinstance(state, dict):
        raise DataError(f"data state must be a dict, got {type(state).__name__}")
    for key, want in expected.items():
        got = state.get(key)
        if got != want:
            raise DataError(f"data state was saved with {key}={got!r} but this run has {key}={want!r}; "
                            f"resume with the same data settings (or start the data stream fresh)")
