"""A ~900-token prompt one engine wrote to a REAL Mooncake store (127.0.0.1) is reused whole by
another at page size 1, where reading it beats recomputing it: the L3 read bound is sized in
tokens from the deadline and the store's measured read rate, not a fixed page count."""

from __future__ import annotations

import pytest

pytest.importorskip("mooncake.store")

from tandem.cache.tiers.l3 import mooncake as mc  # noqa: E402
from tandem.cache.tiers.l3.connect import attach_store, l3_options  # noqa: E402
from tandem.core.config import CacheConfig, EngineConfig  # noqa: E402
from tandem.core.types import SamplingParams  # noqa: E402
from tandem.engine.engine import Engine  # noqa: E402

SLOW_PREFILL_TOK_S = 20.0       # configured: recomputing 900 tokens takes 45 s, so reading wins


def engine(loaded, store):
    cc = CacheConfig(page_size=1, max_total_tokens=4096, debug_invariants=True, host_pool_tokens=0)
    e = Engine(EngineConfig(device="cpu", num_threads=1, cache=cc), loaded=loaded)
    opts = l3_options(store.address.url(), timeout_s=2.0, segment_bytes=0, prefill_tok_s=SLOW_PREFILL_TOK_S)
    assert attach_store(e.kv.cache, e.kv_pool, e.model_name, **opts) is not None
    return e


def long_prompt(e) -> list[int]:
    words = " ".join(f"item{i} costs {i * 7 % 97} coins;" for i in range(96))
    ids = e.tokenizer.encode(f"Price list: {words} Which item is cheapest?")
    assert 850 <= len(ids) <= 1200, len(ids)
    return ids


def test_a_900_token_prompt_is_reused_whole_by_another_worker(smollm2_default):
    store = mc.LocalStore(256 << 20)
    a = b = None
    try:
        a = engine(smollm2_default, store)
        ids = long_prompt(a)
        want = a.generate_many([a.make_request(ids, SamplingParams(max_tokens=4))], timeout=300)[0]
        assert want.error is None
        assert a.kv.cache.tier("l3").store.flush(30.0)
        b = engine(smollm2_default, store)
        tier = b.kv.cache.tier("l3")
        assert tier.budget.read_tok_s > SLOW_PREFILL_TOK_S, tier.as_dict()   # measured at attach
        got = b.generate_many([b.make_request(ids, SamplingParams(max_tokens=4))], timeout=300)[0]
        assert got.error is None and got.token_ids == want.token_ids
        assert got.cached_tokens == len(ids) - 1, (got.cached_tokens, len(ids), tier.as_dict())
        assert tier.stats.hit_pages >= len(ids) - 1 and tier.stats.miss_pages == 0, tier.as_dict()
        b.check_invariants()
    finally:
        for e in (a, b):
            if e is not None:
                e.shutdown()
        store.stop()
