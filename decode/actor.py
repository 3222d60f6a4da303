"""Thin Ray shell around :class:`DecodeWorker` (an async actor: methods share one event loop)."""

from __future__ import annotations

import asyncio

import ray

from tandem.core.messages import GenerateRequest
from tandem.decode.leases import TICK_S, RouterLeases
from tandem.decode.worker import DecodeWorker
from tandem.core.config import WorkerOptions
from tandem.worker.actor import RayKVSource, RoleActorMixin, actor_config, actor_options


@ray.remote
class DecodeActor(RoleActorMixin):
    worker: DecodeWorker

    def __init__(self, name: str, engine_config: dict, options: WorkerOptions, loaded=None):
        """``loaded``: as for PrefillActor (shared CPU weights, or None to load here)."""
        self.worker = DecodeWorker(name, actor_config(engine_config), loaded=loaded,
                                   options=actor_options(options))
        print(f"tandem: {self.worker.engine.startup_line}", flush=True)   # Ray forwards it to the driver
        self.prefills: dict[str, RayKVSource] = {}
        self.sources: dict[str, RayKVSource] = {}
        self.leases = RouterLeases()
        self._lease_task: asyncio.Task | None = None

    def add_prefill(self, handshake: bytes, handle) -> str:
        name = self.worker.add_peer(handshake)
        if name not in self.prefills or self.prefills[name].dead or self.prefills[name].handle != handle:
            me = RayKVSource(self.worker.name, ray.get_runtime_context().current_actor)
            self.prefills[name] = RayKVSource(name, handle, me)   # new, or restarted under its name
        return name

    def add_decode(self, handshake: bytes, handle) -> str:
        """Another decode worker: a peer a migrated request's KV may come from (or go to)."""
        name = self.worker.add_peer(handshake)
        if name not in self.sources or self.sources[name].dead or self.sources[name].handle != handle:
            self.sources[name] = RayKVSource(name, handle)
        return name

    def remove_decode(self, name: str) -> None:
        self.sources.pop(name, None)
        self.worker.remove_peer(name)

    async def freeze(self, rid: str) -> bool:
        """Live migration, source side: ``rid``'s stream ends "migrated", its KV held."""
        await self.worker.freeze(rid)
        return True

    async def write_kv(self, req_wire: dict, xfer: bytes, dst_prefix_len: int) -> bytes:
        """KVSource: a frozen request's or a pushed sequence's held KV, into the target's pages."""
        return (await self.worker.write_kv(req_wire, xfer, dst_prefix_len)).encode()

    async def drop_kv(self, rid: str, reason: str) -> None:
        """KVSource: no copy of held ``rid`` will be asked (:meth:`release_frozen`)."""
        self.worker.release_frozen(rid)

    def release_frozen(self, rid: str) -> None:
        self.worker.release_frozen(rid)

    def remove_prefill(self, name: str) -> None:
        self.prefills.pop(name, None)
        self.worker.remove_peer(name)

    async def progress(self, router: str | None = None, lease_s: float | None = None) -> float:
        """The supervisor's heartbeat (RoleActorMixin's), which also renews ``router``'s lease
        (of ``lease_s`` seconds; None: the default)."""
        if router is not None:
            self.leases.renew(router, lease_s)
        return await super().progress()

    async def _watch_leases(self) -> None:
        while self.leases.streams:
            await asyncio.sleep(TICK_S)
            for rid in self.leases.expired():
                print(f"tandem: {self.worker.name}: aborting {rid}: its router stopped renewing its lease", flush=True)
                await self.worker.abort(rid, "its router went away")

    async def generate(self, req_wire: dict, prefill_name: str | None, router: str | None = None):
        """``router``: the calling router's id; None: no lease."""
        greq = GenerateRequest.from_wire(req_wire)
        self.leases.open(greq.rid, router)
        if router is not None and (self._lease_task is None or self._lease_task.done()):
            self._lease_task = asyncio.ensure_future(self._watch_leases())
        inner = self._generate(greq, prefill_name)
        try:
            async for chunk in inner:
                yield chunk
        finally:
            await inner.aclose()
            self.leases.close(greq.rid)

    async def _generate(self, greq: GenerateRequest, prefill_name: str | None):
        if greq.resume is not None:   # a migrated request: prefill_name names the decode worker it left
            client = self.sources.get(prefill_name) if prefill_name else None
            chunks = self.worker.generate(greq, None if client is None or client.dead else client)
            try:
                async for chunk in chunks:
                    yield chunk
            finally:
                await chunks.aclose()
            return
        client = self.prefills.get(prefill_name) if prefill_name else None
        if client is not None and client.dead:
            client = next((c for c in self.prefills.values() if not c.dead), None)
        chunks = self.worker.generate(greq, client, self._alternate)
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()

    def _alternate(self, dead: str):
        live = [c for n, c in self.prefills.items() if n != dead and not c.dead]
        return live[0] if live else None
