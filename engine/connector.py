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

The base class is the colocated engine's: nothing is received, nothing is held. What a held
request's KV is, for the worker that sends it: worker/held_kv.py.
"""

from __future__ import annotations

from tandem.engine.sched_types import SchedReq


class KVConnector:
    def receives(self, sr: SchedReq) -> bool:
        return False

    def reserved(self, sr: SchedReq) -> None:
        raise RuntimeError(f"{type(self).__name__} receives no KV, but {sr.rid} was reserved")

    def finished(self, sr: SchedReq, reason: str) -> bool:
        return False
