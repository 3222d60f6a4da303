"""Issue 37, means (b): a finished decode's sequence reaches the prefill worker that serves the
session's next turn (decode/reply_push.py -> prefill/store.py), so a turn whose new part goes to
the prefill worker computes only its new tokens there, not the previous reply again.

PrefillWorker + DecodeWorker in one process (no Ray): real engines, real NIXL, SmolLM2. Every
prompt goes to the prefill worker (``local_prefill_threshold=0``: means (a) off, so what is
measured is the push alone). Greedy text equals a colocated engine's over three turns; each
later turn computes (the prefill engine's ``prompt_tokens_computed``) at most its new tokens plus
one page; both pools return to baseline. With the fault lever ``debug_push_fault="fail"`` the push
moves nothing and frees its reservation: the next turn recomputes the reply, still equal text.
"""

from __future__ import annotations

import asyncio

import pytest

from tandem.core.config import CacheConfig, EngineConfig
from tandem.core.types import SamplingParams

PAGE = 4
CFG = EngineConfig(device="cpu", num_threads=1, cache=CacheConfig(page_size=PAGE, max_total_tokens=2048,
                                                                  max_running_requests=4))
SYSTEM = "You are a concise assistant. Answer in two or three sentences."
USERS = ("What is a hash map?", "And a balanced search tree?", "Which one suits a cache better?")
REPLY = 24


@pytest.fixture(scope="module")
def workers(smollm2_default):
    from serve_support import peered_workers
    from tandem.engine.engine import Engine

    loop = asyncio.new_event_loop()
    p, d = peered_workers(loop, "rp", CFG, smollm2_default, local_prefill_threshold=0)
    col = Engine(CFG, loaded=smollm2_default)
    yield p, d, col, loop
    for w in (p, d):
        w.close()
    col.shutdown()
    loop.close()


def run(loop, coro):
    return loop.run_until_complete(asyncio.wait_for(coro, 300))


def _computed(engine) -> int:
    return engine.stats()["prompt_tokens_computed"]


def _session(p, d, col, loop, tag: str) -> list[tuple[list[int], int, int]]:
    """Three turns through ``d`` (prefilled by ``p``) and through ``col``: per turn (decode's
    tokens, the prompt's new tokens, what the prefill engine computed); asserts equal text."""
    from serve_support import PushClient, at_baseline, collect

    client = PushClient(p, d)
    tok = col.tokenizer
    messages = [{"role": "system", "content": SYSTEM}]
    out, prev = [], 0
    for i, user in enumerate(USERS):
        messages.append({"role": "user", "content": f"{user} ({tag})"})
        ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        params = SamplingParams(max_tokens=REPLY)
        want = col.generate(list(ids), params).token_ids
        before = _computed(p.engine)
        greq = col.make_request(list(ids), params, rid=f"{tag}-{i}", session_id=tag)
        chunks = run(loop, collect(d.generate(greq, client)))
        got = [t for c in chunks for t in c.token_ids]
        assert got == want and chunks[-1].error is None, (i, chunks[-1])
        run(loop, d.drain())                          # the push runs off the critical path
        out.append((got, len(ids) - prev, _computed(p.engine) - before))
        prev = len(ids) + len(got)
        messages.append({"role": "assistant", "content": tok.decode(got)})
    run(loop, at_baseline(p, d))
    return out


def test_a_later_turn_computes_only_its_new_tokens_on_the_prefill_worker(workers):
    p, d, col, loop = workers
    stored = p.counts["stored_tokens"]
    turns = _session(p, d, col, loop, "push")
    for got, new, computed in turns[1:]:
        assert 0 < new < REPLY + 40
        assert computed <= new + PAGE, turns
    assert p.counts["stored_tokens"] - stored >= 2 * (REPLY - PAGE)
    assert d.counts["pushed"] >= 3


def test_a_failed_push_costs_a_recompute_not_a_wrong_token(workers):
    p, d, col, loop = workers
    failed = p.counts["store_failed"]
    d.debug_push_fault = "fail"
    try:
        turns = _session(p, d, col, loop, "fault")
    finally:
        d.debug_push_fault = ""
    assert p.counts["store_failed"] - failed == 3
    for got, new, computed in turns[1:]:
        assert computed >= new + REPLY - PAGE, turns     # the previous reply was computed again
