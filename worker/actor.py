"""The Ray actor shell's pieces that a prefill actor and a decode actor share (written once).

:class:`RoleActorMixin`: the thin methods every role's actor has (``self.worker`` is a
:class:`~tandem.worker.role_worker.RoleWorker`); :func:`actor_config`: the engine config an actor
was handed, with as many torch threads as Ray gave it CPUs.
"""

from __future__ import annotations

import os

import ray

from tandem.core.config import EngineConfig


def assigned_threads() -> int:
    """Torch threads for this actor: the CPUs Ray assigned it, at least one."""
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
    return max(1, int(cpus))


def actor_config(engine_config: dict) -> EngineConfig:
    """``engine_config`` validated; ``num_threads`` unset: :func:`assigned_threads`."""
    cfg = EngineConfig.model_validate(engine_config)
    if cfg.num_threads is None:
        cfg = cfg.model_copy(update={"num_threads": assigned_threads()})
    return cfg


class RoleActorMixin:
    """The thin methods every worker's Ray actor has (``self.worker`` is a RoleWorker)."""

    def info(self) -> dict:
        w, e = self.worker, self.worker.engine
        pub = getattr(w, "kv_publisher", None)
        return {"name": w.name, "role": w.role, "model_name": e.model_name,
                "max_context": e.max_context, "vocab_size": e.arch.vocab_size,
                "page_size": w.page_size, "device": str(e.device),
                "regions": sorted(w.regions), "peers": sorted(w.agent.peers),
                "kv_events": pub.endpoint if pub is not None else None,
                "kv_replay": pub.replay_endpoint if pub is not None else None,
                "draining": w.draining, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id()}

    def handshake(self) -> bytes:
        return self.worker.handshake()

    async def abort(self, rid: str, reason: str = "") -> bool:
        return await self.worker.abort(rid, reason)

    async def stats(self) -> dict:
        return await self.worker.stats()

    async def debug_kv(self) -> dict:
        return await self.worker.debug_kv()

    def drain(self) -> bool:
        """Take no new requests (every router reads ``draining`` from ``stats()``); True."""
        self.worker.draining = True
        return True

    def undrain(self) -> bool:
        """Back in rotation after a drain that did not stop it; True."""
        self.worker.draining = False
        return True

    async def ping(self) -> str:
        self.worker.check_alive()   # a crashed engine thread counts as a dead worker
        return self.worker.name

    async def progress(self, router: str | None = None) -> float:
        """The supervisor's heartbeat (answered on the actor's loop, not the engine thread, so a
        long step does not delay it): seconds the engine has been in its current step (0 between
        steps); raises like :meth:`ping` when the engine thread died. ``router``: the caller's id
        (a decode worker renews its lease, decode/leases.py)."""
        self.worker.check_alive()
        return self.worker.engine.step_age()

    def metrics_text(self) -> bytes:
        # imported here: Ray pickles the actor class by value, and a registry holds locks
        from prometheus_client import REGISTRY, generate_latest

        return self.worker.metrics_text() + generate_latest(REGISTRY)

    def shutdown(self) -> None:
        self.worker.close()
