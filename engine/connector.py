"""KVConnector: how the scheduler sees a request whose KV crosses workers.

The scheduler-side half of a KV handoff, after vLLM's ``KVConnectorBase_V1`` split: the scheduler
calls these hooks at fixed points and knows nothing else of peers; the role (decode/, prefill/)
subclasses it. The worker side (the handoff's state, the NIXL write: transfer/handoff.py) reaches
the scheduler only through the typed engine commands ``Activate`` and ``Release``
(engine/commands.py), which the engine hands to ``Scheduler.handoff`` in inbox order.

Hooks (engine thread only)::

    receives(sr) -> bool        decode: sr's prompt KV past its cached prefix is written by a peer,
                                so the scheduler reserves slots for it instead of computing it
                                (asked once, when sr is added)
    reserved(sr)                those slots are allocated (rows [locked_len, seq_len)); sr waits in
                                WAITING_FOR_KV, outside the step loop, until Activate or Abort
    finished(sr, reason) -> bool
                                sr finished (every request, every reason); True keeps its row and
                                KV until a Release (prefill: until they were sent; decode: a
                                request "migrated" to another worker, until copied there)

The base class is the colocated engine's: nothing is received, nothing is held. :func:`held_kv`
reads what a held request's KV is, for the worker that sends it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.kv_regions import KV
from tandem.engine.sched_types import SchedReq


@dataclass(frozen=True)
class HeldKV:
    pages: tuple[int, ...]      # source page ids of positions [start, end of its KV)
    cached_tokens: int          # prompt tokens this worker's prefix cache served
    rows: dict[str, tuple[int, ...]] = field(default_factory=dict)   # hybrid: "swa", "state"

    def source(self, region: str) -> tuple[int, ...]:
        """Source ids of ``region`` ("kv": the pages)."""
        return self.pages if region == KV else self.rows[region]


def held_kv(engine, rid: str, start: int) -> HeldKV:
    """Engine thread: the source ids of held ``rid``'s KV positions ``[start, computed_len)`` (a
    prefill's prompt; a migrating request's prompt and output but the last token) and, for
    hybrid models, the rows a transfer moves past ``start``. KeyError if ``rid`` is not held."""
    sr, kv = engine.scheduler.detached[rid], engine.kv
    return HeldKV(kv.pages(sr, start, sr.req.computed_len), sr.req.cached_len, kv.transfer_rows(sr, start))


class KVConnector:
    def receives(self, sr: SchedReq) -> bool:
        return False

    def reserved(self, sr: SchedReq) -> None:
        raise RuntimeError(f"{type(self).__name__} receives no KV, but {sr.rid} was reserved")

    def finished(self, sr: SchedReq, reason: str) -> bool:
        return False
