"""Builds a run: claims the out_dir, builds model, optimizer and data, restores a checkpoint to resume from;
`Run.save()` writes the next one. What is logged and when is the runner's business (train/trainer/runner.py)."""
from __future__ import annotations

import copy
import errno
import math
import os
import random
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import torch

from nsa.model import Transformer
from nsa.profiling import set_nvtx, set_sdpa_audit
from train.checkpoint import io as ckpt_io
from train.checkpoint.async_writer import AsyncWriter, stage_to_host
from train.checkpoint.run_dir import OutDirBusy, OutDirLock, apply_start, drop_if_only_lock, plan_start
from train.checkpoint.state_dicts import gather_states, load_states
from train.checkpoint.train_state import TrainState
from train.core.artifacts import CONFIG_YAML, checkpoint_name
from train.core.config import RunConfig, data_mixture, dump_config
from train.core.data_config import resolve_document_mask
from train.core.distributed import (
    DistInfo,
    broadcast_from_main,
    gather_objects,
    init_distributed,
    resolve_precision,
    wrap_model,
)
from train.core.errors import CheckpointError, ConfigError, DataError, StorageError, UserError, print_error
from train.core.seq_stages import SeqStage, seq_stages, stage_at, trained_fields
from train.data import build_data
from train.hf.importer import EXTENSION_FIELDS, init_state_dict
from train.observe.efficiency import Efficiency
from train.observe.telemetry import write_text_atomic
from train.trainer.optim import build_optimizer
from train.core.param_groups import muon_names, split_summary
from train.trainer.safety import stale_halt_message
from train.trainer.spikes import SpikeDetector
from train.trainer.start_checks import BATCH_KEYS, resume_checks


