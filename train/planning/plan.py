"""Plan a run: tokens per iteration, iterations for a token target, FLOPs per token, wall time.

The command line, usage and details: train/plan.py (its docstring).
"""
from __future__ import annotations

import math

from train.core.config import RunConfig, data_mixture
from train.core.mixture import plan_lines
from train.data.build import mixture_plan
from train.core.errors import ConfigError


def _peak_dtype(precision: str) -> str:
    """Compute dtype of the peak for a runtime.precision (as the trainer picks it on CUDA)."""
    return "tf32" if precision == "fp32" else "bf16"


def make_plan(cfg: RunConfig, *, tokens: float | None = None, gpus: int = 1, toks_per_s: float | None = None,
              mfu: float | None = None, peak_device: str | None = None, hours: float | None = None) -> dict:
    """The plan as a JSON-able dict (see the module docstring for the formulas)."""
    from nsa.flops import flops_per_token, match_device, param_count, peak_flops

    if tokens is not None and tokens <= 0:
        raise ConfigError(f"--tokens must be positive, got {tokens:g}")
    if gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {gpus}")
    if toks_per_s is not None and mfu is not None:
        raise ConfigError("give --toks-per-s or --mfu, not both")
    if mfu is not None and not 0 < mfu <= 1:
        raise ConfigError(f"--mfu is a fraction in (0, 1], got {mfu:g}")
    if toks_per_s is not None and toks_per_s <= 0:
        raise ConfigError(f"--toks-per-s must be positive, got {toks_per_s:g}")
    t = cfg.train
    tokens_per_iter = t.batch_size * t.accumulate_grad_batches * gpus * t.seq_len
    if tokens is None:  # the config's own steps
        tokens = t.steps * tokens_per_iter
    exact = tokens / tokens_per_iter
    report = flops_per_token(cfg.model, t.seq_len, "v3")
    peak = None
    if peak_device is not None:
        if match_device(peak_device) is None:
            raise ConfigError(f"--peak-device {peak_device!r}: no dense peak known (see PEAK_TFLOPS in nsa/flops.py)")
        peak = peak_flops(peak_device, _peak_dtype(cfg.runtime.precision))
    if mfu is not None:
        if peak is None:
            raise ConfigError("--mfu needs --peak-device (e.g. \"NVIDIA B200\") to turn MFU into tokens/s")
        toks_per_s = mfu * peak * gpus / report.flops_per_token
    iterations = math.ceil(exact)
    plan = {
        "config": cfg.source, "gpus": gpus,
        "batch_size": t.batch_size, "accumulate_grad_batches": t.accumulate_grad_batches, "seq_len": t.seq_len,
        "tokens_per_iter": tokens_per_iter, "target_tokens": tokens,
        "iterations_exact": exact, "iterations": iterations, "iterations_rounded": round(exact),
        "tokens_trained": iterations * tokens_per_iter,
        "config_steps": t.steps, "config_steps_tokens": t.steps * tokens_per_iter,
        "params": param_count(cfg.model), "flops_per_token": report.flops_per_token,
        "calculation_method": report.calculation_method, "attention_to_ffn_ratio": report.attention_to_ffn_ratio,
        "total_flops": report.flops_per_token * iterations * tokens_per_iter,
        "peak_device": peak_device, "peak_flops_per_gpu": peak,
        "toks_per_s": toks_per_s, "mfu": mfu, "throughput_from": "mfu" if mfu is not None else
        "measured" if toks_per_s is not None else None,
    }
    if toks_per_s is not None:
        plan["s_per_iter"] = tokens_per_iter / toks_per_s
        plan["wall_hours"] = iterations * plan["s_per_iter"] / 3600
        plan["config_steps_hours"] = t.steps * plan["s_per_iter"] / 3600
        if mfu is None and peak is not None:
            plan["mfu"] = toks_per_s * report.flops_per_token / (peak * gpus)
        if hours is not None:
            plan["hours"] = hours
            plan["iterations_in_hours"] = math.floor(hours * 3600 / plan["s_per_iter"])
    elif hours is not None:
        raise ConfigError("--hours needs a throughput: --toks-per-s or --mfu with --peak-device")
    if t.seq_stages:  # train.seq_stages: each stage's steps, split and tokens
        from train.core.seq_stages import seq_stages, stage_lines

        plan["seq_stages"] = stage_lines(seq_stages(cfg), t.steps, gpus)
    mixture = data_mixture(cfg)
    if not mixture.single:  # over the config's steps
        plan["mixture"] = mixture_plan(cfg.data, mixture, seq_len=t.seq_len, vocab_size=cfg.model.vocab_size,
                                       global_batch=t.batch_size * t.accumulate_grad_batches * gpus)
    return plan


def _stage_lines(plan: dict) -> list[str]:
    if "seq_stages" not in plan:
        return []
    return ["  seq stages        (train.seq_stages; the lines above are the first stage's):"] + \
        [f"    {line}" for line in plan["seq_stages"]]


def _mixture_lines(plan: dict) -> list[str]:
    if "mixture" not in plan:
        return []
    return ["  data mixture      tokens and epochs per source per stage (over the config's steps):"] + \
        [f"    {line}" for line in plan_lines(plan["mixture"])]


def render(plan: dict) -> str:
    p = plan
    lines = [
        f"plan: {p['config']} on {p['gpus']} GPU(s)",
        f"  tokens/iteration  {p['batch_size']} x {p['accumulate_grad_batches']} x {p['gpus']} x {p['seq_len']} "
        f"= {p['tokens_per_iter']:,}",
        f"  iterations        {p['iterations']:,} for {p['target_tokens']:.4g} tokens "
        f"(ceil of {p['iterations_exact']:,.2f}; rounded to nearest, as the B200 MFU guide writes: ≈ {p['iterations_rounded']:,})",
        f"  tokens trained    {p['tokens_trained']:,} ({p['iterations']:,} iterations)",
        f"  config steps      {p['config_steps']:,} = {p['config_steps_tokens']:,} tokens",
        f"  params            {p['params']:,}",
        f"  FLOPs/token       {p['flops_per_token'] / 1e9:.2f} GFLOP (training, {p['calculation_method']}; "
        f"attention/FFN {p['attention_to_ffn_ratio']:.2f})",
        f"  total FLOPs       {p['total_flops']:.3e}",
    ]
    lines += _stage_lines(p) + _mixture_lines(p)
    if p.get("s_per_iter") is None:
        lines.append("  wall time         give --toks-per-s (measured) or --mfu with --peak-device")
        return "\n".join(lines)
    source = (f"MFU {p['mfu']:.1%} of {p['peak_flops_per_gpu'] / 1e12:,.0f} TFLOP/s x {p['gpus']}"
              if p["throughput_from"] == "mfu" else "measured")
    implied = f" (MFU {p['mfu']:.1%})" if p["throughput_from"] == "measured" and p.get("mfu") is not None else ""
    lines += [
        f"  throughput        {p['toks_per_s']:,.0f} tokens/s global ({source}){implied}",
        f"  time/iteration    {p['s_per_iter']:.2f} s",
        f"  wall time         {p['wall_hours']:.1f} h ({p['wall_hours'] / 24:.2f} days) for {p['iterations']:,} iterations; "
        f"config steps: {p['config_steps_hours']:.1f} h",
    ]
    if "iterations_in_hours" in p:
        lines.append(f"  in {p['hours']:g} h          {p['iterations_in_hours']:,} iterations "
                     f"= {p['iterations_in_hours'] * p['tokens_per_iter']:.4g} tokens")
    return "\n".join(lines)
