"""One NIXL agent per worker (the only module importing NIXL): register regions, WRITE pages to
peers, poll. Not thread-safe. Polls answer in :class:`TransferState`; with NIXL's progress thread
off, the receiving agent must call :meth:`KVTransferAgent.progress` while writes may land.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from tandem.core.kv_messages import Handshake, RegionInfo
from tandem.core.pool_layout import PoolLayout
from tandem.core.transfer_state import TransferState
from tandem.transfer.descriptors import byte_ranges, page_table, page_table_indices, split_even
from tandem.transfer.ucx_env import configure_ucx_modules, configure_ucx_tls, memory_type

log = logging.getLogger(__name__)

_NIXL_STATE = {"PROC": TransferState.TRANSFERRING, "DONE": TransferState.DONE, "ERR": TransferState.FAILED}


@dataclass(frozen=True)
class Region:
    """A local, contiguous, registered buffer and its page geometry."""

    name: str
    tensor: torch.Tensor
    layout: PoolLayout

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, page_size: int, slab_dims: int = 2) -> "Region":
        """Region over ``tensor: [*slab_dims, rows, *row_dims]`` (``slab_dims`` 2: ``[L, kinds, rows, ...]``)."""
        if not tensor.is_contiguous():
            raise ValueError(f"region {name!r}: tensor must be contiguous")
        if slab_dims not in (1, 2) or tensor.dim() < slab_dims + 1:
            raise ValueError(f"region {name!r}: slab_dims={slab_dims} does not fit shape {tuple(tensor.shape)}")
        shape = tuple(tensor.shape)
        kinds = shape[1] if slab_dims == 2 else 1
        row_bytes = math.prod(shape[slab_dims + 1:]) * tensor.element_size()
        return cls(name, tensor, PoolLayout(shape[0], shape[slab_dims], page_size, row_bytes, kinds))

    def __post_init__(self) -> None:
        nbytes = self.tensor.numel() * self.tensor.element_size()
        if nbytes != self.layout.nbytes:
            raise ValueError(f"region {self.name!r}: tensor has {nbytes} bytes, layout {self.layout.nbytes}")

    def info(self) -> RegionInfo:
        mem, dev_id = memory_type(self.tensor.device)
        return RegionInfo(self.name, self.tensor.data_ptr(), dev_id, mem, self.layout)


@dataclass
class TransferHandle:
    """One logical WRITE, possibly split into several NIXL requests. Opaque to callers."""

    peer: str
    nbytes: int
    num_descs: int
    deadline: float
    parts: list = field(default_factory=list)
    part_done: list = field(default_factory=list)
    notif: bytes | None = None
    status: TransferState = TransferState.TRANSFERRING
    error: str = ""


@dataclass
class _Peer:
    name: str
    regions: dict[str, RegionInfo]
    metadata: bytes = b""        # what add_remote_agent loaded: a new incarnation's differs
    prepped: dict = field(default_factory=dict)


class KVTransferAgent:
    """One ``nixl_agent`` over ``regions``. Not thread-safe; with the progress thread off (default) the
    owner keeps calling :meth:`poll` and :meth:`progress`. Options: transfer/README.md."""

    def __init__(self, name: str, regions: Sequence[Region], *, mode: str = "dynamic", parts: int = 1,
                 num_threads: int = 0, ucx_tls: str | None = None, timeout_s: float = 30.0,
                 progress_thread: bool = False, progress_delay_us: int = 100):
        if mode not in ("dynamic", "prepped"):
            raise ValueError(f"mode must be 'dynamic' or 'prepped', got {mode!r}")
        names = [r.name for r in regions]
        if len(set(names)) != len(names):
            raise ValueError(f"region names repeat: {names}")
        self._infos = {r.name: r.info() for r in regions}
        configure_ucx_tls(ucx_tls, mem_types=[i.mem_type for i in self._infos.values()])
        configure_ucx_modules()
        self.name = name
        self.mode = mode
        self.parts = max(1, parts)
        self.timeout_s = timeout_s
        self.progress_thread = progress_thread
        self.regions = {r.name: r for r in regions}
        self._nixl = _new_nixl_agent(name, num_threads, progress_thread, progress_delay_us)
        # register each distinct buffer once (two regions may view one tensor with different pages)
        spans = {(i.base_addr, r.layout.nbytes): i for r, i in zip(regions, self._infos.values())}
        self._reg = [self._nixl.register_memory([(addr, n, i.dev_id, "")], i.mem_type)
                     for (addr, n), i in spans.items()]
        self._peers: dict[str, _Peer] = {}
        self._local_prepped: dict[str, Any] = {}   # region name -> NIXL's prepped descriptor list
        self._leaked: list = []


    def metadata(self) -> bytes:
        """This agent's NIXL metadata (connection info + registered memory)."""
        return self._nixl.get_agent_metadata()

    def handshake(self) -> Handshake:
        return Handshake(self.name, self.metadata(), tuple(r.info() for r in self.regions.values()))

    def add_peer(self, name: str, metadata: bytes, regions: Sequence[RegionInfo] = ()) -> None:
        """Load a peer's metadata and region layouts (re-adding replaces them)."""
        if name in self._peers:
            self.remove_peer(name)
        loaded = self._nixl.add_remote_agent(metadata)
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != name:
            self._nixl.remove_remote_agent(loaded)
            raise ValueError(f"peer metadata is for agent {loaded!r}, not {name!r}")
        self._peers[name] = _Peer(name, {r.name: r for r in regions}, bytes(metadata))

    def knows(self, name: str, metadata: bytes) -> bool:
        """Whether peer ``name`` is loaded with exactly ``metadata``. False for a worker restarted
        under a known name (on another or the same address and port): its new metadata must replace
        the old (:meth:`add_peer`), or writes reach the dead agent's endpoint (vLLM #49238)."""
        p = self._peers.get(name)
        return p is not None and p.metadata == bytes(metadata)

    def remove_peer(self, name: str) -> None:
        """Forget a peer (e.g. it died); later writes to it raise KeyError."""
        peer = self._peers.pop(name, None)
        if peer is None:
            return
        for h in peer.prepped.values():
            h.release()
        try:
            self._nixl.remove_remote_agent(name)
        except Exception as e:
            log.warning("remove_remote_agent(%s) failed: %s", name, e)

    @property
    def peers(self) -> list[str]:
        return list(self._peers)


    def write_pages(self, peer: str, region: str, src_pages, dst_pages, notif: bytes = b"",
                    timeout_s: float | None = None) -> TransferHandle:
        """WRITE ``src_pages`` of local ``region`` into ``dst_pages`` of the peer's same-named region."""
        return self.write(peer, {region: (src_pages, dst_pages)}, notif, timeout_s)

    def write(self, peer: str, pages: Mapping[str, tuple], notif: bytes = b"",
              timeout_s: float | None = None) -> TransferHandle:
        """WRITE pages of several regions (``pages``: region -> (src, dst)) as one transfer. KeyError /
        ValueError for misuse; a transport failure is reported by :meth:`poll`."""
        p = self._peers.get(peer)
        if p is None:
            raise KeyError(f"unknown peer {peer!r}; known: {sorted(self._peers)}")
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        if self.mode == "prepped":
            return self._write_prepped(p, pages, notif, deadline)
        src, dst = [], []
        for rname, (sp, dp) in pages.items():
            local, remote = self._pair(p, rname)
            br = byte_ranges(local.layout, remote.layout, sp, dp)
            li = self._infos[rname]
            src.append(_descs(br.src, br.lengths, li.base_addr, li.dev_id))
            dst.append(_descs(br.dst, br.lengths, remote.base_addr, remote.dev_id))
        src_a = np.concatenate(src) if src else np.zeros((0, 3), np.uint64)
        dst_a = np.concatenate(dst) if dst else np.zeros((0, 3), np.uint64)
        h = TransferHandle(peer, int(src_a[:, 1].sum()), len(src_a), deadline)
        mem = self._mem_type(pages)

        def make(sl: slice, part_notif: bytes):
            return self._nixl.initialize_xfer("WRITE", self._nixl.get_xfer_descs(src_a[sl], mem),
                                              self._nixl.get_xfer_descs(dst_a[sl], mem), peer, part_notif)

        return self._post(h, split_even(src_a[:, 1], self.parts), make, notif)

    def _write_prepped(self, p: _Peer, pages: Mapping[str, tuple], notif: bytes, deadline: float) -> TransferHandle:
        if len(pages) != 1:
            raise ValueError("prepped mode writes one region per call")
        (rname, (sp, dp)), = pages.items()
        local, remote = self._pair(p, rname)
        byte_ranges(local.layout, remote.layout, sp, dp)
        li = page_table_indices(local.layout, sp).astype(np.int32)
        ri = page_table_indices(remote.layout, dp).astype(np.int32)
        h = TransferHandle(p.name, len(li) * local.layout.page_bytes, len(li), deadline)

        def make(sl: slice, part_notif: bytes):
            lh, rh = self._local_dlist(local), self._remote_dlist(p, remote)
            return self._nixl.make_prepped_xfer("WRITE", lh, li[sl], rh, ri[sl], part_notif)

        return self._post(h, split_even(np.ones(len(li)), self.parts), make, notif)

    def _post(self, h: TransferHandle, slices: list[slice], make, notif: bytes) -> TransferHandle:
        """Post one NIXL request per slice; ``notif`` rides on one, or goes alone once all are DONE."""
        single = len(slices) == 1
        h.notif = None if single else (notif or None)
        try:
            for sl in slices:
                x = make(sl, notif if single else b"")
                h.parts.append(x)
                h.part_done.append(False)
                if _NIXL_STATE.get(self._nixl.transfer(x)) is TransferState.FAILED:
                    return self._fail(h, "post returned ERR")
        except Exception as e:
            return self._fail(h, f"{type(e).__name__}: {e}")
        return h

    def poll(self, h: TransferHandle) -> TransferState:
        """DONE, FAILED (transport error or deadline) or TRANSFERRING; terminal answers are sticky."""
        if h.status is not TransferState.TRANSFERRING:
            return h.status
        try:
            for i, x in enumerate(h.parts):
                if not h.part_done[i]:
                    st = _NIXL_STATE.get(self._nixl.check_xfer_state(x), TransferState.FAILED)
                    if st is TransferState.FAILED:
                        return self._fail(h, f"part {i}/{len(h.parts)} reported ERR").status
                    h.part_done[i] = st is TransferState.DONE
            if all(h.part_done):
                if h.notif is not None:
                    self._nixl.send_notif(h.peer, h.notif)
                h.status = TransferState.DONE
                return h.status
        except Exception as e:
            return self._fail(h, f"{type(e).__name__}: {e}").status
        if time.monotonic() > h.deadline:
            return self._fail(h, "deadline passed").status
        return TransferState.TRANSFERRING

    def release(self, h: TransferHandle) -> None:
        """Free the NIXL requests. A request still in flight is kept and released later."""
        for x in h.parts:
            self._release(x)
        h.parts = []
        for x in list(self._leaked):
            self._leaked.remove(x)
            self._release(x)

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call: peer name -> messages, in arrival order."""
        return self._nixl.get_new_notifs()

    def progress(self) -> int:
        """Make progress on writes landing here; how many notifications arrived (dropped)."""
        return sum(len(v) for v in self._nixl.get_new_notifs().values())

    # ---- peers from handshake bytes (what workers exchange through the bootstrap channel) ----
    def handshake_bytes(self) -> bytes:
        return self.handshake().encode()

    def connect(self, handshake: bytes) -> str:
        """Add the peer a :class:`Handshake` (bytes) describes; returns its agent name."""
        hs = Handshake.decode(handshake)
        self.add_peer(hs.agent_name, hs.agent_metadata, hs.regions)
        return hs.agent_name

    def send_notif(self, peer: str, msg: bytes) -> bool:
        """Send a notification not tied to a write. False (logged) if the peer is unreachable."""
        if peer not in self._peers:
            raise KeyError(f"unknown peer {peer!r}; known: {sorted(self._peers)}")
        try:
            self._nixl.send_notif(peer, msg)
            return True
        except Exception as e:
            log.warning("send_notif to %s failed: %s", peer, e)
            return False

    def close(self) -> None:
        for name in list(self._peers):
            self.remove_peer(name)
        for h in self._local_prepped.values():
            h.release()
        self._local_prepped.clear()
        for x in list(self._leaked):
            self._leaked.remove(x)
            self._release(x)
        for reg in self._reg:
            self._nixl.deregister_memory(reg)
        self._reg = []


    def _pair(self, p: _Peer, rname: str) -> tuple[Region, RegionInfo]:
        local = self.regions.get(rname)
        if local is None:
            raise KeyError(f"no local region {rname!r}; have {sorted(self.regions)}")
        remote = p.regions.get(rname)
        if remote is None:
            raise KeyError(f"peer {p.name!r} has no region {rname!r}; it has {sorted(p.regions)}")
        return local, remote

    def _mem_type(self, pages: Mapping[str, tuple]) -> str:
        types = {self._infos[r].mem_type for r in pages if r in self._infos}
        if len(types) > 1:
            raise ValueError(f"one write cannot mix memory types {sorted(types)}")
        return types.pop() if types else "DRAM"

    def _local_dlist(self, r: Region):
        h = self._local_prepped.get(r.name)
        if h is None:
            info = self._infos[r.name]
            off, ln = page_table(r.layout)
            h = self._nixl.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(off, ln, info.base_addr, info.dev_id),
                                           info.mem_type)
            self._local_prepped[r.name] = h
        return h

    def _remote_dlist(self, p: _Peer, r: RegionInfo):
        h = p.prepped.get(r.name)
        if h is None:
            off, ln = page_table(r.layout)
            h = self._nixl.prep_xfer_dlist(p.name, _descs(off, ln, r.base_addr, r.dev_id), r.mem_type)
            p.prepped[r.name] = h
        return h

    def _fail(self, h: TransferHandle, why: str) -> TransferHandle:
        h.status = TransferState.FAILED
        h.error = f"write to {h.peer!r} ({h.nbytes} bytes, {h.num_descs} descriptors) failed: {why}"
        log.warning("%s", h.error)
        return h

    def _release(self, x) -> None:
        try:
            x.release()
        except Exception as e:
            log.debug("release of %r deferred: %s", x, e)
            self._leaked.append(x)


def _new_nixl_agent(name: str, num_threads: int, progress_thread: bool, delay_us: int):
    """``nixl_agent`` with the progress thread's idle delay set (the binding offers no knob)."""
    from nixl import _api

    conf = _api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"], num_threads=num_threads)
    bind = getattr(_api, "nixlBind", None)
    real = getattr(bind, "nixlAgent", None)
    if bind is None or real is None or not progress_thread:
        return _api.nixl_agent(name, conf)

    def make(agent_name, cfg):
        cfg.pthrDelay = delay_us
        return real(agent_name, cfg)

    bind.nixlAgent = make
    try:
        return _api.nixl_agent(name, conf)
    finally:
        bind.nixlAgent = real


def _descs(offsets: np.ndarray, lengths: np.ndarray, base: int, dev_id: int) -> np.ndarray:
    """Nx3 uint64 ``(addr, len, dev_id)`` rows for NIXL."""
    out = np.empty((len(offsets), 3), dtype=np.uint64)
    out[:, 0] = offsets.astype(np.uint64) + np.uint64(base)
    out[:, 1] = lengths
    out[:, 2] = dev_id
    return out


__all__ = ["CUDA_UCX_TLS", "DEFAULT_UCX_MODULES", "DEFAULT_UCX_TLS", "KVTransferAgent", "Region", "TransferHandle",
           "configure_ucx_modules", "configure_ucx_tls", "default_ucx_tls", "memory_type"]
