"""Document boundaries inside packed windows, and the per-query frames attention reads them through.

Rule (docs/NSA.md, "Documents"): EOS opens the document that follows it. A window's token t starts a
document iff t == 0 or token t is EOS; every other token belongs to the document of the token before it.
So the token before an EOS predicts that EOS within its own document, and the EOS, position 0 of the next
document, predicts that document's first token from nothing else (EOS doubles as BOS, as our tokenizers
and the Hugging Face export say). With document masking a query attends only to keys of its own
document, which then looks exactly as if it had been run alone from position 0:
  positions:  restart at 0 in every document, for learned position embeddings and RoPE alike (RoPE
              tables become per row, [B, T, hd/2]), so a document's numbers are exactly its numbers alone;
  NSA:        compressed blocks [j*d, j*d + l) and selection blocks [j*l', (j+1)*l') are counted from the
              document's first token, forced blocks (block 0, previous, current) are the document's, and
              the window stops at the document's first token.

Everything here is a fixed number of tensor ops on the tokens' device, whatever the number of documents:
no host sync, no Python loop over documents or tokens.

A *frame* tells NSA's ops where each query's document lives (NSA ops' `frame` argument):
    frame [3, B, Tq] int64:  frame[0] = q_pos:  the query's position within its document
                             frame[1] = k_base: index in the keys (selection / window keys, [B, H_kv, Tk])
                                                of its document's first token
                             frame[2] = c_base: index in the compressed tokens ([B, H_kv, N_c]) of its
                                                document's first compressed token
A query at q_pos p reads keys k[k_base + r] for r <= p (within its document) and compressed tokens
ck[c_base + i] for i < num_compressed(p + 1) (those of its document that end at or before it).
Without documents the frame is q_pos = q_start + t, k_base = c_base = 0, i.e. one document.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def document_starts(idx: torch.Tensor, eos_id: int) -> torch.Tensor:
    """idx [B, T] token ids -> [B, T] int64: the window index of the first token of each token's document."""
    T = idx.shape[1]
    t = torch.arange(T, device=idx.device)
    opens = idx == eos_id  # [B, T] EOS opens a document
    opens[:, 0] = True
    return torch.where(opens, t, 0).cummax(dim=1).values


@dataclass(frozen=True)
class Documents:
    """The documents of a batch of windows: start [B, T] int64, as `document_starts` returns."""

    start: torch.Tensor
    _layouts: dict = field(default_factory=dict, compare=False, repr=False)  # (l, d) -> CompressedLayout
    _shared: dict = field(default_factory=dict, compare=False, repr=False)  # once_per_batch's values

    @staticmethod
    def from_tokens(idx: torch.Tensor, eos_id: int) -> Documents:
        return Documents(document_starts(idx, eos_id))

    @property
    def positions(self) -> torch.Tensor:  # [B, T] int64: position of each token within its document
        return torch.arange(self.start.shape[1], device=self.start.device) - self.start

    def same_document_causal(self) -> torch.Tensor:
        """[B, 1, T, T] bool: query t may attend key s iff start[t] <= s <= t (block-causal by document)."""
        T = self.start.shape[1]
        s = torch.arange(T, device=self.start.device)
        return ((s[None, None, :] >= self.start[:, :, None]) & (s[None, None, :] <= s[None, :, None]))[:, None]

    def once_per_batch(self, key, compute):
        """compute() the first time a layer asks for `key` in this batch, the same value after (tensors the layers
        share, built by a fixed number of ops outside the per-layer work: e.g. the indexer's counted KL rows)."""
        if key not in self._shared:
            self._shared[key] = compute()
        return self._shared[key]

    def compressed(self, l: int, d: int) -> CompressedLayout:
        """NSA's compressed-token layout for blocks (l, d); built once per batch, then shared by the layers."""
        if (l, d) not in self._layouts:
            self._layouts[(l, d)] = compressed_layout(self.start, l, d)
        return self._layouts[(l, d)]


@dataclass(frozen=True)
class CompressedLayout:
    """NSA's compressed tokens of packed documents, document by document (a static number of slots).

    Document D of length L has num_compressed(L) = (L - l) // d + 1 tokens (0 if L < l), token j covering
    its positions [j*d, j*d + l). Slots hold them in document order; slot i's block starts at window index
    block_start[b, i]. Since l >= d, the tokens of all documents fit in T // d slots; unused slots have
    valid = False (block_start 0) and no query sees them.
    """

    block_start: torch.Tensor  # [B, C] int64, C = T // d
    valid: torch.Tensor  # [B, C] bool
    frame: torch.Tensor  # [3, B, T] int64 (q_pos, k_base, c_base) for queries at window positions 0 .. T-1
    block_rows: torch.Tensor  # [B, 1, C*l, 1] int64: the raw rows of every slot's block (impl/compression.py gather_blocks' index)
    block_end: torch.Tensor  # [B, C] int64: window index of each slot's last position (where its key is rotated)
    l: int  # positions per block


def compressed_layout(start: torch.Tensor, l: int, d: int) -> CompressedLayout:
    B, T = start.shape
    dev = start.device
    t = torch.arange(T, device=dev)
    opens = start == t  # [B, T] document starts
    doc = opens.cumsum(dim=1) - 1  # [B, T] document index within the window
    length = torch.zeros(B, T, dtype=torch.long, device=dev).scatter_add_(1, doc, torch.ones_like(doc))  # [B, T docs]
    first = torch.zeros(B, T, dtype=torch.long, device=dev).scatter_(1, doc, start)  # [B, T docs] first token
    count = torch.where(length >= l, (length - l).div(d, rounding_mode="floor") + 1, 0)  # [B, T docs]
    ends = count.cumsum(dim=1)  # [B, T docs] inclusive
    bases = ends - count  # [B, T docs] first slot of each document
    C = T // d
    slot = torch.arange(C, device=dev).expand(B, C).contiguous()
    owner = torch.searchsorted(ends, slot, right=True).clamp_max(T - 1)  # [B, C] document of each slot
    valid = slot < ends[:, -1:]
    j = slot - bases.gather(1, owner)
    block_start = torch.where(valid, first.gather(1, owner) + j * d, 0)
    frame = torch.stack((t - start, start, bases.gather(1, doc)))  # [3, B, T]
    rows = (block_start[:, :, None] + torch.arange(l, device=dev)).clamp_max(T - 1)  # [B, C, l]; clamps unused slots only
    block_end = (block_start + (l - 1)).clamp_max(T - 1)
    return CompressedLayout(block_start, valid, frame, rows.view(B, 1, C * l, 1), block_end, l)


def plain_frame(B: int, Tq: int, q_start: int, device) -> torch.Tensor:
    """[3, B, Tq] int64: the frame of one document (no masking), queries at positions q_start .."""
    q_pos = torch.arange(q_start, q_start + Tq, device=device).expand(B, Tq)
    zero = torch.zeros(B, Tq, dtype=torch.long, device=device)
    return torch.stack((q_pos, zero, zero))
