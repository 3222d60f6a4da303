"""Typed clients of the worker actors: the only module naming a worker's Ray methods.

Each method has its Protocol's name and parameters (core/actors.py, prefill/api.py,
decode/api.py) and returns the call's ObjectRef (``await`` it, or ``ray.get`` it on a thread).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle


class RoleClient:
    """``RoleAPI`` over ``handle``, the actor of a prefill or a decode worker."""

    def __init__(self, handle: ActorHandle):
        self.handle = handle

    def info(self) -> ObjectRef:
        return self.handle.info.remote()

    def handshake(self) -> ObjectRef:
        return self.handle.handshake.remote()

    def abort(self, rid: str, reason: str = "") -> ObjectRef:
        return self.handle.abort.remote(rid, reason)

    def stats(self) -> ObjectRef:
        return self.handle.stats.remote()

    def debug_kv(self) -> ObjectRef:
        return self.handle.debug_kv.remote()

    def unpin(self, prefix_hash: str, tenant: str | None = None) -> ObjectRef:
        return self.handle.unpin.remote(prefix_hash, tenant)

    def drain(self) -> ObjectRef:
        return self.handle.drain.remote()

    def undrain(self) -> ObjectRef:
        return self.handle.undrain.remote()

    def ping(self) -> ObjectRef:
        return self.handle.ping.remote()

    def progress(self, router: str | None = None, lease_s: float | None = None) -> ObjectRef:
        return self.handle.progress.remote(router, lease_s)

    def metrics_text(self) -> ObjectRef:
        return self.handle.metrics_text.remote()

    def shutdown(self) -> ObjectRef:
        return self.handle.shutdown.remote()


class PrefillClient(RoleClient):
    """``PrefillAPI``: a prefill worker's actor."""

    def add_peer(self, handshake: bytes) -> ObjectRef:
        return self.handle.add_peer.remote(handshake)

    def remove_peer(self, name: str) -> ObjectRef:
        return self.handle.remove_peer.remote(name)


class DecodeClient(RoleClient):
    """``DecodeAPI``: a decode worker's actor. ``handle`` arguments are peers' actor handles."""

    def add_prefill(self, handshake: bytes, handle: Any) -> ObjectRef:
        return self.handle.add_prefill.remote(handshake, handle)

    def remove_prefill(self, name: str) -> ObjectRef:
        return self.handle.remove_prefill.remote(name)

    def add_decode(self, handshake: bytes, handle: Any) -> ObjectRef:
        return self.handle.add_decode.remote(handshake, handle)

    def remove_decode(self, name: str) -> ObjectRef:
        return self.handle.remove_decode.remote(name)

    def generate(self, req_wire: dict, prefill_name: str | None, router: str | None = None):
        """The ObjectRefGenerator of the request's StreamChunks (one ref per chunk)."""
        return self.handle.generate.options(num_returns="streaming").remote(req_wire, prefill_name, router)

    def freeze(self, rid: str) -> ObjectRef:
        return self.handle.freeze.remote(rid)

    def release_frozen(self, rid: str) -> ObjectRef:
        return self.handle.release_frozen.remote(rid)
