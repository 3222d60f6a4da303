"""Retraction victim order (pure function): SGLang's default and the session-aware policy."""

from tandem.core.types import Req, SamplingParams
from tandem.engine.sched.retraction import pick_victim


def req(prompt_len, outputs, session=None):
    r = Req(list(range(prompt_len)), SamplingParams(max_tokens=64), session_id=session)
    r.output_ids = list(range(outputs))
    return r


def test_default_fewest_outputs_then_longest_prompt():
    a, b, c = req(10, 5), req(30, 2), req(50, 2)
    assert pick_victim([a, b, c]) is c
    assert pick_victim([a, b]) is b
    assert pick_victim([]) is None


def test_session_policy_retracts_the_least_recently_active_session_first():
    seen = {"old": 1.0, "mid": 5.0, "new": 9.0}
    fresh = req(10, 0, "new")          # the default policy would pick this one (no outputs)
    stale = req(10, 40, "old")
    mid = req(10, 20, "mid")
    assert pick_victim([fresh, stale, mid]) is fresh
    assert pick_victim([fresh, stale, mid], "session", seen) is stale
    anon = req(10, 50)                 # no session: treated as least recently active
    assert pick_victim([fresh, stale, anon], "session", seen) is anon
