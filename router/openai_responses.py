"""OpenAI-compatible response bodies: chat completions (whole and chunks), text completions,
logprobs in both shapes, tool calls, usage, the model list."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(_Response):
    """The legacy completions shape: parallel lists, ``top_logprobs`` as {token text: logprob}.
    With ``echo`` the prompt's tokens come first, the first of them with ``null`` logprobs."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(_Response):
    """vLLM's ``Logprob``: one token of a prompt position's ``{token id: PromptLogprob}``."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's ``prompt_logprobs``: one entry per prompt token, the first null (no context)
PromptLogprobs = list[dict[str, PromptLogprob] | None]
_UNLESS_ASKED: dict[str, Any] = dict(default=None, exclude_if=lambda v: v is None)   # left out unless asked for


class FunctionCall(_Response):
    name: str
    arguments: str


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer
    def _shape(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return d


class ChatChoice(_Response):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(**_UNLESS_ASKED)


class ChatDelta(_Response):
    """Serialized without its unset fields: the final chunk's delta is ``{}``, as OpenAI sends it.
    ``tool_calls`` entries are ``{"index", "id", "type", "function": {"name", "arguments"}}``."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer
    def _drop_none(self) -> dict[str, Any]:
        return {k: v for k, v in (("role", self.role), ("content", self.content),
                                  ("tool_calls", self.tool_calls)) if v is not None}


class ChatChunkChoice(_Response):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(_Response):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = Field(**_UNLESS_ASKED)


class Completion(_Response):
    """Both the non-streamed body (object "text_completion") and each streamed chunk (same object)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tandem"
    max_model_len: int
    speculative: str | None = None     # Tandem: the decode workers' speculation ("ngram (up to 8
                                       # draft tokens)", "off", or "off: " and why); None: unknown


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
