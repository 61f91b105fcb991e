"""The console of an entry point: stdout/stderr whose reader may vanish (a closed `| head`, a killed
`tee`). A run's record is its files (CSVs, heartbeats, checkpoints), so console lines written after the
reader is gone are dropped instead of raising inside the loop before the final checkpoint."""
from __future__ import annotations

import sys


class _DeafToBrokenPipe:
    """Wraps a text stream; after the first BrokenPipeError it drops every write."""

    def __init__(self, stream):
        self._stream, self._broken = stream, False

    def write(self, text: str) -> int:
        if not self._broken:
            try:
                return self._stream.write(text)
            except (BrokenPipeError, ValueError):  # ValueError: write to a closed file
                self._broken = True
        return len(text)

    def flush(self) -> None:
        if not self._broken:
            try:
                self._stream.flush()
            except (BrokenPipeError, ValueError):
                self._broken = True

    def __getattr__(self, name):
        return getattr(self._stream, name)


def survive_closed_console() -> None:
    """Entry points: console writes after the reader is gone are dropped instead of raising."""
    sys.stdout = _DeafToBrokenPipe(sys.stdout)
    sys.stderr = _DeafToBrokenPipe(sys.stderr)
