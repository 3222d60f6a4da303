"""Typed clients of the worker actors: the only module naming a worker's Ray methods.

Each method has its Protocol's name and parameters (core/actors.py, prefill/api.py,
decode/api.py) and returns the call's ObjectRef (``await`` it, or ``ray.get`` it on a thread).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray import ObjectRef, ObjectRefGenerator
    from ray.actor import ActorHandle

    from tandem.worker.kv_flow_types import KVSource


class RoleClient:
    """``RoleAPI`` over ``handle``, the actor of a prefill or a decode worker."""

    def __init__(self, handle: ActorHandle[Any]) -> None:
        self.handle = handle

    def info(self) -> ObjectRef[dict[str, Any]]:
        return self.handle.info.remote()

    def handshake(self) -> ObjectRef[bytes]:
        return self.handle.handshake.remote()

    def abort(self, rid: str, reason: str = "") -> ObjectRef[bool]:
        return self.handle.abort.remote(rid, reason)

    def stats(self) -> ObjectRef[dict[str, Any]]:
        return self.handle.stats.remote()

    def debug_kv(self) -> ObjectRef[dict[str, Any]]:
        return self.handle.debug_kv.remote()

    def unpin(self, prefix_hash: str, tenant: str | None = None) -> ObjectRef[int]:
        return self.handle.unpin.remote(prefix_hash, tenant)

    def drain(self) -> ObjectRef[bool]:
        return self.handle.drain.remote()

    def undrain(self) -> ObjectRef[bool]:
        return self.handle.undrain.remote()

    def ping(self) -> ObjectRef[str]:
        return self.handle.ping.remote()

    def progress(self, router: str | None = None, lease_s: float | None = None) -> ObjectRef[float]:
        return self.handle.progress.remote(router, lease_s)

    def metrics_text(self) -> ObjectRef[bytes]:
        return self.handle.metrics_text.remote()

    def shutdown(self) -> ObjectRef[None]:
        return self.handle.shutdown.remote()


class PrefillClient(RoleClient):
    """``PrefillAPI``: a prefill worker's actor."""

    def add_peer(self, handshake: bytes) -> ObjectRef[str]:
        return self.handle.add_peer.remote(handshake)

    def remove_peer(self, name: str) -> ObjectRef[None]:
        return self.handle.remove_peer.remote(name)

    def store_kv(self, req_wire: dict[str, Any], source: KVSource) -> ObjectRef[int]:
        return self.handle.store_kv.remote(req_wire, source)


class DecodeClient(RoleClient):
    """``DecodeAPI``: a decode worker's actor. ``handle`` arguments are peers' actor handles."""

    def add_prefill(self, handshake: bytes, handle: Any) -> ObjectRef[str]:
        return self.handle.add_prefill.remote(handshake, handle)

    def remove_prefill(self, name: str) -> ObjectRef[None]:
        return self.handle.remove_prefill.remote(name)

    def add_decode(self, handshake: bytes, handle: Any) -> ObjectRef[str]:
        return self.handle.add_decode.remote(handshake, handle)

    def remove_decode(self, name: str) -> ObjectRef[None]:
        return self.handle.remove_decode.remote(name)

    def generate(self, req_wire: dict[str, Any], prefill_name: str | None,
                 router: str | None = None) -> ObjectRefGenerator:
        """The ObjectRefGenerator of the request's StreamChunks (one ref per chunk)."""
        return self.handle.generate.options(num_returns="streaming").remote(req_wire, prefill_name, router)

    def freeze(self, rid: str) -> ObjectRef[bool]:
        return self.handle.freeze.remote(rid)

    def release_frozen(self, rid: str) -> ObjectRef[None]:
        return self.handle.release_frozen.remote(rid)
