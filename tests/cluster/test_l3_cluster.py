"""``--kv-store mooncake://...`` through a real 2P+1D Ray cluster (NIXL, SmolLM2, HTTP; one per
module, workers lending nothing: pages live in the store's storage process): the launcher hands
every worker actor its L3 options, each joins the one master, and a prompt prefilled by prefill
worker 0 is served from L3 by prefill worker 1 (round robin routing sends the repeat there): the
usage's cached_tokens counts the L3 hit, and the text is unchanged. Then every worker is killed
and replaced, and a session's next turn is an L3 hit on the replacements (runs last: it kills
the cluster's workers)."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("mooncake.store")

from tandem.cache.tiers.l3 import mooncake as mc  # noqa: E402
from tandem.core.config import CacheConfig, EngineConfig, ServeConfig  # noqa: E402

from serve_support import Server  # noqa: E402

MESSAGES = [{"role": "user", "content": "Describe, in one sentence, how a lighthouse keeper spent a "
                                        "stormy night on a small rocky island far from the coast."}]


@pytest.fixture(scope="module")
def cluster(ray_local, smollm2_default):
    from tandem.cluster.launch import launch_disaggregated

    store = mc.LocalStore(64 << 20)   # workers lend nothing: pages live in its storage
    engine = EngineConfig(device="cpu", num_threads=1, cache=CacheConfig(page_size=16, max_total_tokens=2048))
    cfg = ServeConfig(prefill=2, decode=1, policy="round_robin", transfer_timeout_s=20.0,
                      engine_config=engine, kv_store=store.address.url(), kv_events=False,
                      l3_timeout_s=5.0,   # a loaded CI box: a slow first call would be a miss
                      local_prefill_threshold=0)   # a repeat goes to a prefill worker (the decode
                                                   # worker holds it and would otherwise prefill it)
    backend = launch_disaggregated(cfg, loaded=smollm2_default)
    server = Server(backend, cfg)
    yield backend, server
    server.stop()
    backend.close()
    store.stop()


def test_a_repeat_on_the_other_prefill_worker_hits_l3(cluster):
    _, server = cluster
    outs = [server.client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=8,
                                                  temperature=0) for _ in range(2)]
    assert outs[0].choices[0].message.content == outs[1].choices[0].message.content
    n = outs[0].usage.prompt_tokens
    cached = [o.usage.prompt_tokens_details.cached_tokens or 0 for o in outs]
    assert cached[0] == 0 and cached[1] == (n - 1) // 16 * 16, cached
    workers = _workers(server)
    l3 = {w["worker"]: w["l3"] for w in workers}
    assert len(l3) == 3 and all(v is not None for v in l3.values()), l3
    assert all(v["up"] for v in l3.values()), {k: (v["up"], v["store_errors"]) for k, v in l3.items()}
    assert sum(v["hit_pages"] for v in l3.values()) >= (n - 1) // 16
    assert all(w["invariants"] == "ok" and w["leaked_tokens"] == 0 for w in workers)


def _workers(server) -> list[dict]:
    import httpx

    kv = httpx.get(server.url + "/debug/kv", timeout=60).json()
    return kv["workers"] if isinstance(kv, dict) and "workers" in kv else kv


def _l3(server) -> dict:
    return {w["worker"]: w["l3"] for w in _workers(server)}


def test_a_session_whose_workers_were_killed_and_replaced_hits_l3(cluster):
    """Turn 1 and turn 2 of a session, then every prefill AND the decode worker are killed (no
    worker holds the prompt's KV any more) and the supervisor replaces them; the session's turn 2
    asked again is an L3 hit on the replacements (cached_tokens > 0, hit pages counted) and its
    text equals the same turn asked before the kill."""
    import time

    import httpx

    backend, server = cluster
    n = len(backend.prefills) + len(backend.decodes)

    def chat(messages):
        out = server.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8,
                                                    temperature=0)
        return out.choices[0].message.content, out.usage.prompt_tokens_details.cached_tokens or 0

    answer, _ = chat(MESSAGES)
    turn2 = MESSAGES + [{"role": "assistant", "content": answer},
                        {"role": "user", "content": "And what did he do at dawn?"}]
    want, _ = chat(turn2)
    old = {w.name for w in list(backend.prefills) + list(backend.decodes)}
    end = time.monotonic() + 60                  # every write-through queued has been tried
    while not all(v["store_puts"] + v["store_write_dropped"] + v["store_write_skipped"]
                  >= v["written_pages"] > 0
                  for v in _l3(server).values()):
        assert time.monotonic() < end, _l3(server)
        time.sleep(0.2)
    for w in list(backend.prefills) + list(backend.decodes):
        ray.kill(w.handle, no_restart=True)
    end = time.monotonic() + 240
    while True:
        h = httpx.get(server.url + "/health", timeout=30).json()
        if h["restarts"] >= n and not h["degraded"]:
            break
        assert time.monotonic() < end, f"workers were not replaced: {h}"
        time.sleep(0.5)
    got, cached = chat(turn2)
    assert got == want and cached > 0, (got, want, cached)
    workers = _workers(server)
    assert not old & {w["worker"] for w in workers}, "a replaced worker answered /debug/kv"
    assert sum(w["l3"]["hit_pages"] for w in workers) >= cached // 16, workers
    assert all(w["invariants"] == "ok" and w["leaked_tokens"] == 0 for w in workers)
