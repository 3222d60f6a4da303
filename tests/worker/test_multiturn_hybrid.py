"""Issue 37 on hybrid models: a three-turn session through PrefillWorker + DecodeWorker (one
process, real NIXL, the default cost rule for local prefill) equals the colocated engine, on tiny
Gemma 3 (FULL + SWA, window 8) and Granite-4.0-H (FULL + MAMBA), page sizes 1 and 4.

Turn t > 0's prompt is turn t - 1's prompt, its reply and a few new tokens: the decode worker
holds all but the new ones, so it prefills turn t itself (its SWA rows of the kept window and
the recurrent state at the reply's end are its own cache's) and the two workers together compute
at most the new tokens plus one page. Every pool is owned exactly once after each turn.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from tandem.core.messages import GenerateRequest  # noqa: E402
from tandem.core.types import SamplingParams  # noqa: E402
from tandem.engine.engine import Engine  # noqa: E402

from hf_hybrid_support import hybrid_engine_config  # noqa: E402
from serve_support import PushClient, at_baseline, collect  # noqa: E402
from test_hybrid_workers import family, loop  # noqa: E402,F401  (the module's fixtures: tiny models, one loop)
from test_workers import LocalClient  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPLY = 16
FIRST = list(b"[0] tell me about hybrid models and their windows, please: ")
NEW = (list(b" and then?"), list(b" why so?"))   # shorter than a reply: the rule prefills here


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=REPLY, ignore_eos=True)


def _colocated(loaded, page_size) -> list[list[int]]:
    e = Engine(hybrid_engine_config(page_size=page_size), loaded=loaded)
    try:
        ids, replies = list(FIRST), []
        for t in range(3):
            replies.append(list(e.generate(ids, _params()).token_ids))
            if t < 2:
                ids = ids + replies[-1] + NEW[t]
        return replies
    finally:
        e.shutdown()


def _computed(*workers) -> int:
    return sum(w.engine.scheduler.stats["prompt_tokens_computed"] for w in workers)


@pytest.mark.parametrize("push", [False, True], ids=["local", "push"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_three_turns_through_1p1d_equal_colocated_and_compute_only_new_tokens(family, loop, page_size, push):
    """``push``: the prefill worker is given each finished reply (means b); a later turn then
    goes to it and computes only its new tokens there, or (a hybrid sequence that ends
    off a page boundary is not pushed) is prefilled on the decode worker."""
    from tandem.decode.worker import DecodeWorker
    from tandem.prefill.worker import PrefillWorker

    name, loaded = family
    ref = _colocated(loaded, page_size)
    cfg = hybrid_engine_config(page_size=page_size)

    async def make():
        p = PrefillWorker(f"mt-{name}{page_size}{push}-prefill", cfg, loaded=loaded, transfer_timeout_s=20)
        d = DecodeWorker(f"mt-{name}{page_size}{push}-decode", cfg, loaded=loaded, transfer_timeout_s=20,
                         local_prefill_threshold=None, reply_push=push)
        p.add_peer(d.handshake())
        d.add_peer(p.handshake())
        return p, d

    p, d = loop.run_until_complete(make())
    try:
        async def session():
            ids, got, computed = list(FIRST), [], []
            for t in range(3):
                before = _computed(p, d)
                greq = GenerateRequest(f"mt{t}", tuple(ids), _params())
                chunks = await collect(d.generate(greq, PushClient(p, d) if push else LocalClient(p)))
                await d.drain()   # the push runs off the critical path
                assert chunks[-1].error is None, chunks[-1].error
                got.append([x for c in chunks for x in c.token_ids])
                computed.append(_computed(p, d) - before)
                for w in (p, d):
                    await w.handle.check_invariants()
                if t < 2:
                    ids = ids + got[-1] + NEW[t]
            await at_baseline(p, d)
            return got, computed

        got, computed = loop.run_until_complete(session())
        assert got == ref
        if push:   # turn 0's sequence (page-aligned at both page sizes) was pushed: turn 1 went remote
            assert d.counts["pushed"] + d.counts["push_skipped"] == 3 and d.counts["pushed"] >= 1, d.counts
            assert d.counts["remote"] >= 2 and p.counts["stored_tokens"] > 0, (d.counts, p.counts)
        else:
            assert d.counts["remote"] == 1 and d.counts["local"] == 2, d.counts
        for t in (1, 2):
            assert computed[t] <= len(NEW[t - 1]) + page_size, (computed, page_size)
    finally:
        d.close()
        p.close()
