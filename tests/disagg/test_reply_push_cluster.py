"""Issue 37, means (b) on a real 1P+1D cluster (Ray, NIXL, SmolLM2): with the defaults (reply
push on, the local-prefill cost rule), each finished reply reaches the prefill worker
(``tandem_prefill_stored_tokens_total``), so a session's later turns go to it and compute at
most their new tokens plus one page (``tandem_worker_prompt_tokens_computed_total``, every
worker); greedy text equals colocated's; the router's ``tandem_route_cached_tokens_error`` is
within one page on every request of the session.
"""

from __future__ import annotations

import pytest

from serve_support import Server

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from tandem.core.config import CacheConfig, EngineConfig, ServeConfig  # noqa: E402

PAGE = 16
ENGINE = EngineConfig(device="cpu", num_threads=1,
                      cache=CacheConfig(page_size=PAGE, max_total_tokens=8192, max_running_requests=8))
CFG = ServeConfig(prefill=1, decode=1, transfer_timeout_s=30.0, engine_config=ENGINE)
M = "smollm2"
SYSTEM = "You are a careful assistant. Answer in plain prose and keep to the question."
USERS = ("Describe how a hash map handles collisions.",
         "Now compare that with a balanced binary search tree, and say which operations each makes "
         "cheap, which it makes expensive, how each behaves as it grows, and what memory it needs.",
         "Which of the two would you pick for a cache that must evict its least recently used "
         "entry, what else would the cache need besides the map, and how would the pieces fit?")
REPLY = 48


@pytest.fixture(scope="module")
def servers(smollm2_default, ray_local):
    from tandem.cluster.launch import launch_disaggregated
    from tandem.engine.engine import Engine
    from tandem.router.backend import LocalEngineBackend

    assert CFG.reply_push == "on" and CFG.local_prefill_threshold is None   # the defaults under test
    backend = launch_disaggregated(CFG, loaded=smollm2_default)
    engine = Engine(ENGINE, loaded=smollm2_default)
    out = [Server(backend, CFG, "1P+1D"), Server(LocalEngineBackend(engine), CFG, "colocated")]
    yield out
    for s in out:
        s.stop()
    backend.close()
    engine.shutdown()


def _metric(server, name: str, **labels) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(x.value for f in text_string_to_metric_families(text) for x in f.samples
               if x.name == name and all(x.labels.get(k) == v for k, v in labels.items()))


def _session(server, computed=None) -> list[tuple[str, int, int, float]]:
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for user in USERS:
        messages.append({"role": "user", "content": user})
        before = computed() if computed else 0.0
        r = server.client.chat.completions.create(model=M, messages=messages, max_tokens=REPLY,
                                                  temperature=0, extra_body={"session_id": "push37"})
        text = r.choices[0].message.content
        out.append((text, r.usage.prompt_tokens, r.usage.completion_tokens,
                    (computed() - before) if computed else 0.0))
        messages.append({"role": "assistant", "content": text})
    return out


def test_later_turns_compute_their_new_tokens_on_the_prefill_worker(servers):
    disagg, colocated = servers
    computed = lambda: _metric(disagg, "tandem_worker_prompt_tokens_computed_total")   # noqa: E731
    err = "tandem_route_cached_tokens_error"
    n0, ok0 = _metric(disagg, f"{err}_count"), _metric(disagg, f"{err}_bucket", le=f"{PAGE:.1f}")
    remote0 = _metric(disagg, "tandem_decode_prefill_total", path="remote")
    got = _session(disagg, computed)
    want = _session(colocated)
    assert [t[0] for t in got] == [t[0] for t in want]           # greedy text
    for i in (1, 2):
        new = got[i][1] - got[i - 1][1] - got[i - 1][2]
        assert 0 < new, got
        assert got[i][3] <= new + PAGE, (i, got[i][3], new, got)
    assert _metric(disagg, "tandem_prefill_stored_tokens_total") >= 2 * (REPLY - PAGE)
    assert _metric(disagg, "tandem_decode_prefill_total", path="remote") - remote0 == 3
    assert _metric(disagg, f"{err}_count") - n0 == 3
    assert _metric(disagg, f"{err}_bucket", le=f"{PAGE:.1f}") - ok0 == 3   # every request within a page
