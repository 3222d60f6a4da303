"""The Responses API's store on Ray: one detached named actor, :data:`STORE_NAME`, holding a bounded
``ResponseTable``, and :class:`RayResponseStore`, the router's ``ResponseStore`` over it. A dead
store actor is looked up again once (recreated empty) before a call fails.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

from tandem.core.config import ResponsesConfig
from tandem.router.responses.store import ResponseTable, StoredResponse

if TYPE_CHECKING:
    from ray.actor import ActorHandle

log = logging.getLogger(__name__)

STORE_NAME = "tandem-responses"
HEAD_RESOURCE = "node:__internal_head__"


class ResponseStoreActor:
    """The table behind Ray calls (records travel as plain dicts)."""

    def __init__(self, max_stored: int, max_bytes: int, ttl_s: float):
        self.table = ResponseTable(max_stored, max_bytes, ttl_s)

    def put(self, wire: dict[str, Any], unless_cancelled: bool = False) -> dict[str, Any]:
        return self.table.put(wire, unless_cancelled)

    def get(self, rid: str) -> dict[str, Any] | None:
        return self.table.get(rid)

    def delete(self, rid: str) -> bool:
        return self.table.delete(rid)

    def cancel(self, rid: str) -> dict[str, Any] | None:
        return self.table.cancel(rid)

    def stats(self) -> dict[str, Any]:
        return self.table.stats()


def open_store_actor(cfg: ResponsesConfig, namespace: str) -> ActorHandle[ResponseStoreActor]:
    """The (detached) store actor of ``namespace``: the running one, or a new one."""
    import ray

    opts: dict[str, Any] = {"name": STORE_NAME, "namespace": namespace, "get_if_exists": True, "num_cpus": 0,
                  "max_restarts": 0, "lifetime": "detached"}
    if ray.cluster_resources().get(HEAD_RESOURCE):
        opts["resources"] = {HEAD_RESOURCE: 0.001}
    handle = ray.remote(ResponseStoreActor).options(**opts).remote(cfg.max_stored, cfg.max_bytes, cfg.ttl_s)
    return cast("ActorHandle[ResponseStoreActor]", handle)   # Ray types it "a handle or the class"


class RayResponseStore:
    """:class:`~tandem.router.responses.store.ResponseStore` over the store actor."""

    def __init__(self, cfg: ResponsesConfig, namespace: str) -> None:
        self.cfg, self.namespace = cfg, namespace
        self.handle = open_store_actor(cfg, namespace)

    async def _call(self, call: Callable[[ActorHandle[ResponseStoreActor]], Awaitable[Any]]) -> Any:
        """``call(handle)``: one call of the store actor; once more on a new handle if it died."""
        import ray

        for attempt in (0, 1):
            try:
                return await call(self.handle)
            except ray.exceptions.RayActorError:
                if attempt:
                    raise
                log.warning("the response store actor died; resolving %s again", STORE_NAME)
                self.handle = open_store_actor(self.cfg, self.namespace)

    async def put(self, rec: StoredResponse, unless_cancelled: bool = False) -> StoredResponse:
        return StoredResponse.from_wire(await self._call(lambda h: h.put.remote(rec.to_wire(), unless_cancelled)))

    async def get(self, rid: str) -> StoredResponse | None:
        wire = await self._call(lambda h: h.get.remote(rid))
        return None if wire is None else StoredResponse.from_wire(wire)

    async def delete(self, rid: str) -> bool:
        return bool(await self._call(lambda h: h.delete.remote(rid)))

    async def cancel(self, rid: str) -> StoredResponse | None:
        wire = await self._call(lambda h: h.cancel.remote(rid))
        return None if wire is None else StoredResponse.from_wire(wire)
