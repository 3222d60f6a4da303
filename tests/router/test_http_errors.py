"""Bad input: every case gets a 4xx with an OpenAI error object, and the server keeps serving.
Against ScriptedBackend (a test double; only the front door's checks are under test)."""

from __future__ import annotations

import json

import httpx
import pytest

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
M = "scripted-model"
USER = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return {"model": M, "messages": USER, **fields}


def comp(**fields):
    return {"model": M, "prompt": "hi", **fields}


# (path, body: dict -> JSON or bytes as sent, expected status, expected error param or code)
CASES = {
    "malformed json": (CHAT, b'{"model": ', 400, None),
    "json array": (CHAT, b"[1, 2]", 400, None),
    "empty body": (CHAT, b"", 400, None),
    "NaN": (COMP, b'{"model": "scripted-model", "prompt": "x", "temperature": NaN}', 400, None),
    "invalid utf-8": (COMP, b'{"model": "scripted-model", "prompt": "\xff\xfe"}', 400, None),
    "lone surrogate": (COMP, b'{"model": "scripted-model", "prompt": "\\ud800"}', 400, None),
    "deep nesting": (CHAT, b"[" * 50_000, 400, None),
    "5000-digit int": (COMP, b'{"model": "scripted-model", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",
                       400, None),
    "missing model": (CHAT, {"messages": USER}, 400, "model"),
    "missing messages": (CHAT, {"model": M}, 400, "messages"),
    "missing prompt": (COMP, {"model": M}, 400, "prompt"),
    "messages not a list": (CHAT, chat(messages="hi"), 400, "messages"),
    "no messages": (CHAT, chat(messages=[]), 400, "messages"),
    "bad role": (CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role"),
    "image part": (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, "messages"),
    "template refuses": (CHAT, chat(messages=[{"role": "user", "content": "[bad-template]"}]), 400, "messages"),
    "tool message without tool_call_id": (CHAT, chat(messages=[{"role": "tool", "content": "x"}]), 400,
                                          "messages.0.tool_call_id"),
    "max_tokens string": (CHAT, chat(max_tokens="ten"), 400, "max_tokens"),
    "max_tokens float": (CHAT, chat(max_tokens=1.5), 400, "max_tokens"),
    "max_tokens negative": (CHAT, chat(max_tokens=-5), 400, "max_tokens"),
    "max_tokens zero": (COMP, comp(max_tokens=0), 400, "max_tokens"),
    "temperature string": (CHAT, chat(temperature="hot"), 400, "temperature"),
    "temperature negative": (CHAT, chat(temperature=-1), 400, "temperature"),
    "top_p zero": (COMP, comp(top_p=0), 400, "top_p"),
    "stream string": (CHAT, chat(stream="yes"), 400, "stream"),
    "speculative string": (CHAT, chat(speculative="off"), 400, "speculative"),
    "seed too big": (COMP, comp(seed=2 ** 70), 400, "seed"),
    "n above the limit": (CHAT, chat(n=9), 400, "n"),
    "n zero": (CHAT, chat(n=0), 400, "n"),
    "completion logprobs > 20": (COMP, comp(logprobs=21), 400, "logprobs"),
    "top_logprobs > 20": (CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    "top_logprobs without logprobs": (CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    "logprobs int in chat": (CHAT, chat(logprobs=2), 400, "logprobs"),
    "tool without a name": (CHAT, chat(tools=[{"type": "function", "function": {"parameters": {}}}]), 400,
                            "tools[0].function.name"),
    "tool_choice undeclared": (CHAT, chat(tools=[{"type": "function", "function": {"name": "a"}}],
                                          tool_choice={"type": "function", "function": {"name": "b"}}), 400,
                               "tool_choice.function.name"),
    "tool parameters not a schema": (CHAT, chat(tools=[{"type": "function", "function": {
        "name": "a", "parameters": {"type": 5}}}]), 400, "tools[0].function.parameters"),
    "invalid json schema": (CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}), 400,
                            "response_format.json_schema.schema"),
    "json_schema without schema": (CHAT, chat(response_format={"type": "json_schema"}), 400,
                                   "response_format.json_schema"),
    "unknown response_format": (CHAT, chat(response_format={"type": "yaml"}), 400, "response_format.type"),
    "forced tool + response_format": (CHAT, chat(tools=[{"type": "function", "function": {"name": "a"}}],
                                                 tool_choice="required", response_format={"type": "json_object"}),
                                      400, "response_format"),
    "empty stop": (CHAT, chat(stop=[""]), 400, None),
    "stop int": (CHAT, chat(stop=5), 400, "stop"),
    "min_tokens > max_tokens": (COMP, comp(min_tokens=5, max_tokens=2), 400, None),
    "empty prompt": (COMP, comp(prompt=""), 400, "prompt"),
    "token id negative": (COMP, comp(prompt=[1, -1]), 400, "prompt"),
    "prompt batch past the limit": (COMP, comp(prompt=["a"] * 65), 400, "prompt"),
    "empty prompt batch": (COMP, comp(prompt=[]), 400, "prompt"),
    "an empty prompt in a batch": (COMP, comp(prompt=["a", ""]), 400, "prompt"),
    "prompt fills context": (COMP, comp(prompt="x" * 256), 400, "context_length_exceeded"),
    "unknown model": (CHAT, chat(model="gpt-9"), 404, "model_not_found"),
    "body over limit": (COMP, comp(prompt="x" * 70_000), 413, "request_too_large"),
}


def check_error(r: httpx.Response, status: int, param_or_code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if param_or_code is not None:
        assert param_or_code in (err["param"], err["code"]), err
    return err


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, timeout=10) as c:
        yield c


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_a_4xx_error_object(http, case):
    path, body, status, param_or_code = CASES[case]
    if isinstance(body, dict):
        r = http.post(path, json=body)
    else:
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    check_error(r, status, param_or_code)


def test_chunked_body_over_limit(http):
    def body():   # no Content-Length: the limit is enforced while reading
        yield json.dumps(comp()).encode()[:-1]
        for _ in range(20):
            yield b" " * 4096
        yield b"}"
    check_error(http.post(COMP, content=body()), 413, "request_too_large")


def test_long_session_id_header(http):
    r = http.post(COMP, json=comp(max_tokens=1), headers={"X-Session-Id": "s" * 300})
    check_error(r, 400, "session_id")


def test_unknown_route_and_method(http):
    check_error(http.get("/v1/nothing"), 404, "not_found")
    check_error(http.get(CHAT), 405, "method_not_allowed")


def test_prompt_one_short_of_the_context_gets_one_token(http, live):
    r = http.post(COMP, json=comp(prompt="x" * 255, max_tokens=50))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "requested 305 tokens (255 in the prompt, 50 in the completion)" in r.json()["error"]["message"]
    r = http.post(COMP, json=comp(prompt="x" * 255))            # omitted: the one token left
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert live.backend.requests[-1].params.max_tokens == 1


def test_server_keeps_serving_after_bad_input(http):
    for body in (b"\xff", b"{", b"[" * 50_000):
        http.post(CHAT, content=body)
    assert http.get("/health").json() == {"status": "ok", "backend": "scripted"}
    r = http.post(CHAT, json=chat(max_tokens=2))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "He"


def test_client_hanging_up_mid_body(http, live):
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(live.url)
    with socket.create_connection((u.hostname, u.port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"model\": ")
    assert http.get("/health").status_code == 200
    assert http.post(COMP, json=comp(max_tokens=1)).status_code == 200
