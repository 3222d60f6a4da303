"""Thin Ray shell around :class:`PrefillWorker` (an async actor: methods share one event loop)."""

from __future__ import annotations

import ray

from tandem.prefill.worker import PrefillWorker
from tandem.transfer.messages import PrefillResult
from tandem.worker.actor import RoleActorMixin, actor_config


class _PushSource:
    """A decode actor as prefill/store.py's KVWriter: ``prefill`` is its ``push_kv``."""

    def __init__(self, handle):
        self.handle, self.name = handle, "decode"

    async def prefill(self, req_wire: dict, xfer: bytes, dst_prefix_len: int) -> PrefillResult:
        return PrefillResult.decode(await self.handle.push_kv.remote(req_wire, xfer, dst_prefix_len))


@ray.remote
class PrefillActor(RoleActorMixin):
    def __init__(self, name: str, engine_config: dict, transfer_timeout_s: float, loaded=None,
                 kv_events: bool = False, l3: dict | None = None, debug_transfer_delay_ms: float = 0.0,
                 debug_transfer_stall: bool = False):
        cfg = actor_config(engine_config)
        self.worker = PrefillWorker(name, cfg, loaded=loaded, transfer_timeout_s=transfer_timeout_s,
                                    kv_events=kv_events, kv_events_host=ray.util.get_node_ip_address(),
                                    l3=l3, debug_transfer_delay_ms=debug_transfer_delay_ms,
                                    debug_transfer_stall=debug_transfer_stall)
        print(f"tandem: {self.worker.engine.startup_line}", flush=True)

    def add_peer(self, handshake: bytes) -> str:
        return self.worker.add_peer(handshake)

    def remove_peer(self, name: str) -> None:
        self.worker.remove_peer(name)

    async def write_kv(self, req_wire: dict, xfer: bytes, dst_prefix_len: int) -> bytes:
        """KVSource: compute the request's KV and write it into the decode worker's pages."""
        return (await self.worker.prefill(req_wire, xfer, dst_prefix_len)).encode()

    async def store_kv(self, req_wire: dict, source) -> int:
        """Reply push (prefill/store.py): receive the sequence decode actor ``source`` holds
        (its ``push_kv`` writes it) and cache it; the tokens received."""
        return await self.worker.store(req_wire, _PushSource(source))

    async def drop_kv(self, rid: str, reason: str) -> None:
        """KVSource: the decode worker will not take ``rid``'s KV: stop it here."""
        await self.abort(rid, reason)
