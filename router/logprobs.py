"""Shaping :class:`~tandem.core.types.TokenLogprob` into OpenAI's two logprobs shapes.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``.
Completions (legacy): parallel lists ``tokens`` / ``token_logprobs`` / ``top_logprobs`` (a
{token: logprob} dict per position) / ``text_offset`` (character offset of each token in the
choice's text). A token's text is its bytes decoded as UTF-8 (replacement characters where a
token holds part of a character); ``bytes`` are exact (``tokenizer.token_bytes`` when the
tokenizer has it).
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.core.types import TokenLogprob
from tandem.router.openai_responses import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


class TokenTexts:
    """id -> (text, bytes) for one tokenizer, memoized."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._memo: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._memo.get(token_id)
        if hit is None:
            raw_fn = getattr(self._tok, "token_bytes", None)
            raw = raw_fn(token_id) if raw_fn is not None else self._tok.decode([token_id]).encode("utf-8")
            hit = self._memo[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
            if len(self._memo) > 65536:
                self._memo.clear()
        return hit


def chat_logprobs(texts: TokenTexts, lps: Sequence[TokenLogprob], top_n: int) -> ChatLogprobs:
    out = []
    for lp in lps:
        text, raw = texts(lp.token_id)
        top = [TopLogprob(token=texts(t)[0], logprob=v, bytes=texts(t)[1]) for t, v in lp.top[:top_n]]
        out.append(ChatTokenLogprob(token=text, logprob=lp.logprob, bytes=raw, top_logprobs=top))
    return ChatLogprobs(content=out)


def completion_logprobs(texts: TokenTexts, lps: Sequence[TokenLogprob], top_n: int,
                        offset: int) -> tuple[CompletionLogprobs, int]:
    """The legacy shape for ``lps``, whose first token starts at character ``offset`` of the
    choice's text; returns it and the offset after the last token."""
    out = CompletionLogprobs()
    for lp in lps:
        text = texts(lp.token_id)[0]
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        top: dict[str, float] = {}
        for t, v in lp.top[:top_n]:
            top.setdefault(texts(t)[0], v)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out, offset
