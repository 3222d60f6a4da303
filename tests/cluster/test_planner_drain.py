"""The planner's scale-down and live migration (cluster/autoscaler.py ``mover``), on stand-ins for
the pool, the dispatcher and the actor handles: no Ray."""

from __future__ import annotations


def test_the_planners_scale_down_hands_a_draining_decode_worker_to_the_mover():
    """The autoscaler drains the idlest decode worker; with a ``mover`` (the backend's live
    migration) it hands it over at once instead of only waiting for its requests to end."""
    from types import SimpleNamespace

    from tandem.cluster.autoscaler import Autoscaler
    from tandem.cluster.workers import DECODE, WorkerRef
    from tandem.core.config import PlannerConfig

    drained, moved = [], []
    refs = {wid: WorkerRef(f"decode-{wid}", DECODE, wid, wid=wid,
                           handle=SimpleNamespace(drain=SimpleNamespace(remote=lambda wid=wid: drained.append(wid))))
            for wid in (0, 1)}
    views = [SimpleNamespace(worker_id=0, alive=True, in_flight=3, running_tokens=300),
             SimpleNamespace(worker_id=1, alive=True, in_flight=1, running_tokens=90)]
    dispatch = SimpleNamespace(view=lambda: SimpleNamespace(decode=views, prefill=[]))
    a = Autoscaler(PlannerConfig(), SimpleNamespace(get=refs.get), dispatch, None, None, mover=moved.append)
    a._drain_one("decode")
    assert drained == [1] and [w.name for w in moved] == ["decode-1"] and refs[1].retiring
    a._drain_one("decode")   # one left in rotation: never drained
    assert drained == [1]
