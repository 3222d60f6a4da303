"""A new KV flow as one policy and one option: the P->P prefix warm-up (prefill/warmup.py,
``WorkerOptions.prefix_warmup``). Two PrefillWorkers and a DecodeWorker in one process (no Ray):
real engines, real NIXL, SmolLM2. Prefill worker A computes a popular prefix and WRITEs it into
pages prefill worker B reserved; B caches it. A request sharing the prefix, prefilled by B for a
decode worker, then reads the prefix from B's cache (cached tokens > 0, B computes only past it)
and its greedy text equals a cold colocated run; every pool returns to baseline.
"""

from __future__ import annotations

import asyncio

import pytest

from tandem.core.config import CacheConfig, EngineConfig
from tandem.core.types import SamplingParams

PAGE = 4
CFG = EngineConfig(device="cpu", num_threads=1, cache=CacheConfig(page_size=PAGE, max_total_tokens=2048,
                                                                  max_running_requests=4))
SYSTEM = "You are a careful assistant for a bakery. Keep every answer short and friendly, and never guess prices."


@pytest.fixture(scope="module")
def workers(smollm2_default):
    from tandem.decode.worker import DecodeWorker
    from tandem.engine.engine import Engine
    from tandem.prefill.worker import PrefillWorker

    loop = asyncio.new_event_loop()

    async def make():
        a = PrefillWorker("warm-a", CFG, loaded=smollm2_default, transfer_timeout_s=20)
        b = PrefillWorker("warm-b", CFG, loaded=smollm2_default, transfer_timeout_s=20, prefix_warmup=True)
        d = DecodeWorker("warm-d", CFG, loaded=smollm2_default, transfer_timeout_s=20, reply_push=False)
        a.add_peer(b.handshake())
        b.add_peer(a.handshake())
        b.add_peer(d.handshake())
        d.add_peer(b.handshake())
        return a, b, d

    a, b, d = loop.run_until_complete(make())
    col = Engine(CFG, loaded=smollm2_default)
    yield a, b, d, col, loop
    for w in (a, b, d):
        w.close()
    col.shutdown()
    loop.close()


def run(loop, coro):
    return loop.run_until_complete(asyncio.wait_for(coro, 300))


def test_a_warmed_prefix_is_read_from_the_receiving_cache(workers):
    from serve_support import LocalClient, at_baseline, collect

    a, b, d, col, loop = workers
    tok = col.tokenizer
    prompt, other = (tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                          {"role": "user", "content": user}]),
                                add_special_tokens=False)
                     for user in ("Do you sell rye bread?", "When do you open?"))
    common = next(i for i, (x, y) in enumerate(zip(prompt, other)) if x != y)
    prefix = prompt[:common]                                   # the system turn: the popular prefix
    assert len(prefix) > 4 * PAGE

    got = run(loop, b.warm(prefix, LocalClient(a)))            # A computes and writes; B caches
    assert got >= len(prefix) - PAGE and b.counts["stored_tokens"] == got
    assert a.counts["ok"] == 1 and a.counts["bytes"] > 0       # it moved over NIXL, A -> B

    params = SamplingParams(max_tokens=12)
    want = col.generate(list(prompt), params).token_ids          # the cold run
    before = b.engine.stats()["prompt_tokens_computed"]
    chunks = run(loop, collect(d.generate(col.make_request(list(prompt), params, rid="warm-1"), LocalClient(b))))
    assert [t for c in chunks for t in c.token_ids] == want and chunks[-1].error is None, chunks[-1]
    assert chunks[-1].cached_tokens >= len(prefix) - PAGE        # B read the prefix from its cache
    assert b.engine.stats()["prompt_tokens_computed"] - before <= len(prompt) - len(prefix) + PAGE
    run(loop, at_baseline(a, b, d))


def test_warm_up_is_an_option(workers):
    from serve_support import LocalClient

    a, b, d, col, loop = workers
    with pytest.raises(ValueError, match="prefix_warmup is off"):
        run(loop, a.warm([1, 2, 3, 4, 5], LocalClient(b)))
