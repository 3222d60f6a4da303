"""Tool-call fidelity in chat completions, Messages and the parsers under them (issue 24): a call cut
by max_tokens is dropped, never returned as markup in content, and the finish / stop reason says
"length" / "max_tokens" (SGLang keeps only closed calls; vLLM keeps "length" over "tool_calls");
no whitespace content beside calls (``content`` is null); the call count is bounded; Anthropic
blocks come in generation order and streamed usage is the same in every event. Against
ScriptedBackend (``[say]TEXT[/say]`` is the reply, one character per token)."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tandem.router.tools.formats import FORMATS, parse_all
from tandem.router.tools.spec import MAX_PARALLEL_CALLS, parse_openai_tools

M = "scripted-model"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
A_WEATHER = {"name": "get_weather", "description": "Weather.", "input_schema": WEATHER["function"]["parameters"]}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
OSLO = CALL.replace("Paris", "Oslo")
MARKUP = ("<tool", "</", "{", "[TOOL", "[{", "<|python")
FORCED = {  # what each format's call grammar makes the model write: two calls, then one
    "hermes": CALL + "\n" + OSLO,
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                   '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
               '{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
}


def say(text: str) -> str:
    return f"[say]{text}[/say]"


@pytest.fixture()
def live(live_agent):
    return live_agent


# ------------------------------------------------------------------------------ the parsers
@pytest.mark.parametrize("fmt", sorted(FORCED))
def test_a_cut_call_never_leaks_markup_at_any_cut(fmt):
    f, text = FORMATS[fmt], FORCED[fmt]
    whole = parse_all(f, text)[1]
    for cut in range(len(text) + 1):
        content, calls = parse_all(f, text[:cut], truncated=True)
        assert not any(m in content for m in MARKUP) and not content.strip(), (cut, content)
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole[:len(calls)]], cut
        p = f.parser()                       # streamed one character at a time: the same
        events = [e for ch in text[:cut] for e in p.feed(ch)] + p.finish(truncated=True)
        assert "".join(e.text for e in events) == content, cut
        assert [e.call.arguments for e in events if e.call] == [c.arguments for c in calls], cut


def test_text_before_a_cut_call_is_kept_and_a_cut_marker_dropped():
    f = FORMATS["hermes"]
    assert parse_all(f, "Let me check. <tool_ca", truncated=True) == ("Let me check. ", [])
    assert parse_all(f, "Let me check. <tool_ca") == ("Let me check. <tool_ca", [])    # not cut: text
    content, calls = parse_all(f, "Let me check. " + CALL[:-3], truncated=True)         # JSON whole
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather"]
    assert parse_all(f, "<tool_call>\nnot json", truncated=True) == ("", [])
    assert parse_all(f, "<tool_call>\nnot json") == ("<tool_call>\nnot json", [])


def test_whitespace_beside_calls_and_the_call_cap():
    f = FORMATS["hermes"]
    content, calls = parse_all(f, "\n\n" + CALL + "\n\n" + OSLO + "\n")
    assert content == "" and [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Oslo"]
    assert parse_all(f, CALL + "\n\nDone.\n")[0] == "Done."
    assert parse_all(f, "Plain reply.\n\n") == ("Plain reply.\n\n", [])    # no calls: the text exactly
    many = "\n".join([CALL] * (MAX_PARALLEL_CALLS + 3))
    plan = parse_openai_tools([WEATHER], "auto", None)
    assert len(parse_all(f, many, max_calls=plan.max_calls)[1]) == plan.max_calls == MAX_PARALLEL_CALLS
    assert len(parse_all(f, many, max_calls=1)[1]) == 1


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_call_grammars_are_bounded(fmt):
    f = FORMATS[fmt]
    spec = lambda choice, parallel: f.constraint(parse_openai_tools([WEATHER], choice, parallel)).spec  # noqa: E731
    bound = f"{{0,{MAX_PARALLEL_CALLS - 1}}}" if fmt != "mistral" else f'"maxItems": {MAX_PARALLEL_CALLS}'
    assert bound in spec("required", True) and "*" not in spec("required", True)
    one = f'"maxItems": 1' if fmt == "mistral" else "{0,"
    for s in (spec("required", False), spec({"type": "function", "function": {"name": "get_weather"}}, True)):
        assert (one in s) if fmt == "mistral" else (one not in s and "*" not in s)


# ------------------------------------------------------------------------------ chat completions
@pytest.mark.parametrize("stream", [False, True])
def test_chat_cut_call_is_length_with_no_markup(live, stream):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    for n in (5, 20, 40, 66, 67, 70, 79):
        kw = dict(model=M, messages=[{"role": "user", "content": say(CALL + "\n" + OSLO)}], tools=[WEATHER],
                  tool_choice="required", max_tokens=n)
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            calls = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
            finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        else:
            out = client.chat.completions.create(**kw).choices[0]
            content, calls, finish = out.message.content, out.message.tool_calls or [], [out.finish_reason]
            assert content is None if calls else content == "", (n, content)
        assert finish == ["length"] and not (content or "").strip(), (n, content)
        assert len(calls) == (1 if n >= 67 else 0), n
        assert all(json.loads(c.function.arguments) == {"city": "Paris"} for c in calls)


def test_chat_parallel_calls_have_null_content(live):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    out = client.chat.completions.create(model=M, messages=[{"role": "user", "content": say(
        "\n\n" + CALL + "\n" + OSLO + "\n")}], tools=[WEATHER], tool_choice="required").choices[0]
    assert out.message.content is None and out.finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments)["city"] for c in out.message.tool_calls] == ["Paris", "Oslo"]
    out = client.chat.completions.create(model=M, messages=[{"role": "user", "content": say(CALL + "\n" + OSLO)}],
                                         tools=[WEATHER], parallel_tool_calls=False).choices[0]
    assert len(out.message.tool_calls) == 1      # parallel_tool_calls false: one call, even under auto


# ------------------------------------------------------------------------------ Messages
def _anthropic(live):
    return anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=10)


def test_anthropic_blocks_in_generation_order(live):
    client = _anthropic(live)
    msg = client.messages.create(model=M, max_tokens=400, tools=[A_WEATHER], messages=[
        {"role": "user", "content": say("Checking. " + CALL + "\n" + OSLO + "\nBoth done.")}])
    assert [b.type for b in msg.content] == ["text", "tool_use", "tool_use", "text"]
    assert msg.content[0].text == "Checking." and msg.content[3].text == "Both done."
    assert msg.stop_reason == "tool_use"
    with client.messages.stream(model=M, max_tokens=400, tools=[A_WEATHER], messages=[
            {"role": "user", "content": say("\n" + CALL + "\n" + OSLO + "\n")}]) as s:
        streamed = s.get_final_message()
    assert [b.type for b in streamed.content] == ["tool_use", "tool_use"]    # no whitespace text blocks


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_cut_call_is_max_tokens_with_no_markup(live, stream):
    client = _anthropic(live)
    for n in (5, 40, 66, 67):
        kw = dict(model=M, max_tokens=n, tools=[A_WEATHER], tool_choice={"type": "any"},
                  messages=[{"role": "user", "content": say(CALL)}])
        if stream:
            with client.messages.stream(**kw) as s:
                msg = s.get_final_message()
        else:
            msg = client.messages.create(**kw)
        assert msg.stop_reason == "max_tokens", n
        texts = [b.text for b in msg.content if b.type == "text"]
        assert not any(t.strip() for t in texts), (n, texts)
        assert [b.input for b in msg.content if b.type == "tool_use"] == ([{"city": "Paris"}] if n >= 67 else []), n


def test_anthropic_stream_usage_is_the_same_in_every_event(live):
    with httpx.stream("POST", live.url + "/v1/messages", timeout=10, json={
            "model": M, "max_tokens": 50, "stream": True,
            "messages": [{"role": "user", "content": say("Hello there.")}]}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    start = next(e for e in events if e["type"] == "message_start")["message"]["usage"]
    delta = next(e for e in events if e["type"] == "message_delta")["usage"]
    prompt = len(live.backend.requests[-1].prompt_ids)
    assert start["cache_read_input_tokens"] == delta["cache_read_input_tokens"] == 4
    assert start["input_tokens"] == delta["input_tokens"] == prompt - 4
    assert delta["output_tokens"] == len("Hello there.")


def test_anthropic_without_temperature_samples_at_1(live):
    """The anthropic SDK 2.x has no temperature argument; a request without one gets Anthropic's
    default, 1.0 (a client that wants greedy sends ``extra_body={"temperature": 0}``)."""
    client = _anthropic(live)
    client.messages.create(model=M, max_tokens=8, messages=[{"role": "user", "content": say("hi")}])
    assert live.backend.requests[-1].params.temperature == 1.0
    client.messages.create(model=M, max_tokens=8, messages=[{"role": "user", "content": say("hi")}],
                           extra_body={"temperature": 0})
    assert live.backend.requests[-1].params.temperature == 0.0
    client.messages.create(model=M, max_tokens=8, tools=[A_WEATHER], messages=[{"role": "user", "content": say(CALL)}],
                           tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert "{0," not in live.backend.requests[-1].params.constraint.spec      # exactly one call
