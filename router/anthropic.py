"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from tandem.core.messages import GenerateRequest
from tandem.core.types import InvalidRequest, SamplingParams, StreamChunk
from tandem.router import metrics as m
from tandem.router.front_door import FrontDoor, request_priority, session_key
from tandem.router.openai_protocol import APIError, _Request, parse_json_object, parse_request
from tandem.router.prompt_cache import Breakpoint, anthropic_usage, breakpoint_pins, breakpoints
from tandem.router.streaming import (ClientGone, Running, SSEResponse, StartFailed, close_all, collect, merge,
                                     sse, start, unless_disconnected)
from tandem.router.tools.formats import ParseEvent, parse_events
from tandem.router.tools.render import render_prompt
from tandem.router.tools.spec import MAX_TOOLS, ToolPlan, named_choice, tool_from

log = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 499: "invalid_request_error", 500: "api_error", 529: "overloaded_error"}


class MessageParam(_Request):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(_Request):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    speculative: bool = True          # Tandem (the SDK's extra_body): false turns n-gram drafts off


class CountTokensRequest(_Request):
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


def error(status: int, message: str, headers: dict | None = None) -> Response:
    body = {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
    return Response(json.dumps(body), status_code=status, media_type="application/json", headers=headers)


def _text(blocks: Any, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if blocks is None:
        return ""
    if not isinstance(blocks, list):
        raise APIError(400, f"{where} must be a string or a list of text blocks", param=where)
    out = []
    for i, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise APIError(400, f"{where}[{i}]: only text blocks are supported here, got {kind!r}",
                           param=f"{where}.{i}")
        out.append(b["text"])
    return "".join(out)


def internal_messages(req: MessagesRequest | CountTokensRequest) -> list[dict]:
    """Anthropic messages in router/tools/render.py's internal shape."""
    out: list[dict] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system, "system")})
    for i, msg in enumerate(req.messages):
        if isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content})
            continue
        text, calls, results = [], [], []
        for j, b in enumerate(msg.content):
            where = f"messages.{i}.content.{j}"
            kind = b.get("type")
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind == "tool_use" and msg.role == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                    raise APIError(400, f"{where}: a tool_use block needs an id and a name", param=where)
                calls.append((b["id"], b["name"], json.dumps(b.get("input", {}), ensure_ascii=False)))
            elif kind == "tool_result" and msg.role == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise APIError(400, f"{where}: a tool_result block needs a tool_use_id", param=where)
                body = _text(b.get("content"), f"{where}.content")
                results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                                "content": f"Error: {body}" if b.get("is_error") else body})
            elif kind in ("thinking", "redacted_thinking") and msg.role == "assistant":
                continue   # earlier reasoning is not replayed to the model
            else:
                raise APIError(400, f"{where}: content block type {str(kind)[:40]!r} is not supported in a "
                                    f"{msg.role} message (text, tool_use in assistant, tool_result in user)",
                               param=where)
        out += results
        if text or calls or not results:
            d: dict = {"role": msg.role, "content": "".join(text)}
            if calls:
                d["tool_calls"] = calls
            out.append(d)
    return out


def tool_plan(tools: Any, choice: Any) -> ToolPlan | None:
    if tools is None and choice is None:
        return None
    if tools is not None and len(tools) > MAX_TOOLS:
        raise APIError(400, f"at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    parsed = tuple(tool_from(t.get("name"), t.get("description"), t.get("input_schema"), False, f"tools.{i}",
                             params_field="input_schema") for i, t in enumerate(tools or ()))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise APIError(400, "tools declares a name more than once", param="tools")
    c = choice or {"type": "auto" if names else "none"}
    kind = c.get("type")
    parallel = not c.get("disable_parallel_tool_use", False)
    if kind == "auto" or kind == "none":
        return ToolPlan(parsed, kind, None, parallel)
    if kind in ("any", "tool") and not names:
        raise APIError(400, f"tool_choice {kind!r} needs tools", param="tool_choice")
    if kind == "any":
        return ToolPlan(parsed, "required", None, parallel)
    if kind == "tool":
        name = c.get("name")
        if not isinstance(name, str):
            raise APIError(400, "tool_choice type 'tool' needs a name", param="tool_choice.name")
        return ToolPlan(parsed, *named_choice(name, names, "tool_choice.name"), parallel)
    raise APIError(400, f"tool_choice.type must be auto, any, tool or none, got {str(kind)[:40]!r}",
                   param="tool_choice.type")


def _stop_reason(last: StreamChunk, calls: int) -> tuple[str, str | None]:
    if last.finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if last.stop_str is not None:
        return "stop_sequence", last.stop_str
    return "end_turn", None


