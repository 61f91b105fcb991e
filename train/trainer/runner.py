"""Drives a training run: one batch goes build_data (train/trainer/build_run.py) -> Loop.step (train/trainer/loop.py) ->
Transformer (nsa/model.py); at each log interval Loop.log() returns the row and the recorder hands it to
the sinks (train/observe/sinks.py: training.csv, heartbeat, TensorBoard, W&B, console, metrics.json). Evaluation,
sampling and checkpoints are off the training clock (train/trainer/clock.py), and so are the downstream tasks
(train.eval_tasks: loaded before the run starts, scored where it evaluates, train/trainer/tasks_eval.py); gc, profiler,
watchdog, SDPA audit and alerts are hooks at fixed points of the step (train/trainer/hooks.py).

Exit codes: 0 finished or stopped gracefully (HALT / SIGTERM / SIGINT / stop_after), 2 bad input (one line),
3 halted on an anomaly (.anomaly_type written): repeated non-finite losses (the last good checkpoint intact, none
written), or train.spike_skip_limit spike skips in a row (a checkpoint written: skipped steps changed no weights),
4 a checkpoint, CSV, heartbeat, TensorBoard event or metrics.json could not be written (a full disk, a quota, a
file-size limit): one line says which file and why, on every rank. A checkpoint failure stops every rank at that save;
a log file that fails on any rank becomes a stop request at the next stop vote, so every rank stops after the same
step, tries the final checkpoint (which fails cleanly on a full disk) and exits 4: none dies on a lost peer. The
checkpoints before it and latest.pt are untouched and no partial file is left; metrics.json says write_failed where
the disk still takes it (the runners also read the exit code: train/launch.py keeps it under torchrun). The runners
do not relaunch on it: free space, then run the same command to resume. 75 (EXIT_DATA_OUTAGE) a stream source stayed
unreachable past data.retry_max / data.retry_max_s on some rank: every rank stopped after the same step and the
checkpoint was written; the runners wait and resume (docs/RUNBOOK.md "Data outages").
"""
from __future__ import annotations

import sys
import time

from train.checkpoint import io as ckpt_io
from train.core.artifacts import ANOMALY, WRITE_FAILED
from train.core.config import RunConfig
from train.core.distributed import gather_objects, shutdown_distributed
from train.core.errors import CheckpointError, StorageError
from train.generation.sampling import TrainingSampler
from train.observe.sinks import Recorder, open_sinks
from train.observe.summary import RunSummary
from train.observe.telemetry import write_json_atomic
from train.trainer.build_run import Run
from train.trainer.clock import TrainingClock
from train.trainer.hooks import training_hooks
from train.trainer.loop import GateStats, Loop
from train.trainer.safety import StopFlags
from train.trainer.stop import DATA_OUTAGE, WRITE_FAILED as WRITE_FAILED_REASON, StopVote, early_signal
from train.trainer.tasks_eval import LoopTasks

EXIT_ANOMALY = 3
EXIT_DATA_OUTAGE = 75  # EX_TEMPFAIL: the data was unreachable past data.retry_max / retry_max_s; a checkpoint was written
# and the runner resumes after a wait (scripts/lib/common.sh; docs/RUNBOOK.md "Data outages")


def run_training(cfg: RunConfig) -> int:
    tasks = LoopTasks.load(cfg)  # a task that cannot be loaded stops the start before the out_dir is touched
    try:
        run = Run(cfg)
    except BaseException:
        shutdown_distributed(clean_exit=False)
        raise
    clean, recorder = False, None
    try:
        recorder = open_recorder(run)
        code = _eval_only(run, recorder, tasks) if cfg.train.eval_only else _train(run, recorder, tasks)
        clean = True
        return code
    except StorageError as exc:  # exit 4 (StorageError.exit_code): every file written before it is intact
        _record_write_failure(run, recorder, str(exc))
        raise
    finally:
        try:
            if recorder is not None:
                recorder.close()
        finally:
            run.close()
            shutdown_distributed(clean_exit=clean)


