"""Retraction: what a decode batch gives up when the device KV pool runs out, and how it comes
back."""

from __future__ import annotations

import time
from collections import deque

from tandem.core import tracing
from tandem.core.types import Req, ReqStatus
from tandem.engine.request_kv import RequestKV
from tandem.engine.sched.sched_types import SchedReq


def pick_victim(cands: list[Req], policy: str = "default",
                session_seen: dict[str, float] | None = None) -> Req | None:
    """The request to retract."""
    if not cands:
        return None
    if policy == "session":
        seen = session_seen or {}
        return min(cands, key=lambda r: (seen.get(r.session_id, float("-inf")) if r.session_id else
                                         float("-inf"), len(r.output_ids), -len(r.prompt_ids)))
    return min(cands, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)))


class Retraction:
    """Backups and the queue of retracted requests waiting for room."""

    def __init__(self, kv: RequestKV, stats: dict, *, policy: str = "default",
                 host_backup: bool = True):
        self.kv = kv
        self.stats = stats
        self.policy = policy
        self.host_backup = host_backup and kv.cache.host is not None
        self.retracted: deque[SchedReq] = deque()
        self.backups: dict[str, object] = {}

    def choose(self, cands: list[SchedReq], session_seen: dict[str, float]) -> SchedReq | None:
        by_rid = {sr.rid: sr for sr in cands}
        victim = pick_victim([sr.req for sr in cands], self.policy, session_seen)
        return None if victim is None else by_rid[victim.rid]

    def retract(self, sr: SchedReq) -> bool:
        """Free ``sr``'s device KV (the caller took it out of the running set). True: backed up (it
        waits in :attr:`retracted`); False: it must be recomputed (the caller queues it)."""
        r = sr.req
        t0 = time.time()
        self.stats["retractions"] += 1
        backed_up = self.host_backup and self._backup(sr)
        if r.trace:
            tracing.record("retraction", r.trace, t0, **{"tandem.rid": r.rid, "tandem.backed_up": backed_up,
                                                         "tandem.seq_len": r.seq_len})
        if backed_up:
            self.retracted.append(sr)
        else:
            if r.req_pool_idx is not None:
                self.kv.release(sr)
            self.stats["retraction_recomputes"] += 1
        r.status = ReqStatus.RETRACTED
        r.computed_len = 0
        return backed_up

    def _backup(self, sr: SchedReq) -> bool:
        r, kv = sr.req, self.kv
        t0 = time.perf_counter()
        node, freed = kv.back_up(sr)
        if not kv.cache.host.host_only(node):
            kv.release(sr)
            return False
        self.backups[r.rid] = node
        kv.drop_backed_up(sr)
        self.stats["backup_tokens"] += freed
        self.stats["backup_seconds"] += time.perf_counter() - t0
        return True

    def restorable(self, anything_held: bool) -> list[SchedReq]:
        """Retracted requests whose KV fits now, with two pages of headroom each, oldest first. When
        no request holds any KV (the whole pool is free or evictable) the oldest is tried anyway: if
        it does not fit then, it never will (the scheduler aborts it)."""
        out, room = [], self.kv.room()
        for sr in self.retracted:
            need = sr.req.seq_len + 2 * self.kv.page_size
            if need > room:
                break
            room -= need
            out.append(sr)
        if not out and self.retracted and not anything_held:
            out.append(self.retracted[0])
        return out

    def restored(self, sr: SchedReq, seconds: float) -> None:
        """``sr`` was admitted again (its match loaded the host-only KV back): it leaves the queue,
        and the admission's own lock on the restored path now protects it."""
        self.retracted.remove(sr)
        self.drop(sr)
        self.stats["retraction_restores"] += 1
        self.stats["restore_tokens"] += sr.req.computed_len
        self.stats["restore_seconds"] += seconds

    def drop(self, sr: SchedReq) -> None:
        """Release the backup's host lock (restored, or aborted while retracted)."""
        node = self.backups.pop(sr.rid, None)
        if node is not None:
            self.kv.cache.unlock(node)

    def abort(self, rid: str) -> SchedReq | None:
        """Take ``rid`` out of the retracted queue (its host copy becomes evictable)."""
        for sr in self.retracted:
            if sr.rid == rid:
                self.retracted.remove(sr)
                self.drop(sr)
                return sr
        return None
