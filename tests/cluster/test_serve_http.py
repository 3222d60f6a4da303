"""``tandem serve`` end to end: real Ray actors, real NIXL, SmolLM2, HTTP through the openai client.

One cluster per module (1 prefill + 2 decode workers, restarts on) behind the real front door,
plus a colocated server (LocalEngineBackend) for the reference outputs. Worker-kill tests run
last; the final test waits for the monitor to have replaced both killed workers (alone, it kills
them itself).
"""

from __future__ import annotations

import threading
import time

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from tandem.core.config import CacheConfig, EngineConfig, ServeConfig  # noqa: E402

from serve_support import Server  # noqa: E402

ENGINE = EngineConfig(device="cpu", num_threads=1,
                      cache=CacheConfig(page_size=16, max_total_tokens=4096, max_running_requests=8))
CFG = ServeConfig(prefill=1, decode=2, transfer_timeout_s=10.0, engine_config=ENGINE)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


_Server = Server


@pytest.fixture(scope="module")
def servers(smollm2_default, ray_local):
    from tandem.cluster.launch import launch_disaggregated
    from tandem.engine.engine import Engine
    from tandem.router.backend import LocalEngineBackend

    backend = launch_disaggregated(CFG, loaded=smollm2_default)   # one load, shared via the object store
    colocated = Engine(ENGINE, loaded=smollm2_default)
    disagg, coloc = _Server(backend, CFG), _Server(LocalEngineBackend(colocated), CFG)
    yield backend, disagg, coloc
    disagg.stop()
    coloc.stop()
    backend.close()
    colocated.shutdown()


def _chat(server, messages, **kw):
    kw.setdefault("max_tokens", 16)
    kw.setdefault("temperature", 0)
    return server.client.chat.completions.create(model="smollm2", messages=messages, **kw)


def _stats(backend) -> dict[str, dict]:
    ws = [w for w in backend.prefills + backend.decodes if w.alive]
    return dict(zip([w.name for w in ws], ray.get([w.handle.stats.remote() for w in ws], timeout=30)))


def _wait_baseline(backend, timeout=20.0) -> dict[str, dict]:
    end = time.monotonic() + timeout
    while True:
        stats = _stats(backend)
        if all(s["available_tokens"] + s["evictable_tokens"] == s["total_tokens"]
               and s["live_transfers"] == 0 and s.get("held", 0) == 0 and s.get("reserved", 0) == 0
               for s in stats.values()):
            return stats
        if time.monotonic() > end:
            raise AssertionError(f"pages still owned by requests: {stats}")
        time.sleep(0.1)


def _bytes_moved(server) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text)
               if f.name == "tandem_kv_transfer_bytes" for s in f.samples if s.name.endswith("_total"))


def test_chat_streamed_and_not_and_greedy_equals_colocated(servers):
    backend, disagg, coloc = servers
    ref = _chat(coloc, QUESTION)
    out = _chat(disagg, QUESTION)
    assert out.choices[0].message.content == ref.choices[0].message.content
    assert out.choices[0].message.content.strip()
    assert out.choices[0].finish_reason == ref.choices[0].finish_reason
    assert out.usage.prompt_tokens == ref.usage.prompt_tokens
    assert out.usage.completion_tokens == ref.usage.completion_tokens
    stream = _chat(disagg, QUESTION, stream=True, stream_options={"include_usage": True})
    parts, usage, finish = [], None, None
    for ev in stream:
        if ev.choices:
            parts.append(ev.choices[0].delta.content or "")
            finish = ev.choices[0].finish_reason or finish
        if ev.usage is not None:
            usage = ev.usage
    assert "".join(parts) == ref.choices[0].message.content
    assert finish == ref.choices[0].finish_reason and usage.completion_tokens == ref.usage.completion_tokens
    _wait_baseline(backend)


