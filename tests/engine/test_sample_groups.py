"""engine/sched/sample_groups.py: who waits for whom among the n samples of one prompt (no model)."""

from __future__ import annotations

from tandem.core.messages import SampleGroup
from tandem.core.types import Req, SamplingParams
from tandem.engine.sched.sample_groups import SampleGroups
from tandem.engine.sched.sched_types import SchedReq


def member(i: int, gid: str = "g", prompt=(1, 2, 3, 4)) -> SchedReq:
    return SchedReq(Req(list(prompt), SamplingParams(), rid=f"{gid}-{i}"), tracker=None,
                    group=SampleGroup(gid, i, 3))


def test_a_member_waits_only_for_a_running_sibling_still_computing_the_prompt():
    gs = SampleGroups()
    a, b, c, other = member(0), member(1), member(2), member(0, gid="h")
    for sr in (a, b, c, other):
        gs.add(sr, {})
    running = {}
    assert gs.prefilling_sibling(b, running) is None          # nobody computes it yet: b may go first
    running[a.rid] = a
    assert gs.prefilling_sibling(b, running) is a and gs.prefilling_sibling(c, running) is a
    assert gs.prefilling_sibling(other, running) is None and gs.prefilling_sibling(a, running) is None
    a.req.computed_len = 3
    assert gs.prefilling_sibling(b, running) is a              # the last prompt token is not computed
    a.req.computed_len = 4
    assert gs.prefilling_sibling(b, running) is None           # the prompt is computed (and cached)
    running[a.rid] = member(0)                                 # the same rid, another request
    a.req.computed_len = 0
    assert gs.prefilling_sibling(b, running) is None


def test_remove_forgets_members_and_empty_groups():
    gs = SampleGroups()
    a, b = member(0), member(1)
    gs.add(a, {})
    gs.add(b, {})
    gs.remove(a)
    gs.remove(a)                                               # twice: a no-op
    assert len(gs) == 1
    gs.remove(b)
    assert len(gs) == 0
    lone = SchedReq(Req([1], SamplingParams()), tracker=None)
    gs.add(lone, {})
    gs.remove(lone)
    assert len(gs) == 0


def test_a_finished_member_still_holding_kv_is_a_fork_source_until_it_lets_go():
    from tandem.core.types import ReqStatus

    gs = SampleGroups()
    a, b = member(0), member(1)
    gs.add(a, {})
    a.req.computed_len, a.req.status = 4, ReqStatus.FINISHED_LENGTH   # held by a prefill connector
    holders = {a.rid: a}
    gs.add(b, holders)
    assert gs.computed_sibling(b, holders) is a and gs.computed_sibling(a, holders) is None
    assert gs.computed_sibling(member(2, prompt=(9, 9, 9, 9)), holders) is None
    gs.add(member(0, gid="next"), {})                          # a let go: pruned
    assert gs.computed_sibling(b, holders) is None and len(gs) == 2
