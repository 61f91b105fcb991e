"""The training loop: fetch, forward, backward, clip, step; one row per log interval, one per evaluation.

Host syncs on CUDA: none per step. Loss, gradient norm and skipped-step counts stay on the device
and are read once per log interval (one `.tolist()`, plus one for NSA gate statistics); a non-finite
step is skipped on-device by the optimizer's `found_inf` input (fused AdamW's, or train/trainer/muon.py's masked Muon
step with train.optimizer=muon), and so is a loss / gradient-norm spike with
spike skipping on (train/trainer/spikes.py; the step's loss is then all-reduced on multi-rank runs, a collective
queued on the device, so every rank decides alike).

The loop returns plain rows and writes nothing: the runner (train/trainer/runner.py) hands them to the sinks
(train/observe/sinks.py). A `log()` row is a training.csv row, plus the NSA gate and selection statistics
(`gate_*`, `sel_*`, nsa/attention/gate_stats.py) for NSA models, and their selection health
(nsa/attention/selection_health.py: means, and per-layer lists under `<name>_layers`). The selection recall
is computed in `log()` from copies the last step's forward kept, off the training clock.
"""
from __future__ import annotations

import hashlib
import math
import time

import torch
import torch.nn as nn

from nsa.gate_health import gate_health, selection_health, set_gate_stats
from nsa.loss import IGNORE_INDEX
from nsa.profiling import nvtx_range
from train.checkpoint.train_state import TrainState
from train.core.artifacts import BPB_PREFIX, ROWS_PREFIX, SHARE_PREFIX, VAL_LOSS_PREFIX, layer_key
from train.core.config import TrainConfig
from train.core.distributed import DistInfo, all_reduce_mean, autocast_context, gather_objects, no_sync
from train.observe.efficiency import Efficiency
from train.trainer.clock import TrainingClock
from train.trainer.lr_schedule import lr_at
from train.trainer.optim import set_lr, step_unless_nonfinite
from train.trainer.spikes import SpikeDetector


class GateStats:
    """The loop's stats callback for NSA models: gate health of a log interval's last step."""

    def __init__(self, raw_model: nn.Module):
        self.model = raw_model

    def record(self, enabled: bool) -> None:
        set_gate_stats(self.model, enabled)

    def read(self) -> dict[str, float | list[float]]:
        """The recorded statistics (one host sync), then recording off: each aggregated over layers under its
        name, and the selection health per layer as lists under `<name>_layers`. Computes sel_recall from the
        layers' copies (nsa.gate_health.selection_health), which is not training work: call it off the clock."""
        stats = gate_health(self.model)  # name -> 0-dim device tensor, aggregated over layers
        layers = selection_health(self.model)  # name -> [L] device tensor; sel_recall computed here
        self.record(False)
        if not stats:
            return {}
        for name, values in layers.items():
            stats.setdefault(name, values.mean())  # sel_recall's mean over layers (the others are gate_health's)
        n_layers = len(next(iter(layers.values()))) if layers else 0
        flat = torch.cat([torch.stack([v.float() for v in stats.values()]),  # [n_stats]
                          *(v.float() for v in layers.values())]).tolist()  # + [n_health * L]
        row: dict[str, float | list[float]] = dict(zip(stats, flat))
        for i, name in enumerate(layers):
            start = len(stats) + i * n_layers
            row[layer_key(name)] = flat[start:start + n_layers]
        return row


