"""The recall task (train/data/recall.py): make its corpus, probe a checkpoint with it.

    python -m train.recall make --out DIR --window W --seq_len T [--max_windows 8] [--tokenizer byte]
        [--train_tokens 20000000] [--val_tokens 500000] [--seed 0] [--loss_on answers|all] [--format kv|prose]
    python -m train.recall score CKPT_OR_RUN_DIR [--documents 64] [--seed S] [--device auto|cpu|cuda]
        [--window W --doc_tokens N]   (a checkpoint trained on other data)
        [--knockout sel[,cmp]]        (NSA: score with these branches' gates zeroed, the others as learned)
        [--format kv|prose]           (lines in this format; default: the corpus's, or kv)
        [--lengths 1 2 4 8]           (documents at these multiples of the training length; buckets extended)
        [--rope_scale F|length|yarn] [--rope_theta B|ntk]   (a RoPE change for scoring only: interpolation, base)
        [--n_sel K]                   (NSA: K blocks selected per query while scoring; the trained ranking)
        [--distance_cap D]            (NSA: the selected branch reads keys further back than D as D back)

`make` writes a prepared directory (train.bin, val.bin, meta.json with the task's spec) that any config reads
as data.source: bin:DIR. `score` feeds probe documents (their own seed) and reports accuracy and answer loss
per distance bucket, the window's own bucket apart from the far ones, with chance (1/26); it prints one JSON
object and writes recall_step<N>.json beside the checkpoint (recall_step<N>_prose.json for prose lines). Formats:
kv (`qx=M` / `qx?M`) and prose (`The code of qx is M.` / `What is the code of qx? It is M.`), for models
trained on natural text. Bad input: one `error:` line, exit 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from train.core.errors import UserError, print_error
from dataclasses import replace

from train.data.recall import DEFAULT_FORMAT, FORMATS, LOSS_ON, RecallSpec, write_corpus
from train.data.tokenizers import load_tokenizer
from train.evaluation.recall import PROBE_SEED, RopeAtLength, corpus_spec, probe_checkpoint


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.recall", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make", help="write a recall corpus (a prepared bin: directory)")
    make.add_argument("--out", type=Path, required=True)
    make.add_argument("--window", type=int, required=True, help="the model's sliding window (nsa.w), in tokens")
    make.add_argument("--seq_len", type=int, required=True, help="the training seq_len: documents fit one window")
    make.add_argument("--max_windows", type=int, default=8, help="the farthest recall, in windows")
    make.add_argument("--tokenizer", default="byte")
    make.add_argument("--train_tokens", type=int, default=20_000_000)
    make.add_argument("--val_tokens", type=int, default=500_000)
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--format", default=DEFAULT_FORMAT, choices=tuple(FORMATS), help="how lines are spelled")
    make.add_argument("--loss_on", default=LOSS_ON[0], choices=LOSS_ON,
                      help="answers (default): loss masks, so that training targets only the answers' tokens; "
                           "all: every token")
    score = sub.add_parser("score", help="probe a checkpoint")
    score.add_argument("checkpoint", type=Path)
    score.add_argument("--documents", type=int, default=64)
    score.add_argument("--seed", type=int, default=PROBE_SEED)
    score.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    score.add_argument("--window", type=int, default=None, help="with --doc_tokens: probe a model not trained on a recall corpus")
    score.add_argument("--doc_tokens", type=int, default=None)
    score.add_argument("--max_windows", type=int, default=8)
    score.add_argument("--format", default=None, choices=tuple(FORMATS),
                       help="probe lines in this format (default: the corpus's; kv with --window)")
    score.add_argument("--knockout", default="", help="NSA branches to switch off while scoring (comma list of "
                       "cmp, sel, win): their gates zeroed, the others as learned; written to recall_step<N>_without_*.json")
    score.add_argument("--lengths", type=int, nargs="+", default=[1],
                       help="probe documents at these multiples of the training length (1 2 4 8), the distance buckets "
                            "extended to each; written to recall_step<N>_x<M>.json")
    score.add_argument("--rope_scale", default=None, help="score with RoPE positions interpolated by this factor, "
                       "'length' (by each length multiple) or 'yarn' (YaRN by each length multiple): what a dense user "
                       "does before training long")
    score.add_argument("--rope_theta", default=None, help="score with this RoPE base, or 'ntk' (NTK-aware: the base "
                       "times multiple^(hd/(hd-2)))")
    score.add_argument("--n_sel", type=int, default=None, help="NSA: select this many blocks per query while scoring "
                       "(the trained ranking, more free picks); written to recall_step<N>_..._nsel<K>.json")
    score.add_argument("--distance_cap", type=int, default=None, help="NSA: the selected branch reads keys more than "
                       "this many positions back as if this far back (RoPE distances it trained on); written to "
                       "recall_step<N>_..._cap<D>.json")
    return p.parse_args(argv)


def spec_of(window, doc_tokens, max_windows, line_format: str = DEFAULT_FORMAT) -> RecallSpec:
    spec = RecallSpec(window=window, doc_tokens=doc_tokens, max_windows=max_windows, format=line_format)
    try:
        spec.validate()
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return spec


def _rope_value(text: str | None, words: str | tuple[str, ...], flag: str) -> float | str | None:
    words = (words,) if isinstance(words, str) else words
    if text is None or text in words:
        return text
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"{flag} takes a number or {' / '.join(map(repr, words))}, got {text!r}") from None
    if not value > 0:
        raise UserError(f"{flag} must be > 0, got {value}")
    return value


def _branches(text: str) -> tuple[str, ...]:
    return tuple(name for name in text.split(",") if name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "make":
            if args.train_tokens < 1 or args.val_tokens < 1:
                raise UserError("--train_tokens and --val_tokens must be >= 1")
            spec = spec_of(args.window, args.seq_len - 1, args.max_windows, args.format)  # + the EOS before each document
            meta = write_corpus(args.out, spec, load_tokenizer(args.tokenizer), train_tokens=args.train_tokens,
                                val_tokens=args.val_tokens, seed=args.seed, loss_on=args.loss_on)
            s = meta["splits"]
            print(f"ok {args.out}: train {s['train']['tokens']:,} tokens / {s['train']['documents']:,} docs, val "
                  f"{s['val']['tokens']:,} tokens / {s['val']['documents']:,} docs, buckets "
                  f"{', '.join(f'{lo}-{hi}' for lo, hi in spec.buckets())} tokens; train it with "
                  f"--data.source=bin:{args.out} --data.window_start=document (windows open at a document)")
            return 0
        if (args.window is None) != (args.doc_tokens is None):
            raise UserError("--window and --doc_tokens go together")
        spec = spec_of(args.window, args.doc_tokens, args.max_windows, args.format or DEFAULT_FORMAT) \
            if args.window is not None else None
        if spec is None and args.format is not None:  # the corpus's spec, in another format
            spec = replace(corpus_spec(args.checkpoint), format=args.format)
        rope = RopeAtLength(scale=_rope_value(args.rope_scale, ("length", "yarn"), "--rope_scale"),
                            theta=_rope_value(args.rope_theta, "ntk", "--rope_theta"))
        reports = [probe_checkpoint(args.checkpoint, spec=spec, documents=args.documents, seed=args.seed,
                                    device=args.device, knockout=_branches(args.knockout), length=m, rope=rope,
                                    n_sel=args.n_sel, distance_cap=args.distance_cap)
                   for m in args.lengths]
        if len(reports) == 1:
            print(json.dumps(reports[0]))
        else:  # one object: the far accuracy and each bucket's by length
            print(json.dumps({"checkpoint": reports[0]["checkpoint"], "step": reports[0]["step"],
                              "training_length": reports[0]["training_length"],
                              "lengths": {str(r["length_multiple"]): {k: r[k] for k in (
                                  "far_accuracy", "far_stderr", "near_accuracy", "buckets", "file")} for r in reports}}))
    except UserError as exc:
        print_error(exc)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
