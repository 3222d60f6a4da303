"""The receiving side of a KV handoff, for either role: requests whose KV a peer writes.

:class:`ReceivingConnector` is the scheduler's KVConnector half that both roles share
(engine/connector.py): a request the worker :meth:`~ReceivingConnector.expect`-ed is not computed
here; the scheduler reserves a row, its cached prefix (the normal match and component vote) and
slots for the rest, and the connector turns them into a :class:`Reservation`, the future's
result; :class:`ReceivingHandle` is how the worker (asyncio, another thread) reaches it. A
decode worker receives prompts (and migrated requests); a prefill worker receives a
decode worker's finished reply, only to cache it (decode/README.md, "reply push"). What a role
keeps of a finished request's KV is its connector's :meth:`~ReceivingConnector.keeps` rule.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from tandem.core.kv_messages import RegionPages
from tandem.core.messages import GenerateRequest
from tandem.core.types import StreamChunk
from tandem.engine.connector import KVConnector
from tandem.engine.queries import cached_prefix
from tandem.engine.sched.sched_types import SchedReq
from tandem.worker.handle import RoleHandle
from tandem.worker.kv_digest import corrupt_page, regions_digest
from tandem.worker.kv_regions import KV, kv_regions

if TYPE_CHECKING:
    from tandem.engine.engine import Engine


@dataclass(frozen=True)
class Reservation:
    """Where a request's KV must land: positions ``[prefix_len, end)`` in ``pages``
    (``prefix_len`` is page-aligned: the receiving cache already held that much). ``regions``:
    the destination ids of every region the transfer fills (``"kv"``: ``pages``; hybrid models:
    ``"swa"`` rows of the kept window, ``"state"``: the working state row), in transfer order."""

    prefix_len: int
    pages: tuple[int, ...]
    regions: tuple[RegionPages, ...] = ()

    def named(self) -> tuple[RegionPages, ...]:
        """``regions``, or the ``"kv"`` pages alone for a model without other regions."""
        return self.regions or (RegionPages(KV, self.pages),)


@dataclass(frozen=True)
class ComputeHere:
    """A receive's answer when the role's :meth:`ReceivingConnector.computes_here` took the
    request: it is prefilled on this worker as any other request (its chunks go to the receive's
    ``on_chunk``); no page was reserved for a peer."""


HERE = ComputeHere()


class Keep(enum.Enum):
    """What a finished request's KV does (:meth:`ReceivingConnector.keeps`, the role's rule)."""

    NO = "no"                      # cached or freed now, as any finished request's
    HELD = "held"                  # held (locked, its row kept) until a Release
    HELD_CACHED = "held, cached"   # held, its sequence cached now: later requests hit it while held


class ReceivingConnector(KVConnector):
    """Engine thread, except :meth:`expect` and :meth:`forget` (any thread)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.kv = engine.kv
        self.regions = kv_regions(engine)   # name -> RegionSpec
        self._expected: dict[str, concurrent.futures.Future[Reservation | ComputeHere | None]] = {}
        self._lock = threading.Lock()

    def expect(self, rid: str) -> concurrent.futures.Future[Reservation | ComputeHere | None]:
        """Before ``rid`` is submitted: a peer writes its KV. The future gets its Reservation
        (None: it ended first)."""
        with self._lock:
            fut = self._expected[rid] = concurrent.futures.Future()
        return fut

    def forget(self, rid: str) -> None:
        with self._lock:
            fut = self._expected.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def receives(self, sr: SchedReq) -> bool:
        """As ``sr`` is queued: whether a peer writes its KV (it was expected, and the role's
        :meth:`computes_here` did not take it; a taken one's future gets ``HERE``)."""
        with self._lock:
            if sr.rid not in self._expected:
                return False
        if not self.computes_here(sr.rid, sr.req.cache_ids):
            return True
        with self._lock:
            fut = self._expected.pop(sr.rid, None)
        if fut is not None and not fut.done():
            fut.set_result(HERE)
        return False

    def computes_here(self, rid: str, ids: list[int]) -> bool:
        """The role's rule, on the engine thread as expected ``rid`` (cache key ``ids``) is queued:
        True to prefill it here after all (:meth:`cached_prefix` says what this cache holds)."""
        return False

    def cached_prefix(self, ids: list[int]) -> int:
        """Engine thread: tokens of ``ids`` (page-aligned, at most ``len(ids) - 1``) the device cache holds."""
        return cached_prefix(self.engine, ids)

    def reserved(self, sr: SchedReq) -> None:
        kv, p = self.kv, sr.locked_len
        pages = kv.pages(sr, p, sr.req.computed_len)   # the reserved end: seq_len, or seq_len - 1 resumed
        named = {KV: pages, **kv.transfer_rows(sr, p)}
        regions = tuple(RegionPages(n, ids) for n, ids in named.items() if n in self.regions)
        with self._lock:
            fut = self._expected.get(sr.rid)
        if fut is not None and not fut.done():
            fut.set_result(Reservation(p, pages, regions))

    def finished(self, sr: SchedReq, reason: str) -> bool:
        self.forget(sr.rid)
        keep = self.keeps(sr.rid, reason)
        if keep is Keep.HELD_CACHED:
            self.kv.cache_prefix(sr)
        return keep is not Keep.NO

    def keeps(self, rid: str, reason: str) -> Keep:
        """The role's rule, on the engine thread: what the KV of ``rid``, finishing ``reason``
        ("stop", "length", "abort", "migrated", "stored"), does."""
        return Keep.NO

    def digest(self, regions: tuple[RegionPages, ...]) -> str:
        return regions_digest(self.regions, [(rp.region, rp.pages) for rp in regions])

    def corrupt(self, regions: tuple[RegionPages, ...]) -> None:
        """Perturb the first page of the first region (the ``debug_corrupt_kv`` test lever)."""
        for rp in regions:
            if rp.pages:
                spec = self.regions[rp.region]
                corrupt_page(spec.tensor, rp.pages, spec.page_size)
                return