def test_metrics_and_health_are_cluster_wide(servers):
    import httpx

    backend, disagg, _ = servers
    text = httpx.get(disagg.url + "/metrics", timeout=30).text
    for name in ("tandem_kv_transfer_bytes_total{", "tandem_kv_transfer_seconds_bucket{",
                 "tandem_requests_total{", "tandem_worker_kv_used_tokens{", "tandem_decode_prefill_total{",
                 'worker="prefill-0"', 'worker="decode-'):
        assert name in text, name
    h = httpx.get(disagg.url + "/health", timeout=30).json()
    assert h["status"] == "ok" and h["prefill_alive"] == 1 and h["decode_alive"] == 2


def test_grafana_dashboard_references_only_metrics_a_live_server_exports(servers):
    """k8s/base/dashboards/tandem.json may chart only series that this live `tandem serve`
    (1 prefill + 2 decode, disaggregated) exports on /metrics, after it has served requests."""
    import sys
    from pathlib import Path

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "k8s"))
    from k8s_support import k8s_dashboard_metric_names

    backend, disagg, _ = servers
    _chat(disagg, QUESTION)
    text = httpx.get(disagg.url + "/metrics", timeout=30).text
    exported = {smp.name for f in text_string_to_metric_families(text) for smp in f.samples}
    wanted = k8s_dashboard_metric_names()
    assert wanted, "the dashboard should chart something"
    missing = sorted(wanted - exported)
    assert not missing, f"dashboard series not exported by a live server: {missing}"


def test_second_turn_of_a_session_is_cached_and_moves_fewer_bytes(servers):
    backend, disagg, _ = servers
    system = {"role": "system", "content": "You are a concise geography tutor. " * 12}
    turn1 = [system, {"role": "user", "content": "Name the capital of Italy."}]
    b0 = _bytes_moved(disagg)
    r1 = _chat(disagg, turn1, extra_body={"session_id": "sess-1"})
    b1 = _bytes_moved(disagg)
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "And of Spain?"}]
    r2 = _chat(disagg, turn2, extra_body={"session_id": "sess-1"})
    b2 = _bytes_moved(disagg)
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    assert 0 <= b2 - b1 < b1 - b0         # none when the decode worker prefills the turn itself
    _wait_baseline(backend)


def test_a_prompt_larger_than_the_decode_pool_is_a_400(servers):
    backend, disagg, _ = servers
    big = [{"role": "user", "content": "fox " * (ENGINE.cache.max_total_tokens + 200)}]
    with pytest.raises(openai.BadRequestError, match="KV pool"):
        _chat(disagg, big, max_tokens=2)
    _wait_baseline(backend)


def test_abort_mid_stream_frees_every_page_on_both_sides(servers):
    backend, disagg, _ = servers
    stream = _chat(disagg, QUESTION, stream=True, max_tokens=400, extra_body={"ignore_eos": True})
    got = 0
    for ev in stream:
        if ev.choices and ev.choices[0].delta.content:
            got += 1
            if got == 3:
                break
    stream.close()
    assert got == 3
    _wait_baseline(backend)


def _inflight(backend, timeout=30.0) -> str:
    end = time.monotonic() + timeout
    while not backend.inflight:
        assert time.monotonic() < end, "the request never reached a decode worker"
        time.sleep(0.01)
    return next(iter(backend.inflight))


def test_with_no_failovers_killing_a_decode_worker_fails_its_request_and_serving_goes_on(servers, monkeypatch):
    """``--max-failovers 0``: the request its worker held ends with an error event naming the worker
    (the default resumes it on the peer: tests/cluster/test_gray_failures.py)."""
    backend, disagg, _ = servers
    monkeypatch.setattr(backend, "cfg", backend.cfg.model_copy(update={"max_failovers": 0}))
    stream = _chat(disagg, QUESTION, stream=True, max_tokens=400, extra_body={"ignore_eos": True})
    events = iter(stream)
    next(events)
    victim = backend.inflight[_inflight(backend)]
    t0 = time.monotonic()
    ray.kill(victim.handle)
    with pytest.raises(openai.APIError, match="died during the request"):
        for _ in events:
            pass
    assert time.monotonic() - t0 < CFG.transfer_timeout_s
    assert not victim.alive
    out = _chat(disagg, QUESTION)      # the surviving decode worker answers at once
    assert out.choices[0].message.content.strip()


