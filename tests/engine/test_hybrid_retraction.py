"""Retraction of hybrid requests (Gemma 3: FULL + SWA; Granite-4.0-H: FULL + MAMBA), tiny HF
directories: the host-backup path (FULL KV, the SWA window and a state checkpoint go to their
host pools and come back through the normal admission) and the recompute path.

Oracle: every request's greedy tokens (and streamed text) equal an uncontended run with the
prefix cache off, with ``debug_retract_every`` retracting a victim every few decode steps, the
cache's and the scheduler's ownership checks after every operation and step (every pool: full,
SWA, state, host, host SWA, host state), and every pool back to idle at the end. A host-tier
round trip (evict everything to the host, match, load back) gives the same tokens as well.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from tandem.core.types import SamplingParams  # noqa: E402
from tandem.engine.engine import Engine  # noqa: E402
from tandem.engine.hybrid import HybridConfig  # noqa: E402

from hf_hybrid_support import hybrid_engine_config, tiny_family  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [list(f"Request {i}: a prompt longer than the window, {'x' * (5 * i)} answer:".encode())
           for i in range(4)]
MAX_TOKENS = 14


@pytest.fixture(scope="module", params=["gemma3", "granite"])
def family(request, tmp_path_factory):
    _, loaded = tiny_family(request.param, tmp_path_factory)
    ref = Engine(hybrid_engine_config(disable=True, max_total_tokens=1024), loaded=loaded)
    try:
        outs = [ref.generate(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for p in PROMPTS]
    finally:
        ref.shutdown()
    return request.param, loaded, outs


def _run(e: Engine):
    reqs = [e.make_request(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for p in PROMPTS]
    return e.generate_many(reqs, timeout=300)


def _assert_idle(e: Engine) -> None:
    e.check_invariants()
    snap = e.snapshot()
    assert (snap.available_tokens + snap.evictable_tokens, snap.locked_tokens, snap.retracted) == \
        (e.allocator.size, 0, 0)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("host", [True, False], ids=["host_backup", "recompute"])
def test_retracted_hybrid_requests_match_an_uncontended_run(family, host, page_size):
    name, loaded, ref = family
    cfg = hybrid_engine_config(page_size=page_size, retract_every=3,
                               host_pool_tokens=2048 if host else 0)
    e = Engine(cfg, loaded=loaded, hybrid=HybridConfig(state_slots=12))
    try:
        outs = _run(e)
        _assert_idle(e)
        st = dict(e.scheduler.stats)
        usage = e.cache.host.usage() if e.cache.host is not None else {}
    finally:
        e.shutdown()
    for i, (c, r) in enumerate(zip(outs, ref)):
        assert c.error is None and c.token_ids == r.token_ids, f"{name} request {i} differs"
        assert c.text == r.text
    assert st["retractions"] > 0
    if host:
        assert st["retraction_restores"] > 0 and st["retraction_recomputes"] == 0
        assert st["backup_tokens"] > 0 and st["restore_tokens"] > 0
        comp = "swa" if name == "gemma3" else "mamba"
        assert set(usage) == {"full", comp}
    else:
        assert st["retraction_recomputes"] == st["retractions"] and st["retraction_restores"] == 0


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_host_tier_round_trip_serves_the_same_tokens(family, policy):
    """Run, evict every cached node to the host, run again: the second run's prefixes are loaded
    back from the host (FULL pages, SWA window / checkpoint) and the tokens do not change."""
    name, loaded, ref = family
    cfg = hybrid_engine_config(host_pool_tokens=2048).model_copy(deep=True)
    cfg = cfg.model_validate({**cfg.model_dump(), "cache": {**cfg.cache.model_dump(),
                                                             "host_write_policy": policy}})
    e = Engine(cfg, loaded=loaded, hybrid=HybridConfig(state_slots=24, host_state_slots=48))
    try:
        first = _run(e)
        evicted = e.evict(10**9).result(30)
        assert evicted > 0 and e.snapshot().evictable_tokens == 0
        second = _run(e)
        _assert_idle(e)
        usage = e.cache.host.usage()
    finally:
        e.shutdown()
    comp = "swa" if name == "gemma3" else "mamba"
    assert usage["full"][0] > 0 and usage[comp][0] > 0
    for i, (a, b, r) in enumerate(zip(first, second, ref)):
        assert a.token_ids == r.token_ids and b.token_ids == r.token_ids, f"{name} request {i}"
        assert b.cached_tokens > 0, f"{name} request {i}: nothing reused from the host"