def _record_write_failure(run: Run, recorder: Recorder | None, message: str) -> None:
    """Status write_failed in metrics.json and the heartbeat, where the disk still takes them (it may not)."""
    if recorder is not None:  # the one-line error on stderr and exit code 4 say it where no file takes it
        recorder.log_last_word(run.state.step, {"kind": WRITE_FAILED, "message": message})


def open_recorder(run: Run) -> Recorder:
    """This rank's sinks (train/observe/sinks.py); rank 0 of a training run first keeps metrics.json / run_*.json."""
    summary = []
    if run.is_main and not run.cfg.train.eval_only:
        summary = [RunSummary(run.out_dir, run.cfg, run.state, info=run.info, amp_dtype=run.amp_dtype,
                              efficiency=run.efficiency, started=run.started, data_description=run.data.describe(),
                              data_restarts=run.data_restarts, extended_from=run.extended_from,
                              params=(run.raw_model.num_params(), run.raw_model.num_params(False)))]
    return Recorder(summary + open_sinks(run.cfg, run.out_dir, rank=run.info.rank,
                                         resume_step=run.state.step if run.resumed else None))


def build_loop(run: Run, clock: TrainingClock) -> Loop:
    """The loop gets what it uses, and nothing else of the run."""
    nsa = run.cfg.model.attention == "nsa"
    return Loop(model=run.model, raw_model=run.raw_model, optimizer=run.optimizer, data=run.data, state=run.state,
                cfg=run.cfg.train, info=run.info, amp_dtype=run.amp_dtype, clock=clock, efficiency=run.efficiency,
                gate_stats=GateStats(run.raw_model) if nsa else None, spikes=run.spikes)


def task_row(run: Run, tasks: LoopTasks) -> dict:
    """The 'tasks' row of this step (a collective: every rank calls it)."""
    return tasks.score(run.raw_model, run.info, run.amp_dtype, fsdp=run.cfg.runtime.fsdp,
                       tokens_seen=run.state.tokens_seen)


def _eval_only(run: Run, recorder: Recorder, tasks: LoopTasks | None) -> int:
    if not run.resumed:
        raise CheckpointError(f"eval_only needs a checkpoint; none found in {run.out_dir}")
    step = run.state.step
    val = build_loop(run, TrainingClock()).evaluate()
    scores = task_row(run, tasks) if tasks is not None else None
    if run.is_main:
        extra = {"tasks": {t["task"]: t for t in scores["tasks"]}} if scores is not None else {}
        write_json_atomic(run.out_dir / f"eval_step{step}.json",
                          {"checkpoint": str(run.resume_path), "step": step, **val, **extra})
    if scores is not None:
        recorder.log(step, scores)
    recorder.log(step, {"kind": "eval_only", "val_loss": val["val_loss"], "checkpoint": str(run.resume_path)})
    _raise_write_failure(run, recorder)
    return 0


