"""The training loop: fetch, forward, backward, clip, step; log / evaluate / checkpoint on schedule.

Host syncs on CUDA: none per step. Loss, gradient norm and skipped-step counts stay on the device
and are read once per log interval (one `.tolist()`); a non-finite step is skipped on-device by the
fused optimizer's `found_inf` input.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from train.distributed import all_reduce_mean, autocast_context, no_sync
from nsa.profiling import nvtx_range
from train.optim import lr_at, set_lr, step_unless_nonfinite


@dataclass
class TrainState:
    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0
    best_val_loss: float = math.inf
    last_val_loss: float | None = None
    skipped_steps: int = 0  # non-finite steps skipped, whole run
    stop_reason: str | None = None
    history: list = field(default_factory=list)  # per-interval summaries for the run summary JSON
    evals: list = field(default_factory=list)


class Loop:
    """Owns the step; the runner (train/runner.py) builds everything it needs."""

    def __init__(self, run):
        self.run = run  # train.runner.Run
        self.cfg = run.cfg.train
        self.model, self.opt = run.model, run.optimizer
        self.device, self.amp_dtype = run.info.device, run.amp_dtype
        self.params = [p for p in run.raw_model.parameters() if p.requires_grad]
        self.tokens_per_step = self.cfg.batch_size * self.cfg.seq_len * self.cfg.accumulate_grad_batches * run.info.world_size
        self.scaler = torch.amp.GradScaler("cuda") if self.amp_dtype == torch.float16 else None
        self._reset_interval()

    # ---- one optimizer step -------------------------------------------------------------
    def _reset_interval(self) -> None:
        zero = lambda: torch.zeros((), device=self.run.info.device)  # noqa: E731
        self.i_loss, self.i_ok, self.i_skipped, self.i_norm = zero(), zero(), zero(), zero()
        self.i_fetch_s, self.i_steps = 0.0, 0
        self.i_start = time.perf_counter()

    def step(self, collect_stats: bool) -> None:
        cfg, run = self.cfg, self.run
        set_lr(self.opt, lr_at(run.state.step, cfg))
        loss_sum = torch.zeros((), device=self.device)
        n_micro = cfg.accumulate_grad_batches
        for micro in range(n_micro):
            t0 = time.perf_counter()
            with nvtx_range("fetch"):
                x, y = run.data.train.next_batch()
                x = x.to(self.device, non_blocking=True)
                y = y.to(self.device, non_blocking=True)
            self.i_fetch_s += time.perf_counter() - t0
            last = micro == n_micro - 1
            if collect_stats and last:
                run.set_stats(True)
            with no_sync(self.model, skip_sync=not last):
                with autocast_context(self.device, self.amp_dtype), nvtx_range("forward"):
                    loss = self.model(x, y)
                scaled = loss / n_micro
                with nvtx_range("backward"):
                    (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            loss_sum += loss.detach()
        with nvtx_range("optimizer"):
            self._optimizer_step(loss_sum, n_micro)

    def _optimizer_step(self, loss_sum: torch.Tensor, n_micro: int) -> None:
        cfg, run = self.cfg, self.run
        if self.scaler:
            self.scaler.unscale_(self.opt)
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True)
        if hasattr(norm, "full_tensor"):  # FSDP2: a replicated DTensor
            norm = norm.full_tensor()
        # the norm is global (gradients are already reduced), so every rank takes the same decision
        found_inf = (~torch.isfinite(norm)).float()
        if self.scaler:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            step_unless_nonfinite(self.opt, found_inf)
        self.opt.zero_grad(set_to_none=True)
        ok = 1.0 - found_inf
        self.i_loss += torch.nan_to_num(loss_sum / n_micro * ok, nan=0.0, posinf=0.0, neginf=0.0)
        self.i_norm += torch.nan_to_num(norm * ok, nan=0.0, posinf=0.0, neginf=0.0)
        self.i_ok += ok
        self.i_skipped += found_inf
        self.i_steps += 1
        run.state.step += 1
        run.state.tokens_seen += self.tokens_per_step

    # ---- once per log interval: the only host sync ----------------------------------------
    def log(self) -> dict:
        run, state = self.run, self.run.state
        totals = torch.stack([self.i_loss, self.i_ok, self.i_skipped, self.i_norm])
        loss_sum = all_reduce_mean(totals[:1], run.info)  # the global mean loss, not rank 0's
        loss_sum, ok, skipped, norm_sum = torch.cat([loss_sum, totals[1:]]).tolist()
        gate = run.gate_health()  # {} for dense models; one more small sync for NSA
        run.set_stats(False)  # recorded on this interval's last step only
        elapsed = max(time.perf_counter() - self.i_start, 1e-9)
        state.skipped_steps += int(skipped)
        loss = loss_sum / ok if ok else float("nan")
        toks_per_s = self.i_steps * self.tokens_per_step / elapsed
        row = {
            "step": state.step, "loss": loss, "lr": lr_at(state.step - 1, self.cfg), "toks_per_s": toks_per_s,
            "grad_norm": norm_sum / ok if ok else float("nan"), "dt_step_s": elapsed / self.i_steps,
            "dt_fetch_s": self.i_fetch_s / self.i_steps, "tokens_seen": state.tokens_seen,
            "skipped_steps": state.skipped_steps, **run.throughput_metrics(toks_per_s), **run.memory_mib(),
        }
        run.record_interval(row, gate)
        self._reset_interval()
        return row

    # ---- evaluation -------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        run = self.run
        model = run.raw_model  # DDP's wrapper adds nothing to a no-grad forward; FSDP2 shards in place
        model.eval()
        total = torch.zeros((), device=self.device)
        batches = run.data.val_batches(self.cfg.eval_steps)
        for x, y in batches:
            with autocast_context(self.device, self.amp_dtype):
                total += model(x.to(self.device), y.to(self.device)).float()
        model.train()
        val = all_reduce_mean(total / max(1, len(batches)), run.info).item()
        return val
