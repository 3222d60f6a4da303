"""The decode actor's API: :class:`DecodeAPI` (cluster/ calls it) and core's ``KVSource`` (another
decode worker calls it for a migrated request's KV). decode/actor.py's ``DecodeActor`` implements
both; sim/actor.py's ``SimDecodeActor`` implements DecodeAPI (its ``freeze`` refuses)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from tandem.core.actors import RoleAPI


class DecodeAPI(RoleAPI, Protocol):
    def add_prefill(self, handshake: bytes, handle: Any) -> str:
        """A prefill worker (its NIXL agent and actor handle, a KVSource); returns its name."""

    def remove_prefill(self, name: str) -> None:
        """Forget prefill worker ``name``."""

    def add_decode(self, handshake: bytes, handle: Any) -> str:
        """Another decode worker: a KVSource a migrated request's KV comes from; returns its name."""

    def remove_decode(self, name: str) -> None:
        """Forget decode worker ``name``."""

    def generate(self, req_wire: dict, prefill_name: str | None, router: str | None = None) -> AsyncIterator:
        """Stream the request's StreamChunks (call with ``num_returns="streaming"``); ``prefill_name``:
        the KVSource of its KV (None: compute it here); ``router``: the caller's lease."""

    async def freeze(self, rid: str) -> bool:
        """Live migration's stop: ``rid``'s stream here ends "migrated", its KV held for a
        ``write_kv``; ValueError, changing nothing, when it is not decoding here."""

    def release_frozen(self, rid: str) -> None:
        """No copy of frozen ``rid`` will come: its KV goes to this worker's cache."""
