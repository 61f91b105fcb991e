"""Generation over the model's decode caches: chunked prefill of the prompt, then one token per step.

    prompt [T] -> rows [B, T] (B = num_samples copies) -> prefill in chunks of prefill_chunk positions
    -> logits of the last position [B, V] -> sample [B] -> feed [B, 1] at position T -> ... -> new ids [B, N]

Caches: one per layer from `model.new_caches()` (dense KVCache or NSACache), fresh for every call.
Every row of a batch is the same prompt, so every row has the same length at every step, which is
what the caches assume for B > 1. Different prompts are separate calls with their own caches.

Sampling runs on the device: temperature 0 is greedy argmax; otherwise logits / temperature, keep the
top_k largest (0: all), keep the smallest set of most likely tokens whose probability reaches top_p
(1: all), draw one. Row i draws from generators[i] when generators are given: row i of a batch seeded
(s, s+1, ...) draws what a one-sample call seeded s+i draws (`seeded_generators`). Without generators
the rows draw from torch's global RNG.

Greedy guarantee: with temperature 0 every new token is the argmax of the logits a full forward of
prompt + tokens so far (no caches) gives at that position, up to floating-point near-ties.

Context limit: prompt + max_new_tokens must fit the model's max_seq_len, for learned positions (the
size of the position table) and for RoPE models too (the context the model was trained for: RoPE would
run past it, with no guarantee of quality). GenerationError otherwise.

Documents: a model trained with document masking (model.document_eos_id set; nsa/attention/documents.py)
sees one document at a time, so generation does too. The prompt's context is its last document (from its
last EOS on: what the masked model attends to anyway), and a row that samples that EOS without stopping
on it starts a fresh document: its caches are dropped and the EOS is fed again at position 0, exactly as
a packed training window continues after an EOS. Rows then run one at a time (each has its own caches:
they no longer stay the same length), and each step checks its token on the host.

Host syncs: with on_token, one `.tolist()` of the step's [B] tokens per step (streaming needs it);
without, none per step except the all-rows-finished check every EOS_CHECK_EVERY steps when stopping
at EOS; plus one at the end of prefill (timing) and one for the result.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

EOS_CHECK_EVERY = 16  # steps between "have all rows reached EOS?" checks when not streaming


class GenerationError(ValueError):
    """Arguments generation cannot honour: too long for the model's context, bad sampling values."""


@dataclass
class Generation:
    ids: list[list[int]]  # [num_samples][<= max_new_tokens] new ids; cut before the first EOS when eos_id is set
    prefill_tokens: int  # prompt positions processed, all rows: num_samples * len(prompt)
    prefill_s: float
    decode_tokens: int  # new tokens produced, all rows: num_samples * steps run
    decode_s: float  # from the end of prefill to the last token on the host (sampling included)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / max(self.prefill_s, 1e-9)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / max(self.decode_s, 1e-9)


def check_arguments(max_seq_len: int, prompt_len: int, max_new_tokens: int, temperature: float = 1.0,
                    top_k: int = 0, top_p: float = 1.0, num_samples: int = 1, prefill_chunk: int = 512) -> None:
    """GenerationError naming the first value generation cannot take (bad values, then the context)."""
    if max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not temperature >= 0:  # also NaN
        raise GenerationError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    if top_k < 0:
        raise GenerationError(f"top_k must be >= 0 (0: off), got {top_k}")
    if not 0 < top_p <= 1:
        raise GenerationError(f"top_p must be in (0, 1] (1: off), got {top_p}")
    if num_samples < 1:
        raise GenerationError(f"num_samples must be >= 1, got {num_samples}")
    if prefill_chunk < 1:
        raise GenerationError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    if prompt_len < 1:
        raise GenerationError("the prompt is empty (no tokens to start from)")
    if prompt_len + max_new_tokens > max_seq_len:
        raise GenerationError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {prompt_len + max_new_tokens} "
            f"exceeds the model's max_seq_len={max_seq_len}; shorten the prompt or ask for fewer tokens")


def seeded_generators(seed: int, n: int, device: torch.device | str) -> list[torch.Generator]:
    """One generator per sample row, seeded seed, seed+1, ... on the model's device."""
    return [torch.Generator(device=device).manual_seed(seed + i) for i in range(n)]


def sample_next(
    logits: torch.Tensor,  # [B, V] float32, the last position's logits
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generators: Sequence[torch.Generator] | None = None,  # one per row, or None: torch's global RNG
) -> torch.Tensor:  # [B] int64 next ids, on the logits' device
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [B, 1] the k-th largest logit
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ranked, order = torch.sort(logits, dim=-1, descending=True)  # [B, V]
        probs = ranked.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # [B, V] probability of the tokens ranked higher
        ranked = ranked.masked_fill(mass_before >= top_p, float("-inf"))  # the most likely token always stays
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ranked)
    probs = logits.softmax(dim=-1)  # [B, V]; removed tokens have probability exactly 0
    if generators is None:
        return torch.multinomial(probs, 1).squeeze(-1)
    return torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, generators)])