def seed_host_and_torch_rngs(seed: int) -> None:
    """Torch's, Python's and NumPy's global generators from one seed, so a checkpoint's saved RNG states are the same
    on every fresh run of the same command (nothing in training draws from the host ones today; a resume restores
    all three)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def claim_out_dir(cfg: RunConfig, info: DistInfo) -> tuple[Path, OutDirLock | None, Path | None]:
    """Rank 0 creates out_dir, takes its lock, refuses a stale .HALT and decides what to resume (sorting old files
    aside, train/checkpoint/run_dir.py) once the resume checks pass; every rank gets the same answer or the same
    error."""
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
            if plan.resume is not None:  # refuse before a file moves; _build runs them again for the batch split
                resume_checks(copy.deepcopy(cfg), ckpt_io.load_checkpoint(plan.resume), plan.resume, info.world_size)
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


_USER_ERRORS = {cls.__name__: cls for cls in (ConfigError, CheckpointError, DataError, OutDirBusy, UserError)}


def _check_writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_probe{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"out_dir {out} is not writable: {exc.strerror or exc}") from None


SPIKE_SKIP_KEY = "spike_skip"  # the checkpoint's spike-skip window (SpikeDetector.state_dict), None when off
DATA_RESTARTS_KEY = "data_restarts"  # [{step, reason}]: where the training data started afresh (data.restart_on_change)
EXTENDED_FROM_KEY = "extended_from"  # train.extend_from's lineage: {checkpoint, step, seq_len, rope_theta, ...} or None


class Run:
    """What one training process holds: cfg, info (rank, device), out_dir and its lock, state (TrainState),
    raw_model (the Transformer), model (what trains: DDP / FSDP / compiled), optimizer, spikes (the spike-skip
    detector, None when off), data (DataBundle), writer (rank 0's AsyncWriter with train.async_checkpoint, else None),
    efficiency (FLOPs report, MFU), resume_path / resumed, lineage, data_restarts (where the training data started
    afresh, this resume's last), started (unix time)."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.info: DistInfo = init_distributed(cfg.runtime)
        self.is_main = self.info.is_main
        self.writer = AsyncWriter() if cfg.train.async_checkpoint and self.is_main else None
        self._threads_before = torch.get_num_threads()  # restored by close(): an in-process run leaves none changed
        if cfg.runtime.threads and self.info.device.type == "cpu":
            torch.set_num_threads(cfg.runtime.threads)
        existed = Path(cfg.train.out_dir).exists()
        try:
            self.out_dir, self.lock, self.resume_path = claim_out_dir(cfg, self.info)
        except BaseException:
            torch.set_num_threads(self._threads_before)
            raise
        try:
            self._build(cfg)
        except BaseException:
            torch.set_num_threads(self._threads_before)
            if self.lock is not None:  # a failed start leaves the out_dir free at once, in-process too
                self.lock.release()
                if not existed:  # and a directory it created for nothing goes again
                    drop_if_only_lock(self.out_dir)
            raise

    def _set_document_mask(self, ckpt: dict | None) -> None:
        """data.document_mask -> the model's document rule; the effective value is written back into the
        config, so checkpoints, run.info and evaluation record what the run trains with."""
        eos_id = self.data.info.get("eos_id")
        saved = ckpt["config"].get("data", {}) if ckpt is not None else None
        on, note = resolve_document_mask(self.cfg.data.document_mask, eos_id, saved)
        if note and self.is_main:
            print(note, flush=True)
        self.cfg.data.document_mask = on
        self.raw_model.document_eos_id = eos_id if on else None

    def _build(self, cfg: RunConfig) -> None:
        self.amp_dtype = resolve_precision(cfg.runtime.precision, self.info.device)
        set_nvtx(cfg.runtime.nvtx)
        set_sdpa_audit(cfg.runtime.sdpa_audit)
        self.state = TrainState()
        self.started = time.time()

        torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
        self.raw_model = Transformer(cfg.model).to(self.info.device)
        self._check_kernels_fit()
        self.extended_from = None  # train.extend_from: the checkpoint this run continues at a longer context
        if cfg.train.init_from:
            self._init_weights(cfg.train.init_from)
        elif cfg.train.extend_from:
            self._extend(cfg.train.extend_from)
        self.raw_model.checkpoint_every = cfg.runtime.gradient_checkpointing
        self._note_single_process_options()
        fsdp = cfg.runtime.fsdp and self.info.enabled
        if fsdp:  # shard before the optimizer sees the parameters
            wrap_model(self.raw_model, self.info, cfg.runtime, self.amp_dtype)
        self.optimizer = build_optimizer(self.raw_model, cfg.train, self.info.device.type,
                                         zero1=cfg.runtime.zero1 and self.info.enabled)
        if cfg.train.optimizer == "muon" and self.is_main:
            print(split_summary(self.raw_model, muon_names(self.raw_model)), flush=True)
        self.spikes = SpikeDetector.from_config(cfg.train, self.info.device)  # None: spike skipping off
        # memory-mapped: tensors are read from the file while copied in, never held twice
        ckpt = ckpt_io.load_checkpoint(self.resume_path) if self.resume_path else None
        self.resumed = ckpt is not None
        self.data_restarts = list((ckpt or {}).get(DATA_RESTARTS_KEY) or [])
        self.data_restart = None  # why this resume starts the training data afresh (data.restart_on_change)
        if self.resumed:  # the launch's start checks (train/trainer/start_checks.py); may re-split the global batch
            decision = resume_checks(cfg, ckpt, self.resume_path, self.info.world_size)
            for note in decision.notes:
                if self.is_main:
                    print(note, flush=True)
            self.data_restart = decision.data_restart
            if decision.data_restart:
                self.data_restarts.append({"step": int(ckpt["step"]), "reason": decision.data_restart})
        self.lineage = (ckpt or {}).get("lineage") or uuid.uuid4().hex
        if self.resumed:
            self.extended_from = ckpt.get(EXTENDED_FROM_KEY)
        if self.resumed:
            self._restore_weights(ckpt)
        seed_host_and_torch_rngs(cfg.train.seed + 1000 * self.info.rank)  # dropout streams differ per rank
        # train.seq_stages: the stage of the step this launch starts at (the batch split above is this world size's)
        self.stages = seq_stages(cfg)
        self.stage = stage_at(self.stages, int(ckpt["step"]) if ckpt is not None else 0)
        self.data = self._build_data(self.stage)
        self._apply_model_stage(self.stage)
        self._set_document_mask(ckpt)
        if self.resumed:
            self._restore_progress(ckpt)
        del ckpt  # the mapping of the file is dropped; the state lives in the model now
        model = self.raw_model if fsdp else wrap_model(self.raw_model, self.info, cfg.runtime, self.amp_dtype)
        self.model = self._compile(model)
        self.efficiency = Efficiency(cfg.model, self.stage.seq_len, self.info.device, self.amp_dtype,
                                     self.info.world_size)
        if self.is_main and not cfg.train.eval_only:
            write_text_atomic(self.out_dir / CONFIG_YAML, dump_config(cfg))

    # ---- sequence-length stages (train.seq_stages) --------------------------------------------------------------
    def _build_data(self, stage: SeqStage):
        cfg = self.cfg
        return build_data(
            cfg.data, seq_len=stage.seq_len, batch_size=stage.batch_size, vocab_size=cfg.model.vocab_size,
            seed=cfg.train.seed, rank=self.info.rank, world_size=self.info.world_size,
            accumulate=stage.accumulate, pin=self.info.device.type == "cuda", mixture=data_mixture(cfg),
        )

    def _apply_model_stage(self, stage: SeqStage) -> None:
        """The stage's RoPE and NSA window on the model (nothing for a stage that keeps them)."""
        model_cfg = self.raw_model.cfg
        if self.raw_model.rope is not None and (stage.rope_theta, stage.rope_scale) != (model_cfg.rope_theta,
                                                                                        model_cfg.rope_scale):
            self.raw_model.set_positions(stage.rope_theta, stage.rope_scale)
        if stage.nsa_w is not None and stage.nsa_w != model_cfg.nsa.w:
            self.raw_model.set_window(stage.nsa_w)

    def stage_for(self, step: int) -> SeqStage:
        return stage_at(self.stages, step)

    def enter_stage(self, stage: SeqStage) -> None:
        """From optimizer step stage.at on: the data at the stage's seq_len and batch split, positioned at that step
        (bin: / synthetic rows are a function of the step), the model's RoPE and window, MFU at the new length.
        A compiled model compiles again once, for the new shapes."""
        self.data.close()
        self.data = self._build_data(stage)
        self.data.train.load_state_dict({**self.data.train.state_dict(), "step": stage.at})
        self._apply_model_stage(stage)
        if self.cfg.runtime.compile:
            torch._dynamo.reset()  # one compilation per stage, static shapes inside it
        self.efficiency = Efficiency(self.cfg.model, stage.seq_len, self.info.device, self.amp_dtype,
                                     self.info.world_size)
        self.stage = stage

    def _compile(self, model):
        rt = self.cfg.runtime
        if not rt.compile:
            return model
        if rt.cuda_graphs and self.info.device.type != "cuda":
            print("note: runtime.cuda_graphs needs CUDA; compiling without CUDA graphs", flush=True)
        mode = "reduce-overhead" if rt.cuda_graphs and self.info.device.type == "cuda" else None
        # Regional compilation: each block is compiled in place (its parameters' names unchanged). The blocks share one
        # forward, and Dynamo treats their parameters as inputs, so the first block's compilation serves all of them:
        # compile time is one block's, not n_layers' (a whole M7C-125M NSA model had not finished compiling after
        # 162 s on an H200). Embedding, final norm and the chunked loss stay eager.
        for block in model.blocks:
            block.compile(mode=mode)
        return model

    def _init_weights(self, spec: str) -> None:
        """train.init_from: a fresh start loads these weights (the same file on every rank); a resume ignores it."""
        if self.resume_path is not None:
            if self.is_main:
                print(f"note: train.init_from={spec} ignored: resuming from {self.resume_path}", flush=True)
            return
        self.raw_model.load_state_dict(init_state_dict(spec, self.cfg.model))
        if self.is_main:
            print(f"init: weights from {spec}", flush=True)

    def _extend(self, spec: str) -> None:
        """train.extend_from: a fresh start from a checkpoint's weights at a longer context (its positions and window may
        differ: EXTENSION_FIELDS); the lineage (which checkpoint, its step, length, RoPE and window, and its own
        lineage) is recorded here and kept by every checkpoint of this run. A resume keeps the recorded one."""
        if self.resume_path is not None:
            return  # _build reads the lineage from the checkpoint it resumes
        path = ckpt_io.resolve_checkpoint(Path(spec)).resolve()
        ckpt = ckpt_io.load_checkpoint(path)
        self.raw_model.load_state_dict(init_state_dict(str(path), self.cfg.model, "train.extend_from",
                                                       EXTENSION_FIELDS))
        trained = trained_fields(ckpt["config"], int(ckpt["step"]))  # its last step's length, RoPE and window
        seq_len = trained["seq_len"]
        self.extended_from = {"checkpoint": str(path), "step": int(ckpt["step"]), **trained,
                              "lineage": ckpt.get("lineage"),
                              "extended_from": ckpt.get(EXTENDED_FROM_KEY)}  # its own, when it was an extension
        if self.is_main:
            print(f"extend: weights from {path} (step {ckpt['step']}, seq_len {seq_len}) at seq_len "
                  f"{self.cfg.train.seq_len}, rope_theta {self.cfg.model.rope_theta:g}", flush=True)

    def _check_kernels_fit(self) -> None:
        """Refuse, before any launch, NSA kernels that cannot fit this GPU's shared memory (a window-only layer,
        nsa.gates=window, runs none of the selection kernels)."""
        if self.info.device.type != "cuda" or self.cfg.model.nsa.window_only:
            return
        from nsa.attention.ops import kernel_fit_problem

        limit = torch.cuda.get_device_properties(self.info.device).shared_memory_per_block_optin
        problem = kernel_fit_problem(self.cfg.model, self.amp_dtype or torch.float32, limit)
        if problem:
            raise ConfigError(problem)

    def _note_single_process_options(self) -> None:
        rt = self.cfg.runtime
        if not self.info.enabled and self.is_main and (rt.zero1 or rt.fsdp or rt.ddp_compress != "none"):
            print("note: zero1 / fsdp / ddp_compress apply to multi-process runs; this run has one process",
                  flush=True)

    # ---- resume ------------------------------------------------------------------------------
    def _restore_weights(self, ck: dict) -> None:
        """Weights and optimizer state; train.eval_only: the weights (the run never steps, and the checkpoint may
        come from another train.optimizer)."""
        evaluating = self.cfg.train.eval_only
        try:
            load_states(self.raw_model, None if evaluating else self.optimizer, ck["model"],
                        None if evaluating else ck["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"checkpoint {self.resume_path} does not fit the model: {str(exc).splitlines()[0]}") from None

    def _restore_progress(self, ck: dict) -> None:
        self.state.step = int(ck["step"])
        self.state.tokens_seen = int(ck.get("tokens_seen", 0))
        self.state.best_val_loss = float(ck.get("best_val_loss", math.inf))
        self.state.skipped_steps = int(ck.get("skipped_steps", 0))
        self.state.spike_skipped_steps = int(ck.get("spike_skipped_steps", 0))
        if self.spikes is not None and ck.get(SPIKE_SKIP_KEY) is not None:  # else the window starts empty
            note = self.spikes.load_state_dict(ck[SPIKE_SKIP_KEY])
            if note and self.is_main:
                print(note, flush=True)
        data_states = ck.get("data") or []
        if data_states and not self.cfg.train.eval_only and not self.data_restart:  # evaluation reads held-out data only
            if getattr(self.data.train, "any_world_size", False):  # a function of the global step: any world size
                state = data_states[0]
                if any(key in self.cfg.overrides for key in BATCH_KEYS):
                    state = {**state, "global_batch": self.data.train.global_batch}  # a new global batch, by choice
                self.data.train.load_state_dict(state)
            else:  # same world size and workers: resume_checks refused any other
                self.data.train.load_state_dict(data_states[self.info.rank])
        rng = ck["rng"]
        ranks_rng = ck.get("rng_per_rank")
        ckpt_io.set_rng_state(ranks_rng[self.info.rank] if ranks_rng and len(ranks_rng) > self.info.rank else rng)

    # ---- checkpoints -------------------------------------------------------------------------
    def save(self, wait: bool = True) -> Path | None:
        """Collective: every rank's data position and RNG state, rank 0 writes the file (its path; None elsewhere).
        With train.async_checkpoint rank 0 stages the state to host memory and its writer thread writes the file;
        wait=False returns once the state is staged (the path then names a file still being written). A write that
        fails (this one, or the asynchronous one before it) raises StorageError on every rank."""
        data_states = gather_objects(self.data.train.state_dict(), self.info)
        rng_states = gather_objects(ckpt_io.rng_state(), self.info)
        model_state, optim_state = gather_states(self.raw_model, self.optimizer, self.is_main)
        path, failure = None, None
        if self.is_main:
            state = {
                "model": model_state, "optimizer": optim_state,
                "tokens_seen": self.state.tokens_seen, "best_val_loss": self.state.best_val_loss,
                "skipped_steps": self.state.skipped_steps, "spike_skipped_steps": self.state.spike_skipped_steps,
                SPIKE_SKIP_KEY: self.spikes.state_dict() if self.spikes is not None else None,
                "data": data_states, "rng_per_rank": rng_states,
                "config": self.cfg.to_dict(), "world_size": self.info.world_size, "lineage": self.lineage,
                DATA_RESTARTS_KEY: self.data_restarts, EXTENDED_FROM_KEY: self.extended_from,
                ckpt_io.DOCUMENT_EOS_KEY: self.raw_model.document_eos_id,
            }
            try:
                path = self._write(state, wait)
            except (OSError, RuntimeError, CheckpointError) as exc:  # a full disk: ENOSPC, EFBIG, torch.save's writer
                failure = self._write_failure(exc)
        failure = broadcast_from_main(failure, self.info)  # every rank stops together, none waits in a barrier
        if failure is not None:
            raise StorageError(failure)
        return path

    def _write_failure(self, exc: BaseException) -> str:
        """The one line for a checkpoint that could not be written (this step's, or an earlier asynchronous one)."""
        step = self.state.step
        what = str(exc) if isinstance(exc, CheckpointError) else (
            str(StorageError.of(f"checkpoint {self.out_dir / checkpoint_name(step)}", exc)))
        cause = exc.__cause__ if isinstance(exc, CheckpointError) else exc
        full = isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        kept = ckpt_io.latest_checkpoint(self.out_dir)
        return (f"{what}; no partial file is left, {'the newest checkpoint ' + str(kept) if kept else 'no checkpoint'} "
                f"is untouched; {'free space under ' + str(self.out_dir) if full else 'remove the cause'} and run the "
                f"same command again to resume")

    def _write(self, state: dict, wait: bool) -> Path:
        step, train = self.state.step, self.cfg.train
        protect = (self.resume_path,) if self.resume_path else ()
        if self.writer is None:
            return ckpt_io.save_checkpoint(self.out_dir, step, state, train.keep_last, train.keep_all_checkpoints,
                                           protect=protect)
        payload = stage_to_host(ckpt_io.checkpoint_payload(step, state), pin=self.info.device.type == "cuda")
        path = self.out_dir / checkpoint_name(step)
        self.writer.submit(str(path), lambda: ckpt_io.write_checkpoint(
            self.out_dir, step, payload, train.keep_last, train.keep_all_checkpoints, protect=protect))
        if wait:
            self.writer.wait()
        return path

    def finish_writes(self) -> None:
        """Wait for an asynchronous checkpoint write in flight; its failure raises CheckpointError (one line)."""
        if self.writer is not None:
            self.writer.wait()

    def close(self) -> None:
        """Waits for a checkpoint write in flight (the out_dir stays locked until it is done), then frees the run.
        Called on every way out: a write that failed here is reported on stderr, not raised over the run's own
        outcome (the clean path has already waited, and raised, at its final save)."""
        try:
            self.finish_writes()
        except CheckpointError as exc:
            print_error(exc)
        finally:
            self.data.close()
            if self.lock is not None:
                self.lock.release()
            torch.set_num_threads(self._threads_before)
