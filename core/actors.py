"""The worker actors' Protocols: :class:`RoleAPI` and :class:`KVSource`; arguments are plain data."""

from __future__ import annotations

from typing import Protocol


class RoleAPI(Protocol):
    """Every worker's actor: what cluster/ (launch, supervisor, observe, migration) calls."""

    def info(self) -> dict:
        """name, role, model_name, max_context, vocab_size, page_size, peers, kv_events, draining, ..."""

    def handshake(self) -> bytes:
        """The worker's NIXL agent metadata (a simulated one: its name)."""

    async def abort(self, rid: str, reason: str = "") -> bool:
        """Finish ``rid`` here and free its KV; False when it is not here."""

    async def stats(self) -> dict:
        """The pool accounting snapshot the dispatcher reads (capacity, waiting tokens, draining, ...)."""

    async def debug_kv(self) -> dict:
        """KV accounting and the invariant recount's verdict (GET /debug/kv)."""

    async def unpin(self, prefix_hash: str, tenant: str | None = None) -> int:
        """End the pins of prefix ``prefix_hash`` in this worker's cache; the tokens unpinned
        (DELETE /admin/cache/pins/HASH)."""

    def drain(self) -> bool:
        """Take no new requests (True)."""

    def undrain(self) -> bool:
        """Back in rotation after a drain that did not stop it (True)."""

    async def ping(self) -> str:
        """The worker's name; raises when its engine died."""

    async def progress(self, router: str | None = None, lease_s: float | None = None) -> float:
        """Seconds the engine has been in its current step; ``router`` renews that router's lease,
        of ``lease_s`` seconds (None: the worker's default)."""

    def metrics_text(self) -> bytes:
        """The worker's Prometheus exposition."""

    def shutdown(self) -> None:
        """Close the worker (before the actor is killed)."""


class KVSource(Protocol):
    """A prefill worker or a migration source: ``write_kv`` once per request, else ``drop_kv``."""

    async def write_kv(self, req_wire: dict, xfer: bytes, dst_prefix_len: int) -> bytes:
        """WRITE the KV from ``dst_prefix_len`` into ``xfer``'s pages; PrefillResult bytes once none is in flight."""

    async def drop_kv(self, rid: str, reason: str) -> None:
        """No write will be asked for ``rid``: stop computing it, or release its held KV."""
