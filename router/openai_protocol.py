"""OpenAI-compatible request bodies (the subset Tandem serves) and the error object."""

from __future__ import annotations

import json
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem.core.messages import MAX_N
from tandem.core.types import MAX_TOP_LOGPROBS

# torch.Generator.manual_seed accepts [-2**63, 2**64).
_SEED_MIN, _SEED_MAX = -(2 ** 63), 2 ** 64 - 1
MAX_STOP_STRINGS = 16


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)          # -1 or 0: off (vLLM clients send -1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    speculative: bool = True                        # Tandem: false turns n-gram drafts off (engine/sched/spec/)
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    user: str | None = None
    session_id: str | None = None
    prompt_cache_key: str | None = None           # the routing session key (router/sessions.py)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None   # "24h": pin the prompt
    response_format: dict[str, Any] | None = None
    prompt_logprobs: int | None = Field(None, ge=0)   # vLLM's extension: alternatives per prompt token
    # parsed only to refuse them when set (see unsupported())
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first field set to something Tandem does not serve."""
        if self.n > MAX_N:
            return "n", f"n must be at most {MAX_N} (Tandem's limit), got n={self.n}"
        if self.prompt_logprobs is not None:
            if self.prompt_logprobs > MAX_TOP_LOGPROBS:
                return "prompt_logprobs", (f"prompt_logprobs must be at most {MAX_TOP_LOGPROBS}, "
                                           f"got {self.prompt_logprobs}")
            if self.stream:
                return "prompt_logprobs", "prompt_logprobs is not supported with stream: true"
            if self.n > 1:
                return "prompt_logprobs", "prompt_logprobs is not supported with n > 1"
        if self.best_of not in (None, 1):
            return "best_of", f"only best_of=1 is supported, got {self.best_of}"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                return name, f"{name} is not supported (only 0)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if len(self.stop_strings()) > MAX_STOP_STRINGS:
            return "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop_strings())}"
        return None

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def top_logprobs_asked(self) -> int | None:
        """None: no logprobs; else how many alternatives per token (0..MAX_TOP_LOGPROBS)."""
        raise NotImplementedError

    def prompt_logprobs_needed(self) -> int | None:
        """How many alternatives per prompt token the engine must compute (None: none)."""
        return self.prompt_logprobs


class ContentPart(_Request):
    type: str
    text: str | None = None


class ToolCallFunction(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallParam(_Request):
    """An assistant message's earlier call, as a client sends it back in the history."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None   # assistant
    tool_call_id: str | None = None                 # tool

    def text(self) -> str:
        """The message as plain text; raises ValueError for non-text parts."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"only text content parts are supported, got type {part.type!r}")
            out.append(part.text)
        return "".join(out)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0)
    # validated by router/tools/spec.py, which names the failing field in its message
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and self.top_logprobs > MAX_TOP_LOGPROBS:
            return "top_logprobs", f"top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {self.top_logprobs}"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return super().unsupported()


MAX_PROMPTS = 64   # prompts in one /v1/completions batch (lm-evaluation-harness sends its batch_size)


class CompletionRequest(_SamplingFields):
    # a string, a list of token ids, or a batch of one of either
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)   # 0 with echo: score the prompt, generate nothing
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0)    # the legacy shape: how many alternatives per token

    def prompts(self) -> list[str | list[int]]:
        """This request's prompts: one (a string or token ids) or a batch of either (each its own
        choices, in order); ValueError for an empty batch or one past :data:`MAX_PROMPTS`."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) > MAX_PROMPTS:
                raise ValueError(f"a batch holds at most {MAX_PROMPTS} prompts (Tandem's limit), got {len(p)}")
            return list(p)
        if isinstance(p, list) and not p:
            raise ValueError("the prompt is empty")
        return [cast("str | list[int]", p)]     # not a batch: one string or one list of ids

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def scores_only(self) -> bool:
        """``echo`` with ``max_tokens: 0`` (OpenAI's legacy scoring call, as vLLM serves it): the
        answer is the prompt and its logprobs; the one token drawn to end the request is left out."""
        return self.echo and self.max_tokens == 0

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_needed(self) -> int | None:
        """vLLM's rule: echo with logprobs scores the prompt too (with the larger of the two
        alternative counts when prompt_logprobs is also set)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs is not None and self.logprobs > MAX_TOP_LOGPROBS:
            return "logprobs", f"logprobs must be at most {MAX_TOP_LOGPROBS}, got {self.logprobs}"
        if self.echo and self.n > 1:
            return "echo", "echo is not supported with n > 1"
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens 0 only scores the prompt: it needs echo: true"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported()


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorBody(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorBody


class APIError(Exception):
    """A request the front door refuses; becomes ``{"error": {message, type, param, code}}``
    with HTTP ``status``. ``reason`` labels tandem_rejected_requests_total."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error",
                 reason: str = "invalid_request", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.reason, self.headers = reason, headers


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Strict UTF-8, strict JSON (no NaN/Infinity), a top-level object, no lone surrogates."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})", reason="malformed") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise APIError(400, "request body is nested too deeply", reason="malformed") from None
    except ValueError as e:
        raise APIError(400, f"request body is not valid JSON: {str(e)[:200]}", reason="malformed") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(obj).__name__}", reason="malformed")
    _check_strings(obj)
    return obj


def _check_strings(obj: Any) -> None:
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(400, "request contains an unpaired UTF-16 surrogate escape",
                               reason="malformed") from None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if isinstance(p, int)
             or (p.isidentifier() and p.islower() and p not in _TYPE_TAGS)]
    return ".".join(parts) or None


def parse_request(model: type[_Request], obj: dict[str, Any]) -> Any:
    """``model`` validated from ``obj``; the first failing field becomes the error's ``param``."""
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_input=False)
        param = _param(errors[0]["loc"])
        # a value matching no member of a union fails once per member: report them together
        msgs = list(dict.fromkeys(err["msg"] for err in errors if _param(err["loc"]) == param))
        more = len(errors) - sum(_param(err["loc"]) == param for err in errors)
        tail = f" (and {more} more errors)" if more else ""
        raise APIError(400, f"{param}: {' or '.join(msgs)}"[:500] + tail, param=param) from None
