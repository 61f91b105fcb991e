"""python -m train.generate CKPT_OR_RUN_DIR (--prompt TEXT | --prompt_file FILE) [options]

Continues prompts with a trained checkpoint (a file, or a run directory: its newest valid checkpoint),
using the checkpoint's own tokenizer (data.tokenizer) and precision (bf16 autocast on CUDA when the run
trained in bf16). Text streams to stdout as tokens are produced: the prompt, then its continuation.

  --prompt_file: one prompt per line, blank lines skipped. Each prompt is decoded on its own with its
      own caches (per-sequence caches; prompts are never batched together).
  --num_samples N: N samples of one prompt decode together as one batch; sample j draws from a
      generator seeded seed + j, so it does not depend on N or on the other prompts. Sample 1 streams;
      samples 2..N print when the batch is done. With more than one sample in all, a header line
      `=== prompt P, sample S ===` goes before each.
  --temperature 0: greedy (argmax); --top_k 0 and --top_p 1 switch those filters off.
  --json: one JSON line per sample instead of streaming: prompt, text, ids and the prompt's timings.
  --decode static | graphs | compiled: decode over caches of a fixed size (nsa/static_decode.py) instead of the
      growing ones; graphs replays each step as one CUDA graph (the host issues one launch a token), compiled
      compiles the step first (a one-time cost of tens of seconds). Refused in one line where they do not apply
      (a CPU device for graphs; a window-only NSA model; several samples of a packed-documents model that
      continue past EOS).
On stderr: one line naming the checkpoint loaded and its step, then after each prompt one line with
prefill and decode tokens/s, counted over all samples' rows.
Prompt + max_new_tokens must fit the model's max_seq_len (nsa/generate.py). Bad input: one `error:`
line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from nsa.generate import Generation, GenerationError, check_arguments, generate, seeded_generators
from nsa.static_decode import StaticDecoder, static_decode_problem
from train.checkpoint.io import load_checkpoint, model_from_checkpoint, resolve_checkpoint
from train.core.distributed import autocast_context, resolve_precision
from train.core.errors import ConfigError, UserError, print_error
from train.data.tokenizers import load_tokenizer
from train.generation.text_stream import TextStream, continuation_text


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's usage + message (two lines) -> our one-line error
        raise UserError(message)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    _usage, description, details = __doc__.split("\n\n", 2)
    p = _Parser(prog="python -m train.generate", description=description, epilog=details,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt", type=Path, help="checkpoint file or run directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt_file", type=Path, help="one prompt per line (blank lines skipped)")
    p.add_argument("--max_new_tokens", type=int, default=200,
                   help="tokens to generate per sample (the prompt plus these must fit the model's max_seq_len)")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top_k", type=int, default=50, help="0: off")
    p.add_argument("--top_p", type=float, default=0.95, help="1: off")
    p.add_argument("--seed", type=int, default=0, help="sample j of each prompt uses seed + j")
    p.add_argument("--num_samples", type=int, default=1, help="samples per prompt, decoded as one batch")
    p.add_argument("--device", default="auto", help="auto (cuda if available) | cpu | cuda | cuda:N")
    p.add_argument("--stop_at_eos", action="store_true", help="end a sample at the tokenizer's EOS")
    p.add_argument("--prefill_chunk", type=int, default=512, help="prompt tokens per prefill forward")
    p.add_argument("--json", action="store_true", help="one JSON line per sample instead of streaming")
    p.add_argument("--decode", default="caches", choices=DECODE_MODES, metavar="MODE",
                   help="caches (default): the growing decode caches; static: caches of a fixed size "
                        "(nsa/static_decode.py), "
                        "eager; graphs: static, each step a CUDA graph replay (CUDA); compiled: static, the step "
                        "compiled then replayed as a CUDA graph (CUDA)")
    return p.parse_args(argv)


DECODE_MODES = ("caches", "static", "graphs", "compiled")


def decode_problem(model, mode: str, device: torch.device, max_len: int, num_samples: int,
                   eos_id: int | None) -> str | None:
    """Why --decode MODE cannot serve this model and request, in one line, or None."""
    if mode == "caches":
        return None
    if mode in ("graphs", "compiled") and device.type != "cuda":
        return f"--decode {mode} replays CUDA graphs: it needs a CUDA device (use --decode static on {device.type})"
    doc_eos = getattr(model, "document_eos_id", None)
    if doc_eos is not None and eos_id != doc_eos and num_samples > 1:
        return (f"--decode {mode} keeps every sample at one position; this packed-documents model's samples continue "
                f"past EOS into new documents one at a time: use --stop_at_eos, --num_samples 1 or --decode caches")
    problem = static_decode_problem(model, max_len)
    return f"--decode {mode}: {problem} (--decode caches serves it)" if problem else None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name!r}: expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: CUDA is not available here; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {name!r}: expected auto, cpu, cuda or cuda:N")
    return device


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        if not args.prompt:
            raise UserError("--prompt is empty; give some text to continue")
        return [args.prompt]
    try:
        lines = args.prompt_file.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"prompt file not found: {args.prompt_file}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read prompt file {args.prompt_file} as UTF-8 text: {exc}") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise UserError(f"prompt file {args.prompt_file} holds no prompt (every line is blank)")
    return prompts


def run_precision(cfg: dict, device: torch.device) -> torch.dtype:
    """The checkpoint's training precision on this device (fp16 off CUDA: fp32)."""
    try:
        return resolve_precision(cfg.get("runtime", {}).get("precision", "auto"), device)
    except ConfigError:
        return torch.float32


