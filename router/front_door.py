"""FrontDoor: what every route of the HTTP front door shares, bound to one backend and config."""


from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import jinja2
from fastapi import Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from tandem.core import tracing
from tandem.core.config import ServeConfig
from tandem.core.messages import GenerateRequest
from tandem.core.page_hash import cache_salt
from tandem.core.types import TandemError
from tandem.router import metrics as m
from tandem.router.auth import KeyRing, Principal
from tandem.router.backend import AdminBackend, KVDebugBackend, PinBackend, ServingBackend
from tandem.router.openai_protocol import APIError, ErrorBody, ErrorResponse
from tandem.router.openai_responses import ModelCard, ModelList
from tandem.router.sessions import SessionIdTooLong
from tandem.router.sessions import session_key as _session_key
from tandem.router.tools.formats import ToolFormat, choose_format

log = logging.getLogger(__name__)

BODY_READ_TIMEOUT_S = 30.0      # a client that stalls mid-body gets 408
DRAIN_LIMIT_BYTES = 64 << 20    # read (and drop) this much of an oversized body so the client sees 413
HEALTH_TIMEOUT_S = 10.0

# chat templates raise jinja2 errors for conversations they refuse (jinja2 is a dependency)
TEMPLATE_ERRORS = (TandemError, ValueError, TypeError, LookupError, jinja2.TemplateError)


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   type: str = "invalid_request_error", headers: Mapping[str, str] | None = None) -> Response:
    """An OpenAI error object."""
    body = ErrorResponse(error=ErrorBody(message=message, type=type, param=param, code=code))
    return Response(body.model_dump_json(), status_code=status, media_type="application/json",
                    headers=dict(headers or {}))


def refusal(e: APIError) -> Response:
    return error_response(e.status, e.message, param=e.param, code=e.code, type=e.type,
                          headers={"WWW-Authenticate": "Bearer"} if e.status == 401 else e.headers)


def start_failed(e, rid: str) -> Response:
    """The OpenAI-shaped answer to a generation that could not start (streaming.StartFailed)."""
    if e.kind == "gone":
        return Response(status_code=499)   # nobody is listening; metered() already aborted
    if e.kind == "invalid":
        return error_response(400, e.message)
    if e.kind == "overloaded":   # every worker is past its admission limits
        return error_response(429, e.message, code="overloaded", type="rate_limit_error",
                              headers={"Retry-After": str(e.retry_after_s), "X-Request-Id": rid})
    return error_response(500, e.message, type="server_error")


def session_key(headers: Mapping[str, str], body: Mapping[str, Any], prompt_ids=()) -> str | None:
    """router/sessions.py's session_key, with a too-long id as a 400."""
    try:
        return _session_key(headers, body, prompt_ids)
    except SessionIdTooLong as e:
        raise APIError(400, str(e), param="session_id") from None


MAX_PRIORITY = 1_000_000


def request_priority(headers: Mapping[str, str], body: Mapping[str, Any]) -> int:
    """The request's priority in the deferred-dispatch queue: body ``priority``, else header
    ``X-Request-Priority``; an int, lower first, default 0. Anything else is a 400 naming the
    field."""
    raw, param = body.get("priority"), "priority"
    if raw is None:
        raw, param = headers.get("x-request-priority"), "X-Request-Priority"
        if raw is None:
            return 0
        try:
            raw = int(str(raw).strip())
        except ValueError:
            raise APIError(400, f"{param} must be an integer, got {raw!r}"[:200], param=param) from None
    if isinstance(raw, bool) or not isinstance(raw, int) or abs(raw) > MAX_PRIORITY:
        raise APIError(400, f"{param} must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {raw!r}"[:200],
                       param=param)
    return raw


