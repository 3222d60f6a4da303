"""Streaming detokenization: token ids in, only complete text out (a multi-byte character split
across tokens waits for its last byte)."""

from __future__ import annotations

from typing import Protocol


class Decodes(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Ids in, complete text out; pieces plus :meth:`flush` equal ``decode(all ids)``."""

    _CONTEXT = 5

    def __init__(self, tokenizer: Decodes, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids or [])
        self._read = len(self._ids)
        self._prefix = max(self._read - self._CONTEXT, 0)
        self.text = ""

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    def add(self, token_id: int) -> str:
        """Append one id; return the newly complete text ('' when nothing is complete yet)."""
        self._ids.append(int(token_id))
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        new_text = self._tok.decode(self._ids[self._prefix:], self._skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Return the held-back text (possibly ending in U+FFFD) and mark it read."""
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        new_text = self._tok.decode(self._ids[self._prefix:], self._skip)
        delta = new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta
