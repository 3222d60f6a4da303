"""The body of ``POST /v1/responses`` (the subset Tandem serves), validated, and what it maps to:
:class:`ResponsesRequest`; :func:`input_items` (the input, normalized), :func:`tool_plan`,
:func:`text_constraint`, :func:`internal_messages`."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from tandem.core.types import Constraint
from tandem.router.openai_protocol import APIError, _Request
from tandem.router.tools.spec import MAX_TOOLS, ToolPlan, check_schema, named_choice, tool_from

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


class ResponsesRequest(_Request):
    model: str
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    session_id: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    seed: int | None = None
    speculative: bool = True          # Tandem (the SDK's extra_body): false turns n-gram drafts off
    # parsed only to refuse them when set
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    top_logprobs: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first field set to something Tandem does not serve."""
        if self.conversation is not None:
            return "conversation", "conversation is not supported (chain turns with previous_response_id)"
        if self.prompt is not None:
            return "prompt", "prompt templates are not supported (send input and instructions)"
        if self.truncation == "auto":
            return "truncation", "truncation 'auto' is not supported: an input over the context is a 400"
        if self.top_logprobs:
            return "top_logprobs", "top_logprobs is not supported on /v1/responses (use /v1/chat/completions)"
        if self.background and self.stream:
            return "background", "background with stream is not supported (poll GET /v1/responses/{id})"
        if self.background and not self.store:
            return "background", "background requires store: true"
        if self.metadata is not None and len(self.metadata) > 16:
            return "metadata", f"metadata holds at most 16 keys, got {len(self.metadata)}"
        return None


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content parts", param=where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text", part.get("refusal")) if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(text, str):
            raise APIError(400, f"{where}[{j}]: content part type {str(kind)[:40]!r} is not supported "
                                f"(only text parts: {', '.join(TEXT_PARTS)})", param=f"{where}.{j}")
        out.append(text)
    return "".join(out)


def _str_field(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise APIError(400, f"{where}.{key} is required (a string)", param=f"{where}.{key}")
    return value


def input_items(req: ResponsesRequest) -> list[dict]:
    """The input as normalized items: ``{"type": "message", "role", "content": [text part]}``,
    ``{"type": "function_call", "call_id", "name", "arguments"}``, ``{"type":
    "function_call_output", "call_id", "output"}`` (reasoning items dropped)."""
    if isinstance(req.input, str):
        return [_message("user", req.input)]
    out = []
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise APIError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {str(role)[:40]!r}",
                               param=f"{where}.role")
            out.append(_message(role, _text_of(item.get("content"), f"{where}.content")))
        elif kind == "function_call":
            out.append({"type": "function_call", "call_id": _str_field(item, "call_id", where),
                        "name": _str_field(item, "name", where), "arguments": _str_field(item, "arguments", where)})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"type": "function_call_output", "call_id": _str_field(item, "call_id", where),
                        "output": _text_of(output, f"{where}.output") if output is not None else ""})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"{where}: input item type {str(kind)[:40]!r} is not supported (message, "
                                f"function_call, function_call_output)", param=f"{where}.type")
    return out


def _message(role: str, text: str) -> dict:
    part = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": part, "text": text}]}


def item_text(item: dict) -> str:
    return "".join(p.get("text", "") for p in item.get("content", ()))


def internal_messages(instructions: str | None, items: list[dict]) -> list[dict]:
    """Normalized items (history first) in router/tools/render.py's internal shape: function_call
    items join the assistant turn they follow (or start one), outputs become tool messages."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    for it in items:
        if it["type"] == "message":
            out.append({"role": "system" if it["role"] == "developer" else it["role"], "content": item_text(it)})
        elif it["type"] == "function_call":
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                out.append(last)
            last.setdefault("tool_calls", []).append((it["call_id"], it["name"], it["arguments"]))
        else:
            out.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
    return out


def tool_plan(req: ResponsesRequest) -> ToolPlan | None:
    """Function tools (flat: ``{"type": "function", "name", "parameters",...}``) and the choice."""
    if req.tools is None and req.tool_choice is None:
        return None
    tools = req.tools or []
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    parsed = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise APIError(400, f"{where}: tool type {str(kind)[:40]!r} is not supported: Tandem serves "
                                f"function tools only (no built-in tools such as web_search or file_search)",
                           param=f"{where}.type")
        parsed.append(tool_from(t.get("name"), t.get("description"), t.get("parameters"), t.get("strict"), where))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise APIError(400, "tools declares a name more than once", param="tools")
    parallel = req.parallel_tool_calls is not False
    c = req.tool_choice
    if c is None:
        return ToolPlan(tuple(parsed), "auto" if names else "none", None, parallel)
    if c in ("auto", "none", "required"):
        if c == "required" and not names:
            raise APIError(400, "tool_choice 'required' needs tools", param="tool_choice")
        return ToolPlan(tuple(parsed), c, None, parallel)   # type: ignore[arg-type]
    if isinstance(c, dict) and c.get("type") == "function" and isinstance(c.get("name"), str):
        return ToolPlan(tuple(parsed), *named_choice(c["name"], names, "tool_choice.name"), parallel)
    raise APIError(400, "tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", "
                        "\"name\": ...} (hosted-tool and allowed_tools choices are not supported)",
                   param="tool_choice")


def text_constraint(req: ResponsesRequest) -> Constraint | None:
    """``text.format``: text (none), json_object, json_schema (``name``, ``schema``, ``strict``)."""
    fmt = (req.text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "json_schema":
        if "schema" not in fmt:
            raise APIError(400, "text.format json_schema needs a schema", param="text.format.schema")
        strict = fmt.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise APIError(400, "text.format.strict must be a boolean", param="text.format.strict")
        check_schema(fmt["schema"], "text.format.schema")
        return Constraint("json_schema", json.dumps(fmt["schema"], ensure_ascii=False), strict=bool(strict))
    raise APIError(400, f"text.format.type must be text, json_object or json_schema, got {str(kind)[:40]!r}",
                   param="text.format.type")
