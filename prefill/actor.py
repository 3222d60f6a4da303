"""Thin Ray shell around :class:`PrefillWorker` (an async actor: methods share one event loop)."""

from __future__ import annotations

import ray

from tandem.core.config import WorkerOptions
from tandem.prefill.worker import PrefillWorker
from tandem.worker.actor import RoleActorMixin, actor_config, actor_options
from tandem.worker.kv_flow_types import KVSource


@ray.remote
class PrefillActor(RoleActorMixin):
    worker: PrefillWorker

    def __init__(self, name: str, engine_config: dict, options: WorkerOptions, loaded=None):
        """``loaded``: the shared CPU weights, or None to load here."""
        self.worker = PrefillWorker(name, actor_config(engine_config), loaded=loaded,
                                    options=actor_options(options))
        print(f"tandem: {self.worker.engine.startup_line}", flush=True)

    def add_peer(self, handshake: bytes) -> str:
        return self.worker.add_peer(handshake)

    def remove_peer(self, name: str) -> None:
        self.worker.remove_peer(name)

    async def write_kv(self, req_wire: dict, xfer: bytes, dst_prefix_len: int) -> bytes:
        """KVSource: compute the request's KV and write it into the decode worker's pages."""
        return (await self.worker.prefill(req_wire, xfer, dst_prefix_len)).encode()

    async def store_kv(self, req_wire: dict, source: KVSource) -> int:
        """Reply push (prefill/store.py): receive the sequence ``source`` (a KVSource: the decode
        actor holding it, wrapped by worker/actor.py's ``RayKVSource``) holds and cache it; the tokens received."""
        return await self.worker.store(req_wire, source)

    async def drop_kv(self, rid: str, reason: str) -> None:
        """KVSource: the decode worker will not take ``rid``'s KV: stop it here."""
        await self.abort(rid, reason)