class FrontDoor:
    """What the routes share, bound to one backend and config."""

    def __init__(self, backend: ServingBackend, config: ServeConfig):
        self.backend, self.config = backend, config
        self.created = int(time.time())
        self.keys = KeyRing(config.api_key, config.api_keys)
        self.tool_format: ToolFormat = choose_format(
            config.tool_parser, getattr(backend.tokenizer, "chat_template", None))

    def check_auth(self, request: Request, admin: bool = False) -> Principal:
        """The caller of ``request``: 401 without a known key; with ``admin``, 403 for a user key.
        """
        return authorize(self.keys, request.headers, admin)

    def admit(self, who: Principal, greqs: list[GenerateRequest], body: Mapping[str, Any]) -> list[GenerateRequest]:
        """``greqs`` of one HTTP request stamped with who asked: the tenant, its cache salt (the
        tenant's unless ``isolate_tenants`` is off, narrowed by the body's
        ``cache_salt``) and the trace context the workers continue (the router's HTTP
        span, when tracing is on). 429 with Retry-After when the tenant is over its rate
        limit."""
        own = body.get("cache_salt")
        if own is not None and (not isinstance(own, str) or not 0 < len(own) <= 256):
            raise APIError(400, "cache_salt must be a non-empty string of at most 256 characters",
                           param="cache_salt")
        prompt = len(greqs[0].prompt_ids) if greqs else 0
        wait = self.keys.charge(who.tenant, 1, prompt)
        m.count_tenant(who.label, "requests")
        if wait:
            m.count_tenant(who.label, "rate_limited")
            raise APIError(429, f"tenant {who.label!r} is over its rate limit; retry in {wait} s",
                           code="rate_limit_exceeded", type="rate_limit_error", reason="rate_limited",
                           headers={"Retry-After": str(wait)})
        salt = cache_salt(who.tenant if self.config.isolate_tenants else None, own)
        trace = tracing.current()
        if who.pin_tokens is not None and any(g.pins for g in greqs):
            greqs = [replace(g, pin_cap=who.pin_tokens) for g in greqs]
        if not (who.tenant or salt or trace):
            return greqs
        return [replace(g, tenant=who.tenant, cache_salt=salt, trace=trace) for g in greqs]

    def check_model(self, name: str) -> None:
        if name != self.backend.model_name:
            raise APIError(404, f"The model `{name[:256]}` does not exist (serving "
                                f"`{self.backend.model_name}`).", param="model",
                           code="model_not_found", reason="model_not_found")

    def check_prompt(self, n: int, chat: bool) -> int:
        """Room left for output after an ``n``-token prompt (400 when there is none)."""
        ctx = self.backend.max_context
        if n == 0:
            raise APIError(400, "the prompt is empty", param="messages" if chat else "prompt")
        if n >= ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens, but the prompt "
                                f"has {n} tokens (at least 1 token must be left to generate).",
                           param="messages" if chat else "prompt", code="context_length_exceeded",
                           reason="context_length")
        return ctx - n

    def output_budget(self, n: int, asked: int | None, default: int | None, chat: bool,
                      param: str = "max_tokens") -> int:
        """``max_tokens`` for an ``n``-token prompt: what was asked, when it fits; when nothing was
        asked, ``default`` within the room left (None: all of it)."""
        room = self.check_prompt(n, chat)
        if asked is None:
            return room if default is None else min(default, room)
        if asked > room:
            ctx = self.backend.max_context
            where = "messages" if chat else "prompt"
            raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, you "
                                f"requested {n + asked} tokens ({n} in the {where}, {asked} in the "
                                f"completion). Please reduce the length of the {where} or completion.",
                           param=param, code="context_length_exceeded", reason="context_length")
        return asked

    def render(self, render_fn) -> list[int]:
        """Token ids of the chat prompt ``render_fn(tokenizer) -> text`` (400 when the template refuses)."""
        tok = self.backend.tokenizer
        try:
            text = render_fn(tok)
        except TEMPLATE_ERRORS as e:
            raise APIError(400, f"the chat template refused these messages: {str(e)[:300]}",
                           param="messages") from None
        return list(tok.encode(text, add_special_tokens=False))

    async def read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
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

    async def models(self, request: Request) -> Response:
        try:
            self.check_auth(request)
        except APIError as e:
            return refusal(e)
        card = ModelCard(id=self.backend.model_name, created=self.created, max_model_len=self.backend.max_context,
                         speculative=getattr(self.backend, "speculative", None))
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

    async def debug_kv(self, request: Request) -> Response:
        """``{"workers": [...], "migrations": [...]}``: each worker's KV accounting (free /
        evictable / locked / request-owned / leaked tokens, host pool use, queues) and
        its invariant verdict; the live migrations in flight (backends that move
        requests); the requests in flight with their worker, tokens streamed and seconds
        since the last one (backends that track it)."""
        if not isinstance(self.backend, KVDebugBackend):
            return error_response(404, "this backend has no KV pools to inspect", code="not_found")
        out = {"workers": await self.backend.debug_kv()}
        if isinstance(self.backend, AdminBackend):   # live migrations and requests in flight
            out["migrations"] = self.backend.migrations()
            out["requests"] = self.backend.in_flight()
        return JSONResponse(out)

    async def admin_pins(self) -> Response:
        """``{"tenants": {tenant: [{"hash", "tokens", "tier", "expires_in_s", "worker"}]},
        "pinned_tokens": {tenant: {worker: tokens}}, "hits", "refused"}``: every worker's pinned
        prefixes (GET /admin/cache/pins; a worker that does not answer is left out)."""
        if not isinstance(self.backend, KVDebugBackend):
            return error_response(404, "this backend has no prefix cache to inspect", code="not_found")
        tenants: dict = {}
        tokens: dict = {}
        hits = refused = 0
        for w in await self.backend.debug_kv():
            pins = w.get("pins")
            if not pins:
                continue
            for p in pins["prefixes"]:
                tenants.setdefault(p["tenant"], []).append({**{k: v for k, v in p.items() if k != "tenant"},
                                                            "worker": w["worker"]})
            for t, n in pins["tokens"].items():
                tokens.setdefault(t, {})[w["worker"]] = n
            hits, refused = hits + pins["hits"], refused + pins["refused"]
        return JSONResponse({"tenants": tenants, "pinned_tokens": tokens, "hits": hits, "refused": refused})

    async def admin_unpin(self, prefix_hash: str, tenant: str | None) -> Response:
        """End the pins of prefix ``prefix_hash`` (GET's ``hash``) on every worker: ``{"unpinned":
        tokens}``, 404 when no worker held it."""
        if not isinstance(self.backend, PinBackend):
            return error_response(404, "this backend has no prefix cache", code="not_found")
        n = await self.backend.unpin(prefix_hash, tenant)
        if not n:
            return error_response(404, f"no pinned prefix {prefix_hash[:64]!r}", param="hash", code="not_found")
        return JSONResponse({"unpinned": n})

    async def debug_kill(self, request: Request, worker: str) -> Response:
        """Kill worker ``worker`` (a chaos lever): 404 unless ``debug_endpoints`` is on."""
        if not self.config.debug_endpoints:
            return error_response(404, "debug endpoints are off (tandem serve --debug-endpoints)",
                                  code="not_found")
        if not isinstance(self.backend, AdminBackend) or not await self.backend.debug_kill(worker):
            return error_response(404, f"no live worker named {worker!r}", param="worker", code="not_found")
        return JSONResponse({"killed": worker})


    async def admin_drain(self, request: Request, worker: str, stop: bool = False) -> Response:
        """POST /admin/drain: every live request off decode worker ``worker``; ``stop``: then stop
        it (the supervisor relaunches it)."""
        return await self._admin(request, "drain", lambda b: b.drain(worker, stop=stop))

    async def admin_undrain(self, request: Request, worker: str) -> Response:
        """POST /admin/undrain: decode worker ``worker`` back in rotation."""
        return await self._admin(request, "undrain", lambda b: b.undrain(worker))

    async def admin_migrate(self, request: Request, rid: str, to: str | None = None) -> Response:
        """POST /admin/migrate: one running request to another decode worker."""
        async def move(b: AdminBackend) -> dict:
            return {"rid": rid, "to": await b.migrate(rid, to)}

        return await self._admin(request, "migrate", move)

    async def _admin(self, request: Request, verb: str, call) -> Response:
        if not isinstance(self.backend, AdminBackend):
            return error_response(404, f"this backend cannot {verb} (live migration needs decode workers)",
                                  code="not_found")
        try:
            out = await call(self.backend)
        except LookupError as e:
            return error_response(404, str(e), code="not_found")
        except ValueError as e:
            return error_response(409, str(e), code="conflict")
        return JSONResponse(out)

def bearer(headers: Mapping[str, str]) -> str:
    """The key a client sent: ``Authorization: Bearer <key>``, else ``x-api-key`` (Anthropic's)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else headers.get("x-api-key", "")


def authorize(keys: KeyRing, headers: Mapping[str, str], admin: bool = False) -> Principal:
    """The principal of the key in ``headers``: APIError 401 when unknown, 403 when ``admin`` is
    needed and the key is a user's."""
    who = keys.who(bearer(headers))
    if who is None:
        raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                       code="invalid_api_key", reason="unauthorized")
    if admin and not who.admin:
        raise APIError(403, "this route needs an admin key", code="forbidden", type="permission_error",
                       reason="forbidden")
    return who


def _too_large(size: int, limit: int, at_least: bool = False) -> APIError:
    return APIError(413, f"request body is {'over ' if at_least else ''}{size} bytes; the limit is "
                         f"{limit} bytes", code="request_too_large", reason="too_large")


async def _drain(request: Request) -> None:
    seen = 0
    try:
        async with asyncio.timeout(5.0):
            async for part in request.stream():
                seen += len(part)
                if seen > DRAIN_LIMIT_BYTES:
                    return
    except Exception:  # the client vanished or stalled: nothing to protect
        return


