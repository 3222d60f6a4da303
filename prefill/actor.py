"""Thin Ray shell around :class:`PrefillWorker` (an async actor: methods share one event loop).

Created by cluster/launch.py with ``.options(num_cpus=..., num_gpus=...)``; torch uses as many
threads as the actor was given CPUs (at least one). Everything crossing Ray is plain data: the
engine config as a dict, messages as bytes or wire dicts.
"""

from __future__ import annotations

import ray

from tandem.core.config import EngineConfig
from tandem.prefill.worker import PrefillWorker


def assigned_threads() -> int:
    """Torch threads for this actor: the CPUs Ray assigned it, at least one."""
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
    return max(1, int(cpus))


@ray.remote
class PrefillActor:
    def __init__(self, name: str, engine_config: dict, transfer_timeout_s: float, loaded=None,
                 kv_events: bool = False):
        """``loaded``: the driver's LoadedModel through the object store (CPU weights shared by
        all workers of a node), or None to load ``engine_config.model`` here."""
        cfg = EngineConfig.model_validate(engine_config)
        if cfg.num_threads is None:
            cfg = cfg.model_copy(update={"num_threads": assigned_threads()})
        self.worker = PrefillWorker(name, cfg, loaded=loaded, transfer_timeout_s=transfer_timeout_s,
                                    kv_events=kv_events)

    def info(self) -> dict:
        e = self.worker.engine
        return {"name": self.worker.name, "role": "prefill", "model_name": e.model_name,
                "max_context": e.max_context, "vocab_size": e.arch.vocab_size,
                "page_size": self.worker.page_size, "device": str(e.device),
                "kv_events": self.worker.kv_events_endpoint}

    def handshake(self) -> bytes:
        return self.worker.handshake()

    def add_peer(self, handshake: bytes) -> str:
        return self.worker.add_peer(handshake)

    def remove_peer(self, name: str) -> None:
        self.worker.remove_peer(name)

    async def prefill(self, req_wire: dict, xfer: bytes, dst_prefix_len: int) -> dict:
        return await self.worker.prefill(req_wire, xfer, dst_prefix_len)

    async def abort(self, rid: str, reason: str = "") -> bool:
        return await self.worker.abort(rid, reason)

    async def stats(self) -> dict:
        return await self.worker.stats()

    async def ping(self) -> str:
        self.worker.check_alive()   # a crashed engine thread counts as a dead worker
        return self.worker.name

    def metrics_text(self) -> bytes:
        # imported here: Ray pickles the actor class by value, and a registry holds locks
        from prometheus_client import REGISTRY, generate_latest

        return self.worker.metrics_text() + generate_latest(REGISTRY)

    def shutdown(self) -> None:
        self.worker.close()
