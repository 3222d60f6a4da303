"""The session table and the conversation fingerprint."""

from __future__ import annotations

import pytest

from tandem.router.sessions import SessionTable, fingerprint


def test_bind_get_and_turns():
    t = SessionTable(ttl_s=10)
    assert t.get("a", 0.0) is None and t.get(None, 0.0) is None
    t.bind("a", 1, 5, now=0.0)
    e = t.get("a", 3.0)
    assert (e.prefill_worker, e.decode_worker, e.last_touched, e.turns) == (1, 5, 0.0, 1)
    t.bind("a", 2, 6, now=4.0)
    e = t.get("a", 4.0)
    assert (e.prefill_worker, e.decode_worker, e.last_touched, e.turns) == (2, 6, 4.0, 2)
    t.bind(None, 0, 0, now=5.0)                  # no key: nothing recorded
    assert len(t) == 1


def test_ttl_makes_entries_absent_and_restarts_turns():
    t = SessionTable(ttl_s=10)
    t.bind("a", 1, 5, now=0.0)
    assert t.get("a", 10.0) is not None
    assert t.get("a", 10.5) is None
    t.bind("a", 3, 7, now=20.0)                  # a stale entry starts over
    assert t.get("a", 20.0).turns == 1
    t.bind("b", 0, 4, now=21.0)
    assert t.expire(31.0) == 1 and len(t) == 1   # "a" (20.0) is past 10 s; "b" is not
    assert t.get("b", 31.0) is not None


def test_bounded_least_recently_touched_first():
    t = SessionTable(ttl_s=100, max_sessions=2)
    t.bind("a", 0, 2, now=0.0)
    t.bind("b", 1, 3, now=1.0)
    t.bind("a", 0, 2, now=2.0)                   # touch "a": "b" is now the oldest
    t.bind("c", 1, 2, now=3.0)
    assert t.get("b", 3.0) is None
    assert t.get("a", 3.0) is not None and t.get("c", 3.0) is not None


def test_forget_worker():
    t = SessionTable()
    t.bind("a", 0, 2, now=0.0)
    t.bind("b", 1, 2, now=0.0)
    t.bind("c", 1, 3, now=0.0)
    assert t.forget_worker(2) == 2
    assert t.get("c", 0.0) is not None and len(t) == 1


def test_bad_arguments():
    with pytest.raises(ValueError):
        SessionTable(ttl_s=0)
    with pytest.raises(ValueError):
        SessionTable(max_sessions=0)


CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is KV cache?"}]


def test_fingerprint_is_stable_across_turns_and_processes():
    fp = fingerprint(CHAT)
    later = CHAT + [{"role": "assistant", "content": "A cache of keys and values."},
                    {"role": "user", "content": "And paging?"}]
    assert fingerprint(later) == fp
    assert fingerprint([dict(m) for m in CHAT]) == fp
    # pinned: BLAKE2b of the canonical JSON, so every router replica and restart agrees
    assert fp == 5215104352613949656
    assert 0 <= fp < 2 ** 63


def test_fingerprint_tells_conversations_apart():
    fp = fingerprint(CHAT)
    assert fingerprint([CHAT[0], {"role": "user", "content": "What is a KV cache?"}]) != fp
    assert fingerprint([{"role": "system", "content": "You are verbose."}, CHAT[1]]) != fp
    assert fingerprint(CHAT[1:]) != fp                        # the system prompt counts
    parts = [CHAT[0], {"role": "user", "content": [{"type": "text", "text": "What is KV cache?"}]}]
    assert fingerprint(parts) == fp                           # content parts read as their text


def test_fingerprint_needs_a_user_message():
    assert fingerprint([]) is None
    assert fingerprint([{"role": "system", "content": "x"}]) is None
