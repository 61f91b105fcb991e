"""Samples during training (train.sample_every > 0; off by default).

At every step that is a multiple of train.sample_every, rank 0 continues each prompt of
train.sample_prompts by train.sample_tokens tokens, greedily (temperature 0: deterministic, so the
samples of successive steps differ only by what the model learned, and no RNG stream of the run is
touched), stopping a sample at the tokenizer's EOS. The raw model runs in eval mode under the run's
autocast, with its own decode caches (nsa/generate.py); train mode is restored afterwards. The runner
takes the time spent out of the interval's tokens/s, as for evaluation (train/trainer/clock.py).

    out_dir/samples.jsonl: one row per prompt and sampling step: {"step", "prompt", "text", "tokens"}
                           (text: the continuation only; tokens: its new ids)

`sample()` returns those rows; the runner records them as one 'sample' row (train/observe/sinks.py): TensorBoard
text `samples/<i>` per prompt (prompt + continuation) and one console line with the first sample.

Prompts: 'a|b' (empty pieces dropped), or @FILE with one prompt per line (blank lines skipped); an
empty setting samples once from EOS (a document start). They are checked when the run starts, on
every rank alike (one error everywhere, nobody left waiting): unreadable file, ids the model's
vocabulary does not hold, prompt + sample_tokens longer than model.max_seq_len.

Distributed: only rank 0 generates, and generation calls no collective, so the other ranks go on
to the next step. Under FSDP the parameters are sharded: sampling is skipped with a one-line note
(sample from a checkpoint with `python -m train.generate` instead).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nsa.generate import GenerationError, check_arguments, generate
from train.core.distributed import autocast_context
from train.core.errors import ConfigError
from train.data.tokenizers import load_tokenizer
from train.generation.text_stream import continuation_text


@dataclass
class Prompt:
    text: str  # as configured ('' for "start from EOS")
    ids: list[int]  # what the model is fed


def parse_prompts(spec: str) -> list[str]:
    """'a|b' -> ['a', 'b']; '@FILE' -> its non-blank lines; '' -> [''] (one sample from EOS)."""
    if spec.startswith("@"):
        path = Path(spec[1:])
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"train.sample_prompts={spec}: cannot read {path} as UTF-8 text "
                              f"({getattr(exc, 'strerror', None) or exc})") from None
        prompts = [line for line in lines if line.strip()]
        if not prompts:
            raise ConfigError(f"train.sample_prompts={spec}: {path} holds no prompt (every line is blank)")
        return prompts
    return [piece for piece in spec.split("|") if piece] or [""]


class TrainingSampler:
    def __init__(self, run, tok, prompts: list[Prompt]):
        self.run, self.tok, self.prompts = run, tok, prompts
        self.every = run.cfg.train.sample_every
        self.n_tokens = run.cfg.train.sample_tokens

    @classmethod
    def for_run(cls, run) -> TrainingSampler | None:
        """None when sampling is off (or skipped under FSDP); ConfigError for prompts it cannot use."""
        cfg = run.cfg
        if cfg.train.sample_every == 0:
            return None
        if cfg.runtime.fsdp and run.info.enabled:
            if run.is_main:
                print("note: train.sample_every is skipped under FSDP (sharded parameters); "
                      "sample from a checkpoint with python -m train.generate", flush=True)
            return None
        tok = load_tokenizer(cfg.data.tokenizer)
        texts = parse_prompts(cfg.train.sample_prompts)
        prompts = [Prompt(text, ids or [tok.eos_id]) for text, ids in zip(texts, tok.encode_batch(texts))]
        for n, p in enumerate(prompts, 1):
            if max(p.ids) >= cfg.model.vocab_size:
                raise ConfigError(f"train.sample_prompts: prompt {n} has token id {max(p.ids)} (tokenizer "
                                  f"{tok.name}) >= model.vocab_size={cfg.model.vocab_size}")
            try:
                check_arguments(cfg.model.max_seq_len, len(p.ids), cfg.train.sample_tokens)
            except GenerationError as exc:
                raise ConfigError(f"train.sample_prompts: prompt {n}: {exc}") from None
        return cls(run, tok, prompts)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def sample(self, step: int) -> list[dict]:
        """Rank 0: generate for every prompt and return the rows (the recorder's SamplesSink appends them to
        samples.jsonl, train/observe/sinks.py). Others: []."""
        run = self.run
        if not run.is_main:
            return []
        model = run.raw_model
        was_training = model.training
        model.eval()
        try:
            with autocast_context(run.info.device, run.amp_dtype):
                results = [generate(model, p.ids, self.n_tokens, temperature=0.0, eos_id=self.tok.eos_id,
                                    prefill_chunk=run.cfg.train.seq_len).ids[0] for p in self.prompts]
        finally:
            model.train(was_training)
        return [{"step": step, "prompt": p.text, "text": continuation_text(self.tok, p.ids, ids), "tokens": ids}
                for p, ids in zip(self.prompts, results)]
