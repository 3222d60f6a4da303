"""The Ray actor shell's shared pieces: :class:`RoleActorMixin`, :func:`actor_config`,
:func:`actor_options`, and :class:`RayKVSource`, the one adapter from a KVSource actor to
worker/kv_flow.py's in-process ``KVSource``."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import ray

from tandem.core.config import EngineConfig, WorkerOptions
from tandem.core.kv_messages import PrefillResult
from tandem.worker.kv_flow_types import SourceUnavailable

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from tandem.worker.role_worker import RoleWorker


def assigned_threads() -> int:
    """Torch threads for this actor: the CPUs Ray assigned it, at least one."""
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
    return max(1, int(cpus))


def actor_config(engine_config: dict[str, Any]) -> EngineConfig:
    """``engine_config`` validated; ``num_threads`` unset: :func:`assigned_threads`."""
    cfg = EngineConfig.model_validate(engine_config)
    if cfg.num_threads is None:
        cfg = cfg.model_copy(update={"num_threads": assigned_threads()})
    return cfg


def actor_options(options: WorkerOptions | dict[str, Any]) -> WorkerOptions:
    """``options`` validated, its KV events published on this node's address."""
    return WorkerOptions.model_validate(options).model_copy(
        update={"kv_events_host": ray.util.get_node_ip_address()})


class RoleActorMixin:
    """The thin methods every worker's Ray actor has (``self.worker`` is a RoleWorker)."""

    worker: RoleWorker   # the subclass's

    def info(self) -> dict[str, Any]:
        w, e = self.worker, self.worker.engine
        pub = getattr(w, "kv_publisher", None)
        return {"name": w.name, "role": w.role, "model_name": e.model_name,
                "max_context": e.max_context, "vocab_size": e.arch.vocab_size,
                "speculative": e.spec_status,
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

    async def stats(self) -> dict[str, Any]:
        return await self.worker.stats()

    async def debug_kv(self) -> dict[str, Any]:
        return await self.worker.debug_kv()

    async def unpin(self, prefix_hash: str, tenant: str | None = None) -> int:
        return await self.worker.unpin(prefix_hash, tenant)

    def drain(self) -> bool:
        self.worker.draining = True
        return True

    def undrain(self) -> bool:
        self.worker.draining = False
        return True

    async def ping(self) -> str:
        self.worker.check_alive()
        return self.worker.name

    async def progress(self, router: str | None = None, lease_s: float | None = None) -> float:
        """Seconds in the current engine step (0 between); raises like :meth:`ping`; ``router`` renews
        its lease (of ``lease_s`` seconds; None: the default)."""
        self.worker.check_alive()
        return self.worker.engine.step_age()

    def metrics_text(self) -> bytes:
        # imported here: Ray pickles the actor class by value, and a registry holds locks
        from prometheus_client import REGISTRY, generate_latest

        return self.worker.metrics_text() + generate_latest(REGISTRY)

    def shutdown(self) -> None:
        self.worker.close()


class RayKVSource:
    """The one adapter: a KVSource actor's handle (core/actors.py: a prefill worker, a decode
    worker holding a frozen request or a pushed sequence) as worker/kv_flow.py's in-process
    ``KVSource``. Picklable: a decode actor hands itself, wrapped, to a prefill worker's
    ``store_kv`` (prefill/api.py), and the prefill process unpickles it from here (worker/, which
    both roles import), never from decode/."""

    def __init__(self, name: str, handle: ActorHandle[Any], me: RayKVSource | None = None) -> None:
        """``me``: the calling decode actor as a KVSource (what a reply push's ``store`` hands over)."""
        self.name, self.handle, self.me = name, handle, me
        self.dead = False

    async def prefill(self, req_wire: dict[str, Any], xfer: bytes, dst_prefix_len: int) -> PrefillResult:
        """``KVSource.write_kv``; a dead actor raises :class:`SourceUnavailable` (marks it ``dead``)."""
        try:
            raw: bytes = await self.handle.write_kv.remote(req_wire, xfer, dst_prefix_len)
        except ray.exceptions.RayActorError as e:
            self.dead = True
            raise SourceUnavailable(f"{type(e).__name__}: {str(e)[:200]}") from None
        return PrefillResult.decode(raw)

    async def abort(self, rid: str, reason: str) -> None:
        """``KVSource.drop_kv``."""
        await self.handle.drop_kv.remote(rid, reason)

    async def store(self, req_wire: dict[str, Any]) -> int:
        """Reply push (decode/reply_push.py): ``PrefillAPI.store_kv``; the prefill worker reserves
        and calls back ``me`` (this decode actor's ``write_kv``); the tokens it received."""
        n: int = await self.handle.store_kv.remote(req_wire, self.me)
        return n
