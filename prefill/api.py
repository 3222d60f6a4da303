"""The prefill actor's API: :class:`PrefillAPI` (cluster/ calls it; a decode worker calls its
``store_kv``) and core's ``KVSource`` (decode workers call it). prefill/actor.py's
``PrefillActor`` implements both; sim/actor.py's ``SimPrefillActor`` implements PrefillAPI."""

from __future__ import annotations

from typing import Any, Protocol

from tandem.core.actors import RoleAPI
from tandem.worker.kv_flow_types import KVSource


class PrefillAPI(RoleAPI, Protocol):
    def add_peer(self, handshake: bytes) -> str:
        """A decode worker it may write to (its NIXL agent); returns its name."""

    def remove_peer(self, name: str) -> None:
        """Forget decode worker ``name`` (dead or gone)."""

    async def store_kv(self, req_wire: dict[str, Any], source: KVSource) -> int:
        """Reply push (prefill/store.py): reserve pages past this cache's match for ``req_wire``'s
        sequence, have ``source`` (the decode actor holding it, as worker/actor.py's
        ``RayKVSource``) write them, cache it; the tokens received (0: nothing moved)."""