def _train(run: Run, recorder: Recorder, tasks: LoopTasks | None) -> int:
    cfg, state = run.cfg.train, run.state
    sampler = TrainingSampler.for_run(run)  # None unless train.sample_every > 0
    clock = TrainingClock()
    loop = build_loop(run, clock)
    loop.set_stage(run.stage, run.data, run.efficiency, staged=len(run.stages) > 1)  # the stage this launch starts in
    flags = StopFlags(run.out_dir, rank=run.info.rank,
                      on_stackdump=lambda path: recorder.log(state.step, {"kind": "stackdump", "path": str(path)}))
    vote = StopVote(run.info.control_group, enabled=run.info.enabled)
    hooks = training_hooks(run.cfg, run.out_dir, run.info.rank, recorder)
    start_step = state.step
    try:
        hooks.open(start_step)
        recorder.log(state.step, {"kind": "start", "resumed_from": str(run.resume_path) if run.resume_path else None,
                                  "world_size": run.info.world_size, "device": str(run.info.device)})
        if run.is_main:
            print(f"run: {run.raw_model.num_params():,} params | {loop.tokens_per_step:,} tokens/step | "
                  f"device {run.info.device} | {str(run.amp_dtype).replace('torch.', '')} | "
                  f"{'resumed at step ' + str(state.step) if run.resumed else 'fresh start'}", flush=True)
            if tasks is not None:
                print(f"tasks: {tasks.describe()}; scored every {cfg.eval_every} steps, off the clock", flush=True)
        if run.data.reads_ahead and cfg.eval_every:  # stream sources: the held-out batches read now, at the start,
            for name in run.data.val_names:  # so no evaluation waits on the network in the middle of the run
                run.data.val_batches(cfg.eval_steps, name)
        if cfg.eval_at_start and state.step == 0 and cfg.eval_every:
            with clock.off_the_clock():
                recorder.log(state.step, {"kind": "eval", **loop.evaluate()})
                if tasks is not None:
                    recorder.log(state.step, task_row(run, tasks))
        while state.step < cfg.steps:
            if (stage := run.stage_for(state.step)) is not run.stage:  # train.seq_stages: a new length from this step
                with clock.off_the_clock():
                    run.enter_stage(stage)
                loop.set_stage(stage, run.data, run.efficiency, staged=True)
                recorder.log(state.step, {"kind": "stage", "seq_len": stage.seq_len, "batch_size": stage.batch_size,
                                          "accumulate": stage.accumulate, "rope_theta": stage.rope_theta,
                                          "rope_scale": stage.rope_scale, "nsa_w": stage.nsa_w,
                                          "tokens_per_step": loop.tokens_per_step})
                if run.is_main:
                    print(f"stage: {stage.describe(run.info.world_size)}", flush=True)
            next_step = state.step + 1
            log_now = next_step % cfg.log_every == 0 or next_step == cfg.steps
            hooks.before_step(next_step)
            loop.step(collect_stats=log_now)
            hooks.after_step(state.step)
            local = flags.reason if flags.should_stop() else early_signal()
            if recorder.failure is not None:  # a file this rank could not write: every rank stops after this step
                local = WRITE_FAILED_REASON
            if local is None and cfg.stop_after and state.step - start_step >= cfg.stop_after:
                local = "stop_after"
            if local is None and state.step < cfg.steps and (outage := loop.read_ahead()) is not None:
                local = DATA_OUTAGE  # this rank cannot read the next step: every rank stops here, with a checkpoint
                recorder.log(state.step, {"kind": "data_outage", "message": outage})
                print(f"data outage on rank {run.info.rank}: {outage}", file=sys.stderr, flush=True)
            reason = vote.decide(local)  # collective: every rank stops after the same step
            if log_now or reason is not None:
                row = loop.log()  # the interval's host sync
                with clock.off_the_clock():
                    recorder.log(state.step, {"kind": "train", **row})
                if state.skipped_steps > cfg.nonfinite_skip_limit:
                    return _halt_anomaly(run, recorder)
                if cfg.spike_skip and loop.spike_run >= cfg.spike_skip_limit:
                    with clock.off_the_clock():
                        return _halt_spikes(run, recorder, loop.spike_run)
                hooks.after_log(state.step, row)
            if cfg.eval_every and state.step % cfg.eval_every == 0:
                with clock.off_the_clock():  # evaluation is not training time, nor are tasks, sampling and checkpoints
                    recorder.log(state.step, {"kind": "eval", **loop.evaluate()})
                    if tasks is not None:
                        recorder.log(state.step, task_row(run, tasks))
            if sampler is not None and sampler.due(state.step):
                with clock.off_the_clock():
                    if samples := sampler.sample(state.step):  # rank 0 only; no collective
                        recorder.log(state.step, {"kind": "sample", "samples": samples})
            periodic = cfg.save_every and state.step % cfg.save_every == 0 and state.step < cfg.steps
            if periodic and (cfg.always_save_checkpoint or _val_improved(run)):
                with clock.off_the_clock():
                    _save(run, recorder, wait=False)  # train.async_checkpoint: the write goes on with the steps
            if reason is not None:
                state.stop_reason = f"stop_after={cfg.stop_after}" if reason == "stop_after" else reason
                break
        if state.stop_reason == WRITE_FAILED_REASON:  # no 'end' row: the run ends write_failed (run_training)
            try:  # the steps since the last checkpoint, where the disk still takes them (a full one refuses cleanly)
                _save(run, recorder)
            except StorageError:
                pass  # no partial file; the newest checkpoint is untouched (the line below names it)
        else:
            _save(run, recorder)  # .HALT stays in place: the operator removes it before resuming (documented)
            recorder.log(state.step, {"kind": "end", "reason": state.stop_reason or "finished"})
        _raise_write_failure(run, recorder)  # collective: a file that failed after the last vote stops every rank too
        if state.stop_reason == DATA_OUTAGE:
            return EXIT_DATA_OUTAGE
    finally:
        try:
            hooks.close(state.step)
        finally:
            flags.restore()
    return 0


