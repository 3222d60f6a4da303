"""What the HTTP front door needs from whatever serves the model: :class:`ServingBackend`."""

from __future__ import annotations

import inspect
from collections.abc import AsyncGenerator
from typing import Any, Protocol, runtime_checkable

from prometheus_client import REGISTRY, generate_latest

from tandem.core.messages import GenerateRequest
from tandem.core.types import StreamChunk


@runtime_checkable
class ServingBackend(Protocol):
    """The serving side of the front door. Contract:

    - ``model_name``: the id clients put in ``"model"`` (and /v1/models lists).
    - ``max_context``: tokens of prompt + output one request may hold.
    - ``tokenizer``: ``encode(text, add_special_tokens=False) -> list[int]``,
      ``apply_chat_template(messages, add_generation_prompt=True) -> str`` (core/tokenizer.py);
      ``vocab_size`` is used to reject out-of-range prompt ids when present.
    - ``generate(req)``: an async generator of StreamChunk for ``req.rid``. Exactly one chunk carries
      a finish_reason and it is the last; it also carries prompt_tokens / cached_tokens /
      completion_tokens (the first token's chunk should carry prompt_tokens / cached_tokens too:
      streamed usage is stated up front from it, falling back to the final chunk's). A request the backend refuses raises :class:`InvalidRequest` on the first
      ``__anext__`` (the front door answers 400); a failure after that is a final chunk with
      finish_reason "abort" and ``error`` set.
    - ``abort(rid)``: finish ``rid`` and free its KV; a no-op for unknown or finished ids. The front
      door calls it whenever it stops consuming ``generate`` before the final chunk (client gone).
    - ``health()``: a JSON-able dict with ``"status": "ok"`` when serving (anything else -> 503).
    - ``metrics_text()``: Prometheus text exposition for the whole deployment (may block; the front
      door calls it off the event loop).
    - optional: ``speculative``, the engines' speculative decoding status (/v1/models says it);
      :class:`KVDebugBackend` (GET /debug/kv), :class:`AdminBackend` (POST /admin/*,
      /debug/kill and the live state /debug/kv adds); the front door checks ``isinstance``.
    """

    model_name: str
    max_context: int
    tokenizer: Any

    def generate(self, req: GenerateRequest) -> AsyncGenerator[StreamChunk, None]: ...

    async def abort(self, rid: str) -> None: ...

    async def health(self) -> dict: ...

    def metrics_text(self) -> bytes: ...


@runtime_checkable
class KVDebugBackend(Protocol):
    async def debug_kv(self) -> list[dict]:
        """Per worker: its KV accounting (EngineSnapshot fields, ``leaked_tokens``) and the
        invariant recount's verdict (GET /debug/kv)."""


@runtime_checkable
class PinBackend(Protocol):
    async def unpin(self, prefix_hash: str, tenant: str | None = None) -> int:
        """End the pins of prefix ``prefix_hash`` (only ``tenant``'s when given) on every worker;
        the tokens unpinned (DELETE /admin/cache/pins/HASH). GET lists them from
        :meth:`KVDebugBackend.debug_kv`'s ``"pins"``."""


@runtime_checkable
class AdminBackend(Protocol):
    """An operator's levers on a backend whose requests can move between decode workers (live
    migration). The verbs raise LookupError (no such request or worker: 404) or ValueError (not
    movable now: 409)."""

    async def migrate(self, rid: str, to: str | None = None) -> str:
        """Move running ``rid`` to decode worker ``to`` (None: the best one); the target's name."""

    async def drain(self, name: str, stop: bool = False) -> dict:
        """Every live request off decode worker ``name``; ``stop``: then stop it (a restart)."""

    async def undrain(self, name: str) -> dict:
        """Decode worker ``name`` back in rotation after a drain without ``stop``."""

    async def debug_kill(self, name: str) -> bool:
        """Kill worker ``name`` (a chaos lever; POST /debug/kill); False: no live worker of that name."""

    def migrations(self) -> list[dict]:
        """The live migrations in flight (GET /debug/kv): rid, from, to, reason, phase, age."""

    def in_flight(self) -> list[dict]:
        """The requests in flight with their worker, tokens streamed and seconds since the last one."""

class LocalEngineBackend:
    """Colocated mode: the in-process ``tandem.engine.engine.Engine`` behind the protocol."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.model_name: str = engine.model_name
        self.max_context: int = int(engine.max_context)
        self.speculative: str | None = getattr(engine, "spec_status", None)
        self.tokenizer = engine.tokenizer

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[StreamChunk, None]:
        async for chunk in self.engine.stream(req):
            yield chunk

    async def abort(self, rid: str) -> None:
        result = self.engine.abort(rid)
        if inspect.isawaitable(result):
            await result

    async def health(self) -> dict:
        dead = getattr(self.engine, "error", None)  # set when the engine thread crashed
        return {"status": "ok" if dead is None else "error", "mode": "colocated",
                "model": self.model_name, **({"error": repr(dead)} if dead is not None else {})}

    def metrics_text(self) -> bytes:
        return generate_latest(REGISTRY)

    async def debug_kv(self) -> list[dict]:
        """The engine's KV accounting and invariant verdict (GET /debug/kv)."""
        import asyncio

        snapshot = getattr(self.engine, "snapshot", None)
        if snapshot is None:
            return []
        snap = await asyncio.to_thread(snapshot)
        try:
            await asyncio.to_thread(self.engine.check_invariants)
            verdict = "ok"
        except AssertionError as e:
            verdict = str(e)[:4000]
        out = {"worker": "colocated-0", "role": "colocated", **snap.as_dict(),
               "leaked_tokens": snap.leaked_tokens, "invariants": verdict}
        if hasattr(self.engine, "pins"):
            out["pins"] = await asyncio.to_thread(self.engine.pins)
        return [out]

    async def unpin(self, prefix_hash: str, tenant: str | None = None) -> int:
        import asyncio

        return await asyncio.wrap_future(self.engine.unpin(prefix_hash, tenant))
