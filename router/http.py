"""The HTTP front door: ``create_app(backend, config) -> FastAPI``."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from tandem.core import tracing
from tandem.core.config import ServeConfig
from tandem.router.anthropic import AnthropicRoutes
from tandem.router.auth import KeyRing
from tandem.router.backend import ServingBackend
from tandem.router.front_door import FrontDoor, authorize, error_response, refusal
from tandem.router.openai_protocol import APIError
from tandem.router.responses.routes import ResponsesRoutes
from tandem.router.responses.store import MemoryResponseStore
from tandem.router.routes_openai import OpenAIRoutes
from tandem.router.tokenize import TokenizeRoutes

log = logging.getLogger(__name__)

ADMIN_PREFIXES = ("/admin", "/debug")     # any path that starts so, routed or not


class AdminGate:
    """ASGI middleware: a request for a path under :data:`ADMIN_PREFIXES` goes on only with an admin
    key; anything else passes untouched."""

    def __init__(self, app, keys: KeyRing):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(ADMIN_PREFIXES):
            try:
                authorize(self.keys, Headers(scope=scope), admin=True)
            except APIError as e:
                await refusal(e)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class TraceRequests:
    """ASGI middleware (only while tracing is on): one server span per HTTP request, child of
    the client's ``traceparent`` when it sent one, current while the route runs (so the
    GenerateRequests carry it to the workers), ended when the response is."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with tracing.span(f"{scope['method']} {scope['path']}", Headers(scope=scope), server=True,
                          **{"http.request.method": scope["method"], "url.path": scope["path"]}) as sp:
            async def send_status(msg) -> None:
                if msg["type"] == "http.response.start":
                    sp.set("http.response.status_code", msg["status"])
                await send(msg)

            await self.app(scope, receive, send_status)


def create_app(backend: ServingBackend, config: ServeConfig) -> FastAPI:
    """The front door over ``backend``. Safe to call more than once per process (metrics are shared)."""

    app = FastAPI(title="Tandem", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    door = FrontDoor(backend, config)
    openai_routes, anthropic_routes = OpenAIRoutes(door), AnthropicRoutes(door)
    rc = config.responses
    store = getattr(backend, "response_store", None) or MemoryResponseStore(rc.max_stored, rc.max_bytes, rc.ttl_s)
    responses = ResponsesRoutes(door, store)
    app.state.front_door, app.state.response_store, app.state.keys = door, store, door.keys
    app.add_middleware(AdminGate, keys=door.keys)
    if tracing.enabled():
        app.add_middleware(TraceRequests)

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
        return await openai_routes.serve(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai_routes.serve(request, chat=False)

    tokenize_routes = TokenizeRoutes(door)
    app.add_api_route("/tokenize", tokenize_routes.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", tokenize_routes.detokenize, methods=["POST"])

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await anthropic_routes.serve(request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await anthropic_routes.count_tokens(request)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await responses.create(request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Response:
        return await responses.get(request, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        return await responses.delete(request, response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> Response:
        return await responses.cancel(request, response_id)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await door.models(request)

    @app.get("/health")
    async def health() -> Response:
        return await door.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return await door.metrics()

    @app.get("/debug/kv")
    async def debug_kv(request: Request) -> Response:
        """Each worker's KV accounting and invariant verdict (read-only; behind the API key)."""
        return await door.debug_kv(request)

    @app.post("/admin/drain")
    async def admin_drain(request: Request, worker: str = "", stop: bool = False) -> Response:
        """Move every live request off decode worker ``worker`` (live migration); ``stop``: then
        stop it (a rolling restart: the supervisor relaunches it). Behind the API key."""
        return await door.admin_drain(request, worker, stop)

    @app.post("/admin/undrain")
    async def admin_undrain(request: Request, worker: str = "") -> Response:
        """Put decode worker ``worker`` back in rotation after a drain without ``stop``."""
        return await door.admin_undrain(request, worker)

    @app.post("/admin/migrate")
    async def admin_migrate(request: Request, rid: str = "", to: str = "") -> Response:
        """Move running request ``rid`` to decode worker ``to`` (default: the least loaded one)."""
        return await door.admin_migrate(request, rid, to or None)

    @app.get("/admin/cache/pins")
    async def admin_pins(request: Request) -> Response:
        """Every worker's pinned prefixes, per tenant: prefix hash, tokens, tier, expiry."""
        return await door.admin_pins()

    @app.delete("/admin/cache/pins/{prefix_hash}")
    async def admin_unpin(request: Request, prefix_hash: str, tenant: str | None = None) -> Response:
        """End one pinned prefix (its ``hash`` from GET; ``tenant``: only that tenant's)."""
        return await door.admin_unpin(prefix_hash, tenant)

    @app.post("/debug/kill")
    async def debug_kill(request: Request, worker: str = "") -> Response:
        """Test lever (``debug_endpoints``): kill a worker by name, as a chaos run does."""
        return await door.debug_kill(request, worker)

    return app
