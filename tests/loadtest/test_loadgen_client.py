"""The SSE client against scripted HTTP answers (httpx.MockTransport): parsing, usage, error kinds,
and the two run loops. The real server is in test_loadgen_serve.py."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from tandem.loadtest.loadgen.client import ClientConfig, StreamClient, run_sessions, run_timed
from tandem.loadtest.loadgen.workloads import AgentConfig, Dist, TimedRequest, agent_workload


def _sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def _chat_stream(words, prompt=10, cached=4):
    return _sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                *({"choices": [{"delta": {"content": w}}]} for w in words),
                {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": len(words),
                                          "prompt_tokens_details": {"cached_tokens": cached}}},
                b"[DONE]")


def _run(handler, coro_fn):
    async def main():
        async with httpx.AsyncClient(base_url="http://test", transport=httpx.MockTransport(handler)) as http:
            client = StreamClient(http, ClientConfig(url="http://test", timeout_s=5), "m", time.perf_counter())
            return await coro_fn(client)
    return asyncio.run(main())


def test_stream_parsing_and_request_body():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get("x-session-id"), json.loads(request.content)))
        return httpx.Response(200, content=_chat_stream(["Hel", "lo", "!"]), headers={"X-Request-Id": "r1"})

    rec = _run(handler, lambda c: c.chat([{"role": "user", "content": "hi"}], max_tokens=3, session="s9", turn=2))
    assert rec.ok and rec.text == "Hello!" and rec.request_id == "r1" and rec.status == 200
    assert (rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens) == (10, 4, 3)
    assert rec.ttft is not None and len(rec.itl) == 2 and rec.e2e >= rec.ttft
    assert (rec.session, rec.turn) == ("s9", 2)
    path, sid, body = seen[0]
    assert path == "/v1/chat/completions" and sid == "s9"
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 3 and body["temperature"] == 0.0 and "min_tokens" not in body

    comp = _sse({"choices": [{"text": "a"}]}, {"choices": [{"text": "b", "finish_reason": "length"}]},
                {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}, b"[DONE]")
    rec = _run(lambda r: (seen.append(json.loads(r.content)), httpx.Response(200, content=comp))[1],
               lambda c: c.completion([1, 2, 3], max_tokens=2, scheduled=1.5))
    assert rec.ok and rec.text == "ab" and rec.cached_tokens == 0 and rec.scheduled == 1.5
    assert seen[-1]["prompt"] == [1, 2, 3] and seen[-1]["min_tokens"] == 2


def test_error_kinds():
    def answer(resp):
        return lambda c: c.chat([{"role": "user", "content": "x"}], max_tokens=2)

    cases = {
        "http_400": httpx.Response(400, json={"error": {"message": "context too long"}}),
        "stream_error": httpx.Response(200, content=_sse({"choices": [{"text": "a"}]},
                                                         {"error": {"message": "generation failed"}})),
        "incomplete": httpx.Response(200, content=_sse({"choices": [{"text": "a"}]})),
        "protocol": httpx.Response(200, content=b"data: {not json\n\n"),
    }
    for kind, resp in cases.items():
        rec = _run(lambda r, resp=resp: resp, answer(resp))
        assert rec.error == kind, (kind, rec)
    rec = _run(lambda r: httpx.Response(400, json={"error": {"message": "context too long"}}), answer(None))
    assert rec.error_detail == "context too long"

    def refuse(request):
        raise httpx.ConnectError("refused", request=request)
    assert _run(refuse, answer(None)).error == "connection"


def test_run_sessions_feeds_replies_back_and_stops_a_session_on_error():
    cfg = AgentConfig(num_sessions=2, turns=3, system_prompt_tokens=5, task_tokens=3,
                      tool_result_tokens=Dist.parse("4"), think_time_s=Dist.parse("0"), max_tokens=2)
    w = agent_workload(cfg)
    bodies = []

    def handler(request):
        body = json.loads(request.content)
        bodies.append(body)
        if request.headers["x-session-id"] == w.sessions[1].sid and len(body["messages"]) > 2:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        return httpx.Response(200, content=_chat_stream(["ok", str(len(body["messages"]))]))

    recs = _run(handler, lambda c: run_sessions(c, w.sessions, concurrency=1, progress=False))
    assert len(recs) == 3 + 2                                      # session 1 stops after its failed turn 1
    assert [r.error for r in recs if r.session == w.sessions[1].sid] == [None, "http_503"]
    last = [b for b in bodies if b["messages"][1]["content"] == w.sessions[0].turns[0].user][-1]
    assert [m["role"] for m in last["messages"]] == ["system", "user", "assistant", "tool", "user",
                                                     "assistant", "tool", "user"]
    assert last["messages"][2]["content"] == "ok2" and last["messages"][5]["content"] == "ok5"
    assert last["messages"][2]["tool_calls"][0]["id"] == last["messages"][3]["tool_call_id"]
    assert all(b["tools"] == list(w.sessions[0].tools) for b in bodies)   # declared on every turn

    capped = _run(handler, lambda c: run_sessions(c, w.sessions, max_requests=2, progress=False))
    assert len(capped) == 2


def test_run_timed_keeps_arrival_times():
    reqs = [TimedRequest(i, 0.05 * i, (1, 2), 1) for i in range(3)]
    recs = _run(lambda r: httpx.Response(200, content=_sse({"choices": [{"text": "a"}]}, b"[DONE]")),
                lambda c: run_timed(c, reqs, progress=False))
    assert [r.scheduled for r in recs] == [0.0, 0.05, 0.1]
    assert all(r.ok and r.scheduled <= r.start < r.scheduled + 0.5 for r in recs)
    assert recs[0].completion_tokens == 1                          # no usage: counted from chunks
