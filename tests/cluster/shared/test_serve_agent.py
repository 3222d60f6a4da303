"""Agent clients against ``tandem serve`` on SmolLM2 (issue 13, phase 2): the engine enforces what
the front door accepts. Real clients only (openai, openai-agents, langchain-openai, anthropic).

Three servers per module: a router over the shared 1 prefill + 1 decode Ray workers (real NIXL;
tests/cluster/shared/conftest.py), a colocated engine, and a colocated engine with the prefix cache
off, all on SmolLM2 in float32 (bitwise batch- and prefix-invariant, test_batch_invariance.py). Every greedy check runs on all of them and must give
the same result: tool calls decoded under the call grammar (``tool_choice`` required / named /
Anthropic ``any``) that the test then runs, structured output over seeded random JSON schemas that
``jsonschema`` accepts, logprobs whose top entry is the sampled token, n = 3 seeded and
reproducible; a constraint the grammar engine cannot compile is a 400.
"""

from __future__ import annotations

import json

import pytest

from serve_support import Server

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from schema_support import object_schema  # noqa: E402

from support.shared_workers import ENGINE, F32_NAMESPACE, base_config  # noqa: E402

CFG = base_config(F32_NAMESPACE)        # the shared workers (tests/cluster/shared/conftest.py)
M = "smollm2"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone.",
                                         "parameters": {"type": "object", "properties": {
                                             "tz": {"enum": ["UTC", "CET", "PST"]}}, "required": ["tz"],
                                             "additionalProperties": False}}}


def _Server(name, backend, cfg):
    return Server(backend, cfg, name)


@pytest.fixture(scope="module")
def servers(smollm2, smollm2_1p1d):
    from tandem.engine.engine import Engine
    from tandem.router.backend import LocalEngineBackend

    backend = smollm2_1p1d.router(CFG)
    engines = [Engine(ENGINE, loaded=smollm2),
               Engine(ENGINE.model_copy(update={"cache": ENGINE.cache.model_copy(
                   update={"disable_prefix_cache": True})}), loaded=smollm2)]
    out = [_Server("1P+1D", backend, CFG), _Server("colocated", LocalEngineBackend(engines[0]), CFG),
           _Server("colocated, no cache", LocalEngineBackend(engines[1]), CFG)]
    yield out
    for s in out:
        s.stop()
    backend.close()
    for e in engines:
        e.shutdown()


def same_everywhere(servers, fn, cache_off: bool = False):
    """``fn(server)`` on 1P+1D and colocated (and, with ``cache_off``, colocated without the
    prefix cache: the SDK flows' cache on/off equality is the engine's, pinned in
    tests/engine/test_constrained_engine.py; two flows check it here too); the results must be
    equal (greedy). Returns one."""
    servers = servers if cache_off else servers[:2]
    results = [fn(s) for s in servers]
    for s, r in zip(servers[1:], results[1:]):
        assert r == results[0], f"{s.name} differs from {servers[0].name}:\n{r}\nvs\n{results[0]}"
    return results[0]


# ------------------------------------------------------------------------------ tools (openai SDK)
def test_openai_tool_round_trip_required_streamed_and_not(servers):
    def trip(s, stream: bool):
        msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
        kw = dict(model=M, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
                  temperature=0, max_tokens=60)
        if stream:
            chunks = list(s.client.chat.completions.create(messages=msgs, stream=True, **kw))
            deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
            finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
            calls = [(d.id, d.function.name, d.function.arguments) for d in deltas]
        else:
            out = s.client.chat.completions.create(messages=msgs, **kw)
            finish = [out.choices[0].finish_reason]
            calls = [(t.id, t.function.name, t.function.arguments) for t in out.choices[0].message.tool_calls]
        assert finish == ["tool_calls"] and len(calls) == 1
        cid, name, args = calls[0]
        params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}[name]
        jsonschema.validate(json.loads(args), params)          # always a valid call, even from 135M
        result = {"get_weather": lambda a: f"18C and sunny in {a['city']}",
                  "get_time": lambda a: f"12:00 {a['tz']}"}[name](json.loads(args))
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}]},
                 {"role": "tool", "tool_call_id": cid, "content": result}]
        final = s.client.chat.completions.create(model=M, messages=msgs, tools=[WEATHER, TIME],
                                                 temperature=0, max_tokens=8)   # any text: the call's round trip
        return name, args, final.choices[0].finish_reason, final.choices[0].message.content

    for stream in (False, True):
        name, args, finish, text = same_everywhere(servers, lambda s: trip(s, stream))
        assert name == "get_weather" and json.loads(args)["city"] and finish in ("stop", "length") and text


