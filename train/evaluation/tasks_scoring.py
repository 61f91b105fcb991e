"""Continuation log-likelihoods, log p(continuation | context) summed over its tokens, batched.

Tokenisation follows lm-evaluation-harness (`HFLM._encode_pair`, which OLMES inherits):

    context "Answer: " + continuation "Paris"  ->  context "Answer:" + continuation " Paris"
    context tokens      = encode(context)
    continuation tokens = encode(context + continuation)[len(context tokens):]

trailing whitespace of the context moves onto the continuation; the context is encoded alone and the pair
jointly; the continuation's tokens are the joint encoding's after the context's count (the model reads the
context's own tokens, then those). An empty context (or one of whitespace only) is [EOS], the token that opens
a document here (lm-eval: the prefix token). When a split leaves the continuation no token (a merge across the
boundary), the continuation is encoded alone. No special token is ever added.

Row of a request: s = (context tokens + continuation tokens)[-(max_len + 1):] (left-truncated, the continuation
kept); the model reads s[:-1] (at most max_len tokens) and its last `scored` targets are the continuation's
(all of it unless the continuation alone exceeds max_len). Rows are scored longest first in batches of at most
batch_tokens (rows x the batch's longest row), right-padded: a causal model's scores of a row do not depend
on its padding or on the other rows. Per batch one forward whose output head reads only the continuation's
positions (forward_at), a log-sum-exp over the vocabulary there and one index_add: no loop over tokens or rows
in the hot path.
A context shared by the choices of a doc is recomputed in each row (no KV-cache reuse: simple and exact for dense
and NSA alike; docs/USE.md "Downstream tasks" gives the share of tokens that costs).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

PAD_MULTIPLE = 16  # batch widths round up to a multiple of this (fewer distinct shapes to compile), never past max_len


@dataclass
class Rows:
    """Encoded requests: row i's tokens s_i = tokens[offsets[i]:offsets[i + 1]] (inputs + the last target)."""
    tokens: np.ndarray  # [sum of row lengths] int64
    offsets: np.ndarray  # [R + 1] int64
    scored: np.ndarray  # [R] continuation tokens scored: the row's last targets
    truncated: np.ndarray  # [R] bool: the context was cut on the left to fit max_len

    def __len__(self) -> int:
        return len(self.scored)

    @property
    def inputs(self) -> np.ndarray:
        """[R] tokens each row's forward reads."""
        return np.diff(self.offsets) - 1


def split_pair(context: str, continuation: str) -> tuple[str, str]:
    """lm-eval's rule: the context's trailing whitespace moves onto the continuation."""
    n = len(context) - len(context.rstrip())
    return (context[:-n], context[-n:] + continuation) if n else (context, continuation)


def encode_requests(tokenizer, pairs: list[tuple[str, str]], max_len: int) -> Rows:
    """(context, continuation) pairs -> Rows (see the module doc). tokenizer: train/data/tokenizers.py's."""
    pairs = [split_pair(c, x) for c, x in pairs]
    contexts = list(dict.fromkeys(c for c, _ in pairs if c))  # each distinct context encoded once
    context_ids = dict(zip(contexts, tokenizer.encode_batch(contexts))) if contexts else {}
    whole = tokenizer.encode_batch([c + x for c, x in pairs])
    alone = {}  # continuations a joint encoding left without a token
    rows, scored, truncated = [], np.zeros(len(pairs), np.int64), np.zeros(len(pairs), bool)
    for i, ((context, continuation), joint) in enumerate(zip(pairs, whole)):
        ctx = context_ids[context] if context else [tokenizer.eos_id]
        cont = joint[len(ctx):] if context else joint
        if not cont:
            if continuation not in alone:
                alone[continuation] = tokenizer.encode_batch([continuation])[0]
            cont = alone[continuation]
        seq = ctx + cont
        if len(seq) > max_len + 1:
            seq, truncated[i] = seq[-(max_len + 1):], True
        scored[i] = min(len(cont), len(seq) - 1)
        rows.append(seq)
    lengths = np.fromiter((len(r) for r in rows), np.int64, len(rows))
    offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows]) if rows else np.zeros(0, np.int64)
    return Rows(tokens=tokens, offsets=offsets, scored=scored, truncated=truncated)


