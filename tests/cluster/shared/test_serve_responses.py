"""The Responses API and the agent clients on it, against SmolLM2 on 1 prefill + 1 decode Ray worker
shared by two routers (issue 24): the workers are detached named actors of one namespace (the worker
set of tests/cluster/shared/conftest.py), routers A and B both adopt them, and the response store is the namespace's detached actor (cluster/responses.py).

What must hold end to end: the openai SDK's ``responses.create`` / ``responses.stream``; a forced
function call whose arguments validate, continued on the *other* router with its output by
``previous_response_id``, which sees the history and reports ``cached_tokens`` > 0; GET / DELETE
from either router, and a restarted router that loses no stored response; openai-agents'
``Runner.run_sync`` on its default (Responses) model; pydantic-ai and langchain-openai on the
Responses API; and 50 seeds of forced tool calls cut by small max_tokens across chat completions,
Responses and Messages with no tool markup in any content field.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from serve_support import Server

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from support.shared_workers import F32_NAMESPACE, base_config  # noqa: E402

pytestmark = pytest.mark.timeout(300)

CFG = base_config(F32_NAMESPACE)             # the shared workers' own config (tests/support/shared_workers.py)
M = "smollm2"
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
          "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city.", "parameters": PARAMS}
MARKUP = ("<tool", "</", "{", "[TOOL")


@pytest.fixture(scope="module")
def routers(smollm2_1p1d):
    a = smollm2_1p1d.router(CFG)
    b = smollm2_1p1d.router(CFG)                  # a second router: adopts the same workers and store
    servers = {"a": Server(a, CFG, "A"), "b": Server(b, CFG, "B")}
    backends = {"a": a, "b": b}
    yield servers, backends
    for s in servers.values():
        s.stop()
    for be in backends.values():
        be.close()


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


# ------------------------------------------------------------------------------ the openai SDK
def test_create_and_stream_agree(routers):
    servers, _ = routers
    c = _client(servers["a"])
    kw = dict(model=M, input="What is the capital of France?", instructions="Answer in one sentence.",
              max_output_tokens=12, temperature=0)
    r = c.responses.create(**kw)
    assert r.status in ("completed", "incomplete") and r.output_text and r.usage.output_tokens <= 12
    with c.responses.stream(**kw) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        if r.status == "completed":
            final = s.get_final_response()
            assert final.output_text == r.output_text
    assert "".join(deltas) == r.output_text                     # greedy: the same text streamed
    assert _client(servers["b"]).responses.retrieve(r.id).output_text == r.output_text


def test_forced_call_chained_on_the_other_router(routers):
    servers, backends = routers
    a, b = _client(servers["a"]), _client(servers["b"])
    r1 = a.responses.create(model=M, input="What is the weather in Paris?", instructions="Use the tools.",
                            tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                            temperature=0, max_output_tokens=60)
    [call] = r1.output
    assert r1.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    args = json.loads(call.arguments)
    jsonschema.validate(args, PARAMS)
    r2 = b.responses.create(model=M, previous_response_id=r1.id, tools=[WEATHER], temperature=0,
                            instructions="Use the tools.",       # not carried over: clients send them again
                            max_output_tokens=8, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                          "output": f"18C and sunny in {args['city']}."}])
    assert r2.status in ("completed", "incomplete") and r2.previous_response_id == r1.id
    assert r2.usage.input_tokens > r1.usage.input_tokens          # it saw the history ...
    assert r2.usage.input_tokens_details.cached_tokens > 0         # ... whose KV the workers kept
    assert b.responses.retrieve(r1.id).output[0].call_id == call.call_id
    b.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(r1.id)

    from tandem.cluster.launch import launch_disaggregated

    backends["a"].close()                                          # router A restarts ...
    servers["a"].stop()
    backends["a"] = launch_disaggregated(CFG)
    servers["a"] = Server(backends["a"], CFG, "A2")
    again = _client(servers["a"]).responses.retrieve(r2.id)        # ... and loses no stored response
    assert again.output_text == r2.output_text and again.status == r2.status


# ------------------------------------------------------------------------------ agent clients
def test_openai_agents_default_model_calls_the_tool_and_finishes(routers):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    servers, _ = routers
    calls = []

    @agents.function_tool
    def lookup_population(city: str) -> str:
        """Population of a city."""
        calls.append(city)
        return "about 2.1 million people"

    client = openai.AsyncOpenAI(base_url=servers["b"].url + "/v1", api_key="unused", max_retries=0, timeout=120)
    provider = agents.OpenAIProvider(openai_client=client)        # its default: the Responses API
    assert type(provider.get_model(M)).__name__ == "OpenAIResponsesModel"
    agent = agents.Agent(name="geo", instructions="Answer with tools.", tools=[lookup_population], model=M,
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=40,
                                                             parallel_tool_calls=False))
    result = agents.Runner.run_sync(agent, "How many people live in Paris?", max_turns=4,
                                    run_config=agents.RunConfig(model_provider=provider))
    assert calls and all(isinstance(c, str) and c for c in calls)
    assert isinstance(result.final_output, str) and result.final_output


def test_pydantic_ai_and_langchain_on_the_responses_api(routers):
    pytest.importorskip("pydantic_ai")
    lc = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)

    servers, _ = routers
    model = OpenAIResponsesModel(M, provider=OpenAIProvider(base_url=servers["a"].url + "/v1", api_key="unused"))
    agent = Agent(model, output_type=City, model_settings={"temperature": 0, "max_tokens": 60})
    city = agent.run_sync("Describe Paris.").output          # its output tool, forced: a valid call
    assert isinstance(city, City) and city.name

    llm = lc.ChatOpenAI(model=M, base_url=servers["b"].url + "/v1", api_key="unused", max_retries=0, timeout=120,
                        temperature=0, max_tokens=40, use_responses_api=True)
    msg = llm.bind_tools([{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                                            "parameters": PARAMS}}],
                         tool_choice="get_weather").invoke("What is the weather in Rome?")
    [tc] = msg.tool_calls
    assert tc["name"] == "get_weather"
    jsonschema.validate(tc["args"], PARAMS)


def test_anthropic_stream_states_the_same_usage_in_every_event(routers):
    """The first token's chunk carries the prompt's figures (prefill's cache hit, on 1P+1D), so
    message_start is right from the start and message_delta repeats it."""
    import httpx

    servers, _ = routers
    body = {"model": M, "max_tokens": 3, "stream": True, "temperature": 0,
            "system": "You are terse. " * 12, "messages": [{"role": "user", "content": "Say hi."}]}
    for _ in range(2):                     # the second time, the prompt is cached
        with httpx.stream("POST", servers["a"].url + "/v1/messages", json=body, timeout=120) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        start = next(e for e in events if e["type"] == "message_start")["message"]["usage"]
        delta = next(e for e in events if e["type"] == "message_delta")["usage"]
        assert {k: start[k] for k in ("input_tokens", "cache_read_input_tokens")} == \
            {k: delta[k] for k in ("input_tokens", "cache_read_input_tokens")}, (start, delta)
    assert start["cache_read_input_tokens"] > 0 and start["input_tokens"] > 0


# ------------------------------------------------------------------------------ cut calls never leak
def _cut(server, seed: int) -> tuple[str, list, list]:
    """One forced tool call cut at a small max_tokens through one of the three APIs (by seed);
    (api, content texts, call arguments)."""
    api, stream, n = ("chat", "responses", "messages")[seed % 3], seed % 2 == 1, 3 + seed % 19
    user = f"What is the weather in city number {seed}?"
    if api == "chat":
        kw = dict(model=M, messages=[{"role": "user", "content": user}], temperature=1.0, seed=seed, max_tokens=n,
                  tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
                  tool_choice="required")
        c = _client(server)
        if stream:
            chunks = [ch for ch in c.chat.completions.create(stream=True, **kw) if ch.choices]
            texts = ["".join(ch.choices[0].delta.content or "" for ch in chunks)]
            args = [d.function.arguments for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
        else:
            msg = c.chat.completions.create(**kw).choices[0].message
            texts, args = [msg.content or ""], [t.function.arguments for t in msg.tool_calls or []]
    elif api == "responses":
        kw = dict(model=M, input=user, tools=[WEATHER], tool_choice="required", temperature=1.0,
                  max_output_tokens=n, store=False, extra_body={"seed": seed})
        c = _client(server)
        if stream:
            with c.responses.stream(**kw) as s:
                events = list(s)
            texts = ["".join(e.delta for e in events if e.type == "response.output_text.delta")]
            args = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
        else:
            r = c.responses.create(**kw)
            texts = [p.text for o in r.output if o.type == "message" for p in o.content]
            args = [o.arguments for o in r.output if o.type == "function_call"]
    else:
        import anthropic

        c = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        kw = dict(model=M, max_tokens=n, messages=[{"role": "user", "content": user}], tool_choice={"type": "any"},
                  tools=[{"name": "get_weather", "description": "Weather.", "input_schema": PARAMS}])
        if stream:
            with c.messages.stream(**kw) as s:
                msg = s.get_final_message()
        else:
            msg = c.messages.create(**kw)
        texts = [b.text for b in msg.content if b.type == "text"]
        args = [json.dumps(b.input) for b in msg.content if b.type == "tool_use"]
    return api, texts, args


def test_forced_calls_cut_by_max_tokens_never_leak_markup(routers):
    servers, _ = routers
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda s: _cut(servers["b" if s % 2 else "a"], s), range(50)))
    for seed, (api, texts, args) in enumerate(results):
        assert not any(m in t for t in texts for m in MARKUP) and not any(t.strip() for t in texts), (seed, api, texts)
        for a in args:                      # what is returned as a call is a whole, valid call
            jsonschema.validate(json.loads(a), PARAMS)
    assert sum(bool(a) for _, _, a in results) < 50     # most were cut before the call was whole