def test_named_tool_choice_calls_that_function(servers):
    def named(s):
        out = s.client.chat.completions.create(
            model=M, messages=[{"role": "user", "content": "What time is it in Berlin?"}], tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=0, max_tokens=80)
        [call] = out.choices[0].message.tool_calls
        return call.function.name, call.function.arguments

    name, args = same_everywhere(servers, named)
    assert name == "get_time" and json.loads(args)["tz"] in ("UTC", "CET", "PST")


def test_openai_agents_sdk_loop_finishes(servers):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)

    def loop(s):
        calls = []

        @agents.function_tool
        def lookup_population(city: str) -> str:
            """Population of a city."""
            calls.append(city)
            return "about 2.1 million people"

        client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        agent = agents.Agent(name="geo", instructions="Answer with tools.", tools=[lookup_population],
                             model=agents.OpenAIChatCompletionsModel(model=M, openai_client=client),
                             model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                                 max_tokens=40, parallel_tool_calls=False))
        result = agents.Runner.run_sync(agent, "How many people live in Paris?", max_turns=4)
        return calls, result.final_output

    calls, final = same_everywhere(servers, loop)
    assert calls and all(isinstance(c, str) and c for c in calls) and isinstance(final, str) and final


def test_langchain_with_structured_output(servers):
    lc = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)
        population_millions: int = Field(ge=0, le=50)

    def structured(s):
        llm = lc.ChatOpenAI(model=M, base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120,
                            temperature=0, max_tokens=60)
        return llm.with_structured_output(City).invoke("Describe Paris.")

    city = same_everywhere(servers, structured)
    assert isinstance(city, City) and city.name


