"""The training stream read one optimizer step ahead, so a rank whose data is unreachable says so at the stop vote
instead of inside the next step's collectives (docs/DATA.md "Remote sources").

A rank that met a DataOutage in the middle of a step would leave its peers waiting in that step's gradient all-reduce
until NCCL's timeout, and no checkpoint would be written. So the trainer reads the next step's micro-batches after
each step and before the ranks' stop vote (train/trainer/runner.py): an outage there becomes this rank's stop
request, every rank stops after the same step, writes the checkpoint and exits EXIT_DATA_OUTAGE.

The batches are the same ones in the same order (they are only read earlier), and the state a checkpoint saves is
the stream's as of the batches consumed: a resume reads the step read ahead again.
"""
from __future__ import annotations

from train.data.remote import DataOutage


class Lookahead:
    """BatchStream over `stream` (StreamBatches, MixtureStream, ...) with read_ahead(); every other attribute is the
    stream's."""

    def __init__(self, stream, micro_batches: int):
        self.stream, self.micro_batches = stream, micro_batches
        self._ahead: list = []  # the next step's micro-batches, read ahead and not yet consumed
        self._before: dict | None = None  # the stream's state before they were read (while any is unconsumed)
        self._steps_before: int | None = None

    def read_ahead(self) -> str | None:
        """Read the next optimizer step's micro-batches now; the outage's one line when the data is unreachable
        (the stream's retries are spent), else None."""
        if self._ahead:
            return None
        self._before, self._steps_before = self.stream.state_dict(), getattr(self.stream, "step", None)
        try:
            for _ in range(self.micro_batches):
                self._ahead.append(self.stream.next_batch())
        except DataOutage as e:
            self._ahead = []  # the step is not taken: every rank stops after this vote (the state stays _before)
            return str(e)
        return None

    def next_batch(self):
        if not self._ahead:
            return self.stream.next_batch()
        batch = self._ahead.pop(0)
        if not self._ahead:
            self._before = self._steps_before = None
        return batch

    def state_dict(self) -> dict:
        return self._before if self._before is not None else self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._ahead, self._before, self._steps_before = [], None, None
        self.stream.load_state_dict(state)

    def rows(self) -> dict[str, int]:
        """A mixture's rows per source over the steps consumed (not the one read ahead)."""
        return self.stream.rows(until=self._steps_before) if self._steps_before is not None else self.stream.rows()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)