def main(argv: list[str] | None = None, out=None, err=None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    try:
        args = parse_args(argv)
        device = resolve_device(args.device)
        prompts = read_prompts(args)
        checkpoint = resolve_checkpoint(args.ckpt).resolve()  # latest.pt -> the checkpoint it names
        model, cfg = model_from_checkpoint(checkpoint, str(device))
        tok = load_tokenizer(cfg["data"]["tokenizer"])
        encoded = tok.encode_batch(prompts)
        for n, ids in enumerate(encoded, 1):  # every prompt is checked before any output
            too_big = [i for i in ids if i >= model.cfg.vocab_size]
            if too_big:
                raise UserError(f"prompt {n}: tokenizer {tok.name} gives id {too_big[0]} >= the model's "
                                f"vocab_size {model.cfg.vocab_size}")
            check_arguments(model.cfg.max_seq_len, len(ids), args.max_new_tokens, args.temperature, args.top_k,
                            args.top_p, args.num_samples, args.prefill_chunk)
            problem = decode_problem(model, args.decode, device, len(ids) + args.max_new_tokens, args.num_samples,
                                     tok.eos_id if args.stop_at_eos else None)
            if problem:
                raise UserError(problem)
        print(f"checkpoint: {checkpoint} (step {load_checkpoint(checkpoint)['step']})", file=err, flush=True)
        headers = len(prompts) * args.num_samples > 1
        with autocast_context(device, run_precision(cfg, device)):
            for n, (text, ids) in enumerate(zip(prompts, encoded), 1):
                gen = _generate_one(model, tok, args, device, n, text, ids, headers, out)
                print(f"prompt {n}/{len(prompts)}: prefill {gen.prefill_tokens} tokens in {gen.prefill_s:.3f} s "
                      f"({gen.prefill_tokens_per_s:,.0f} tok/s) | decode {gen.decode_tokens} tokens in "
                      f"{gen.decode_s:.3f} s ({gen.decode_tokens_per_s:,.0f} tok/s) | "
                      f"{args.num_samples} sample(s) as one batch", file=err, flush=True)
    except UserError as exc:
        print_error(exc, err)
        return exc.exit_code
    except GenerationError as exc:
        print_error(exc, err)
        return 2
    return 0


def _generate_one(model, tok, args, device, n: int, text: str, ids: list[int], headers: bool, out) -> Generation:
    """Decode the samples of one prompt; stream sample 1 (or, with --json, print JSON lines after)."""
    eos_id = tok.eos_id if args.stop_at_eos else None
    stream, ended = TextStream(tok, ids), False

    def on_token(step_ids: list[int]) -> None:  # sample 1's new id; later rows print after the batch
        nonlocal ended
        ended = ended or step_ids[0] == eos_id
        if not ended:
            out.write(stream.push(step_ids[0]))
            out.flush()

    if not args.json:
        _write_start(out, n, 1, text, headers)
    decoder = None if args.decode == "caches" else StaticDecoder(
        model, args.num_samples, len(ids) + args.max_new_tokens, graphs=args.decode in ("graphs", "compiled"),
        compile=args.decode == "compiled")  # per prompt: its caches sized to this prompt and request
    gen = generate(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   num_samples=args.num_samples, generators=seeded_generators(args.seed, args.num_samples, device),
                   eos_id=eos_id, prefill_chunk=args.prefill_chunk, on_token=None if args.json else on_token,
                   decoder=decoder)
    if args.json:
        for j, sample in enumerate(gen.ids, 1):
            out.write(json.dumps({
                "prompt_index": n, "prompt": text, "sample": j, "text": continuation_text(tok, ids, sample), "ids": sample,
                "prefill_tokens": gen.prefill_tokens, "prefill_s": gen.prefill_s,
                "prefill_tokens_per_s": gen.prefill_tokens_per_s, "decode_tokens": gen.decode_tokens,
                "decode_s": gen.decode_s, "decode_tokens_per_s": gen.decode_tokens_per_s}) + "\n")
        out.flush()
        return gen
    out.write(stream.flush() + "\n")
    for j, sample in enumerate(gen.ids[1:], 2):
        _write_start(out, n, j, text, headers)
        out.write(continuation_text(tok, ids, sample) + "\n")
    out.flush()
    return gen


def _write_start(out, n: int, j: int, text: str, headers: bool) -> None:
    if headers:
        out.write(f"=== prompt {n}, sample {j} ===\n")
    out.write(text)
    out.flush()


if __name__ == "__main__":
    sys.exit(main())
