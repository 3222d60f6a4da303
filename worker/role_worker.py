"""RoleWorker: what both roles share; its methods run on one asyncio loop (NIXL is not thread-safe)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest

from tandem.cache.tiers.factory import build_tier
from tandem.core.config import EngineConfig, WorkerOptions
from tandem.core import tracing
from tandem.core.kv_messages import Handshake
from tandem.engine.gie_metrics import register_gie_metrics
from tandem.engine.metrics import register_engine_metrics
from tandem.transfer.agent import KVTransferAgent, Region
from tandem.worker.kv_flow import KVReceiver, KVSender
from tandem.worker.kv_regions import kv_regions
from tandem.worker.receiving import ReceivingHandle

if TYPE_CHECKING:
    from tandem.cache.radix.events import KVEventPublisher
    from tandem.cache.tiers.base import KVTier
    from tandem.engine.connector import KVConnector
    from tandem.engine.engine import Engine
    from tandem.engine.queries import EngineSnapshot

log = logging.getLogger(__name__)


def kv_publisher(name: str, model: str, host: str = "127.0.0.1") -> KVEventPublisher:
    """Worker ``name``'s KV-event publisher (vLLM's format, replay socket) on ``host``."""
    import os

    from tandem.cache.radix.events import KVEventPublisher, topic_for

    return KVEventPublisher(f"tcp://{host}:0", topic=topic_for(name, os.path.basename(model)),
                            replay_endpoint=f"tcp://{host}:0")


def role_engine(name: str, role: str, connector: type[KVConnector], config: EngineConfig | None,
                options: WorkerOptions, *, loaded: Any = None) -> tuple[Engine, KVEventPublisher | None]:
    """``(engine, publisher or None)``: a new engine of ``role`` running ``connector``."""
    from tandem.engine.engine import Engine

    publisher = None
    if options.kv_events:
        publisher = kv_publisher(name, (config or EngineConfig()).model, options.kv_events_host)
    engine = Engine(config or EngineConfig(), loaded=loaded, kv_events=publisher, role=role,
                    name=name, connector=connector)
    return engine, publisher


def attach_tier(engine: Engine, name: str, options: dict[str, Any] | None) -> KVTier | None:
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

    HANDLE: type[ReceivingHandle] = ReceivingHandle   # the role's handle; its CONNECTOR runs in the engine

    def __init__(self, name: str, config: EngineConfig | None = None, *, engine: Engine | None = None,
                 loaded: Any = None, options: WorkerOptions | None = None, **fields: Any) -> None:
        """A worker of ``engine`` (None: a new one of ``config``, ``loaded`` weights); ``options``
        (core/config.py ``WorkerOptions``), its fields overridden by keywords (in-process workers)."""
        options = options_of(options, fields)
        self.kv_publisher: KVEventPublisher | None = None
        if engine is None:
            engine, self.kv_publisher = role_engine(name, self.role, self.HANDLE.CONNECTOR, config, options,
                                                    loaded=loaded)
        self.name = name
        self.engine = engine
        self.handle = self.HANDLE(engine)
        self.options = options
        tracing.setup(name)
        self.page_size = engine.kv_pool.page_size
        self.transfer_timeout_s = options.transfer_timeout_s
        self.regions = kv_regions(engine)
        self.agent = KVTransferAgent(name, [Region.of(n, r.tensor, r.page_size, r.slab_dims)
                                            for n, r in self.regions.items()],
                                     **engine.config.transfer.model_dump())
        self.counts: dict[str, int] = {}
        self.sender = KVSender(name, self.handle, self.agent, self.transfer_timeout_s)
        self.receiver: KVReceiver   # the role's, with its counting hooks
        self.l3 = attach_tier(engine, "l3", options.l3)
        self.draining = False
        self.metrics = CollectorRegistry()
        register_engine_metrics(engine, worker=name, role=self.role, registry=self.metrics)
        register_gie_metrics(engine, worker=name, role=self.role, registry=self.metrics)

    def handshake(self) -> bytes:
        """This worker's Handshake (NIXL metadata + region layout), encoded."""
        hs: bytes = self.agent.handshake_bytes()
        return hs

    def add_peer(self, handshake: bytes) -> str:
        """Load a peer's handshake; its agent name. A peer known with the same metadata is kept as it
        is; new metadata under a known name (the peer restarted under its name) replaces the old."""
        hs = Handshake.decode(handshake)
        name: str = hs.agent_name
        if self.agent.knows(name, hs.agent_metadata):
            return name
        return self.agent.connect(handshake)

    def remove_peer(self, name: str) -> None:
        """Forget a (dead) peer; transfers with it fail from now on."""
        self.agent.remove_peer(name)

    async def abort(self, rid: str, reason: str = "") -> bool:
        """Finish ``rid`` here and free its KV; False when it is not here (the role's)."""
        raise NotImplementedError

    async def stats(self) -> dict[str, Any]:
        """Pool accounting (:class:`EngineSnapshot` fields), live transfers and counters."""
        snap = await self.handle.snapshot()
        return {"worker": self.name, "role": self.role, **snap.as_dict(), "draining": self.draining,
                "live_transfers": self.live_transfers, **self.counts, **self._extra_stats(snap)}

    def _extra_stats(self, snap: EngineSnapshot) -> dict[str, Any]:
        return {}

    @property
    def live_transfers(self) -> int:
        """Handoffs in progress, sending and receiving."""
        return self.sender.live + self.receiver.live

    async def debug_kv(self) -> dict[str, Any]:
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
                "live_transfers": self.live_transfers, **self.counts}

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
        self.receiver.pump.close()
        try:
            self.engine.shutdown()
        finally:
            self.agent.close()
            if self.kv_publisher is not None:
                self.kv_publisher.close()


def options_of(options: WorkerOptions | None, fields: dict[str, Any]) -> WorkerOptions:
    """``options`` (None: the defaults) with ``fields`` (an in-process worker's keywords) over
    them, validated (an unknown keyword is a ValidationError)."""
    if not fields:
        return options or WorkerOptions()
    return WorkerOptions.model_validate({**(options or WorkerOptions()).model_dump(), **fields})