def plan_batches(rows: Rows, batch_tokens: int) -> list[np.ndarray]:
    """Row indices per forward: longest first, each batch at most batch_tokens (rows x its longest row; a row
    longer than that goes alone)."""
    order = np.argsort(-rows.inputs, kind="stable")
    widths = rows.inputs[order]
    batches, start = [], 0
    while start < len(order):
        size = max(1, batch_tokens // max(1, int(widths[start])))
        batches.append(order[start:start + size])
        start += size
    return batches


def batch_arrays(rows: Rows, batch: np.ndarray, max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> inputs [B, T] (0-padded on the right), targets [B, T], mask [B, T] bool (the continuation's targets)."""
    n_in = rows.inputs[batch]  # [B]
    width = int(n_in.max())
    width = max(width, min(max_len, -(-width // PAD_MULTIPLE) * PAD_MULTIPLE))
    columns = np.arange(width + 1)  # [T + 1]
    starts, ends = rows.offsets[batch], rows.offsets[batch + 1]  # [B]
    index = np.minimum(starts[:, None] + columns, (ends - 1)[:, None])  # [B, T + 1]
    seq = np.where(columns < (n_in + 1)[:, None], rows.tokens[index], 0)  # [B, T + 1]
    pos = columns[:-1]  # [T]
    mask = (pos >= (n_in - rows.scored[batch])[:, None]) & (pos < n_in[:, None])  # [B, T]
    seq = torch.from_numpy(seq)
    return seq[:, :-1], seq[:, 1:], torch.from_numpy(mask)


# no_grad, not inference_mode: the training loop scores too (train.eval_tasks), and tensors the model keeps across
# calls (FlexAttention block masks) must stay usable by autograd
@torch.no_grad()
def score_rows(model: torch.nn.Module, rows: Rows, batches: list[np.ndarray], *, device: torch.device, max_len: int,
               autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
               progress: Callable[[int], None] | None = None) -> np.ndarray:
    """[R] float64: each row's summed log-probability of its scored tokens (nats). model(idx [B, T]) -> logits
    [B, T, V]. progress(input tokens of the batches done) after each batch."""
    autocast = autocast or contextlib.nullcontext
    out = torch.zeros(len(rows), dtype=torch.float64, device=device)
    done = 0
    for batch in batches:
        inputs, targets, mask = batch_arrays(rows, batch, max_len)
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        mask = mask.to(device, non_blocking=True)
        with autocast():
            picked = forward_at(model, inputs, mask).float()  # [N, V]
        wanted = targets[mask]  # [N]
        logp = picked.gather(1, wanted[:, None])[:, 0] - torch.logsumexp(picked, dim=-1)  # [N]
        row_of = mask.nonzero()[:, 0]  # [N]: the batch row of each scored token
        sums = torch.zeros(len(batch), dtype=torch.float64, device=device).index_add_(0, row_of, logp.double())
        out.index_copy_(0, torch.from_numpy(batch).to(device), sums)
        done += int(rows.inputs[batch].sum())
        if progress is not None:
            progress(done)
    return out.cpu().numpy()


def forward_at(model: torch.nn.Module, inputs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """model(inputs [B, T]) -> logits [N, V] at the N positions where mask [B, T] is set. The output head reads
    only those rows (a forward pre-hook on model.lm_head hands it hidden[mask]): the logits of the context's
    positions, most of a small model's work with a large vocabulary, are never computed."""
    head = getattr(model, "lm_head", None)
    handle = head.register_forward_pre_hook(lambda _, args: (args[0][mask], *args[1:])) \
        if isinstance(head, torch.nn.Module) else None
    try:
        logits = model(inputs)
    finally:
        if handle is not None:
            handle.remove()
    return logits[mask] if logits.dim() == 3 else logits  # [N, V] (a model without lm_head: [B, T, V] picked here)


def dummy_forward(model: torch.nn.Module, device: torch.device) -> None:
    """One forward of one token: keeps a rank in step with peers that still have batches (FSDP gathers)."""
    with torch.no_grad():
        model(torch.zeros(1, 1, dtype=torch.long, device=device))