@torch.no_grad()
def generate(
    model,  # nsa.model.Transformer, in eval mode (dropout would make greedy decoding random)
    prompt_ids: Sequence[int],  # [T] token ids
    max_new_tokens: int,
    *,
    temperature: float = 1.0,  # 0: greedy
    top_k: int = 0,  # 0: off
    top_p: float = 1.0,  # 1: off
    num_samples: int = 1,  # rows decoded together as one batch
    generators: Sequence[torch.Generator] | None = None,  # one per row (seeded_generators)
    eos_id: int | None = None,  # a row that samples it stops (the id is not returned); all stopped: done
    prefill_chunk: int = 512,  # prompt positions per prefill forward
    on_token: Callable[[list[int]], None] | None = None,  # called each step with the [B] new ids
    decoder=None,  # a static decoder (nsa/static_decode.StaticDecoder) for these B rows: prefill and steps run on it
) -> Generation:
    """Continue prompt_ids by up to max_new_tokens tokens in num_samples rows (see the module doc).

    After a row samples eos_id it keeps emitting eos_id (on_token sees it) until every row has.
    decoder: built for num_samples rows and >= len(prompt) + max_new_tokens positions; the prompt is prefilled into
    its static caches and each step is its step (eager, compiled, or a CUDA graph replay), instead of the model's
    growing caches: the same tokens up to floating-point near-ties (tests/nsa/test_static_decode.py).
    no_grad rather than inference_mode: this also runs inside training (train/generation/sampling.py), where
    tensors the model keeps across calls (FlexAttention block masks) must stay usable by autograd."""
    B = num_samples
    check_arguments(model.cfg.max_seq_len, len(prompt_ids), max_new_tokens, temperature, top_k, top_p, B, prefill_chunk)
    if generators is not None and len(generators) != B:
        raise GenerationError(f"{len(generators)} generators for {B} samples; give one per sample")
    doc_eos = getattr(model, "document_eos_id", None)  # EOS opens a document (document masking)
    crosses = doc_eos is not None and eos_id != doc_eos  # a sampled EOS continues into a new document
    if doc_eos is not None and doc_eos in prompt_ids:
        prompt_ids = list(prompt_ids)[len(prompt_ids) - 1 - list(prompt_ids)[::-1].index(doc_eos):]
    if crosses and B > 1 and decoder is not None:
        raise GenerationError("static decoding keeps every row at one position: several samples of a packed-documents "
                              "model that continue past EOS need the growing caches (or stop at EOS)")
    if crosses and B > 1:  # rows restart at different steps: each decodes with its own caches
        parts = [generate(model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                          num_samples=1, generators=None if generators is None else [generators[i]], eos_id=eos_id,
                          prefill_chunk=prefill_chunk, on_token=on_token) for i in range(B)]
        return Generation(ids=[p.ids[0] for p in parts], prefill_tokens=sum(p.prefill_tokens for p in parts),
                          prefill_s=sum(p.prefill_s for p in parts), decode_tokens=sum(p.decode_tokens for p in parts),
                          decode_s=sum(p.decode_s for p in parts))
    T = len(prompt_ids)
    device = model.lm_head.weight.device
    if decoder is not None and (decoder.batch != B or decoder.max_len < T + max_new_tokens):
        raise GenerationError(f"the static decoder holds {decoder.batch} rows of {decoder.max_len} positions; this "
                              f"call needs {B} rows of {T + max_new_tokens}")
    caches = model.new_caches() if decoder is None else None

    t_start = time.perf_counter()
    prompt = torch.tensor(list(prompt_ids), dtype=torch.long, device=device).repeat(B, 1)  # [B, T]
    if decoder is not None:
        logits = decoder.prefill(prompt, chunk=prefill_chunk)  # [B, V] predicts position T
    else:
        for start in range(0, T, prefill_chunk):
            logits = model(prompt[:, start:start + prefill_chunk], start_pos=start, caches=caches)  # [B, C, V]
        logits = logits[:, -1]  # [B, V] predicts position T
    _synchronize(device)
    t_prefilled = time.perf_counter()

    new = torch.empty(B, max_new_tokens, dtype=torch.long, device=device)  # [B, N]
    finished = torch.zeros(B, dtype=torch.bool, device=device)  # [B] rows past their EOS
    steps = 0
    pos = T  # the document position of the next token fed
    for i in range(max_new_tokens):
        if i and decoder is not None:  # the static caches' step (its position advances on the device)
            logits = decoder.step(new[:, i - 1])  # [B, V], the decoder's buffer: sampled from before the next step
        elif i:  # feed the previous token, at position pos - 1 of its document
            logits = model(new[:, i - 1:i], start_pos=pos - 1, caches=caches)[:, -1]  # [B, V]
        token = sample_next(logits, temperature, top_k, top_p, generators)  # [B]
        pos += 1
        if crosses and int(token[0]) == doc_eos:  # one row (see above): the EOS opens a fresh document
            if decoder is not None:
                decoder.restart()
            else:
                caches = model.new_caches()
            pos = 1
        if eos_id is not None:
            token = torch.where(finished, eos_id, token)
            finished |= token == eos_id
        new[:, i] = token
        steps = i + 1
        if on_token is not None:
            step_ids = token.tolist()
            on_token(step_ids)
            if eos_id is not None and all(t == eos_id for t in step_ids):  # finished rows emit eos_id
                break
        elif eos_id is not None and steps % EOS_CHECK_EVERY == 0 and bool(finished.all()):
            break
    rows = new[:, :steps].tolist()
    t_done = time.perf_counter()

    if eos_id is not None:
        rows = [row[:row.index(eos_id)] if eos_id in row else row for row in rows]
    return Generation(ids=rows, prefill_tokens=B * T, prefill_s=t_prefilled - t_start,
                      decode_tokens=B * steps, decode_s=t_done - t_prefilled)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
