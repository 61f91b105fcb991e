"""Sets a run up (directories, resume, model, optimizer, data, telemetry) and drives the Loop.

Exit codes: 0 finished or stopped gracefully (HALT / SIGTERM / SIGINT / stop_after),
3 halted on repeated non-finite losses (.anomaly_type written, last good checkpoint intact).
"""
from __future__ import annotations

import gc
import math
import os
import platform
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch

from nsa.model import Transformer
from nsa.profiling import audit_log, set_nvtx, set_sdpa_audit
from train import checkpoint as ckpt_io
from train.config import RunConfig, dump_config
from train.data import build_data
from train.data.build import stream_resume_refusal
from train.distributed import (
    DistInfo, barrier, broadcast_from_main, gather_objects, init_distributed, resolve_precision, shutdown_distributed,
    wrap_model,
)
from train.errors import CheckpointError, ConfigError, UserError
from train.import_hf import init_state_dict
from train.loop import Loop, TrainState
from train.optim import build_optimizer
from train.state_dicts import gather_states, load_states
from train.alerts import Alerts
from train.profiler import StepProfiler
from train.run_dir import OutDirBusy, OutDirLock, apply_start, plan_start
from train.safety import ANOMALY_FILE, StopFlags, Watchdog, stale_halt_message
from train.sampling import TrainingSampler
from train.stop import StopVote, early_signal
from train.telemetry import TRAIN_FIELDS, VAL_FIELDS, CsvLog, Heartbeat, TensorBoard, write_json_atomic

EXIT_ANOMALY = 3


def git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def claim_out_dir(cfg: RunConfig, info: DistInfo) -> tuple[Path, OutDirLock | None, Path | None]:
    """Rank 0 creates out_dir, takes its lock, refuses a stale .HALT and decides what to resume
    (sorting old files aside, train/run_dir.py); every rank gets the same answer or the same error."""
    out = Path(cfg.train.out_dir)
    lock, answer, error = None, None, None
    if info.is_main:
        try:
            _check_writable(out)
            lock = OutDirLock(out)
            lock.acquire()
            if not cfg.train.eval_only and (halt := stale_halt_message(out)):
                raise ConfigError(halt)
            plan = plan_start(out, cfg.train.resume, eval_only=cfg.train.eval_only)
            apply_start(out, plan, eval_only=cfg.train.eval_only)
            for note in plan.notes:
                print(note, file=sys.stderr, flush=True)
            answer = ("ok", str(plan.resume) if plan.resume else None)
        except UserError as exc:
            error, answer = exc, ("error", type(exc).__name__, str(exc))
    answer = broadcast_from_main(answer, info)
    if answer[0] == "error":
        if lock is not None:
            lock.release()
        raise error if error is not None else _USER_ERRORS.get(answer[1], UserError)(answer[2])
    return out, lock, Path(answer[1]) if answer[1] else None


_USER_ERRORS = {cls.__name__: cls for cls in (ConfigError, CheckpointError, OutDirBusy, UserError)}


def _check_writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_probe{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"out_dir {out} is not writable: {exc.strerror or exc}") from None


