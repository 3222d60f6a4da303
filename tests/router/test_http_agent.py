"""Agent features at the front door, through the real `openai` SDK against ScriptedBackend (a test
double that replies canned text: ``[say]...[/say]`` in the prompt, with canned logprobs). These
check the protocol mapping (tools in the prompt, tool_calls out, the constraint handed to the
engine, logprobs shapes, n fan-out); that the engine enforces the constraint and computes real
logprobs is phase 2's (tests against a real engine)."""

from __future__ import annotations

import json

import openai
import pytest

from tandem.router.tools.formats import FORMATS
from tandem.router.tools.spec import parse_openai_tools

M = "scripted-model"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture()
def live(live_agent):
    return live_agent


@pytest.fixture()
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=10)


def prompt_of(live) -> str:
    return live.backend.tokenizer.decode(live.backend.requests[-1].prompt_ids)


def say(text: str) -> str:
    return f"[say]{text}[/say]"


# ------------------------------------------------------------------------------ tools
def test_tool_round_trip(client, live):
    msgs = [{"role": "user", "content": "Weather in Paris? " + say(CALL)}]
    out = client.chat.completions.create(model=M, messages=msgs, tools=[WEATHER, TIME], tool_choice="required")
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    prompt = prompt_of(live)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and '"name": "get_time"' in prompt
    c = live.backend.requests[-1].params.constraint   # required: the engine decodes under the call grammar
    assert c.kind == "lark" and c.spec == FORMATS["hermes"].constraint(
        parse_openai_tools([WEATHER, TIME], "required", None)).spec

    # the client runs the function and sends the result back
    msgs += [choice.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "18C and sunny " + say("It is 18C in Paris.")}]
    final = client.chat.completions.create(model=M, messages=msgs, tools=[WEATHER, TIME])
    assert final.choices[0].message.content == "It is 18C in Paris." and final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.tool_calls is None
    prompt = prompt_of(live)
    assert "<assistant><tool_call>\n" in prompt and "<tool_response>\n18C and sunny" in prompt
    assert live.backend.requests[-1].params.constraint is None    # auto: not constrained