class Loop:
    def __init__(self, *, model: nn.Module, raw_model: nn.Module, optimizer: torch.optim.Optimizer, data,
                 state: TrainState, cfg: TrainConfig, info: DistInfo, amp_dtype: torch.dtype, clock: TrainingClock,
                 efficiency: Efficiency, gate_stats: GateStats | None = None, spikes: SpikeDetector | None = None):
        """model: what trains (DDP / FSDP / compiled wrapper); raw_model: the Transformer itself (clipping,
        evaluation); data: train/data/build.py's DataBundle; gate_stats: NSA models only; spikes: the spike-skip
        detector (None: spike skipping off, and the step does nothing for it)."""
        self.model, self.raw_model, self.opt, self.spikes = model, raw_model, optimizer, spikes
        self.spike_run = 0  # the longest run of spike skips in a row seen by the last log(); the runner halts on train.spike_skip_limit
        self.data, self.state, self.cfg = data, state, cfg
        self.info, self.device, self.amp_dtype = info, info.device, amp_dtype
        self.clock, self.efficiency, self.gate_stats = clock, efficiency, gate_stats
        self.params = [p for p in raw_model.parameters() if p.requires_grad]
        nsa = raw_model.cfg.nsa if raw_model.cfg.attention == "nsa" else None
        self.indexer_warmup = nsa.indexer_warmup_steps if nsa is not None and nsa.selector == "indexer" else 0
        self.cap_from = nsa.sel_distance_cap_from_step if nsa is not None and nsa.sel_distance_cap else 0
        self.n_micro, self.seq_len, self.staged = cfg.accumulate_grad_batches, cfg.seq_len, False
        self.tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.accumulate_grad_batches * info.world_size
        self.scaler = torch.amp.GradScaler("cuda") if amp_dtype == torch.float16 else None
        self._rows_before = data.rows_per_source()  # a mixture's rows per source where the first interval starts (a
        # function of the step: a resumed run, and a later stage's data, count the same)
        self._reset_interval()

    def set_stage(self, stage, data, efficiency: Efficiency, staged: bool = True) -> None:
        """A sequence-length stage (train/core/seq_stages.py): its batch split and tokens per step, the run's data and
        MFU at its length. The interval in progress keeps counting (its row reports the new tokens per step)."""
        self.data, self.efficiency = data, efficiency
        self.n_micro, self.seq_len, self.staged = stage.accumulate, stage.seq_len, staged  # staged: rows carry seq_len
        self.tokens_per_step = stage.batch_size * stage.seq_len * stage.accumulate * self.info.world_size

    def _source_columns(self) -> dict:
        """A mixture's share_NAME (of the logged interval's rows: a stage's weights show from its first interval) and
        rows_NAME (the rows so far); nothing without a mixture."""
        rows = self.data.rows_per_source()
        before, self._rows_before = self._rows_before, rows
        interval = {name: n - before.get(name, 0) for name, n in rows.items()}
        total = sum(interval.values())
        return {**{SHARE_PREFIX + name: n / total if total else float("nan") for name, n in interval.items()},
                **{ROWS_PREFIX + name: n for name, n in rows.items()}}

    # ---- one optimizer step -------------------------------------------------------------
    def _reset_interval(self) -> None:
        zero = lambda: torch.zeros((), device=self.device)  # noqa: E731
        self.i_loss, self.i_ok, self.i_skipped, self.i_norm = zero(), zero(), zero(), zero()  # 0-dim, on device
        self.i_spiked = zero() if self.spikes is not None else None
        self.i_fetch_s, self.i_steps = 0.0, 0
        self.digest = hashlib.blake2b(digest_size=8) if self.cfg.batch_digest else None

    def step(self, collect_stats: bool) -> None:
        """One optimizer step over train.accumulate_grad_batches micro-batches. collect_stats: record NSA
        gate statistics on the last micro-batch (the step that ends a log interval)."""
        cfg = self.cfg
        set_lr(self.opt, lr_at(self.state.step, cfg))
        if self.indexer_warmup:  # nsa.indexer_warmup_steps: pooled scores pick until then (a function of the step)
            self.raw_model.set_indexer_selects(self.state.step >= self.indexer_warmup)
        if self.cap_from:  # nsa.sel_distance_cap_from_step: uncapped reading until then (a function of the step)
            self.raw_model.set_distance_cap_on(self.state.step >= self.cap_from)
        loss_sum = torch.zeros((), device=self.device)
        n_micro = self.n_micro
        for micro in range(n_micro):
            t0 = time.perf_counter()
            with nvtx_range("fetch"):
                x, y = self.data.train.next_batch()  # [B, T] int64 each; y = x shifted by one token
                if self.digest is not None:
                    self.digest.update(x.contiguous().numpy())
                x = x.to(self.device, non_blocking=True)
                y = y.to(self.device, non_blocking=True)
            self.i_fetch_s += time.perf_counter() - t0
            last = micro == n_micro - 1
            if collect_stats and last and self.gate_stats is not None:
                self.gate_stats.record(True)
            with no_sync(self.model, skip_sync=not last):
                with autocast_context(self.device, self.amp_dtype), nvtx_range("forward"):
                    loss = self.model(x, y)  # 0-dim mean cross-entropy (nsa/model.py)
                scaled = loss / n_micro
                with nvtx_range("backward"):
                    (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            loss_sum += loss.detach()
        with nvtx_range("optimizer"):
            self._optimizer_step(loss_sum, n_micro)

    def _optimizer_step(self, loss_sum: torch.Tensor, n_micro: int) -> None:
        if self.scaler:
            self.scaler.unscale_(self.opt)
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True)  # 0-dim
        if hasattr(norm, "full_tensor"):  # FSDP2: a replicated DTensor
            norm = norm.full_tensor()
        # the norm is global (gradients are already reduced), so every rank takes the same decision
        found_inf = (~torch.isfinite(norm)).float()
        if self.spikes is None:
            if self.scaler:
                self.scaler.step(self.opt)
                self.scaler.update()
            else:
                step_unless_nonfinite(self.opt, found_inf)
        else:
            self._step_unless_spike(loss_sum / n_micro, norm, found_inf)
        self.opt.zero_grad(set_to_none=True)
        ok = 1.0 - found_inf
        self.i_loss += torch.nan_to_num(loss_sum / n_micro * ok, nan=0.0, posinf=0.0, neginf=0.0)
        self.i_norm += torch.nan_to_num(norm * ok, nan=0.0, posinf=0.0, neginf=0.0)
        self.i_ok += ok
        self.i_skipped += found_inf
        self.i_steps += 1
        self.state.step += 1
        self.state.tokens_seen += self.tokens_per_step

    def _step_unless_spike(self, loss: torch.Tensor, norm: torch.Tensor, found_inf: torch.Tensor) -> None:
        """Spike skipping on: the step is applied unless it is non-finite or a spike (on-device flag). loss: this
        rank's mean over its micro-batches, made global here. With fp16 the scaler's overflow shows as a non-finite
        norm (the gradients are unscaled before the norm), so found_inf covers it; the scaler still updates its scale
        from its own overflow check only, so a spike never shrinks the scale."""
        if self.info.enabled:
            loss = all_reduce_mean(loss.detach().reshape(1), self.info).reshape(())
        spike = self.spikes.observe(loss, norm, found_inf)
        step_unless_nonfinite(self.opt, found_inf + spike)
        if self.scaler:
            self.scaler.update()
        self.i_spiked += spike

    # ---- once per log interval: the only host sync ----------------------------------------
    def log(self) -> dict:
        """The interval's row: training.csv columns (docs/ARTIFACTS.md), then gate statistics (NSA)."""
        state = self.state
        spiking = [] if self.spikes is None else [self.i_spiked, self.spikes.take_peak()]
        totals = torch.stack([self.i_loss, self.i_ok, self.i_skipped, self.i_norm, *spiking])  # [4] or [6]
        loss_sum = all_reduce_mean(totals[:1], self.info)  # the global mean loss, not rank 0's
        loss_sum, ok, skipped, norm_sum, *spiked = torch.cat([loss_sum, totals[1:]]).tolist()
        if spiked:
            state.spike_skipped_steps += int(spiked[0])
            self.spike_run = int(spiked[1])
        gate = {}
        if self.gate_stats is not None:
            # off the clock: the selection recall computed here is not training work (the .tolist() above has
            # already waited for the interval's queued device work, so that stays on the clock)
            with self.clock.off_the_clock():
                gate = self.gate_stats.read()
        elapsed = self.clock.lap()  # training seconds of this interval (train/trainer/clock.py)
        state.skipped_steps += int(skipped)
        toks_per_s = self.i_steps * self.tokens_per_step / elapsed
        row = {
            "step": state.step, "loss": loss_sum / ok if ok else float("nan"), "lr": lr_at(state.step - 1, self.cfg),
            "toks_per_s": toks_per_s, "grad_norm": norm_sum / ok if ok else float("nan"),
            "dt_step_s": elapsed / self.i_steps, "dt_fetch_s": self.i_fetch_s / self.i_steps,
            "tokens_seen": state.tokens_seen, **({"seq_len": self.seq_len} if self.staged else {}),
            "skipped_steps": state.skipped_steps,
            "spike_skipped_steps": state.spike_skipped_steps,
            **self.efficiency.columns(toks_per_s), "interval_steps": self.i_steps, **gate,
            **self._source_columns(),
            **self._retry_columns(),
            **({"batch_digest": self.digest.hexdigest()} if self.digest is not None else {}),
        }
        self._reset_interval()
        return row

    def _retry_columns(self) -> dict:
        """Stream sources: the read retries so far (data_retries, data_stalls: every rank's summed; data_wait_s: the
        longest any rank waited in all; data_retries_by_rank), gathered over the CPU group at the log interval only.
        This rank's own retry in the heartbeat: data_last_error."""
        counts = self.data.retry_counts()
        if counts is None:
            return {}
        mine = [float(counts["retries"]), float(counts["stalls"]), float(counts["wait_s"])]
        every = gather_objects(mine, self.info)  # [world][3]
        return {"data_retries": int(sum(r[0] for r in every)), "data_stalls": int(sum(r[1] for r in every)),
                "data_wait_s": max(r[2] for r in every), "data_retries_by_rank": [int(r[0]) for r in every],
                **({"data_last_error": counts["last_error"]} if counts["last_error"] else {})}

    def read_ahead(self) -> str | None:
        """Read the next step's batches before the stop vote (train/data/lookahead.py): a data outage's one line."""
        return self.data.read_ahead()

    # ---- evaluation -------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Loss per target over train.eval_steps held-out batches (all ranks): the val.csv row {val_loss, ppl}. Each
        batch counts by its targets, so a source with a loss mask is scored on its targets alone, and a batch with
        none adds nothing (its mean would be 0/0). A mixture: each source's own (val_loss_NAME, bpb_NAME) and
        val_loss = their sum weighted as the current stage."""
        model = self.raw_model  # DDP's wrapper adds nothing to a no-grad forward; FSDP2 shards in place
        model.eval()
        names = self.data.val_names
        sums = torch.zeros(2, len(names), device=self.device)  # [loss x targets, targets] per source
        for i, name in enumerate(names):
            for x, y in self.data.val_batches(self.cfg.eval_steps, name):  # [(x [B, T], y [B, T])], the same every time
                y = y.to(self.device)
                targets = (y != IGNORE_INDEX).sum()
                with autocast_context(self.device, self.amp_dtype):
                    loss = model(x.to(self.device), y).float()
                sums[0, i] += torch.where(targets > 0, loss * targets, 0.0)
                sums[1, i] += targets
        model.train()
        sums = all_reduce_mean(sums, self.info).tolist()  # one sync; the ranks' mean of both: their ratio is the sum's
        losses = [total / count if count else float("nan") for total, count in zip(*sums)]
        row = {}
        if len(names) == 1:
            val = losses[0]
        else:
            weights = self.data.mixture.weights_at(self.state.step)
            val = sum(w * loss for w, loss in zip(weights, losses))
            for name, loss in zip(names, losses):
                bytes_per_token = self.data.val_bytes_per_token(name)
                row[VAL_LOSS_PREFIX + name] = loss
                row[BPB_PREFIX + name] = loss / math.log(2) / bytes_per_token if bytes_per_token else float("nan")
        self.state.last_val_loss = val
        self.state.best_val_loss = min(self.state.best_val_loss, val)
        return {"val_loss": val, "ppl": math.exp(min(val, 50.0)), **row}
