"""Alerts computed once per log interval from the interval's row (the best-practices guide §3): early loss
floor (data-leak suspicion), loss spikes, sustained throughput drops (which ask for a profiler trace), and for
NSA models gate collapse and low gate entropy (the row's gate statistics, nsa/attention/gate_stats.py).

An alert is a record {"alert": name, <values>, "message": ...}; the runner's hook (train/trainer/hooks.py) sends it to
every sink as an 'alert' row: heartbeat, console, TensorBoard, W&B (train/observe/sinks.py). A gate alert fires when
its statistic crosses the threshold and again only after the statistic has been back on the healthy side."""
from __future__ import annotations

import math
import statistics
import time
from collections import deque

from nsa.attention.nsa import initial_gate_entropy
from train.core.config import RunConfig


class Alerts:
    def __init__(self, cfg: RunConfig, clock=time.monotonic):
        self.train, self.runtime = cfg.train, cfg.runtime
        self.clock = clock
        self.losses: deque[float] = deque(maxlen=max(2, cfg.train.loss_spike_window))
        self.rates: deque[float] = deque(maxlen=20)
        self.degraded_since: float | None = None
        self.profile_requested = False  # set once when a throughput drop has lasted long enough
        self._profiled = False
        self._gate_alerting: set[str] = set()  # gate alerts whose condition still holds (fired once)
        # runtime.gate_entropy_alert is for gates that start equal (ln 2); other inits start lower, and the
        # threshold keeps the same fraction of their starting entropy
        start = initial_gate_entropy(cfg.model.nsa)
        self.gate_entropy_threshold = cfg.runtime.gate_entropy_alert * start / math.log(2.0)

    def observe(self, row: dict) -> list[dict]:
        """row: a training.csv row (plus gate statistics for NSA). Returns alert records (possibly none)."""
        alerts = []
        step, loss, rate = row["step"], row["loss"], row["toks_per_s"]
        t = self.train
        if t.loss_floor > 0 and step <= t.loss_floor_steps and loss < t.loss_floor:
            alerts.append({"alert": "loss_below_floor", "loss": loss, "floor": t.loss_floor,
                           "message": "loss fell below the floor early: suspect data leakage (eye-test the data)"})
        if math.isfinite(loss):
            if len(self.losses) >= 10:
                mean, std = statistics.fmean(self.losses), statistics.pstdev(self.losses)
                if std > 0 and loss > mean + t.loss_spike_sigma * std:
                    alerts.append({"alert": "loss_spike", "loss": loss, "window_mean": mean, "window_std": std,
                                   "sigma": (loss - mean) / std})
            self.losses.append(loss)
        alerts += self._throughput(rate)
        alerts += self._gates(row)
        return alerts

    def _gates(self, row: dict) -> list[dict]:
        rt = self.runtime
        checks = (  # name, statistic, threshold, unhealthy(value, threshold), message
            ("gate_collapse", "gate_collapse_frac", rt.gate_collapse_alert, lambda v, t: v > t,
             "one NSA branch took over (gate_collapse_frac > runtime.gate_collapse_alert)"),
            ("gate_entropy_low", "gate_entropy_mean", self.gate_entropy_threshold, lambda v, t: v < t,
             "NSA gates are saturating (gate_entropy_mean < runtime.gate_entropy_alert, scaled by the gate init's "
             "starting entropy)"),
        )
        alerts = []
        for name, key, threshold, unhealthy, message in checks:
            value = row.get(key)
            if threshold <= 0 or value is None or not math.isfinite(value):
                continue
            if not unhealthy(value, threshold):
                self._gate_alerting.discard(name)
            elif name not in self._gate_alerting:
                self._gate_alerting.add(name)
                alerts.append({"alert": name, key: value, "threshold": threshold, "message": message})
        return alerts

    def _throughput(self, rate: float) -> list[dict]:
        alerts = []
        if len(self.rates) >= 5:
            median = statistics.median(self.rates)
            if rate < (1.0 - self.runtime.throughput_alert_drop) * median:
                now = self.clock()
                self.degraded_since = self.degraded_since or now
                lasted = now - self.degraded_since
                if lasted >= self.runtime.throughput_alert_s and not self._profiled:
                    self._profiled = self.profile_requested = True
                    alerts.append({"alert": "throughput_drop", "toks_per_s": rate, "median_toks_per_s": median,
                                   "lasted_s": lasted, "message": "capturing a profiler trace"})
                return alerts  # a degraded interval does not enter the baseline
            self.degraded_since = None
        self.rates.append(rate)
        return alerts