def test_streamed_tool_calls(client, live):
    text = "Checking both. " + CALL + "\n" + CALL.replace("Paris", "Oslo")
    stream = client.chat.completions.create(
        model=M, messages=[{"role": "user", "content": say(text)}], tools=[WEATHER], stream=True)
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert content == "Checking both."   # whitespace beside the calls is not content
    assert [d.index for d in deltas] == [0, 1] and all(d.id.startswith("call_") for d in deltas)
    assert [json.loads(d.function.arguments)["city"] for d in deltas] == ["Paris", "Oslo"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    # the SDK's stream helper assembles the same calls
    with client.beta.chat.completions.stream(model=M, messages=[{"role": "user", "content": say(text)}],
                                             tools=[WEATHER]) as s:
        final = s.get_final_completion()
    assert [t.function.name for t in final.choices[0].message.tool_calls] == ["get_weather", "get_weather"]


def test_named_and_none_tool_choice(client, live):
    named = {"type": "function", "function": {"name": "get_time"}}
    client.chat.completions.create(model=M, messages=[{"role": "user", "content": say("x")}],
                                   tools=[WEATHER, TIME], tool_choice=named, parallel_tool_calls=False)
    spec = live.backend.requests[-1].params.constraint.spec
    assert "get_time" in spec and "get_weather" not in spec and 'call ("\\n" call)*' not in spec
    out = client.chat.completions.create(model=M, messages=[{"role": "user", "content": say(CALL)}],
                                         tools=[WEATHER], tool_choice="none")
    assert out.choices[0].message.content == CALL and out.choices[0].message.tool_calls is None
    assert "<tools>" not in prompt_of(live) and live.backend.requests[-1].params.constraint is None


# ------------------------------------------------------------------------------ response_format
def test_response_format_becomes_the_constraint(client, live):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    out = client.chat.completions.create(model=M, messages=[{"role": "user", "content": say('{"a": 1}')}],
                                         response_format={"type": "json_schema", "json_schema": {
                                             "name": "thing", "schema": schema, "strict": True}})
    assert json.loads(out.choices[0].message.content) == {"a": 1}
    c = live.backend.requests[-1].params.constraint
    assert (c.kind, json.loads(c.spec), c.strict) == ("json_schema", schema, True)
    client.chat.completions.create(model=M, messages=[{"role": "user", "content": "x"}],
                                   response_format={"type": "json_object"})
    assert live.backend.requests[-1].params.constraint.kind == "json_object"
    client.completions.create(model=M, prompt="x", extra_body={"response_format": {"type": "regex", "regex": r"\d+"}})
    c = live.backend.requests[-1].params.constraint
    assert (c.kind, c.spec) == ("regex", r"\d+")
    client.completions.create(model=M, prompt="x", extra_body={"response_format": {"type": "grammar",
                                                                                   "grammar": 'start: "yes"'}})
    assert live.backend.requests[-1].params.constraint.kind == "lark"


def test_langchain_with_structured_output(live):
    lc = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    llm = lc.ChatOpenAI(model=M, base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    person = llm.with_structured_output(Person).invoke(say('{"name": "Ada", "age": 36}'))
    assert person == Person(name="Ada", age=36)
    c = live.backend.requests[-1].params.constraint
    assert c.kind == "json_schema" and set(json.loads(c.spec)["properties"]) == {"name", "age"}


# ------------------------------------------------------------------------------ logprobs
def test_chat_logprobs(client, live):
    out = client.chat.completions.create(model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                         logprobs=True, top_logprobs=3)
    p = live.backend.requests[-1].params
    assert (p.logprobs, p.top_logprobs) == (True, 3)
    content = out.choices[0].logprobs.content
    assert "".join(t.token for t in content) == out.choices[0].message.content == "Hello"
    for i, t in enumerate(content):
        assert t.logprob == -0.25 * (i % 4) and t.bytes == list(t.token.encode())
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert [x.logprob for x in t.top_logprobs] == [t.logprob, t.logprob - 1, t.logprob - 2]
    chunks = list(client.chat.completions.create(model=M, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5, logprobs=True, stream=True))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob, t.bytes) for t in streamed] == [(t.token, t.logprob, t.bytes) for t in content]
    assert all(t.top_logprobs == [] for t in streamed)     # top_logprobs defaults to 0
    plain = client.chat.completions.create(model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert plain.choices[0].logprobs is None and live.backend.requests[-1].params.logprobs is False


def test_completion_logprobs(client, live):
    out = client.completions.create(model=M, prompt="x", max_tokens=4, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.tokens == list("Hell") and lp.token_logprobs == [0.0, -0.25, -0.5, -0.75]
    assert lp.text_offset == [0, 1, 2, 3]
    assert lp.top_logprobs[1] == {"e": -0.25, "f": -1.25}
    chunks = list(client.completions.create(model=M, prompt="x", max_tokens=4, logprobs=0, stream=True))
    offsets = [o for c in chunks for o in (c.choices[0].logprobs.text_offset if c.choices[0].logprobs else [])]
    assert offsets == [0, 1, 2, 3]
    assert all(d == {} for c in chunks if c.choices[0].logprobs for d in c.choices[0].logprobs.top_logprobs)


# ------------------------------------------------------------------------------ n
def test_n_fans_out_one_group(client, live):
    out = client.chat.completions.create(model=M, messages=[{"role": "user", "content": "hi"}], n=3, seed=5,
                                         max_tokens=4, temperature=0.8)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.content == "Hell" for c in out.choices)
    greqs = live.backend.requests[-3:]
    assert [g.rid for g in greqs] == [f"{out.id}-{i}" for i in range(3)]
    assert [(g.group.id, g.group.index, g.group.size) for g in greqs] == [(out.id, i, 3) for i in range(3)]
    assert [g.params.seed for g in greqs] == [5, 6, 7] and len({g.prompt_ids for g in greqs}) == 1
    assert len({g.session_id for g in greqs}) == 1
    assert out.usage.prompt_tokens == len(greqs[0].prompt_ids) and out.usage.completion_tokens == 12

    chunks = list(client.chat.completions.create(model=M, messages=[{"role": "user", "content": "hi"}], n=2,
                                                 max_tokens=3, stream=True, stream_options={"include_usage": True}))
    text = {0: "", 1: ""}
    for c in chunks[:-1]:
        text[c.choices[0].index] += c.choices[0].delta.content or ""
    assert text == {0: "Hel", 1: "Hel"}
    assert sorted(c.choices[0].index for c in chunks[:-1] if c.choices[0].finish_reason) == [0, 1]
    assert chunks[-1].usage.completion_tokens == 6
    comp = client.completions.create(model=M, prompt="x", n=2, max_tokens=2)
    assert [(c.index, c.text) for c in comp.choices] == [(0, "He"), (1, "He")]
    one = client.completions.create(model=M, prompt="x", max_tokens=1)
    assert live.backend.requests[-1].group is None and live.backend.requests[-1].rid == one.id


# ------------------------------------------------------------------------------ sessions
@pytest.mark.parametrize("header", ["X-Session-Affinity", "X-Claude-Code-Session-Id", "Session-Id"])
def test_agent_session_headers(client, live, header):
    client.chat.completions.create(model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                   extra_headers={header: f"agent-{header}"})
    assert live.backend.requests[-1].session_id == f"agent-{header}"


# ------------------------------------------------------------------------------ the OpenAI Agents SDK
def test_openai_agents_sdk_loop(live):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def lookup_population(city: str) -> str:
        """Population of a city."""
        calls.append(city)
        return "2.1 million " + say("Paris has about 2.1 million people.")

    client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    agent = agents.Agent(name="geo", instructions="Answer with tools.", tools=[lookup_population],
                         model=agents.OpenAIChatCompletionsModel(model=M, openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="required"))
    question = "How many people live in Paris? " + say(
        '<tool_call>\n{"name": "lookup_population", "arguments": {"city": "Paris"}}\n</tool_call>')
    result = agents.Runner.run_sync(agent, question, max_turns=4)
    assert calls == ["Paris"]
    assert result.final_output == "Paris has about 2.1 million people."