class Run:
    """Everything one training run holds; the Loop reads it, this class writes the artefacts."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.info: DistInfo = init_distributed(cfg.runtime)
        self.is_main = self.info.is_main
        if cfg.runtime.threads and self.info.device.type == "cpu":
            torch.set_num_threads(cfg.runtime.threads)
        self.out_dir, self.lock, self.resume_path = claim_out_dir(cfg, self.info)
        try:
            self._build(cfg)
        except BaseException:
            if self.lock is not None:  # a failed start leaves the out_dir free at once, in-process too
                self.lock.release()
            raise

    def _build(self, cfg: RunConfig) -> None:
        self.amp_dtype = resolve_precision(cfg.runtime.precision, self.info.device)
        set_nvtx(cfg.runtime.nvtx)
        set_sdpa_audit(cfg.runtime.sdpa_audit)
        self.state = TrainState()
        self.started = time.time()

        torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
        self.raw_model = Transformer(cfg.model).to(self.info.device)
        if cfg.train.init_from:
            self._init_weights(cfg.train.init_from)
        self.raw_model.checkpoint_every = cfg.runtime.gradient_checkpointing
        self._note_single_process_options()
        fsdp = cfg.runtime.fsdp and self.info.enabled
        if fsdp:  # shard before the optimizer sees the parameters
            wrap_model(self.raw_model, self.info, cfg.runtime, self.amp_dtype)
        self.optimizer = build_optimizer(self.raw_model, cfg.train, self.info.device.type,
                                         zero1=cfg.runtime.zero1 and self.info.enabled)
        # memory-mapped: tensors are read from the file while copied in, never held twice
        self.ckpt = ckpt_io.load_checkpoint(self.resume_path) if self.resume_path else None
        self.resumed = self.ckpt is not None
        if self.resumed and self.ckpt.get("imported_from"):  # written by train/import_hf.py
            raise CheckpointError(f"checkpoint {self.resume_path} holds imported weights only (no optimizer or data "
                                  f"state) and cannot be resumed; start from it with train.init_from={self.resume_path}")
        self.lineage = (self.ckpt or {}).get("lineage") or uuid.uuid4().hex
        if self.resumed:
            self._restore_weights()
        torch.manual_seed(cfg.train.seed + 1000 * self.info.rank)  # dropout streams differ per rank
        self.data = build_data(
            cfg.data, seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size, vocab_size=cfg.model.vocab_size,
            seed=cfg.train.seed, rank=self.info.rank, world_size=self.info.world_size,
            accumulate=cfg.train.accumulate_grad_batches, pin=self.info.device.type == "cuda",
        )
        if self.resumed:
            self._restore_progress()
        self.ckpt = None  # the mapping of the file is dropped; the state lives in the model now
        model = self.raw_model if fsdp else wrap_model(self.raw_model, self.info, cfg.runtime, self.amp_dtype)
        self.model = self._compile(model)
        self.flops = self._flops_report()
        self._open_telemetry()

    def _compile(self, model):
        rt = self.cfg.runtime
        if not rt.compile:
            return model
        if rt.cuda_graphs and self.info.device.type != "cuda":
            print("note: runtime.cuda_graphs needs CUDA; compiling without CUDA graphs", flush=True)
        mode = "reduce-overhead" if rt.cuda_graphs and self.info.device.type == "cuda" else None
        return torch.compile(model, mode=mode)

    def _init_weights(self, spec: str) -> None:
        """train.init_from: a fresh start loads these weights (the same file on every rank); a resume ignores it."""
        if self.resume_path is not None:
            if self.is_main:
                print(f"note: train.init_from={spec} ignored: resuming from {self.resume_path}", flush=True)
            return
        self.raw_model.load_state_dict(init_state_dict(spec, self.cfg.model))
        if self.is_main:
            print(f"init: weights from {spec}", flush=True)

    # ---- resume ------------------------------------------------------------------------------
    def _restore_weights(self) -> None:
        ckpt_io.check_architecture(self.ckpt, self.cfg.to_dict()["model"] | {"nsa": self.cfg.to_dict()["nsa"]},
                                   self.resume_path)
        try:
            load_states(self.raw_model, self.optimizer, self.ckpt["model"], self.ckpt["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"checkpoint {self.resume_path} does not fit the model: {str(exc).splitlines()[0]}") from None

    def _note_single_process_options(self) -> None:
        rt = self.cfg.runtime
        if not self.info.enabled and self.is_main and (rt.zero1 or rt.fsdp or rt.ddp_compress != "none"):
            print("note: zero1 / fsdp / ddp_compress apply to multi-process runs; this run has one process",
                  flush=True)

    def _restore_progress(self) -> None:
        ck = self.ckpt
        self.state.step = int(ck["step"])
        self.state.tokens_seen = int(ck.get("tokens_seen", 0))
        self.state.best_val_loss = float(ck.get("best_val_loss", math.inf))
        self.state.skipped_steps = int(ck.get("skipped_steps", 0))
        data_states = ck.get("data") or []
        if data_states and not self.cfg.train.eval_only:  # evaluation reads held-out data only
            if getattr(self.data.train, "any_world_size", False):  # a function of the global step: any world size
                self.data.train.load_state_dict(data_states[0])
            elif refusal := stream_resume_refusal(
                    len(data_states), self.info.world_size, ck["config"].get("data", {}).get("num_workers", 0),
                    self.cfg.data.num_workers, checkpoint=str(self.resume_path)):
                raise CheckpointError(refusal)
            else:
                self.data.train.load_state_dict(data_states[self.info.rank])
        rng = ck["rng"]
        ranks_rng = ck.get("rng_per_rank")
        ckpt_io.set_rng_state(ranks_rng[self.info.rank] if ranks_rng and len(ranks_rng) > self.info.rank else rng)

    # ---- telemetry ---------------------------------------------------------------------------
    def _open_telemetry(self) -> None:
        resume_step = self.state.step if self.resumed else None
        self.heartbeat = Heartbeat(self.out_dir / f"heartbeat_rank{self.info.rank}.jsonl", self.info.rank)
        self.train_csv = self.val_csv = None
        self.tb = TensorBoard(None)
        if self.is_main and not self.cfg.train.eval_only:
            (self.out_dir / "config.yaml").write_text(dump_config(self.cfg))
            self.train_csv = CsvLog(self.out_dir / "training.csv", TRAIN_FIELDS, resume_step)
            self.val_csv = CsvLog(self.out_dir / "val.csv", VAL_FIELDS, resume_step)
            self.tb = TensorBoard(self.out_dir / "tb")
        self.wandb = None
        if self.is_main and self.cfg.runtime.wandb and not self.cfg.train.eval_only:
            from train.wandb_log import WandbLogger

            self.wandb = WandbLogger(self.cfg, self.out_dir)

    def _flops_report(self) -> dict:
        try:
            from nsa.flops import flops_per_token, peak_flops
        except ImportError:
            return {}
        report = flops_per_token(self.cfg.model, self.cfg.train.seq_len)
        peak = None
        if self.info.device.type == "cuda":
            dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "tf32"}[self.amp_dtype]
            peak = peak_flops(torch.cuda.get_device_name(self.info.device), dtype)
        return {"report": report, "peak": peak}

    def throughput_metrics(self, toks_per_s: float) -> dict:
        out = {"toks_per_s_per_gpu": toks_per_s / self.info.world_size, "mfu": None, "tflops": None}
        if self.flops:
            from nsa.flops import mfu

            fpt = self.flops["report"].flops_per_token
            out["tflops"] = toks_per_s * fpt / 1e12 / self.info.world_size
            out["mfu"] = mfu(toks_per_s, fpt, self.flops["peak"], self.info.world_size)
        return out

    def memory_mib(self) -> dict:
        if self.info.device.type != "cuda":
            return {"mem_alloc_mib": None, "mem_reserved_mib": None}
        return {"mem_alloc_mib": torch.cuda.max_memory_allocated(self.info.device) / 2**20,
                "mem_reserved_mib": torch.cuda.max_memory_reserved(self.info.device) / 2**20}

    def set_stats(self, enabled: bool) -> None:
        if self.cfg.model.attention == "nsa":
            from nsa.attention.gate_stats import set_gate_stats

            set_gate_stats(self.raw_model, enabled)

    def gate_health(self) -> dict:
        if self.cfg.model.attention != "nsa":
            return {}
        from nsa.attention.gate_stats import gate_health

        stats = gate_health(self.raw_model)
        if not stats:
            return {}
        values = torch.stack([v.float() for v in stats.values()]).tolist()
        return dict(zip(stats.keys(), values))

    def record_interval(self, row: dict, gate: dict) -> None:
        # gate keys are already namespaced (gate_*, sel_*): see nsa/attention/gate_stats.py
        self.heartbeat.emit("train", row["step"], **{k: v for k, v in row.items() if k != "step"}, **gate)
        self.state.history.append({**row, **gate})
        if self.is_main:
            self.train_csv.write(row)
            scalars = {f"train/{k}": v for k, v in row.items() if k != "step"} | {f"gates/{k}": v for k, v in gate.items()}
            self.tb.scalars(row["step"], scalars)
            if self.wandb:
                self.wandb.log(row["step"], scalars)
            mfu = f" mfu {row['mfu'] * 100:.1f}%" if row.get("mfu") is not None else ""
            print(f"step {row['step']:>6} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
                  f"{row['toks_per_s']:,.0f} tok/s | norm {row['grad_norm']:.3f}{mfu}", flush=True)

    def record_eval(self, val_loss: float) -> None:
        step = self.state.step
        ppl = math.exp(min(val_loss, 50.0))
        self.state.last_val_loss = val_loss
        self.state.best_val_loss = min(self.state.best_val_loss, val_loss)
        self.heartbeat.emit("eval", step, val_loss=val_loss, ppl=ppl)
        if self.is_main:
            self.val_csv.write({"step": step, "val_loss": val_loss, "ppl": ppl})
            self.state.evals.append({"iter": step, "val_loss": val_loss, "ppl": ppl})
            self.tb.scalars(step, {"val/loss": val_loss, "val/ppl": ppl})
            if self.wandb:
                self.wandb.log(step, {"val/loss": val_loss, "val/ppl": ppl})
            print(f"step {step:>6} | val loss {val_loss:.4f} | ppl {ppl:.2f}", flush=True)

    # ---- checkpoints -------------------------------------------------------------------------
    def save(self) -> Path | None:
        t0 = time.perf_counter()
        data_states = gather_objects(self.data.train.state_dict(), self.info)
        rng_states = gather_objects(ckpt_io.rng_state(), self.info)
        model_state, optim_state = gather_states(self.raw_model, self.optimizer, self.is_main)
        path = None
        if self.is_main:
            state = {
                "model": model_state, "optimizer": optim_state,
                "tokens_seen": self.state.tokens_seen, "best_val_loss": self.state.best_val_loss,
                "skipped_steps": self.state.skipped_steps, "data": data_states, "rng_per_rank": rng_states,
                "config": self.cfg.to_dict(), "world_size": self.info.world_size, "lineage": self.lineage,
            }
            protect = (self.resume_path,) if self.resume_path else ()
            path = ckpt_io.save_checkpoint(self.out_dir, self.state.step, state, self.cfg.train.keep_last,
                                           self.cfg.train.keep_all_checkpoints, protect=protect)
            self.write_metrics("running")
            self.write_run_summary()
        barrier(self.info)
        self.heartbeat.emit("checkpoint", self.state.step, path=str(path) if path else None,
                            dt_save_s=time.perf_counter() - t0)
        return path

    def write_metrics(self, status: str) -> None:
        if not self.is_main:
            return
        ckpts = [p.name for _, p in ckpt_io.valid_checkpoints(self.out_dir)]
        last = self.state.history[-1] if self.state.history else {}
        report = self.flops.get("report") if self.flops else None
        write_json_atomic(self.out_dir / "metrics.json", {
            "status": status, "step": self.state.step, "steps": self.cfg.train.steps,
            "tokens_seen": self.state.tokens_seen, "last_loss": last.get("loss"),
            "last_toks_per_s": last.get("toks_per_s"), "best_val_loss": _finite_or_none(self.state.best_val_loss),
            "last_val_loss": self.state.last_val_loss, "skipped_steps": self.state.skipped_steps,
            "params": self.raw_model.num_params(), "params_non_embedding": self.raw_model.num_params(False),
            "flops": report.as_dict() if report is not None else None,
            "device": str(self.info.device), "world_size": self.info.world_size,
            "precision": str(self.amp_dtype).replace("torch.", ""), "torch": torch.__version__,
            "python": platform.python_version(), "git_sha": git_sha(), "started": self.started,
            "updated": time.time(), "checkpoints": ckpts, "data": self.data.describe(),
            "stop_reason": self.state.stop_reason,
        })

    def write_run_summary(self) -> None:
        """run_YYYYMMDD_HHMMSS.json (seeds 001/002): config, hardware, per-interval metrics, summary."""
        if not self.is_main:
            return
        hist = self.state.history
        warm = hist[1:] if len(hist) > 1 else hist  # the first interval includes start-up
        mfus = [h["mfu"] for h in warm if h.get("mfu") is not None]
        tps = [h["toks_per_s"] for h in warm]
        report = self.flops.get("report") if self.flops else None
        name = time.strftime("run_%Y%m%d_%H%M%S.json", time.localtime(self.started))
        write_json_atomic(self.out_dir / name, {
            "config": self.cfg.to_dict(),
            "hardware": {"device": str(self.info.device), "device_name": _device_name(self.info.device),
                         "world_size": self.info.world_size, "peak_flops_per_gpu": self.flops.get("peak") if self.flops else None},
            "parallelism": {"ddp": self.info.enabled and not (self.cfg.runtime.fsdp or self.cfg.runtime.zero1),
                            "zero1": self.cfg.runtime.zero1 and self.info.enabled,
                            "fsdp": self.cfg.runtime.fsdp and self.info.enabled,
                            "ddp_compress": self.cfg.runtime.ddp_compress},
            "calculation_method": report.calculation_method if report is not None else None,
            "flops_per_token": report.flops_per_token if report is not None else None,
            "attention_to_ffn_ratio": report.attention_to_ffn_ratio if report is not None else None,
            "training_iterations": [{"iter": h["step"], **{k: v for k, v in h.items() if k != "step"}} for h in hist],
            "eval_steps": self.state.evals, "checkpoints": [p.name for _, p in ckpt_io.valid_checkpoints(self.out_dir)],
            "summary": {"steps": self.state.step, "tokens_seen": self.state.tokens_seen,
                        "avg_mfu": sum(mfus) / len(mfus) if mfus else None, "peak_mfu": max(mfus) if mfus else None,
                        "avg_toks_per_s": sum(tps) / len(tps) if tps else None,
                        "final_loss": hist[-1]["loss"] if hist else None,
                        "best_val_loss": _finite_or_none(self.state.best_val_loss),
                        "wall_s": time.time() - self.started},
        })

    def close(self) -> None:
        for thing in (self.train_csv, self.val_csv, self.tb, self.heartbeat):
            if thing is not None:
                thing.close()
        if self.wandb:
            self.wandb.finish()
        self.data.close()
        if self.lock is not None:
            self.lock.release()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def run_training(cfg: RunConfig) -> int:
    try:
        run = Run(cfg)
    except BaseException:
        shutdown_distributed(clean_exit=False)
        raise
    clean = False
    try:
        code = _eval_only(run) if cfg.train.eval_only else _train(run)
        clean = True
        return code
    finally:
        run.close()
        shutdown_distributed(clean_exit=clean)


def _eval_only(run: Run) -> int:
    if not run.resumed:
        raise CheckpointError(f"eval_only needs a checkpoint; none found in {run.out_dir}")
    val = Loop(run).evaluate()
    run.heartbeat.emit("eval_only", run.state.step, val_loss=val, checkpoint=str(run.resume_path))
    if run.is_main:
        result = {"checkpoint": str(run.resume_path), "step": run.state.step, "val_loss": val,
                  "ppl": math.exp(min(val, 50.0))}
        write_json_atomic(run.out_dir / f"eval_step{run.state.step}.json", result)
        print(f"eval_only | step {run.state.step} | val loss {val:.4f} | ppl {result['ppl']:.2f}", flush=True)
    return 0


def _train(run: Run) -> int:
    cfg, state = run.cfg.train, run.state
    sampler = TrainingSampler.for_run(run)  # None unless train.sample_every > 0
    loop = Loop(run)
    flags = StopFlags(run.out_dir, on_stackdump=lambda p: run.heartbeat.emit("stackdump", state.step, path=str(p)),
                      rank=run.info.rank)
    watchdog = None
    if run.cfg.runtime.watchdog_s > 0:
        watchdog = Watchdog(run.out_dir, run.cfg.runtime.watchdog_s,
                            lambda p, idle: run.heartbeat.emit("watchdog", state.step, idle_s=idle, path=str(p)),
                            rank=run.info.rank)
        watchdog.start()
    vote = StopVote(run.info.control_group, enabled=run.info.enabled)
    start_step = state.step
    if run.cfg.runtime.disable_gc:  # seed 004's NSA_DDP_DISABLE_GC: no GC pauses inside steps
        gc.collect()
        gc.freeze()
        gc.disable()
    run.heartbeat.emit("start", state.step, resumed_from=str(run.resume_path) if run.resume_path else None,
                       world_size=run.info.world_size, device=str(run.info.device))
    run.write_metrics("running")
    if run.is_main:
        print(f"run: {run.raw_model.num_params():,} params | {loop.tokens_per_step:,} tokens/step | "
              f"device {run.info.device} | {str(run.amp_dtype).replace('torch.', '')} | "
              f"{'resumed at step ' + str(state.step) if run.resumed else 'fresh start'}", flush=True)
    alerts = Alerts(run.cfg)
    profiler = StepProfiler(run.out_dir, run.cfg.runtime.profile_steps if run.is_main else "",
                            on_written=lambda tag, paths: run.heartbeat.emit("profile", state.step, tag=tag, paths=paths))
    try:
        if cfg.eval_at_start and state.step == 0 and cfg.eval_every:
            run.record_eval(loop.evaluate())
        while state.step < cfg.steps:
            next_step = state.step + 1
            log_now = next_step % cfg.log_every == 0 or next_step == cfg.steps
            profiler.before_step(next_step)
            loop.step(collect_stats=log_now)
            profiler.after_step(state.step)
            if watchdog:
                watchdog.beat()
            if state.step == start_step + 1 and run.cfg.runtime.sdpa_audit:
                run.heartbeat.emit("sdpa_audit", state.step, sites=audit_log())
                if run.is_main:
                    print(f"sdpa audit: {audit_log()}", flush=True)
            local = flags.reason if flags.should_stop() else early_signal()
            if local is None and cfg.stop_after and state.step - start_step >= cfg.stop_after:
                local = "stop_after"
            reason = vote.decide(local)  # collective: every rank stops after the same step
            stop = reason is not None
            if log_now or stop:
                row = loop.log()
                if run.cfg.runtime.disable_gc:
                    gc.collect(1)
                if state.skipped_steps > cfg.nonfinite_skip_limit:
                    return _halt_anomaly(run, row)
                for alert in alerts.observe(row):
                    run.heartbeat.emit("alert", state.step, **alert)
                if alerts.profile_requested:
                    alerts.profile_requested = False
                    profiler.start(state.step + 1, state.step + 5, tag=f"throughput_drop_step{state.step}")
            if cfg.eval_every and state.step % cfg.eval_every == 0:
                t_eval = time.perf_counter()
                run.record_eval(loop.evaluate())
                loop.i_start += time.perf_counter() - t_eval  # eval time is not training time
            if sampler is not None and sampler.due(state.step):
                t_sample = time.perf_counter()
                sampler.sample(state.step)  # rank 0 only; no collective
                loop.i_start += time.perf_counter() - t_sample  # nor is sampling time
            periodic = cfg.save_every and state.step % cfg.save_every == 0 and state.step < cfg.steps
            if periodic and (cfg.always_save_checkpoint or _val_improved(run)):
                t_save = time.perf_counter()
                run.save()
                loop.i_start += time.perf_counter() - t_save
            if stop:
                state.stop_reason = f"stop_after={cfg.stop_after}" if reason == "stop_after" else reason
                break
        run.save()  # .HALT stays in place: the operator removes it before resuming (documented)
        run.heartbeat.emit("end", state.step, reason=state.stop_reason or "finished")
        run.write_metrics("stopped" if state.stop_reason else "finished")
        run.write_run_summary()
        if run.is_main:
            print(f"done: step {state.step} ({state.stop_reason or 'finished'}); checkpoint in {run.out_dir}", flush=True)
    finally:
        profiler.close(state.step)
        flags.restore()
        if watchdog:
            watchdog.stop()
        if run.cfg.runtime.disable_gc:
            gc.enable()
            gc.unfreeze()
    return 0


def _val_improved(run: Run) -> bool:
    last = run.state.last_val_loss
    return last is None or last <= run.state.best_val_loss


def _halt_anomaly(run: Run, row: dict) -> int:
    """Too many non-finite steps: flag and stop without writing a checkpoint (the last good one stays)."""
    msg = f"nonfinite_loss: {run.state.skipped_steps} skipped steps > limit {run.cfg.train.nonfinite_skip_limit}"
    if run.is_main:
        (run.out_dir / ANOMALY_FILE).write_text(msg + "\n")
        print(f"HALT: {msg}; last good checkpoint kept", flush=True)
    run.heartbeat.emit("anomaly", run.state.step, anomaly_type="nonfinite_loss", message=msg)
    run.state.stop_reason = "anomaly"
    run.write_metrics("anomaly")
    return EXIT_ANOMALY
