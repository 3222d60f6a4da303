"""The router wired into a live cluster: real Ray actors, NIXL, SmolLM2, HTTP front door.

One cluster per module: 2 prefill + 2 decode workers, the session policy, KV events on, and a
tiny admission limit (one waiting request per prefill worker) so concurrent load gets 429s.
Order matters: the worker-kill tests run last (the cluster runs without relaunches; replacing
dead workers is test_serve_http.py's).
"""

from __future__ import annotations

import threading
import time

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tandem.core.config import CacheConfig, EngineConfig, ServeConfig  # noqa: E402

from serve_support import Server as _Server  # noqa: E402

ENGINE = EngineConfig(device="cpu", num_threads=1,
                      cache=CacheConfig(page_size=16, max_total_tokens=4096, max_running_requests=8))
CFG = ServeConfig(prefill=2, decode=2, transfer_timeout_s=30.0, engine_config=ENGINE, policy="session",
                  kv_events=True, admission_max_queue=1)
LONG = "Summarize: " + "the quick brown fox jumps over the lazy dog " * 120



@pytest.fixture(scope="module")
def cluster(smollm2_default, ray_local):
    from tandem.cluster.launch import launch_disaggregated

    # no relaunches: the kill tests run last and nothing here waits for a replacement (that is
    # test_serve_http.py's); two model loads fewer competing with the last test for the CPU
    backend = launch_disaggregated(CFG, loaded=smollm2_default, restart=False)
    server = _Server(backend, CFG)
    yield backend, server
    server.stop()
    backend.close()


def _chat_raw(server, messages, session=None, max_tokens=4):
    headers = {"X-Session-Id": session} if session else None
    raw = server.client.chat.completions.with_raw_response.create(
        model="smollm2", messages=messages, max_tokens=max_tokens, temperature=0, extra_headers=headers)
    return raw.headers.get("x-tandem-worker"), raw.parse()


def _metric(server, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_kv_events_fill_the_routers_block_index(cluster):
    from tandem.router.prefix_index import block_hashes

    backend, server = cluster
    ids = list(range(1000, 1100))     # 6 whole pages
    out = server.client.completions.create(model="smollm2", prompt=ids, max_tokens=2, temperature=0)
    assert out.choices[0].text is not None
    hashes = block_hashes(ids, ENGINE.cache.page_size)
    prefill_ids = {w.wid for w in backend.prefills}
    end = time.monotonic() + 10
    while True:
        with backend.dispatch.lock:
            ov = backend.dispatch.state.kv.overlap(hashes)
        held = {w: dev for w, (dev, _host) in ov.items() if w in prefill_ids}
        if held and max(held.values()) >= 5:
            break
        assert time.monotonic() < end, f"the index never saw the prompt's blocks: {ov}, {backend.feed.counts}"
        time.sleep(0.05)
    assert backend.feed.counts["malformed"] == 0
    # the metrics the router adds
    assert _metric(server, "tandem_routing_decision_seconds_count") >= 1
    assert 0.0 <= _metric(server, "tandem_cache_hit_ratio") <= 1.0
    text = httpx.get(server.url + "/metrics", timeout=30).text
    assert 'tandem_worker_load{role="prefill",worker="prefill-0"}' in text


def test_overload_is_a_429_with_retry_after_and_load_drains(cluster, monkeypatch):
    backend, server = cluster
    before = _metric(server, "tandem_rejected_requests_total", reason="overloaded")
    monkeypatch.setattr(backend.queue, "max_size", 0)   # the 429 path itself (the deferred queue: tests/router)
    results: list = [None] * 6

    def send(i):
        results[i] = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": "smollm2", "prompt": f"{i} {LONG[:1200]}", "max_tokens": 2, "temperature": 0})

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    codes = [r.status_code for r in results]
    assert 429 in codes and 200 in codes, [(r.status_code, r.text[:300]) for r in results]
    refused = [r for r in results if r.status_code == 429]
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "overloaded"
    assert _metric(server, "tandem_rejected_requests_total", reason="overloaded") - before == len(refused)
    ok = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": "smollm2", "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200, ok.text


def _decode_stats(backend) -> list[dict]:
    ws = [w for w in backend.decodes if w.alive]
    return ray.get([w.handle.stats.remote() for w in ws], timeout=30)


def test_a_prefill_worker_dying_before_its_write_is_redispatched(cluster):
    backend, server = cluster
    before = sum(s["redispatched"] for s in _decode_stats(backend))
    result: dict = {}

    def send():
        try:
            result["ok"] = server.client.completions.create(
                model="smollm2", prompt="Once more. " + LONG, max_tokens=2, temperature=0)
        except Exception as e:  # noqa: BLE001 - checked below
            result["err"] = e

    th = threading.Thread(target=send)
    th.start()
    victim = None
    end = time.monotonic() + 60
    while victim is None:
        assert time.monotonic() < end and th.is_alive(), f"the prompt never reached prefill: {result}"
        for p in [p for p in backend.prefills if p.alive]:
            s = ray.get(p.handle.stats.remote(), timeout=30)
            if s["running"] + s["waiting"] > 0:
                victim = p
                break
        else:
            time.sleep(0.01)
    ray.kill(victim.handle)
    th.join(timeout=60)
    assert not th.is_alive()
    assert "ok" in result, result
    assert result["ok"].choices[0].finish_reason in ("length", "stop")
    assert sum(s["redispatched"] for s in _decode_stats(backend)) == before + 1


def test_sessions_stick_to_a_decode_worker_and_move_when_it_dies(cluster):
    backend, server = cluster
    system = {"role": "system", "content": "You are a concise geography tutor. " * 10}
    # explicit session id
    msgs = [system, {"role": "user", "content": "Name the capital of Italy."}]
    w1, r1 = _chat_raw(server, msgs, session="s-explicit")
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "And of Spain?"}]
    w2, r2 = _chat_raw(server, msgs, session="s-explicit")
    assert w1 and w1 == w2
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    # no id: the fingerprint of the opening names the session
    fp = [{"role": "system", "content": "You answer in one word. " * 10},
          {"role": "user", "content": "Largest planet?"}]
    f1, q1 = _chat_raw(server, fp)
    fp += [{"role": "assistant", "content": q1.choices[0].message.content},
           {"role": "user", "content": "Smallest planet?"}]
    f2, q2 = _chat_raw(server, fp)
    assert f1 and f1 == f2
    assert q2.usage.prompt_tokens_details.cached_tokens > 0
    # kill the explicit session's decode worker: its next turn lands elsewhere, nothing fails
    victim = next(w for w in backend.decodes if w.name == w1)
    ray.kill(victim.handle)
    msgs += [{"role": "assistant", "content": r2.choices[0].message.content},
             {"role": "user", "content": "And of France?"}]
    w3, r3 = _chat_raw(server, msgs, session="s-explicit")
    assert w3 and w3 != w1 and r3.choices[0].message.content is not None
    f3, _ = _chat_raw(server, [{"role": "user", "content": "A new conversation."}])
    assert f3 and f3 != w1
