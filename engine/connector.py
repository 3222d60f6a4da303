"""KVConnector: how the scheduler sees a request whose KV crosses workers."""

from __future__ import annotations

from tandem.engine.sched.sched_types import SchedReq


class KVConnector:
    def receives(self, sr: SchedReq) -> bool:
        return False

    def reserved(self, sr: SchedReq) -> None:
        raise RuntimeError(f"{type(self).__name__} receives no KV, but {sr.rid} was reserved")

    def finished(self, sr: SchedReq, reason: str) -> bool:
        return False
