"""Issue 37, the route error: what the router predicts a request reuses equals what the engine
that computes its prompt reuses, within one page, when requests sharing a long prefix arrive
together (the agent workload's first turns: one system prompt, several sessions at once).

The router's prefix index records a prompt when it routes it (router/policies.py
``predicted_cached``: the later sessions are predicted to reuse the whole shared prefix). A
prompt longer than the step's budget is computed in chunks; a later sharer must wait until the
shared prefix is cached (engine/sched/queue_policy.py ``InStepPrefixes``), not start from whatever
part of it the first chunks cached, which recomputed the rest and missed the prediction by up
to a chunk. Real SmolLM2, the default fcfs policy, the shared prefix ending in the first
prompt's last chunk.
"""

from __future__ import annotations

import pytest

from tandem.core.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.core.types import SamplingParams
from tandem.engine.engine import Engine
from tandem.router.dispatch import Dispatcher
from tandem.router.policies import AdmissionLimits, PolicyConfig

PAGE = 4
CHUNK = 64
SYSTEM = ("You are a careful assistant for a small software team. Answer in plain prose, explain your "
          "reasoning briefly, and keep every answer focused on the question that was asked. Use the "
          "declared tools when a question needs a file, a search or a test run; never invent results. "
          "The team works on a storage engine written in Rust and Python: a write-ahead log, a "
          "buffer pool, B-tree and hash indexes, a query planner and a small SQL dialect. Prefer "
          "examples from that code base, name the module you mean, and say when you are unsure. "
          "Keep answers under two hundred words unless the question asks for a longer design.")
QUESTIONS = ("How does a hash map handle collisions?", "What does a write-ahead log protect against?",
             "When is a B-tree better than a hash index?")


@pytest.fixture(scope="module")
def engine(smollm2_default):
    e = Engine(EngineConfig(device="cpu", num_threads=1,
                            cache=CacheConfig(page_size=PAGE, max_total_tokens=4096, debug_invariants=True),
                            scheduler=SchedulerConfig(chunked_prefill_size=CHUNK)), loaded=smollm2_default)
    assert e.config.scheduler.schedule_policy == "fcfs"   # the default policy
    yield e
    e.shutdown()


def test_sessions_sharing_a_prompt_reuse_what_the_router_predicts(engine):
    d = Dispatcher("session", PolicyConfig(kv_block_size=PAGE), AdmissionLimits())
    d.add_worker(0, "prefill", "rp-prefill-0", 4096)
    d.add_worker(10, "decode", "rp-decode-0", 4096)
    tok = engine.tokenizer
    reqs = []
    for i, q in enumerate(QUESTIONS):
        ids = tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": q}]))
        reqs.append(engine.make_request(ids, SamplingParams(max_tokens=1), rid=f"rp{i}", session_id=f"s{i}"))
    predicted = [d.route(g).predicted_cached for g in reqs]
    shared = predicted[1]
    assert predicted[0] == 0 and shared > 2 * CHUNK and predicted[2] == shared, predicted
    # the first prompt's last chunk computes the end of the shared prefix and leaves budget over
    first = len(reqs[0].prompt_ids)
    assert (first - 1) // CHUNK * CHUNK < shared - PAGE and first % CHUNK < CHUNK - PAGE, (first, shared)
    engine.snapshot()   # the engine thread is idle before the three arrive together
    outs = {c.rid: c for c in engine.generate_many(reqs, timeout=300)}
    cached = [outs[g.rid].cached_tokens for g in reqs]
    assert all(abs(p - c) < PAGE for p, c in zip(predicted, cached)), (predicted, cached)
