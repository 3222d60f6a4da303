"""The OpenAI-compatible HTTP front door: ``create_app(backend, config) -> FastAPI``.

Routes: POST /v1/chat/completions, POST /v1/completions (SSE when ``stream``), GET /v1/models,
GET /health, GET /metrics. /v1/* needs ``Authorization: Bearer <api_key>`` when
``ServeConfig.api_key`` is set.

A generation request goes: auth -> body (size limit, UTF-8, JSON) -> pydantic validation ->
model check -> tokenize (chat template) -> context check and max_tokens clamp -> session key ->
:class:`GenerateRequest` -> ``backend.generate``. Every refusal on the way is an :class:`APIError`
answered with an OpenAI error object; the first chunk is awaited before the response starts, so a
request the backend refuses (InvalidRequest) is still a 400. Whenever the front door stops reading
a generation before its final chunk (client gone, server shutting down) it calls
``backend.abort(rid)`` so the engine frees the request's KV.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from starlette.requests import ClientDisconnect
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from tandem.core.config import ServeConfig
from tandem.core.messages import GenerateRequest
from tandem.core.types import InvalidRequest, Overloaded, SamplingParams, StreamChunk, TandemError
from tandem.router.sessions import fingerprint
from tandem.router import metrics as m
from tandem.router.backend import ServingBackend
from tandem.router.openai_protocol import (
    MAX_SESSION_ID_CHARS, APIError, AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
    ChatCompletionChunk, ChatCompletionRequest, ChatDelta, Completion, CompletionChoice,
    CompletionRequest, ErrorBody, ErrorResponse, ModelCard, ModelList, Usage, parse_json_object,
    parse_request)

log = logging.getLogger(__name__)

BODY_READ_TIMEOUT_S = 30.0      # a client that stalls mid-body gets 408
DRAIN_LIMIT_BYTES = 64 << 20    # read (and drop) this much of an oversized body so the client sees 413
HEALTH_TIMEOUT_S = 10.0
ABORT_TIMEOUT_S = 10.0
DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's default for /v1/completions; chat defaults to the rest of the context

try:  # chat templates raise jinja2 errors for conversations they refuse
    from jinja2 import TemplateError as _JinjaError
except ImportError:  # pragma: no cover
    _JinjaError = ValueError
_TEMPLATE_ERRORS = (TandemError, ValueError, TypeError, LookupError, _JinjaError)


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   type: str = "invalid_request_error", headers: Mapping[str, str] | None = None) -> Response:
    body = ErrorResponse(error=ErrorBody(message=message, type=type, param=param, code=code))
    return Response(body.model_dump_json(), status_code=status, media_type="application/json",
                    headers=dict(headers or {}))


def _refusal(e: APIError) -> Response:
    return error_response(e.status, e.message, param=e.param, code=e.code, type=e.type,
                          headers={"WWW-Authenticate": "Bearer"} if e.status == 401 else None)


class _ClientGone(Exception):
    pass


def session_key(headers: Mapping[str, str], body: Mapping[str, Any], prompt_ids: list[int]) -> str | None:
    """The session a request belongs to: ``X-Session-Id`` header, else body ``session_id``, else body
    ``user``; when the client names none, a fingerprint of the chat's opening (its system
    prompt(s) and first user message), so agents that send nothing still stick to their workers.
    None for a plain completion prompt with no session named.
    """
    for value in (headers.get("x-session-id"), body.get("session_id"), body.get("user")):
        if isinstance(value, str) and value:
            if len(value) > MAX_SESSION_ID_CHARS:
                raise APIError(400, f"session id has {len(value)} characters, at most "
                                    f"{MAX_SESSION_ID_CHARS} allowed", param="session_id")
            return value
    messages = body.get("messages")
    if isinstance(messages, list) and all(isinstance(m, Mapping) for m in messages):
        fp = fingerprint(messages)
        if fp is not None:
            return f"fp-{fp:016x}"
    return None


# ------------------------------------------------------------------------------ body parsing
async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise APIError(400, f"invalid Content-Length header {declared[:32]!r}", reason="malformed")
        if int(declared) > limit:
            await _drain(request)
            raise _too_large(int(declared), limit)
    body = bytearray()
    try:
        async with asyncio.timeout(BODY_READ_TIMEOUT_S):
            async for part in request.stream():
                body += part
                if len(body) > limit:
                    await _drain(request)
                    raise _too_large(len(body), limit, at_least=True)
    except TimeoutError:
        raise APIError(408, f"request body not received within {BODY_READ_TIMEOUT_S:.0f} s",
                       code="timeout", reason="timeout") from None
    except ClientDisconnect:   # nobody will read the answer; counted, not logged as a failure
        raise APIError(499, "client disconnected while sending the body", reason="disconnected") from None
    return bytes(body)


def _too_large(size: int, limit: int, at_least: bool = False) -> APIError:
    return APIError(413, f"request body is {'over ' if at_least else ''}{size} bytes; the limit is "
                         f"{limit} bytes", code="request_too_large", reason="too_large")


async def _drain(request: Request) -> None:
    """Read and drop the rest of a refused body (bounded), so a client still writing gets the 413
    instead of a connection reset."""
    seen = 0
    try:
        async with asyncio.timeout(5.0):
            async for part in request.stream():
                seen += len(part)
                if seen > DRAIN_LIMIT_BYTES:
                    return
    except Exception:  # the client vanished or stalled: nothing to protect
        return


# ------------------------------------------------------------------------------ generation
async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(aw: Awaitable[Any], receive) -> Any:
    """Await ``aw`` unless the client disconnects first (then cancel it and raise _ClientGone)."""
    task = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_until_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise _ClientGone()
    finally:
        task.cancel()
        watch.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


async def _metered(backend: ServingBackend, greq: GenerateRequest, arrival: float) -> AsyncIterator[StreamChunk]:
    """``backend.generate(greq)`` with the front door's metrics; aborts ``greq.rid`` when closed
    (or cancelled) before the final chunk. Counts tandem_requests_total once, by outcome."""
    chunks = backend.generate(greq)
    status, finished, last = "aborted", False, None
    try:
        async for c in chunks:
            now = time.perf_counter()
            if c.token_ids:
                if last is None:
                    m.TTFT.observe(now - arrival)
                else:
                    gap = (now - last) / len(c.token_ids)
                    for _ in c.token_ids:
                        m.ITL.observe(gap)
                last = now
            if c.finish_reason is not None:
                finished = True
                status = "error" if c.error else "aborted" if c.finish_reason == "abort" else "ok"
                m.count_prompt(c.prompt_tokens, c.cached_tokens)
            yield c
            if finished:
                return
        status = "error"
        raise RuntimeError(f"backend stream for {greq.rid} ended without a finish_reason")
    except InvalidRequest:
        status = "rejected"
        m.REJECTED.labels("invalid_request").inc()
        raise
    except Overloaded:
        status = "rejected"
        m.REJECTED.labels("overloaded").inc()
        raise
    except Exception:
        status = "error"
        raise
    finally:
        if not finished:
            try:
                await asyncio.wait_for(backend.abort(greq.rid), ABORT_TIMEOUT_S)
            except Exception:
                log.exception("abort(%s) failed", greq.rid)
        await chunks.aclose()
        m.REQUESTS.labels(status).inc()


class _SSEResponse(Response):
    """Server-sent events from ``events``; stops (and closes ``events``) when the client disconnects,
    whatever ASGI spec version the server speaks."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: Mapping[str, str]):
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})

    async def __call__(self, scope, receive, send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await _unless_disconnected(pump(), receive)
        except (_ClientGone, OSError):
            pass
        finally:
            await self.events.aclose()   # runs _metered's abort when the stream was cut short


def _sse(data: str) -> bytes:
    return b"data: " + data.encode() + b"\n\n"


def _error_json(message: str) -> str:
    return ErrorResponse(error=ErrorBody(message=message, type="server_error")).model_dump_json()


class _FrontDoor:
    """The route handlers, bound to one backend and config."""

    def __init__(self, backend: ServingBackend, config: ServeConfig):
        self.backend, self.config = backend, config
        self.created = int(time.time())
        self._key = config.api_key.encode() if config.api_key else None

    # ---------------------------------------------------------------- checks
    def check_auth(self, request: Request) -> None:
        if self._key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key", reason="unauthorized")

    def check_model(self, name: str) -> None:
        if name != self.backend.model_name:
            raise APIError(404, f"The model `{name[:256]}` does not exist (serving "
                                f"`{self.backend.model_name}`).", param="model",
                           code="model_not_found", reason="model_not_found")

    # ---------------------------------------------------------------- prompt
    def _chat_ids(self, req: ChatCompletionRequest) -> list[int]:
        try:
            # "developer" is OpenAI's newer name for "system"; chat templates know only the latter
            messages = [{"role": "system" if msg.role == "developer" else msg.role, "content": msg.text()}
                        for msg in req.messages]
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        tok = self.backend.tokenizer
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True)
        except _TEMPLATE_ERRORS as e:
            raise APIError(400, f"the chat template refused these messages: {str(e)[:300]}",
                           param="messages") from None
        return list(tok.encode(text, add_special_tokens=False))

    def _completion_ids(self, req: CompletionRequest) -> list[int]:
        try:
            prompt = req.single_prompt()
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        if isinstance(prompt, str):
            return list(self.backend.tokenizer.encode(prompt, add_special_tokens=True))
        vocab = getattr(self.backend.tokenizer, "vocab_size", None)
        for t in prompt:
            if t < 0 or (vocab is not None and t >= vocab):
                raise APIError(400, f"token id {t} is outside the vocabulary (0..{vocab - 1 if vocab else '?'})",
                               param="prompt")
        return list(prompt)

    def build_request(self, req: ChatCompletionRequest | CompletionRequest, body: dict[str, Any],
                      headers: Mapping[str, str], prompt_ids: list[int], rid: str) -> GenerateRequest:
        chat = isinstance(req, ChatCompletionRequest)
        n, ctx = len(prompt_ids), self.backend.max_context
        if n == 0:
            raise APIError(400, "the prompt is empty", param="messages" if chat else "prompt")
        if n >= ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens, but the prompt "
                                f"has {n} tokens (at least 1 token must be left to generate).",
                           param="messages" if chat else "prompt", code="context_length_exceeded",
                           reason="context_length")
        room = ctx - n
        asked = req.requested_max_tokens()
        max_tokens = min(asked, room) if asked is not None else (
            room if chat else min(DEFAULT_COMPLETION_MAX_TOKENS, room))
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(req.top_k or 0, 0),
            seed=req.seed,
            stop=req.stop_strings(),
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens)
        try:
            params.validate()
        except InvalidRequest as e:
            raise APIError(400, str(e)) from None
        return GenerateRequest(rid=rid, prompt_ids=tuple(prompt_ids), params=params,
                               session_id=session_key(headers, body, prompt_ids))

    # ---------------------------------------------------------------- generation routes
    async def serve(self, request: Request, chat: bool) -> Response:
        arrival = time.perf_counter()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            self.check_auth(request)
            body = parse_json_object(await _read_body(request, self.config.max_body_bytes))
            req = parse_request(ChatCompletionRequest if chat else CompletionRequest, body)
            self.check_model(req.model)
            refused = req.unsupported()
            if refused is not None:
                raise APIError(400, refused[1], param=refused[0], code="unsupported")
            ids = await asyncio.to_thread(self._chat_ids if chat else self._completion_ids, req)
            greq = self.build_request(req, body, request.headers, ids, rid)
        except APIError as e:
            m.REJECTED.labels(e.reason).inc()
            m.REQUESTS.labels("rejected").inc()
            return _refusal(e)
        except Exception as e:   # a bug on our side (or the tokenizer's): 500, and keep serving
            log.exception("preparing %s failed", rid)
            m.REQUESTS.labels("error").inc()
            return error_response(500, f"internal error: {type(e).__name__}", type="server_error")

        chunks = _metered(self.backend, greq, arrival)
        try:   # the first chunk decides the status code: a refusal is still a 400
            first = await _unless_disconnected(anext(chunks), request.receive)
        except _ClientGone:
            return Response(status_code=499)   # nobody is listening; _metered already aborted
        except InvalidRequest as e:
            return error_response(400, str(e))
        except Overloaded as e:   # every worker is past its admission limits
            return error_response(429, str(e), code="overloaded", type="rate_limit_error",
                                  headers={"Retry-After": str(e.retry_after_s), "X-Request-Id": rid})
        except Exception as e:
            log.exception("backend failed on %s", rid)
            return error_response(500, f"backend error: {e!r}"[:500], type="server_error")

        headers = {"X-Request-Id": rid}
        if req.stream:
            return _SSEResponse(self._events(req, greq, first, chunks), headers)
        try:
            text, last, n_tokens = await _unless_disconnected(_collect(first, chunks), request.receive)
        except _ClientGone:
            return Response(status_code=499)
        except Exception as e:
            log.exception("backend failed on %s", rid)
            return error_response(500, f"backend error: {e!r}"[:500], type="server_error")
        finally:
            await chunks.aclose()   # records the outcome now, not when the generator is collected
        if last.error:
            return error_response(500, f"generation failed: {last.error}", type="server_error", headers=headers)
        if last.worker:
            headers["X-Tandem-Worker"] = last.worker
        usage = _usage(last, len(greq.prompt_ids), n_tokens)
        model = self.backend.model_name
        if chat:
            out: BaseModel = ChatCompletion(
                id=rid, model=model, usage=usage,
                choices=[ChatChoice(message=AssistantMessage(content=text), finish_reason=last.finish_reason)])
        else:
            out = Completion(id=rid, model=model, usage=usage,
                             choices=[CompletionChoice(text=text, finish_reason=last.finish_reason)])
        return Response(out.model_dump_json(), media_type="application/json", headers=headers)

    async def _events(self, req: ChatCompletionRequest | CompletionRequest, greq: GenerateRequest,
                      first: StreamChunk, chunks: AsyncIterator[StreamChunk]) -> AsyncIterator[bytes]:
        """SSE events of one generation, ending with ``data: [DONE]``. Once the status line is sent a
        failure can only be an error event."""
        chat = isinstance(req, ChatCompletionRequest)
        rid, created, model = greq.rid, int(time.time()), self.backend.model_name

        def event(text: str | None, finish: str | None, usage: Usage | None = None, *,
                  role: bool = False, choices: bool = True) -> bytes:
            if chat:
                choice = [ChatChunkChoice(delta=ChatDelta(role="assistant" if role else None, content=text),
                                          finish_reason=finish)]
                out: BaseModel = ChatCompletionChunk(id=rid, created=created, model=model,
                                                     choices=choice if choices else [], usage=usage)
            else:
                choice = [CompletionChoice(text=text or "", finish_reason=finish)]
                out = Completion(id=rid, created=created, model=model, choices=choice if choices else [],
                                 usage=usage)
            return _sse(out.model_dump_json())

        n_tokens = 0
        try:
            if chat:
                yield event("", None, role=True)
            c: StreamChunk | None = first
            while c is not None:
                n_tokens += len(c.token_ids)
                if c.error:
                    yield _sse(_error_json(f"generation failed: {c.error}"))
                    break
                if c.text or c.finish_reason is not None:
                    yield event(c.text or None, c.finish_reason)
                if c.finish_reason is not None:
                    if req.include_usage():
                        yield event(None, None, _usage(c, len(greq.prompt_ids), n_tokens), choices=False)
                    break
                c = await anext(chunks, None)
        except Exception as e:
            log.exception("stream %s failed", rid)
            yield _sse(_error_json(f"backend error: {e!r}"[:500]))
        finally:
            await chunks.aclose()
        yield _sse("[DONE]")

    # ---------------------------------------------------------------- other routes
    async def models(self, request: Request) -> Response:
        try:
            self.check_auth(request)
        except APIError as e:
            return _refusal(e)
        card = ModelCard(id=self.backend.model_name, created=self.created, max_model_len=self.backend.max_context)
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

    async def health(self) -> Response:
        try:
            info = await asyncio.wait_for(self.backend.health(), HEALTH_TIMEOUT_S)
        except Exception as e:
            return JSONResponse({"status": "error", "error": repr(e)[:500]}, status_code=503)
        if not isinstance(info, dict):
            return JSONResponse({"status": "error", "error": f"health() returned {type(info).__name__}"}, 503)
        return JSONResponse(info, status_code=200 if info.get("status") == "ok" else 503)

    async def metrics(self) -> Response:
        return Response(await asyncio.to_thread(self.backend.metrics_text), media_type=CONTENT_TYPE_LATEST)


async def _collect(first: StreamChunk, chunks: AsyncIterator[StreamChunk]) -> tuple[str, StreamChunk, int]:
    """All of one generation: (text, final chunk, generated token count)."""
    parts, n, c = [first.text], len(first.token_ids), first
    while c.finish_reason is None:
        c = await anext(chunks)
        parts.append(c.text)
        n += len(c.token_ids)
    return "".join(parts), c, n


def _usage(last: StreamChunk, prompt_len: int, n_tokens: int) -> Usage:
    """Usage from the final chunk; counts the front door saw stand in for numbers a backend left at 0."""
    return Usage.of(last.prompt_tokens or prompt_len, last.cached_tokens, last.completion_tokens or n_tokens)


def create_app(backend: ServingBackend, config: ServeConfig) -> FastAPI:
    """The front door over ``backend``. Safe to call more than once per process (metrics are shared)."""
    app = FastAPI(title="Tandem", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    door = _FrontDoor(backend, config)
    app.state.front_door = door

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), code=code,
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}", type="server_error")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await door.serve(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await door.serve(request, chat=False)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await door.models(request)

    @app.get("/health")
    async def health() -> Response:
        return await door.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return await door.metrics()

    return app
