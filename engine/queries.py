"""The engine's named queries: what another thread may read of the engine. Each is answered by
one function, run on the engine thread between steps (directly, once that thread has stopped);
none changes the engine. A query's ``future`` gets the answer, or the exception it raised."""

from __future__ import annotations

import concurrent.futures
from dataclasses import asdict, dataclass, field
from typing import Any

KV_REGION = "kv"        # the full-attention pages' region name (worker/kv_regions.py ``KV``)


@dataclass(frozen=True)
class Query:
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future, kw_only=True)


@dataclass(frozen=True)
class HeldPages(Query):
    """-> :class:`HeldKV`: held ``rid``'s source ids from position ``start``; KeyError if it
    holds none here."""

    rid: str
    start: int


@dataclass(frozen=True)
class CachedPrefix(Query):
    """-> int: tokens of ``ids`` (page-aligned, at most ``len(ids) - 1``) the prefix cache holds
    on the device."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class Snapshot(Query):
    """-> :class:`EngineSnapshot`."""


@dataclass(frozen=True)
class PinReport(Query):
    """-> dict: the live pinned prefixes (``cache.pins()``), pinned tokens per tenant, matches
    that ended on a pinned node and pins refused past a tenant's cap."""


@dataclass(frozen=True)
class Stats(Query):
    """-> dict: a copy of the scheduler's counters."""


@dataclass(frozen=True)
class CheckInvariants(Query):
    """-> None: the ownership recount (raises AssertionError)."""


@dataclass(frozen=True)
class HeldKV:
    """A held request's source ids: full pages, and hybrid ``rows`` by region ("swa", "state")."""

    pages: tuple[int, ...]
    cached_tokens: int
    rows: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def source(self, region: str) -> tuple[int, ...]:
        """Source ids of ``region`` ("kv": the pages)."""
        return self.pages if region == KV_REGION else self.rows[region]


@dataclass(frozen=True)
class EngineSnapshot:
    """One engine's accounting at one moment (read on the engine thread)."""

    available_tokens: int
    evictable_tokens: int
    locked_tokens: int
    total_tokens: int
    request_tokens: int
    host_used_tokens: int
    running: int
    waiting: int
    retracted: int
    detached: int
    rows_free: int
    waiting_prompt_tokens: int

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def leaked_tokens(self) -> int:
        """Allocated slots neither cached nor owned by a request (0 unless there is a leak)."""
        return (self.total_tokens - self.available_tokens - self.evictable_tokens
                - self.locked_tokens - self.request_tokens)


def answer(engine, q: Query) -> Any:
    """Engine thread only: ``q``'s answer (raises what reading it raises)."""
    match q:
        case HeldPages(rid=rid, start=start):
            return held_kv(engine, rid, start)
        case CachedPrefix(ids=ids):
            return cached_prefix(engine, ids)
        case Snapshot():
            return take_snapshot(engine)
        case PinReport():
            return pin_report(engine)
        case Stats():
            return dict(engine.scheduler.stats)
        case CheckInvariants():
            return engine.scheduler.check_invariants()
    raise TypeError(f"unknown engine query {q!r}")


def held_kv(engine, rid: str, start: int) -> HeldKV:
    sr, kv = engine.scheduler.detached[rid], engine.kv
    return HeldKV(kv.pages(sr, start, sr.req.computed_len), sr.req.cached_len, kv.transfer_rows(sr, start))


def cached_prefix(engine, ids: tuple[int, ...] | list[int]) -> int:
    ps = engine.kv.page_size
    usable = (len(ids) - 1) // ps * ps
    return min(engine.kv.cache.peek(list(ids[:usable])), usable)


def _whole_pages(slots, page_size: int) -> int:
    return int(len(set((slots // page_size).tolist()))) * page_size


def take_snapshot(engine) -> EngineSnapshot:
    s, kv = engine.scheduler, engine.kv
    st = kv.cache.stats()
    host = kv.cache.host.used() if kv.cache.host is not None else 0
    return EngineSnapshot(
        available_tokens=kv.alloc.available_size(), evictable_tokens=st.evictable,
        locked_tokens=st.protected, total_tokens=kv.alloc.size,
        request_tokens=_whole_pages(kv.owned_slots(), kv.page_size), host_used_tokens=host,
        running=len(s.running), waiting=len(s.waiting), retracted=len(s.retraction.retracted),
        detached=len(kv.holders) - len(s.running), rows_free=kv.r2t.available_size(),
        waiting_prompt_tokens=sum(len(sr.req.prompt_ids) for sr in s.waiting))


def pin_report(engine) -> dict:
    c = engine.kv.cache
    return {"prefixes": c.pins(), "tokens": c.pinned_tokens, "hits": c.pin_hits, "refused": c.pin_refused}
