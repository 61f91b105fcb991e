"""Hooks around the optimizer step: small pieces the runner (train/trainer/runner.py) calls at fixed points.

At each point the hooks run in this order (`training_hooks` builds the list):

    open(step)            gc: collect, freeze, disable (runtime.disable_gc); watchdog: start its timer
    before_step(step)     profiler: a scheduled window (runtime.profile_steps A:B) opens before step A
      -- Loop.step --
    after_step(step)      profiler: a window closes after its last step; watchdog: beat;
                          sdpa audit: the attention path of each call site, once, after this process's
                          first step (runtime.sdpa_audit)
      -- the stop vote; at a log interval Loop.log() and the train row to the sinks --
    after_log(step, row)  gc: collect generation 1; alerts: alert rows to the sinks, and a sustained
                          throughput drop opens a profiler window over the next steps
    close(step)           in reverse: alerts, sdpa audit, watchdog (stop), profiler (an open window is
                          written), gc (enable); only hooks that were opened

`step` is the number of optimizer steps completed; before_step's is the step about to run. Hooks write
through the recorder (train/observe/sinks.py): 'profile', 'watchdog' (from the watchdog thread), 'sdpa_audit'
and 'alert' rows. The stop decision (train/trainer/safety.py StopFlags, train/trainer/stop.py) is the runner's own.
"""
from __future__ import annotations

import gc
from pathlib import Path

from nsa.profiling import audit_log
from train.core.config import RunConfig
from train.observe.alerts import Alerts
from train.observe.profiler import StepProfiler
from train.observe.sinks import Recorder
from train.trainer.safety import Watchdog


class Hook:
    def open(self, step: int) -> None:
        pass

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass

    def after_log(self, step: int, row: dict) -> None:
        pass

    def close(self, step: int) -> None:
        pass


class GcHook(Hook):
    """runtime.disable_gc (seed 004's NSA_DDP_DISABLE_GC): no GC pauses inside steps."""

    def open(self, step: int) -> None:
        gc.collect()
        gc.freeze()
        gc.disable()

    def after_log(self, step: int, row: dict) -> None:
        gc.collect(1)

    def close(self, step: int) -> None:
        gc.enable()
        gc.unfreeze()


class ProfilerHook(Hook):
    """torch.profiler windows (train/observe/profiler.py): scheduled (rank 0) and on demand (a throughput drop)."""

    def __init__(self, out_dir: Path, spec: str, recorder: Recorder):
        self.profiler = StepProfiler(out_dir, spec, on_written=lambda step, tag, paths: recorder.log(
            step, {"kind": "profile", "tag": tag, "paths": paths}))

    def before_step(self, step: int) -> None:
        self.profiler.before_step(step)

    def after_step(self, step: int) -> None:
        self.profiler.after_step(step)

    def capture(self, first: int, last: int, tag: str) -> None:
        self.profiler.start(first, last, tag=tag)

    def close(self, step: int) -> None:
        self.profiler.close(step)


class WatchdogHook(Hook):
    """Stack dumps when no step completes for runtime.watchdog_s (train/trainer/safety.py)."""

    def __init__(self, out_dir: Path, timeout_s: float, rank: int, recorder: Recorder):
        self.out_dir, self.timeout_s, self.rank, self.recorder = out_dir, timeout_s, rank, recorder
        self.step = 0  # the last completed step, for the watchdog thread's record
        self.watchdog: Watchdog | None = None

    def _stalled(self, path: Path, idle_s: float) -> None:  # the watchdog thread
        self.recorder.log(self.step, {"kind": "watchdog", "idle_s": idle_s, "path": str(path)})

    def open(self, step: int) -> None:
        self.step = step
        self.watchdog = Watchdog(self.out_dir, self.timeout_s, self._stalled, rank=self.rank)
        self.watchdog.start()

    def after_step(self, step: int) -> None:
        self.step = step
        self.watchdog.beat()

    def close(self, step: int) -> None:
        self.watchdog.stop()


class SdpaAuditHook(Hook):
    def __init__(self, recorder: Recorder):
        self.recorder, self.done = recorder, False

    def after_step(self, step: int) -> None:
        if not self.done:
            self.done = True
            self.recorder.log(step, {"kind": "sdpa_audit", "sites": audit_log()})


class AlertHook(Hook):
    """train/observe/alerts.py on each log row; its records become 'alert' rows."""

    def __init__(self, alerts: Alerts, recorder: Recorder, profiler: ProfilerHook):
        self.alerts, self.recorder, self.profiler = alerts, recorder, profiler

    def after_log(self, step: int, row: dict) -> None:
        for alert in self.alerts.observe(row):
            self.recorder.log(step, {"kind": "alert", **alert})
        if self.alerts.profile_requested:
            self.alerts.profile_requested = False
            self.profiler.capture(step + 1, step + 5, tag=f"throughput_drop_step{step}")


class Hooks:
    """The hooks of a run, called in list order (close: in reverse, opened ones only)."""

    def __init__(self, hooks: list[Hook]):
        self.hooks = list(hooks)
        self._opened: list[Hook] = []

    def open(self, step: int) -> None:
        for hook in self.hooks:
            hook.open(step)
            self._opened.append(hook)

    def before_step(self, step: int) -> None:
        for hook in self.hooks:
            hook.before_step(step)

    def after_step(self, step: int) -> None:
        for hook in self.hooks:
            hook.after_step(step)

    def after_log(self, step: int, row: dict) -> None:
        for hook in self.hooks:
            hook.after_log(step, row)

    def close(self, step: int) -> None:
        """Close every opened hook, even when one fails; the first failure is raised afterwards."""
        error = None
        for hook in reversed(self._opened):
            try:
                hook.close(step)
            except Exception as exc:  # noqa: BLE001 (re-raised below)
                error = error or exc
        self._opened = []
        if error is not None:
            raise error


def training_hooks(cfg: RunConfig, out_dir: Path, rank: int, recorder: Recorder) -> Hooks:
    """The hooks of a training run in the order of the module docstring; those switched off are left out."""
    rt = cfg.runtime
    profiler = ProfilerHook(out_dir, rt.profile_steps if rank == 0 else "", recorder)
    hooks: list[Hook] = [GcHook()] if rt.disable_gc else []
    hooks.append(profiler)
    if rt.watchdog_s > 0:
        hooks.append(WatchdogHook(out_dir, rt.watchdog_s, rank, recorder))
    if rt.sdpa_audit:
        hooks.append(SdpaAuditHook(recorder))
    hooks.append(AlertHook(Alerts(cfg), recorder, profiler))
    return Hooks(hooks)
