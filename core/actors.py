"""The actors' Protocols: the workers' :class:`RoleAPI` and :class:`KVSource`, the cluster's
:class:`ResponseStoreAPI` and :class:`PlannerLeaseAPI`; arguments are plain data."""

from __future__ import annotations

from typing import Any, Protocol


class RoleAPI(Protocol):
    """Every worker's actor: what cluster/ (launch, supervisor, observe, migration) calls."""

    def info(self) -> dict[str, Any]:
        """name, role, model_name, max_context, vocab_size, page_size, peers, kv_events, draining, ..."""

    def handshake(self) -> bytes:
        """The worker's NIXL agent metadata (a simulated one: its name)."""

    async def abort(self, rid: str, reason: str = "") -> bool:
        """Finish ``rid`` here and free its KV; False when it is not here."""

    async def stats(self) -> dict[str, Any]:
        """The pool accounting snapshot the dispatcher reads (capacity, waiting tokens, draining, ...)."""

    async def debug_kv(self) -> dict[str, Any]:
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

    async def write_kv(self, req_wire: dict[str, Any], xfer: bytes, dst_prefix_len: int) -> bytes:
        """WRITE the KV from ``dst_prefix_len`` into ``xfer``'s pages; PrefillResult bytes once none is in flight."""

    async def drop_kv(self, rid: str, reason: str) -> None:
        """No write will be asked for ``rid``: stop computing it, or release its held KV."""


class ResponseStoreAPI(Protocol):
    """The Responses API's store (cluster/responses.py): one detached actor; records are
    ``StoredResponse.to_wire()`` dicts."""

    def put(self, wire: dict[str, Any], unless_cancelled: bool = False) -> dict[str, Any]:
        """Store ``wire`` (replacing a record of its id); what is stored afterwards (the cancelled
        record, with ``unless_cancelled``, when the id was cancelled meanwhile)."""

    def get(self, rid: str) -> dict[str, Any] | None:
        """The record, or None (never stored, deleted, evicted or expired)."""

    def delete(self, rid: str) -> bool:
        """Drop the record; whether there was one."""

    def cancel(self, rid: str) -> dict[str, Any] | None:
        """Mark a queued / in-progress record "cancelled" and return it; None when there is none."""

    def stats(self) -> dict[str, Any]:
        """Records and bytes held, records evicted."""


class PlannerLeaseAPI(Protocol):
    """The planner's leadership (cluster/autoscaler.py): one detached actor; one router plans."""

    def acquire(self, who: str, ttl_s: float) -> bool:
        """``who`` holds the lease for ``ttl_s`` more seconds (True), unless another holds it."""

    def release(self, who: str) -> None:
        """``who`` gives the lease up (nothing when it does not hold it)."""