def test_killing_the_prefill_worker_loses_no_request_and_serving_goes_on(servers, monkeypatch):
    """The request the killed worker was prefilling had sent nothing to the client: the router
    routes it again without that worker (decode prefills it locally) and it completes, with the
    colocated server's text. The router re-routes as soon as the death is seen, not after the
    transfer timeout: that moment is bounded by ``transfer_timeout_s``; the completion after it
    is a local prefill of the whole prompt, as long as the machine takes (CI once needed 10.5 s)."""
    backend, disagg, coloc = servers
    # ~1,350 tokens, three 512-token prefill chunks: stats() answers between engine steps, so the
    # first "busy" is seen after a chunk at the latest and the kill still lands mid-prefill
    long = [{"role": "user", "content": "Summarize: " + "the quick brown fox jumps over the lazy dog " * 150}]
    result: dict = {}
    rerouted: list[float] = []
    reroute = backend.dispatch.reroute

    def spy(r, dead):
        rerouted.append(time.monotonic())
        return reroute(r, dead)

    monkeypatch.setattr(backend.dispatch, "reroute", spy)

    def send():
        try:
            result["ok"] = _chat(disagg, long, max_tokens=4)
        except Exception as e:  # noqa: BLE001 - the test checks what it was
            result["err"] = e

    th = threading.Thread(target=send)
    th.start()
    victim = backend.prefills[0]
    end = time.monotonic() + 60
    def busy() -> bool:
        s = ray.get(victim.handle.stats.remote(), timeout=30)
        return s["running"] + s["waiting"] > 0

    while not busy():
        assert time.monotonic() < end and th.is_alive(), f"the prompt never reached prefill: {result}"
        time.sleep(0.02)
    t0 = time.monotonic()
    ray.kill(victim.handle)
    th.join(timeout=120)
    assert not th.is_alive()
    assert "ok" in result, result
    assert len(rerouted) == 1 and rerouted[0] - t0 < CFG.transfer_timeout_s, (rerouted, t0)
    want = _chat(coloc, long, max_tokens=4)
    assert result["ok"].choices[0].message.content == want.choices[0].message.content
    out = _chat(disagg, QUESTION)      # decode prefills locally until a prefill worker is back
    assert out.choices[0].message.content.strip()


def test_dead_workers_are_replaced_and_the_cluster_is_whole_again(servers):
    """The monitor replaces the workers the kill tests above killed (a decode worker and the prefill
    worker); run without them, this test kills the same two itself first."""
    import httpx

    backend, disagg, coloc = servers
    h = httpx.get(disagg.url + "/health", timeout=30).json()
    if h["restarts"] == 0 and not h["degraded"]:        # nothing was killed before this test
        for victim in (backend.decodes[0], backend.prefills[0]):
            ray.kill(victim.handle)
    end = time.monotonic() + 240
    while True:
        h = httpx.get(disagg.url + "/health", timeout=30).json()
        if h["restarts"] >= 2 and not h["degraded"]:
            break
        assert time.monotonic() < end, f"workers were not replaced: {h}"
        time.sleep(0.5)
    assert h["prefill_alive"] == 1 and h["decode_alive"] == 2
    ref = _chat(coloc, QUESTION)
    for _ in range(2):   # both decode workers (round-robin), prefilled remotely again
        assert _chat(disagg, QUESTION).choices[0].message.content == ref.choices[0].message.content
    stats = _wait_baseline(backend)
    assert sum(s.get("remote", 0) for s in stats.values()) >= 1