def _usage(last: StreamChunk, greq: GenerateRequest, n_tokens: int) -> dict:
    prompt = last.prompt_tokens or len(greq.prompt_ids)
    return {**anthropic_usage(prompt, last.cached_tokens, greq.pins),
            "output_tokens": last.completion_tokens or n_tokens}


def _upto(req: MessagesRequest, bp: Breakpoint) -> MessagesRequest:
    """``req`` cut just after breakpoint ``bp``'s block (what a cache write at it covers)."""
    kind = bp.where[0]
    if kind == "tools":
        return req.model_copy(update={"messages": []})
    if kind == "system":
        assert req.system is not None, "a system breakpoint lies in the system prompt"
        return req.model_copy(update={"system": req.system[:bp.where[1] + 1], "messages": []})
    i, j = bp.where[1], bp.where[2]
    last = req.messages[i]
    cut = last.model_copy(update={"content": last.content[:j + 1]})
    return req.model_copy(update={"messages": [*req.messages[:i], cut]})


class AnthropicRoutes:
    def __init__(self, door: FrontDoor):
        self.door = door

    def _ids(self, req, plan: ToolPlan | None) -> list[int]:
        msgs = internal_messages(req)
        return self.door.render(lambda tok: render_prompt(tok, msgs, plan, self.door.tool_format))

    def _pins(self, req: MessagesRequest, plan: ToolPlan | None, ids: list[int]) -> tuple:
        def render_upto(bp: Breakpoint) -> list[int] | None:
            try:
                return self._ids(_upto(req, bp), plan)
            except Exception:       # a template that cannot render the head alone: no pin there
                return None

        bps = breakpoints(req.tools, req.system, req.messages)
        return breakpoint_pins(bps, ids, render_upto) if bps else ()

    def prepare(self, req: MessagesRequest, body: dict, headers, rid: str) -> tuple[GenerateRequest, ToolPlan | None]:
        plan = tool_plan(req.tools, req.tool_choice)
        ids = self._ids(req, plan)
        pins = self._pins(req, plan, ids)
        max_tokens = self.door.output_budget(len(ids), req.max_tokens, None, chat=True)
        constraint = self.door.tool_format.constraint(plan) if plan is not None and plan.forced else None
        params = SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=req.top_p or 1.0, top_k=req.top_k or 0, stop=tuple(req.stop_sequences or ()),
            constraint=constraint, speculative=req.speculative)
        try:
            params.validate()
        except InvalidRequest as e:
            raise APIError(400, str(e)) from None
        return GenerateRequest(rid, tuple(ids), params, session_key(headers, body, ids),
                               priority=request_priority(headers, body), pins=pins), plan

    async def _parse(self, request: Request, model):
        who = self.door.check_auth(request)
        body = parse_json_object(await self.door.read_body(request))
        req = parse_request(model, body)
        self.door.check_model(req.model)
        request.state.principal = who
        return req, body

    async def count_tokens(self, request: Request) -> Response:
        try:
            req, _ = await self._parse(request, CountTokensRequest)
            breakpoints(req.tools, req.system, req.messages)      # the same 400s as /v1/messages
            ids = await asyncio.to_thread(self._ids, req, tool_plan(req.tools, None))
        except APIError as e:
            return error(e.status, e.message)
        return Response(json.dumps({"input_tokens": len(ids)}), media_type="application/json")

    async def serve(self, request: Request) -> Response:
        arrival = time.perf_counter()
        rid = f"msg_{uuid.uuid4().hex}"
        try:
            req, body = await self._parse(request, MessagesRequest)
            greq, plan = await asyncio.to_thread(self.prepare, req, body, request.headers, rid)
            [greq] = self.door.admit(request.state.principal, [greq], body)
        except APIError as e:
            m.REJECTED.labels(e.reason).inc()
            m.REQUESTS.labels("rejected").inc()
            return error(e.status, e.message, e.headers)
        except Exception as e:
            log.exception("preparing %s failed", rid)
            m.REQUESTS.labels("error").inc()
            return error(500, f"internal error: {type(e).__name__}")
        try:
            runs = await start(self.door.backend, [greq], arrival, request.receive)
        except StartFailed as e:
            if e.kind == "gone":
                return Response(status_code=499)
            if e.kind == "overloaded":
                return error(529, e.message, {"Retry-After": str(e.retry_after_s), "request-id": rid})
            return error(400 if e.kind == "invalid" else 500, e.message)
        headers = {"request-id": rid, "X-Request-Id": rid}
        active = plan is not None and plan.active
        if req.stream:
            return SSEResponse(self._events(greq, runs, plan if active else None), headers)
        try:
            [done] = await unless_disconnected(collect(runs), request.receive)
        except ClientGone:
            return Response(status_code=499)
        except Exception as e:
            log.exception("backend failed on %s", rid)
            return error(500, f"backend error: {e!r}"[:500])
        finally:
            await close_all([r.chunks for r in runs])
        if done.last.error:
            return error(500, f"generation failed: {done.last.error}", headers)
        events = (parse_events(self.door.tool_format, done.text, "toolu_", done.last.finish_reason == "length",
                               plan.max_calls) if plan is not None and active else [ParseEvent(done.text)])
        content = _blocks(events)   # in generation order
        calls = sum(b["type"] == "tool_use" for b in content)
        reason, seq = _stop_reason(done.last, calls)
        out = {"id": rid, "type": "message", "role": "assistant", "model": self.door.backend.model_name,
               "content": content, "stop_reason": reason, "stop_sequence": seq,
               "usage": _usage(done.last, greq, done.n_tokens)}
        return Response(json.dumps(out, ensure_ascii=False), media_type="application/json", headers=headers)

    async def _events(self, greq, runs: list[Running], plan: ToolPlan | None) -> AsyncGenerator[bytes, None]:
        def ev(kind: str, **data) -> bytes:
            return sse(json.dumps({"type": kind, **data}, ensure_ascii=False), kind)

        parser = self.door.tool_format.parser("toolu_", plan.max_calls) if plan is not None else None
        index, open_text, calls, n_tokens = 0, False, 0, 0
        first = runs[0].first
        known = first.prompt_tokens > 0
        usage0 = _usage(first, greq, 0) if known else {
            **anthropic_usage(len(greq.prompt_ids), 0, greq.pins), "output_tokens": 0}
        try:
            yield ev("message_start", message={
                "id": greq.rid, "type": "message", "role": "assistant", "content": [],
                "model": self.door.backend.model_name, "stop_reason": None, "stop_sequence": None, "usage": usage0})
            yield ev("ping")
            async for _, c in merge(runs):
                n_tokens += len(c.token_ids)
                if c.error:
                    yield ev("error", error={"type": "api_error", "message": f"generation failed: {c.error}"})
                    return
                events = ([*parser.feed(c.text),
                           *(parser.finish(c.finish_reason == "length") if c.finish_reason else [])] if parser
                          else [ParseEvent(c.text)])
                for e in events:
                    if e.text:
                        if not open_text:
                            yield ev("content_block_start", index=index, content_block={"type": "text", "text": ""})
                            open_text = True
                        yield ev("content_block_delta", index=index, delta={"type": "text_delta", "text": e.text})
                    if e.call is not None:
                        if open_text:
                            yield ev("content_block_stop", index=index)
                            index, open_text = index + 1, False
                        yield ev("content_block_start", index=index, content_block={
                            "type": "tool_use", "id": e.call.id, "name": e.call.name, "input": {}})
                        yield ev("content_block_delta", index=index,
                                 delta={"type": "input_json_delta", "partial_json": e.call.arguments})
                        yield ev("content_block_stop", index=index)
                        index, calls = index + 1, calls + 1
                if c.finish_reason is not None:
                    if open_text:
                        yield ev("content_block_stop", index=index)
                    reason, seq = _stop_reason(c, calls)
                    usage = _usage(c, greq, n_tokens)
                    if known:   # the same input figures as message_start
                        usage.update({k: usage0[k] for k in ("input_tokens", "cache_read_input_tokens",
                                                             "cache_creation_input_tokens")})
                    yield ev("message_delta", delta={"stop_reason": reason, "stop_sequence": seq}, usage=usage)
                    yield ev("message_stop")
        except Exception as e:
            log.exception("stream %s failed", greq.rid)
            yield ev("error", error={"type": "api_error", "message": f"backend error: {e!r}"[:500]})
        finally:
            await close_all([r.chunks for r in runs])


def _blocks(events: list[ParseEvent]) -> list[dict]:
    out: list[dict] = []
    for e in events:
        if e.call is not None:
            out.append({"type": "tool_use", "id": e.call.id, "name": e.call.name, "input": _input(e.call.arguments)})
        elif e.text and out and out[-1]["type"] == "text":
            out[-1]["text"] += e.text
        elif e.text:
            out.append({"type": "text", "text": e.text})
    return out or [{"type": "text", "text": ""}]


def _input(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"_raw": arguments}
    return value if isinstance(value, dict) else {"value": value}
