"""SSE framing, client disconnect -> backend.abort(rid), /health and /metrics. Against ScriptedBackend
(a test double standing in for the engine)."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

M = "scripted-model"


@pytest.fixture()
def script(live) -> str:
    """What ScriptedBackend replies, one character per token."""
    return live.backend.script


def sample(text: str, name: str, **labels) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_sse_framing(script, live):
    body = {"model": M, "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 4}
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read()
    assert raw.endswith(b"\n\ndata: [DONE]\n\n")
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    events = events[:-1]
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events)
    objs = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
    assert {o["id"] for o in objs} == {r.headers["x-request-id"]}
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(o["choices"][0]["delta"].get("content", "") for o in objs) == script[:4]
    assert [o["choices"][0]["finish_reason"] for o in objs] == [None] * 4 + ["length"]
    assert all(o["usage"] is None for o in objs)   # no stream_options.include_usage


def test_error_mid_stream_is_an_error_event(live):
    body = {"model": M, "prompt": "[error]", "stream": True}
    raw = httpx.post(live.url + "/v1/completions", json=body, timeout=10).content
    events = raw.split(b"\n\n")[:-1]
    assert events[-1] == b"data: [DONE]"
    err = json.loads(events[-2][len(b"data: "):])["error"]
    assert err["type"] == "server_error" and "scripted failure" in err["message"]


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request(live, stream):
    live.backend.abort_seen.clear()
    body = {"model": M, "messages": [{"role": "user", "content": "[hang]"}], "stream": stream}
    url = live.url + "/v1/chat/completions"
    if stream:
        with httpx.stream("POST", url, json=body, timeout=10) as r:
            rid = r.headers["x-request-id"]
            next(r.iter_raw())            # the first event arrived; then hang up
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=body, timeout=httpx.Timeout(10, read=0.5))
        rid = live.backend.requests[-1].rid
    assert live.backend.abort_seen.wait(5), "backend.abort was not called"
    assert rid.startswith("chatcmpl-") and rid in live.backend.aborted
    # the server still serves
    assert httpx.get(live.url + "/health", timeout=5).json()["status"] == "ok"


def test_health_and_metrics(live):
    assert httpx.get(live.url + "/health").json() == {"status": "ok", "backend": "scripted"}
    before = httpx.get(live.url + "/metrics").text
    body = {"model": M, "prompt": "abcdef", "max_tokens": 3}
    assert httpx.post(live.url + "/v1/completions", json=body).status_code == 200
    assert httpx.post(live.url + "/v1/completions", json={**body, "model": "nope"}).status_code == 404
    r = httpx.get(live.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    after = r.text

    def delta(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("tandem_requests_total", status="ok") == 1
    assert delta("tandem_requests_total", status="rejected") == 1
    assert delta("tandem_rejected_requests_total", reason="model_not_found") == 1
    assert delta("tandem_prompt_tokens_total") == 6
    assert delta("tandem_cached_prompt_tokens_total") == 4
    assert delta("tandem_time_to_first_token_seconds_count") == 1
    assert delta("tandem_inter_token_latency_seconds_count") == 2   # 3 tokens, 2 gaps
