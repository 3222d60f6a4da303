"""/v1/responses at the front door, through the real ``openai`` SDK and httpx against
ScriptedBackend (``[say]TEXT[/say]`` in the prompt is the reply): the request mapping (items,
instructions, tools, text.format, the constraint handed to the engine), the output items and the
typed stream, chains by previous_response_id and their session, GET / DELETE / cancel, background,
and the 4xx answers. The store's bounds are pinned on ResponseTable directly."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tandem.router.responses.store import ResponseTable, StoredResponse
from tandem.router.tools.formats import FORMATS
from tandem.router.tools.spec import parse_openai_tools

M = "scripted-model"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def say(text: str) -> str:
    return f"[say]{text}[/say]"


@pytest.fixture()
def live(live_agent):
    return live_agent


@pytest.fixture()
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=10)


def prompt_of(live, i: int = -1) -> str:
    return live.backend.tokenizer.decode(live.backend.requests[i].prompt_ids)


def post(live, body: dict, **kw) -> httpx.Response:
    return httpx.post(live.url + "/v1/responses", json={"model": M, **body}, timeout=10, **kw)


# ------------------------------------------------------------------------------ create, GET, DELETE
def test_create_get_delete(client, live):
    r = client.responses.create(model=M, input="Hi " + say("Hello there!"), instructions="Be brief.")
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == "Hello there!" and r.incomplete_details is None and r.error is None
    [msg] = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "completed" and msg.id.startswith("msg_")
    u = r.usage
    assert u.input_tokens == len(live.backend.requests[-1].prompt_ids) and u.input_tokens_details.cached_tokens == 4
    assert u.output_tokens == len("Hello there!") and u.total_tokens == u.input_tokens + u.output_tokens
    assert prompt_of(live).startswith("<system>Be brief.\n<user>Hi ")
    assert live.backend.requests[-1].params.temperature == 1.0          # OpenAI's default
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError):
            call()


def test_speculative_field_reaches_the_engine(client, live):
    """Tandem's ``speculative`` (the SDK's extra_body) turns drafts off for the request; absent, on."""
    client.responses.create(model=M, input=say("x"), store=False)
    assert live.backend.requests[-1].params.speculative is True
    client.responses.create(model=M, input=say("x"), store=False, extra_body={"speculative": False})
    assert live.backend.requests[-1].params.speculative is False


def test_store_false_is_not_kept(client):
    r = client.responses.create(model=M, input=say("x"), store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=M, input="more", previous_response_id=r.id)
    assert e.value.body["code"] == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"


# ------------------------------------------------------------------------------ tools and chains
def test_forced_call_then_chained_function_output(client, live):
    r1 = client.responses.create(model=M, input="Weather in Paris? " + say(CALL), tools=[WEATHER],
                                 tool_choice="required", parallel_tool_calls=False, instructions="Use tools.")
    [call] = r1.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and json.loads(call.arguments) == {"city": "Paris"}
    assert r1.status == "completed" and r1.tool_choice == "required" and r1.tools[0].name == "get_weather"
    c = live.backend.requests[-1].params.constraint
    plan = parse_openai_tools([{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
                              "required", False)
    assert c.kind == "lark" and c.spec == FORMATS["hermes"].constraint(plan).spec
    session = live.backend.requests[-1].session_id
    assert session and session.startswith("fp-")

    r2 = client.responses.create(model=M, previous_response_id=r1.id, tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "18C " + say("It is 18C in Paris.")}])
    assert r2.output_text == "It is 18C in Paris." and r2.previous_response_id == r1.id
    prompt = prompt_of(live)
    assert "Use tools." not in prompt                             # instructions are not carried over
    assert "<user>Weather in Paris? " in prompt and '<assistant><tool_call>\n{"name": "get_weather", ' \
                                                    '"arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18C " in prompt
    assert live.backend.requests[-1].session_id == session        # the chain is one session
    assert live.backend.requests[-1].params.constraint is None    # auto
    r3 = client.responses.create(model=M, previous_response_id=r2.id, input="And tomorrow? " + say("Rain."),
                                 extra_headers={"X-Session-Affinity": "agent-7"})
    assert r3.output_text == "Rain." and live.backend.requests[-1].session_id == "agent-7"   # explicit wins
    assert "It is 18C in Paris." in prompt_of(live)


def test_client_side_history_items_render_like_the_chain(client, live):
    r1 = client.responses.create(model=M, input="Weather? " + say(CALL), tools=[WEATHER], tool_choice="required")
    chained = prompt_of(live)   # not yet: compare the second turns
    out = [i.model_dump(exclude_none=True) for i in r1.output]
    follow = {"type": "function_call_output", "call_id": r1.output[0].call_id, "output": "sunny"}
    client.responses.create(model=M, previous_response_id=r1.id, tools=[WEATHER], input=[follow])
    chained = prompt_of(live)
    client.responses.create(model=M, tools=[WEATHER], store=False, input=[
        {"role": "user", "content": "Weather? " + say(CALL)}, *out, follow])
    assert prompt_of(live) == chained


def test_named_choice_auto_parallel_false_keeps_one_call(client, live):
    two = CALL + "\n" + CALL.replace("Paris", "Oslo")
    r = client.responses.create(model=M, input=say(two), tools=[WEATHER], parallel_tool_calls=False)
    assert [o.type for o in r.output] == ["function_call"] and json.loads(r.output[0].arguments)["city"] == "Paris"
    r = client.responses.create(model=M, input=say("Checking. " + two), tools=[WEATHER])
    assert [o.type for o in r.output] == ["message", "function_call", "function_call"]
    assert r.output[0].content[0].text == "Checking."                # no whitespace beside the calls
    r = client.responses.create(model=M, input=say(CALL), tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"})
    assert r.tool_choice.name == "get_weather" and r.output[0].name == "get_weather"
    assert "{0," not in live.backend.requests[-1].params.constraint.spec   # exactly one call


def test_truncated_call_is_dropped_and_incomplete(client, live):
    whole = len(CALL) - len("\n</tool_call>")
    for n in sorted({*range(1, len(CALL), 9), whole - 1, whole, whole + 1, len(CALL) - 1, len(CALL)}):
        r = client.responses.create(model=M, input=say(CALL), tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=n, store=False)
        complete = n >= whole      # the JSON is whole: a call (even when its closing marker was cut)
        assert r.status == ("incomplete" if n < len(CALL) else "completed"), n
        if r.status == "incomplete":
            assert r.incomplete_details.reason == "max_output_tokens"
        texts = [p.text for o in r.output if o.type == "message" for p in o.content]
        assert not any("<tool" in t or "{" in t or t.strip() for t in texts), (n, texts)
        assert [o.type for o in r.output if o.type == "function_call"] == (["function_call"] if complete else []), n


def test_text_format_json_schema(client, live):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = client.responses.create(model=M, input=say('{"a": 1}'), text={"format": {
        "type": "json_schema", "name": "thing", "schema": schema, "strict": True}})
    c = live.backend.requests[-1].params.constraint
    assert c.kind == "json_schema" and json.loads(c.spec) == schema and c.strict
    assert json.loads(r.output_text) == {"a": 1} and r.text.format.type == "json_schema"
    client.responses.create(model=M, input=say("{}"), text={"format": {"type": "json_object"}})
    assert live.backend.requests[-1].params.constraint.kind == "json_object"


# ------------------------------------------------------------------------------ streaming
def test_stream_events_and_final_response(client, live):
    with client.responses.stream(model=M, input=say("Sure. " + CALL), tools=[WEATHER]) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     *["response.output_text.delta"] * kinds.count("response.output_text.delta"),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Sure."
    assert events[0].response.status == "in_progress" and final.status == "completed"
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert json.loads(final.output[1].arguments) == {"city": "Paris"}
    assert final.usage.output_tokens == len("Sure. " + CALL)
    stored = client.responses.retrieve(final.id)   # what GET returns is what the stream completed with
    assert (stored.status, stored.usage, [o.id for o in stored.output]) == (final.status, final.usage,
                                                                             [o.id for o in final.output])


def test_stream_incomplete_and_raw_sse(live):
    with httpx.stream("POST", live.url + "/v1/responses", timeout=10, json={
            "model": M, "input": say(CALL), "tools": [WEATHER], "tool_choice": "required",
            "max_output_tokens": 20, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    frames = [f for f in body.split("\n\n") if f]
    assert all(f.startswith("event: ") and "\ndata: " in f for f in frames) and "[DONE]" not in body
    last = json.loads(frames[-1].split("\ndata: ", 1)[1])
    assert last["type"] == "response.incomplete" and last["response"]["status"] == "incomplete"
    assert "<tool" not in body.replace('"tool_choice"', "").replace('"tools"', "")


# ------------------------------------------------------------------------------ background, cancel
def test_background_completes_and_cancel_aborts(client, live):
    r = client.responses.create(model=M, input=say("later"), background=True)
    assert r.status == "queued" and r.background
    deadline = time.monotonic() + 10
    while (got := client.responses.retrieve(r.id)).status != "completed":
        assert time.monotonic() < deadline, got.status
        time.sleep(0.05)
    assert got.output_text == "later" and got.usage.output_tokens == 5

    h = client.responses.create(model=M, input="[hang]", background=True)
    deadline = time.monotonic() + 10
    while client.responses.retrieve(h.id).status != "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    live.backend.abort_seen.clear()
    c = client.responses.cancel(h.id)
    assert c.status == "cancelled" and live.backend.abort_seen.wait(5)
    assert h.id in live.backend.aborted[-1]
    time.sleep(0.1)
    assert client.responses.retrieve(h.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):      # not in background mode
        client.responses.cancel(client.responses.create(model=M, input=say("x")).id)
    with pytest.raises(openai.BadRequestError):      # already finished
        client.responses.cancel(r.id)


# ------------------------------------------------------------------------------ 4xx
@pytest.mark.parametrize("body, status, param", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, 400, "tools[0].type"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, 400, "tool_choice"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice.name"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, 400,
     "input[0].content.0"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, 400, "input[0].type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input[0].call_id"),
    ({"input": "x", "conversation": "conv_1"}, 400, "conversation"),
    ({"input": "x", "truncation": "auto"}, 400, "truncation"),
    ({"input": "x", "background": True, "stream": True}, 400, "background"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "nope"}}}}, 400,
     "text.format.schema"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     400, "text.format"),
    ({"input": "x", "max_output_tokens": 1 << 20}, 400, "max_output_tokens"),
    ({"input": "x", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
    ({"input": "x", "model": "gpt-5"}, 404, "model"),
    ({"input": ""}, 400, "input"),
    ({"input": "x", "temperature": "hot"}, 400, "temperature"),
    ({"input": "x", "speculative": "off"}, 400, "speculative"),
])
def test_bad_requests_are_4xx_naming_the_field(live, body, status, param):
    r = post(live, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err


def test_unknown_ids_are_404s(live):
    for method, path in (("GET", "/v1/responses/resp_nope"), ("DELETE", "/v1/responses/resp_nope"),
                         ("POST", "/v1/responses/resp_nope/cancel")):
        r = httpx.request(method, live.url + path, timeout=10)
        assert r.status_code == 404 and "resp_nope" in r.json()["error"]["message"], (method, r.text)


# ------------------------------------------------------------------------------ the store's bounds
def _rec(i: int, pad: int = 0) -> dict:
    return StoredResponse(f"resp_{i}", {"status": "completed", "pad": "x" * pad}, [], None).to_wire()


def test_table_bounds_count_bytes_and_ttl():
    now = [0.0]
    t = ResponseTable(max_stored=3, max_bytes=10_000, ttl_s=60, clock=lambda: now[0])
    for i in range(4):
        t.put(_rec(i))
    assert len(t) == 3 and t.get("resp_0") is None and t.evicted == 1
    t.get("resp_1")                       # touched: resp_2 is now the least recently used
    t.put(_rec(4))
    assert t.get("resp_2") is None and t.get("resp_1") is not None
    t.put(_rec(5, pad=9_900))             # bytes: older ones go until it fits
    assert t.bytes <= 10_000 and t.get("resp_5") is not None and len(t) == 1
    t.put(_rec(6, pad=20_000))            # larger than the whole store: not kept
    assert t.get("resp_6") is None and t.get("resp_5") is not None
    now[0] = 61.0
    assert t.get("resp_5") is None and len(t) == 0 and t.bytes == 0


def test_table_cancel_sticks():
    t = ResponseTable(10, 100_000, 60)
    t.put(StoredResponse("resp_a", {"status": "in_progress"}).to_wire())
    assert t.cancel("resp_a")["response"]["status"] == "cancelled"
    kept = t.put(StoredResponse("resp_a", {"status": "completed"}).to_wire(), unless_cancelled=True)
    assert kept["response"]["status"] == "cancelled" and t.get("resp_a")["response"]["status"] == "cancelled"
    t.put(StoredResponse("resp_b", {"status": "completed"}).to_wire())
    assert t.cancel("resp_b")["response"]["status"] == "completed" and t.cancel("resp_c") is None
