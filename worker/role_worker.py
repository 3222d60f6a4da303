"""RoleWorker: what both roles share; its methods run on one asyncio loop (NIXL is not thread-safe)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest

from tandem.cache.tiers.factory import build_tier
from tandem.core.config import EngineConfig
from tandem.core import tracing
from tandem.engine.gie_metrics import register_gie_metrics
from tandem.engine.handle import EngineHandle
from tandem.engine.metrics import register_engine_metrics
from tandem.transfer.agent import KVTransferAgent, Region
from tandem.transfer.handoff import Handoff
from tandem.transfer.messages import Handshake, KVTransferRequest
from tandem.transfer.state import TransferState
from tandem.worker.kv_regions import KV, kv_regions

REGION = KV
IN_FLIGHT_LIMIT = 10
_POLL_S = 0.0005
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriteOutcome:
    """How a WRITE ended: DONE, FAILED, or QUARANTINED (its destination pages are never reused)."""

    state: TransferState
    nbytes: int = 0
    seconds: float = 0.0
    error: str = ""


def kv_publisher(name: str, model: str, host: str = "127.0.0.1"):
    """Worker ``name``'s KV-event publisher (vLLM's format, replay socket) on ``host``."""
    import os

    from tandem.cache.radix.events import KVEventPublisher, topic_for

    return KVEventPublisher(f"tcp://{host}:0", topic=topic_for(name, os.path.basename(model)),
                            replay_endpoint=f"tcp://{host}:0")


def role_engine(name: str, role: str, connector, config: EngineConfig | None, *, loaded=None,
                kv_events: bool = False, kv_events_host: str = "127.0.0.1"):
    """``(engine, publisher or None)``: a new engine of ``role`` running ``connector``."""
    from tandem.engine.engine import Engine

    publisher = None
    if kv_events:
        publisher = kv_publisher(name, (config or EngineConfig()).model, kv_events_host)
    engine = Engine(config or EngineConfig(), loaded=loaded, kv_events=publisher, role=role,
                    name=name, connector=connector)
    return engine, publisher


def attach_tier(engine, name: str, options: dict | None):
    """Tier ``name`` from ``options`` added to the cache; None when off or it could not start (logged)."""
    if not options:
        return None
    cache = engine.kv.cache
    if not hasattr(cache, "add_tier"):
        log.info("%s tier off: the prefix cache is disabled", name)
        return None
    tier = build_tier(name, engine.tier_site(), options)
    if tier is not None:
        cache.add_tier(tier)
    return tier


class RoleWorker:
    role = "worker"

    def __init__(self, name: str, engine, handle: EngineHandle, *, transfer_timeout_s: float,
                 agent_opts: dict | None = None):
        self.name = name
        self.engine = engine
        self.handle = handle
        tracing.setup(name)
        self.page_size = engine.kv_pool.page_size
        self.transfer_timeout_s = transfer_timeout_s
        if agent_opts is None:
            agent_opts = engine.config.transfer.model_dump()
        self.regions = kv_regions(engine)
        self.agent = KVTransferAgent(name, [Region.of(n, r.tensor, r.page_size, r.slab_dims)
                                            for n, r in self.regions.items()], **agent_opts)
        self.handoffs: dict[str, Handoff] = {}
        self.counts: dict[str, int] = {}
        self.draining = False
        self.metrics = CollectorRegistry()
        register_engine_metrics(engine, worker=name, role=self.role, registry=self.metrics)
        register_gie_metrics(engine, worker=name, role=self.role, registry=self.metrics)

    def handshake(self) -> bytes:
        """This worker's Handshake (NIXL metadata + region layout), encoded."""
        return self.agent.handshake_bytes()

    def add_peer(self, handshake: bytes) -> str:
        """Load a peer's handshake; its agent name. A peer known with the same metadata is kept as it
        is; new metadata under a known name (the peer restarted under its name) replaces the old."""
        hs = Handshake.decode(handshake)
        if self.agent.knows(hs.agent_name, hs.agent_metadata):
            return hs.agent_name
        return self.agent.connect(handshake)

    def remove_peer(self, name: str) -> None:
        """Forget a (dead) peer; transfers with it fail from now on."""
        self.agent.remove_peer(name)

    async def write_held(self, h: Handoff, req: KVTransferRequest, held) -> WriteOutcome:
        """One WRITE of ``held`` into ``req``'s pages, moving ``h`` to DONE, FAILED or QUARANTINED; returns
        only when no write is in flight (except QUARANTINED)."""
        pages = {n: (list(held.source(n)), list(req.pages(n))) for n in req.regions}
        limit = self.transfer_timeout_s * IN_FLIGHT_LIMIT
        t0 = time.monotonic()
        try:
            w = self.agent.write(req.agent_name, pages, timeout_s=limit * 2)
        except (KeyError, ValueError) as e:
            h.fail(str(e))
            return WriteOutcome(TransferState.FAILED, error=f"not posted: {e}")
        h.send()
        state = self.agent.poll(w)
        while state is TransferState.TRANSFERRING:
            if time.monotonic() - t0 > limit:
                h.fail("write still in flight")
                h.settle(in_flight=True)
                log.error("transfer %d to %s still in flight after %.0fs; quarantined",
                          h.transfer_id, req.agent_name, limit)
                self.agent.release(w)
                return WriteOutcome(TransferState.QUARANTINED, seconds=time.monotonic() - t0,
                                    error=f"still in flight after {limit:.0f}s")
            await asyncio.sleep(_POLL_S)
            state = self.agent.poll(w)
        seconds = time.monotonic() - t0
        self.agent.release(w)
        if state is not TransferState.DONE:
            h.fail(w.error or f"write ended {state.name}")
            h.settle(in_flight=False)
            return WriteOutcome(TransferState.FAILED, seconds=seconds, error=f"failed: {w.error}")
        h.land()
        return WriteOutcome(TransferState.DONE, w.nbytes, seconds)

    async def stats(self) -> dict:
        """Pool accounting (:class:`EngineSnapshot` fields), live transfers and counters."""
        snap = await self.handle.snapshot()
        return {"worker": self.name, "role": self.role, **snap.as_dict(), "draining": self.draining,
                "live_transfers": sum(h.live for h in self.handoffs.values()), **self.counts, **self._extra_stats(snap)}

    def _extra_stats(self, snap) -> dict:
        return {}

    async def debug_kv(self) -> dict:
        """Every KV slot's place, the leak count and the invariant recount's verdict."""
        snap = await self.handle.snapshot()
        try:
            await self.handle.check_invariants()
            verdict = "ok"
        except AssertionError as e:
            verdict = str(e)[:4000]
        l3 = self.engine.kv.cache.tier("l3")
        return {"worker": self.name, "role": self.role, **snap.as_dict(),
                "leaked_tokens": snap.leaked_tokens, "invariants": verdict,
                "l3": l3.as_dict() if l3 is not None else None, "pins": await self.handle.pins(),
                "live_transfers": sum(h.live for h in self.handoffs.values()), **self.counts}

    async def unpin(self, prefix_hash: str, tenant: str | None = None) -> int:
        """End the pins of prefix ``prefix_hash`` in this worker's cache; the tokens unpinned."""
        return await self.handle.unpin(prefix_hash, tenant)

    def metrics_text(self) -> bytes:
        return generate_latest(self.metrics)

    def check_alive(self) -> None:
        """Raise if the engine thread died (the cluster then replaces this worker)."""
        try:
            self.handle.check_alive()
        except RuntimeError as e:
            raise RuntimeError(f"{self.name}: {e}") from None

    def close(self) -> None:
        try:
            self.engine.shutdown()
        finally:
            self.agent.close()