class ReceivingHandle(RoleHandle):
    """The worker's typed way to a :class:`ReceivingConnector`: KV in (``receive``, ``cancel``),
    and ``page_digest`` for KV in or out (out: EngineHandle's ``held_pages``, ``release_held``)."""

    connector: ReceivingConnector

    def receive(self, greq: GenerateRequest,
                on_chunk: Callable[[StreamChunk], None]) -> concurrent.futures.Future[Reservation | ComputeHere | None]:
        """Queue ``greq`` to be filled by a peer; its Reservation once reserved (None: it ended
        first, its final chunk says why; ``HERE``: the role's rule computes it here instead). Raises InvalidRequest for a prompt this engine can
        never serve. Chunks go to ``on_chunk``."""
        self.check_alive()
        fut = self.connector.expect(greq.rid)
        try:
            self.engine.submit(greq, on_chunk)
        except BaseException:
            self.connector.forget(greq.rid)
            raise
        return fut

    def cancel(self, rid: str, why: str | None) -> None:
        """End ``rid`` and free its reserved pages (queued or reserved alike). The caller
        guarantees that no write into them is in flight (transfer/handoff.py)."""
        self.connector.forget(rid)
        self.engine.abort(rid, error=why)

    async def page_digest(self, regions: tuple[RegionPages, ...]) -> str:
        """Digest of ``regions``' pages, in their order, hashed on a helper thread (the step loop
        keeps running): held pages are locked, and received pages are the request's alone once
        no write into them is in flight."""
        self.check_alive()
        return await asyncio.to_thread(self.connector.digest, regions)

    async def corrupt_page(self, regions: tuple[RegionPages, ...]) -> None:
        """Test lever (``debug_corrupt_kv``): perturb received pages, as a bad transfer would."""
        self.check_alive()
        await asyncio.to_thread(self.connector.corrupt, regions)