def _raise_write_failure(run: Run, recorder: Recorder) -> None:
    """Collective: when any rank's recorder could not write a file, every rank raises StorageError (exit 4) with the
    first failing rank's line; the checkpoint the run ended with (if its write succeeded) is named."""
    failures = gather_objects(recorder.failure, run.info)
    failed = [(rank, line) for rank, line in enumerate(failures) if line is not None]
    if not failed:
        return
    rank, line = failed[0]
    where = f" (rank {rank}; every rank stopped after step {run.state.step})" if run.info.enabled else ""
    kept = ckpt_io.latest_checkpoint(run.out_dir)
    raise StorageError(f"{line}{where}; {'the newest checkpoint is ' + str(kept) if kept else 'no checkpoint'}; "
                       f"free space under {run.out_dir} and run the same command again to resume")


def _save(run: Run, recorder: Recorder, wait: bool = True) -> None:
    """A checkpoint (collective), then its row: rank 0's summary sink rewrites metrics.json and run_*.json.
    wait=False (periodic saves): with train.async_checkpoint the file is written in the background and dt_save_s is
    the time training stopped for (staging the state to host memory, and any previous write still in flight);
    the final save and the anomaly stop wait for the write."""
    t0 = time.perf_counter()
    path = run.save(wait=wait)
    recorder.log(run.state.step, {"kind": "checkpoint", "path": str(path) if path else None,
                                  "dt_save_s": time.perf_counter() - t0})


def _val_improved(run: Run) -> bool:
    last = run.state.last_val_loss
    return last is None or last <= run.state.best_val_loss


def _halt_spikes(run: Run, recorder: Recorder, spike_run: int) -> int:
    """train.spike_skip_limit spike skips in a row: a checkpoint (the skipped steps left weights and optimizer as they
    were; the data position moved past them), the one-line reason in .anomaly_type, exit 3. Checked at log intervals
    only (no host sync per step; the longest run of the interval counts, so a run that ended within it is not missed),
    so the stop can come up to train.log_every - 1 steps after the limit's skip."""
    cfg = run.cfg.train
    run.state.stop_reason = "anomaly"
    _save(run, recorder)
    msg = (f"loss_spike_skips: {spike_run} spike-skipped steps in a row >= limit {cfg.spike_skip_limit} at step "
           f"{run.state.step} (train.spike_skip_limit; {run.state.spike_skipped_steps} in the run)")
    return _flag_anomaly(run, recorder, "loss_spike_skips", msg)


def _halt_anomaly(run: Run, recorder: Recorder) -> int:
    """Too many non-finite steps: flag and stop without writing a checkpoint (the last good one stays)."""
    msg = f"nonfinite_loss: {run.state.skipped_steps} skipped steps > limit {run.cfg.train.nonfinite_skip_limit}"
    run.state.stop_reason = "anomaly"
    return _flag_anomaly(run, recorder, "nonfinite_loss", msg)


def _flag_anomaly(run: Run, recorder: Recorder, anomaly_type: str, msg: str) -> int:
    """The one-line reason in .anomaly_type (rank 0) and the heartbeat's anomaly record; the exit code."""
    if run.is_main:
        (run.out_dir / ANOMALY).write_text(msg + "\n")
    recorder.log(run.state.step, {"kind": "anomaly", "anomaly_type": anomaly_type, "message": msg})
    return EXIT_ANOMALY