# ------------------------------------------------------------------------------ anthropic SDK
def test_anthropic_streams_and_round_trips_tool_use(servers):
    anthropic = pytest.importorskip("anthropic")
    tool = {"name": "get_weather", "description": "Current weather in a city.",
            "input_schema": WEATHER["function"]["parameters"]}

    def trip(s):
        client = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0, timeout=120)
        greedy = {"extra_body": {"temperature": 0}}   # this SDK has no temperature argument any more
        with client.messages.stream(model=M, max_tokens=8, **greedy,
                                    messages=[{"role": "user", "content": "Say hello."}]) as st:
            streamed = "".join(st.text_stream)
            final = st.get_final_message()
        assert streamed == final.content[0].text and final.stop_reason in ("end_turn", "max_tokens")
        msgs = [{"role": "user", "content": "What is the weather in Oslo?"}]
        out = client.messages.create(model=M, max_tokens=60, **greedy, tools=[tool], messages=msgs,
                                     tool_choice={"type": "any", "disable_parallel_tool_use": True})
        [use] = [b for b in out.content if b.type == "tool_use"]
        assert out.stop_reason == "tool_use" and use.name == "get_weather"
        jsonschema.validate(use.input, tool["input_schema"])
        msgs += [{"role": "assistant", "content": out.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": f"18C and sunny in {use.input['city']}"}]}]
        reply = client.messages.create(model=M, max_tokens=30, **greedy, tools=[tool], messages=msgs)
        return streamed, use.input, [b.type for b in reply.content], reply.stop_reason

    streamed, args, blocks, stop = same_everywhere(servers, trip)
    assert streamed and args["city"] and blocks and stop in ("end_turn", "max_tokens", "tool_use")


# ------------------------------------------------------------------------------ structured output
def test_random_json_schemas_validate_on_every_server(servers):
    schemas = [object_schema(seed) for seed in range(100, 108)]

    def fill(s):
        out = []
        for i, schema in enumerate(schemas):
            kw = dict(model=M, messages=[{"role": "user", "content": "Reply with a JSON object."}], temperature=0,
                      max_tokens=160, response_format={"type": "json_schema", "json_schema": {
                          "name": f"s{i}", "schema": schema, "strict": True}})
            if i == 0:   # one of them streamed
                text = "".join(c.choices[0].delta.content or "" for c in s.client.chat.completions.create(
                    stream=True, **kw) if c.choices)
            else:
                text = s.client.chat.completions.create(**kw).choices[0].message.content
            jsonschema.validate(json.loads(text), schema)
            out.append(text)
        return out

    same_everywhere(servers, fill, cache_off=True)


def test_a_constraint_the_grammar_engine_refuses_is_a_400(servers):
    for s in servers[:2]:
        with pytest.raises(openai.BadRequestError, match="does not compile"):
            s.client.chat.completions.create(
                model=M, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                response_format={"type": "json_schema", "json_schema": {
                    "name": "x", "strict": True, "schema": {"type": "string", "format": "no-such-format"}}})
        with pytest.raises(openai.BadRequestError, match="does not compile"):
            s.client.completions.create(model=M, prompt="x", max_tokens=4,
                                        extra_body={"response_format": {"type": "regex", "regex": "(("}})


# ------------------------------------------------------------------------------ logprobs, n
def test_logprobs_top_entry_is_the_sampled_token(servers):
    def lps(s):
        kw = dict(model=M, messages=[{"role": "user", "content": "What is 2 + 2?"}], max_tokens=8, temperature=0,
                  logprobs=True, top_logprobs=3)
        out = s.client.chat.completions.create(**kw)
        content = out.choices[0].logprobs.content
        assert "".join(t.token for t in content) == out.choices[0].message.content
        for t in content:
            assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob <= 0
        streamed = [t for c in s.client.chat.completions.create(stream=True, **kw) if c.choices
                    and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
        assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
        comp = s.client.completions.create(model=M, prompt="The capital of France is", max_tokens=4,
                                           temperature=0, logprobs=2).choices[0].logprobs
        return ([(t.token, round(t.logprob, 3), [x.token for x in t.top_logprobs]) for t in content],
                comp.tokens, [round(v, 3) for v in comp.token_logprobs])

    same_everywhere(servers, lps, cache_off=True)


def test_n3_with_a_seed_is_reproducible(servers):
    for s in servers[:2]:
        def n3():
            out = s.client.chat.completions.create(model=M, messages=[{"role": "user", "content": "Name a fruit."}],
                                                   n=3, seed=7, temperature=0.9, max_tokens=8)
            assert [c.index for c in out.choices] == [0, 1, 2]
            return [c.message.content for c in out.choices]

        first = n3()
        assert n3() == first and len(set(first)) > 1, (s.name, first)


def _prefill_computed(server) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(x.value for f in text_string_to_metric_families(text) if f.name == "tandem_worker_prompt_tokens_computed"
               for x in f.samples if x.labels.get("role") == "prefill")


def test_n4_costs_one_prompt_prefill_on_the_prefill_worker(servers):
    disagg = servers[0]
    cost = {}
    for n, tag in ((1, "first"), (4, "second")):
        before = _prefill_computed(disagg)
        disagg.client.chat.completions.create(
            model=M, n=n, seed=1, temperature=0.9, max_tokens=2,
            messages=[{"role": "user", "content": f"Write one line about rivers, the {tag} time."}])
        cost[n] = _prefill_computed(disagg) - before
    assert 0 < cost[4] <= cost[1] + 3 * 16, cost     # each sibling computes at most its last page
