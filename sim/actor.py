"""Thin Ray shells around the simulated workers, implementing the real workers' actor Protocols
(``freeze`` refuses: simulated workers do not migrate; ``store_kv`` takes nothing: they push no
replies), and the simulated prefill's own verb, :class:`SimPrefillAPI` (a simulated decode
actor calls it through :class:`_RemotePrefill`, the only module naming it).
"""

from __future__ import annotations

from typing import Any, Protocol

import ray

from tandem.core.config import ServeConfig
from tandem.core.messages import GenerateRequest
from tandem.sim.remote import SimDecodeRole, SimPrefillRole


class _Shell:
    role: SimPrefillRole | SimDecodeRole    # the subclass's

    def handshake(self) -> bytes:
        return self.role.name.encode()

    def add_peer(self, handshake: bytes) -> str:
        return handshake.decode()

    def remove_peer(self, name: str) -> None:
        pass

    def stats(self) -> dict:
        return self.role.stats()

    def debug_kv(self) -> dict:
        return self.role.debug_kv()

    def unpin(self, prefix_hash: str, tenant: str | None = None) -> int:
        """Simulated workers take no pins."""
        return 0

    def ping(self) -> str:
        return self.role.name

    def progress(self, router: str | None = None, lease_s: float | None = None) -> float:
        """The supervisor's heartbeat (a simulated step never hangs)."""
        return 0.0

    def drain(self) -> bool:
        self.role.draining = True
        return True

    def undrain(self) -> bool:
        self.role.draining = False
        return True

    async def abort(self, rid: str, reason: str = "") -> bool:
        return False

    def metrics_text(self) -> bytes:
        return self.role.metrics_text()

    def shutdown(self) -> None:
        self.role.close()


class SimPrefillAPI(Protocol):
    """What a simulated decode actor calls on a simulated prefill actor (beside ``PrefillAPI``)."""

    async def prefill(self, req_wire: dict[str, Any]) -> dict[str, Any]:
        """The simulated prefill of ``req_wire``: its result as plain data (sim/remote.py)."""


@ray.remote
class SimPrefillActor(_Shell):
    role: SimPrefillRole
    def __init__(self, name: str, serve_config: dict, kv_events: bool = False, _tokenizer=None):
        cfg = ServeConfig.model_validate(serve_config)
        pub = None
        if kv_events:
            from tandem.cache.radix.events import KVEventPublisher, topic_for

            host = ray.util.get_node_ip_address()
            pub = KVEventPublisher(f"tcp://{host}:0", topic=topic_for(name, cfg.engine_config.model),
                                   replay_endpoint=f"tcp://{host}:0")
        self.role = SimPrefillRole(name, cfg, pub)

    def info(self) -> dict:
        pub = self.role.publisher
        return self.role.info(kv_events=pub.endpoint if pub else None,
                              kv_replay=pub.replay_endpoint if pub else None,
                              node_id=ray.get_runtime_context().get_node_id(), vocab_size=0)

    async def prefill(self, req_wire: dict, *_ignored) -> dict:
        return await self.role.prefill(req_wire)

    async def store_kv(self, req_wire: dict, source: Any) -> int:
        """Simulated workers push no replies: nothing is received."""
        return 0


class _RemotePrefill:
    """``SimPrefillAPI`` over a simulated prefill actor's handle."""

    def __init__(self, handle):
        self.handle = handle

    async def prefill(self, req_wire: dict) -> dict:
        return await self.handle.prefill.remote(req_wire)


@ray.remote
class SimDecodeActor(_Shell):
    role: SimDecodeRole
    def __init__(self, name: str, serve_config: dict, kv_events: bool = False, tokenizer=None):
        self.role = SimDecodeRole(name, ServeConfig.model_validate(serve_config), tokenizer)
        self.prefills: dict[str, _RemotePrefill] = {}
        self.decodes: set[str] = set()

    def info(self) -> dict:
        return self.role.info(kv_events=None, kv_replay=None, peers=sorted(self.prefills) + sorted(self.decodes),
                              node_id=ray.get_runtime_context().get_node_id(),
                              vocab_size=int(self.role.tokenizer.vocab_size))

    def add_prefill(self, handshake: bytes, handle) -> str:
        name = handshake.decode()
        self.prefills.setdefault(name, _RemotePrefill(handle))
        return name

    def remove_prefill(self, name: str) -> None:
        self.prefills.pop(name, None)

    def add_decode(self, handshake: bytes, handle) -> str:
        self.decodes.add(handshake.decode())
        return handshake.decode()

    def remove_decode(self, name: str) -> None:
        self.decodes.discard(name)

    async def freeze(self, rid: str) -> bool:
        raise ValueError(f"simulated decode worker {self.role.name} does not migrate requests")

    def release_frozen(self, rid: str) -> None:
        pass

    async def generate(self, req_wire: dict, prefill_name: str | None, router: str | None = None):
        client = self.prefills.get(prefill_name) if prefill_name else None
        async for c in self.role.generate(GenerateRequest.from_wire(req_wire), client):
            yield c
