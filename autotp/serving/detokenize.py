"""Incremental detokenization: a sequence's text grows by whole characters as its tokens arrive.

A byte-level tokenizer emits a character of several bytes (CJK text, emoji) as several tokens, and the first of them
decode to U+FFFD.  As vLLM's detokenizer and transformers' TextStreamer do, each new token is decoded together with
the tokens since the last text given out (``prefix``), and text is given out only once it no longer ends in U+FFFD:
an incomplete character is held back until its last byte arrives.  Decoding from that prefix, rather than the new
tokens alone, keeps what a tokenizer joins between tokens (SentencePiece's leading spaces) right, and costs a few
tokens a step instead of the whole output.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalText:
    """The text of ``tokens`` appended one at a time; ``text`` holds only whole characters until ``finish``."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix = 0  # tokens before this are in ``text`` and no longer decoded
        self.read = 0  # tokens before this are in ``text``
        self.text = ""

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Append ``token``; the text it completes (empty while a character is incomplete)."""
        self.tokens.append(token)
        return self._advance(final=False)

    def finish(self) -> str:
        """The text still held back (bytes that never made a character decode to U+FFFD, as a full decode gives)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read == len(self.tokens):
            return ""
        before = self._decode(self.tokens[self.prefix : self.read])
        after = self._decode(self.tokens[self.prefix :])
        if len(after) <= len(before) or (after.endswith(REPLACEMENT) and not final):
            return ""
        new = after[len(before) :]
        self.prefix, self.read = self.read, len(self.tokens)
        self.text += new
        return new
