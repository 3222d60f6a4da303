"""POST /v1/messages through the real `anthropic` SDK against ScriptedBackend (a test double that
replies SCRIPT, or ``[say]TEXT[/say]`` from the prompt): text and streaming event shapes, usage with
cache reads, stop sequences, a tool_use round trip (the reply is canned: that the engine writes
valid calls under the grammar is phase 2's), sessions and errors in Anthropic's shape."""

from __future__ import annotations

import json

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")

M = "scripted-model"
WEATHER = {"name": "get_weather", "description": "Current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture()
def live(live_agent):
    return live_agent


@pytest.fixture()
def client(live):
    return anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=10)


def say(text: str) -> str:
    return f"[say]{text}[/say]"


def prompt_of(live) -> str:
    return live.backend.tokenizer.decode(live.backend.requests[-1].prompt_ids)


def test_text_reply_and_usage(client, live):
    out = client.messages.create(model=M, max_tokens=100, system="Be brief.",
                                 messages=[{"role": "user", "content": "hi"}])
    assert out.id.startswith("msg_") and out.type == "message" and out.role == "assistant" and out.model == M
    assert [b.type for b in out.content] == ["text"] and out.content[0].text == live.backend.script
    assert out.stop_reason == "end_turn" and out.stop_sequence is None
    n = len(live.backend.requests[-1].prompt_ids)
    assert (out.usage.input_tokens, out.usage.cache_read_input_tokens, out.usage.output_tokens) == (
        n - 4, 4, len(live.backend.script))
    assert prompt_of(live).startswith("<system>Be brief.\n<user>hi\n")
    short = client.messages.create(model=M, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert short.stop_reason == "max_tokens" and short.content[0].text == "Hel"
    stopped = client.messages.create(model=M, max_tokens=100, stop_sequences=["from"],
                                     messages=[{"role": "user", "content": "hi"}])
    assert (stopped.stop_reason, stopped.stop_sequence, stopped.content[0].text) == ("stop_sequence", "from", "Hello ")


def test_streaming_events(client, live):
    with client.messages.stream(model=M, max_tokens=100, messages=[{"role": "user", "content": "hi"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == live.backend.script == final.content[0].text
    assert final.stop_reason == "end_turn" and final.usage.cache_read_input_tokens == 4
    body = {"model": M, "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    raw = httpx.post(live.url + "/v1/messages", json=body, timeout=10).text
    events = [e.split("\n") for e in raw.strip().split("\n\n")]
    kinds = [e[0].removeprefix("event: ") for e in events]
    assert kinds == ["message_start", "ping", "content_block_start"] + ["content_block_delta"] * 5 + [
        "content_block_stop", "message_delta", "message_stop"]
    datas = [json.loads(e[1].removeprefix("data: ")) for e in events]
    assert all(d["type"] == k for d, k in zip(datas, kinds))
    assert datas[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert datas[-2]["usage"]["output_tokens"] == 5


def test_tool_use_round_trip(client, live):
    msgs = [{"role": "user", "content": "Weather in Paris? " + say(CALL)}]
    out = client.messages.create(model=M, max_tokens=200, tools=[WEATHER], tool_choice={"type": "any"}, messages=msgs)
    assert out.stop_reason == "tool_use"
    [use] = out.content
    assert use.type == "tool_use" and use.id.startswith("toolu_") and use.name == "get_weather"
    assert use.input == {"city": "Paris"}
    c = live.backend.requests[-1].params.constraint
    assert c.kind == "lark" and "get_weather" in c.spec
    assert "<tools>" in prompt_of(live)
    msgs += [{"role": "assistant", "content": [b.model_dump() for b in out.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": [{"type": "text", "text": "18C " + say("Sunny, 18C.")}]}]}]
    final = client.messages.create(model=M, max_tokens=200, tools=[WEATHER], messages=msgs)
    assert final.content[0].text == "Sunny, 18C." and final.stop_reason == "end_turn"
    assert live.backend.requests[-1].params.constraint is None
    prompt = prompt_of(live)
    assert '<assistant><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n18C " in prompt

    with client.messages.stream(model=M, max_tokens=200, tools=[WEATHER], messages=[
            {"role": "user", "content": say("Let me look. " + CALL)}]) as s:
        streamed = s.get_final_message()
    assert [b.type for b in streamed.content] == ["text", "tool_use"]
    assert streamed.content[0].text == "Let me look." and streamed.content[1].input == {"city": "Paris"}
    assert streamed.stop_reason == "tool_use"


def test_named_tool_choice_and_sessions(client, live):
    client.messages.create(model=M, max_tokens=10, tools=[WEATHER], messages=[{"role": "user", "content": "x"}],
                           tool_choice={"type": "tool", "name": "get_weather"}, metadata={"user_id": "u-7"})
    greq = live.backend.requests[-1]
    assert greq.params.constraint is not None and greq.session_id == "u-7"
    client.messages.create(model=M, max_tokens=1, messages=[{"role": "user", "content": "x"}],
                           extra_headers={"X-Claude-Code-Session-Id": "cc-1"})
    assert live.backend.requests[-1].session_id == "cc-1"


def test_count_tokens(client, live):
    out = client.messages.count_tokens(model=M, messages=[{"role": "user", "content": "hi"}])
    assert out.input_tokens == len("<user>hi\n<assistant>")


@pytest.mark.parametrize("body, status, kind, needle", [
    ({"model": M, "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "claude-9", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, 404,
     "not_found_error", "claude-9"),
    ({"model": M, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     400, "invalid_request_error", "'image' is not supported"),
    ({"model": M, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{"input_schema": {}}]},
     400, "invalid_request_error", "tools.0.name is required"),
    ({"model": M, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error", "not among the declared"),
    ({"model": M, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "speculative": "off"}, 400,
     "invalid_request_error", "speculative"),
])
def test_errors_in_anthropic_shape(live, body, status, kind, needle):
    r = httpx.post(live.url + "/v1/messages", json=body, timeout=10)
    assert r.status_code == status
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind and needle in err["error"]["message"]


def test_speculative_field_reaches_the_engine(client, live):
    """Tandem's ``speculative`` (through the SDK's extra_body) turns drafts off for the request;
    absent, it stays on."""
    client.messages.create(model=M, max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert live.backend.requests[-1].params.speculative is True
    client.messages.create(model=M, max_tokens=2, messages=[{"role": "user", "content": "x"}],
                           extra_body={"speculative": False})
    assert live.backend.requests[-1].params.speculative is False


def test_api_key_header(live_auth):
    ok = anthropic.Anthropic(base_url=live_auth.url, api_key="sk-test-key", max_retries=0, timeout=10)
    assert ok.messages.create(model=M, max_tokens=2, messages=[{"role": "user", "content": "x"}]).content[0].text == "He"
    bad = anthropic.Anthropic(base_url=live_auth.url, api_key="sk-wrong", max_retries=0, timeout=10)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=M, max_tokens=2, messages=[{"role": "user", "content": "x"}])
