"""Shaping :class:`~tandem.core.types.TokenLogprob` into OpenAI's two logprobs shapes."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.core.types import TokenLogprob
from tandem.router.openai_responses import (ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprob,
                                            PromptLogprobs, TopLogprob)


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


def echo_logprobs(texts: TokenTexts, prompt_ids: Sequence[int], plps: Sequence[TokenLogprob],
                  top_n: int) -> tuple[CompletionLogprobs, int]:
    """The legacy shape for an echoed prompt: every prompt token, the first with ``null``
    logprob and alternatives (nothing comes before it), then ``plps`` (the engine's prompt
    logprobs, one per later token); returns it and the offset after the last token."""
    out, offset = CompletionLogprobs(), 0
    if prompt_ids:
        text = texts(prompt_ids[0])[0]
        out.tokens.append(text)
        out.token_logprobs.append(None)
        out.top_logprobs.append(None)
        out.text_offset.append(0)
        offset = len(text)
    rest, offset = completion_logprobs(texts, plps, top_n, offset)
    out.tokens += rest.tokens
    out.token_logprobs += rest.token_logprobs
    out.top_logprobs += rest.top_logprobs
    out.text_offset += rest.text_offset
    return out, offset


def joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    """``a``'s tokens then ``b``'s (the echoed prompt, then the completion)."""
    return CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs,
                              text_offset=a.text_offset + b.text_offset)


def vllm_prompt_logprobs(texts: TokenTexts, plps: Sequence[TokenLogprob], top_n: int) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: ``null`` for the first prompt token, then per token
    ``{token id: {logprob, rank, decoded_token}}`` holding the prompt token itself and its
    ``top_n`` most likely alternatives (ranks 1..top_n; the prompt token's own rank)."""
    out: PromptLogprobs = [None]
    for lp in plps:
        d = {str(lp.token_id): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=texts(lp.token_id)[0])}
        for rank, (t, v) in enumerate(lp.top[:top_n], start=1):
            d.setdefault(str(t), PromptLogprob(logprob=v, rank=rank, decoded_token=texts(t)[0]))
        out.append(d)
    return out
