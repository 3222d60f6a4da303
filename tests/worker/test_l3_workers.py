"""Two prefill workers and a decode worker in one process (no Ray; real engines, NIXL and a REAL
Mooncake master with its storage process): each joins the store from its ``l3`` options (what
cluster/launch.py hands the actors for ``--kv-store mooncake://...``), lending it nothing. A
prompt prefilled on worker 1 is served from L3 on worker 2 (cached_tokens > 0 in the usage), the
greedy output is unchanged, the L3 series are on the worker's /metrics and its /debug/kv, and
every pool returns to its baseline."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("mooncake.store")

from serve_support import LocalClient, at_baseline, collect  # noqa: E402

from tandem.cache.tiers.l3 import mooncake as mc  # noqa: E402
from tandem.cache.tiers.l3.connect import l3_options  # noqa: E402
from tandem.core.config import CacheConfig, EngineConfig  # noqa: E402
from tandem.core.types import SamplingParams  # noqa: E402

PAGE = 4
CFG = EngineConfig(device="cpu", num_threads=1, cache=CacheConfig(page_size=PAGE, max_total_tokens=768,
                                                                  max_running_requests=6))
PROMPT = "Name three rivers of Europe and say which one is the longest, in one sentence."


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def cluster(smollm2_default, loop):
    from tandem.decode.worker import DecodeWorker
    from tandem.engine.engine import Engine
    from tandem.prefill.worker import PrefillWorker

    master = mc.LocalStore(64 << 20)   # workers lend nothing: pages live in its storage
    l3 = l3_options(master.address.url(), timeout_s=2.0)

    async def make():
        p1 = PrefillWorker("l3-prefill-1", CFG, loaded=smollm2_default, transfer_timeout_s=20, l3=l3)
        p2 = PrefillWorker("l3-prefill-2", CFG, loaded=smollm2_default, transfer_timeout_s=20, l3=l3)
        d = DecodeWorker("l3-decode", CFG, loaded=smollm2_default, transfer_timeout_s=20, l3=l3)
        for p in (p1, p2):
            p.add_peer(d.handshake())
            d.add_peer(p.handshake())
        return p1, p2, d

    p1, p2, d = loop.run_until_complete(make())
    colocated = Engine(CFG, loaded=smollm2_default)
    yield p1, p2, d, colocated
    for w in (p1, p2, d):
        w.close()
    colocated.shutdown()
    master.stop()


def run(loop, coro):
    return loop.run_until_complete(asyncio.wait_for(coro, 120))


def test_a_prompt_prefilled_on_worker_1_is_served_from_l3_on_worker_2(cluster, loop):
    p1, p2, d, col = cluster
    assert p1.l3 is not None and p2.l3 is not None and d.l3 is not None
    ref = col.generate(PROMPT, SamplingParams(max_tokens=10), chat=True)
    first = run(loop, collect(d.generate(col.make_request(PROMPT, SamplingParams(max_tokens=10), chat=True,
                                                          rid="r1"), LocalClient(p1))))
    assert p1.l3.store.flush(10.0)
    d.engine.evict(1 << 20).result(30)          # decode forgets it: worker 2 prefills it all
    second = run(loop, collect(d.generate(col.make_request(PROMPT, SamplingParams(max_tokens=10), chat=True,
                                                           rid="r2"), LocalClient(p2))))
    for chunks in (first, second):
        assert [t for c in chunks for t in c.token_ids] == ref.token_ids
    usable = (ref.prompt_tokens - 1) // PAGE * PAGE
    assert first[-1].cached_tokens == 0
    assert second[-1].cached_tokens == usable, "worker 2 should reuse every page worker 1 stored"
    assert p2.l3.stats.hit_pages == usable // PAGE
    text = p2.metrics_text().decode()
    assert f"tandem_l3_hit_pages_total{{role=\"prefill\",worker=\"l3-prefill-2\"}} {usable // PAGE}.0" in text
    assert "tandem_l3_prefetch_seconds_total" in text and "tandem_l3_up" in text
    dbg = run(loop, p2.debug_kv())
    assert dbg["invariants"] == "ok" and dbg["l3"]["hit_pages"] == usable // PAGE
    assert dbg["l3"]["store_corrupt"] == 0
    run(loop, at_baseline(p1, p2, d))
