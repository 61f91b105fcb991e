"""Generated token ids -> text, piece by piece, for printing tokens as they arrive.

Tokens do not end on character boundaries: a byte-level tokenizer (byte, gpt2) may split one UTF-8
character over several tokens, and decoding a token alone gives U+FFFD garbage. So the stream decodes
the whole continuation each time and emits what was added since the last emit, holding it back while
the text ends in U+FFFD (a character a later token completes). The decode starts a few prompt tokens
back: tokenizers that drop the leading space of the first token (SentencePiece) would otherwise glue
the continuation to the prompt.
"""
from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 8  # prompt tokens decoded in front of the continuation


def decodable(tok, ids: Sequence[int]) -> list[int]:
    """ids the tokenizer knows: a model's padded vocabulary has rows no tokenizer id names."""
    return [i for i in ids if i < tok.n_vocab]


class TextStream:
    def __init__(self, tok, prompt_ids: Sequence[int]):
        self.tok = tok
        self.context = decodable(tok, prompt_ids[-PROMPT_CONTEXT:])
        self.ids: list[int] = []  # the continuation so far
        self.emitted = len(tok.decode(self.context))  # characters of _text() already handed out

    def push(self, token: int) -> str:
        """Add one new id; the text it completes ('' while a character is incomplete)."""
        self.ids.append(token)
        text = self._text()
        return "" if text.endswith(REPLACEMENT) else self._take(text)

    def flush(self) -> str:
        """Whatever is held back (at the end of a sample, an incomplete character prints as U+FFFD)."""
        return self._take(self._text())

    def _text(self) -> str:
        return self.tok.decode(self.context + decodable(self.tok, self.ids))

    def _take(self, text: str) -> str:
        piece, self.emitted = text[self.emitted:], len(text)
        return piece


def continuation_text(tok, prompt_ids: Sequence[int], ids: Sequence[int]) -> str:
    """The text `ids` add after the prompt: what a TextStream prints in total."""
    stream = TextStream(tok, prompt_ids)
    stream.ids = list(ids)
    return stream.flush()
