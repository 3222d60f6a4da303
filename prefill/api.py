"""The prefill actor's API: :class:`PrefillAPI` (cluster/ calls it) and core's ``KVSource``
(decode workers call it). prefill/actor.py's ``PrefillActor`` implements both; sim/actor.py's
``SimPrefillActor`` implements PrefillAPI."""

from __future__ import annotations

from typing import Protocol

from tandem.core.actors import RoleAPI


class PrefillAPI(RoleAPI, Protocol):
    def add_peer(self, handshake: bytes) -> str:
        """A decode worker it may write to (its NIXL agent); returns its name."""

    def remove_peer(self, name: str) -> None:
        """Forget decode worker ``name`` (dead or gone)."""
