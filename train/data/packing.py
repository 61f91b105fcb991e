"""Pack tokenized documents into training windows without truncating any document.

Documents arrive as token arrays that already end with EOS. They are concatenated and cut
into windows of seq_len + 1 tokens with stride seq_len: consecutive windows share one token,
so every next-token pair of the stream is trained exactly once and a long document simply
continues in the next window. `head()` says where the next window starts (the document's
position and the token offset inside it), which is all a resume needs.
"""
from __future__ import annotations

from collections import deque

import numpy as np


class WindowPacker:
    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self._pieces: deque[list] = deque()  # [position, tokens, start offset]
        self._available = 0

    def add(self, position, tokens: np.ndarray, start: int = 0) -> None:
        """Append a document's tokens (ending with EOS); skip its first `start` tokens (resume)."""
        if start < len(tokens):
            self._pieces.append([position, tokens, start])
            self._available += len(tokens) - start

    @property
    def available(self) -> int:
        return self._available

    def head(self):
        """(position, offset) of the next window's first token, or None when nothing is buffered."""
        if not self._pieces:
            return None
        position, _, start = self._pieces[0]
        return position, start

    def pop_window(self) -> np.ndarray | None:
        """The next seq_len + 1 tokens, advancing by seq_len; None until enough tokens are buffered."""
        size = self.seq_len + 1
        if self._available < size:
            return None
        parts, need = [], size
        for _, tokens, start in self._pieces:
            take = min(need, len(tokens) - start)
            parts.append(tokens[start:start + take])
            need -= take
            if not need:
                break
        self._advance(self.seq_len)
        return np.concatenate(parts)

    def _advance(self, n: int) -> None:
        self._available -= n
        while n:
            piece = self._pieces[0]
            left = len(piece[1]) - piece[2]
            if left > n:
                piece[2] += n
                return
            n -= left
            self._pieces.popleft()
