"""Prompt caching at the front door (issue 52), through the real `anthropic` and `openai` SDKs
against ScriptedBackend (a test double reporting cached_tokens = min(4, prompt)): cache_control
breakpoints become GenerateRequest.pins (prefix tokens, TTL) on tools, system and message blocks,
bad cache_control / prompt_cache_retention are 400s naming the field, prompt_cache_key is the
session key on every OpenAI API (ahead of session ids), usage is truthful, and an API key's
pin_tokens reaches the workers as pin_cap."""

from __future__ import annotations

import httpx
import pytest

from tandem.core.config import ServeConfig
from tandem.router.prompt_cache import anthropic_usage

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

M = "scripted-model"
SYS = "You are a careful agent. " * 4
TOOL = {"name": "lookup", "description": "Look a thing up.",
        "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}},
        "cache_control": {"type": "ephemeral", "ttl": "1h"}}
CC5 = {"type": "ephemeral"}
CC1H = {"type": "ephemeral", "ttl": "1h"}


@pytest.fixture()
def live(live_agent):
    return live_agent


@pytest.fixture()
def claude(live):
    return anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=10)


@pytest.fixture()
def oai(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=10)


def last(live):
    return live.backend.requests[-1]


def text(live, n: int) -> str:
    return live.backend.tokenizer.decode(last(live).prompt_ids[:n])


def test_breakpoints_on_system_and_message_blocks_become_pins_with_their_ttl(claude, live):
    out = claude.messages.create(
        model=M, max_tokens=5,
        system=[{"type": "text", "text": SYS, "cache_control": CC1H}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "first question", "cache_control": CC5},
                                               {"type": "text", "text": " and more"}]}])
    greq = last(live)
    (n_sys, ttl_sys), (n_msg, ttl_msg) = greq.pins
    assert (ttl_sys, ttl_msg) == (3600, 300)
    # the prefix rendered up to each block; "<" opens the next message either way
    assert text(live, n_sys) == f"<system>{SYS}\n<"
    assert text(live, n_msg) == f"<system>{SYS}\n<user>first question"
    prompt = len(greq.prompt_ids)
    assert out.usage.cache_read_input_tokens == 4
    assert out.usage.cache_creation_input_tokens == n_msg - 4
    assert out.usage.input_tokens == prompt - n_msg
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens + out.usage.cache_creation_input_tokens == prompt


def test_breakpoint_on_a_tool_and_on_a_tool_result_are_accepted(claude, live):
    claude.messages.create(
        model=M, max_tokens=5, tools=[TOOL], system="S",
        messages=[{"role": "user", "content": "weather?"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "lookup",
                                                     "input": {"q": "x"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny",
                                                "cache_control": CC5}]}])
    greq = last(live)
    (n_tool, ttl_tool), (n_res, ttl_res) = greq.pins
    assert (ttl_tool, ttl_res) == (3600, 300)
    assert text(live, n_tool).startswith("<system>") and n_tool < n_res
    assert n_res == len(greq.prompt_ids)        # the last block: the whole prompt


def test_streamed_message_start_reports_cache_creation(claude, live):
    with claude.messages.stream(model=M, max_tokens=5,
                                system=[{"type": "text", "text": SYS, "cache_control": CC5}],
                                messages=[{"role": "user", "content": "hi"}]) as s:
        start = next(e for e in s if e.type == "message_start")
        final = s.get_final_message()
    n = last(live).pins[0][0]
    assert (start.message.usage.cache_read_input_tokens, start.message.usage.cache_creation_input_tokens) == (4, n - 4)
    assert final.usage.cache_creation_input_tokens == n - 4 and final.usage.cache_read_input_tokens == 4


def test_no_breakpoint_no_pin_and_nothing_created(claude, live):
    out = claude.messages.create(model=M, max_tokens=5, system=SYS, messages=[{"role": "user", "content": "hi"}])
    assert last(live).pins == () and out.usage.cache_creation_input_tokens == 0


def test_usage_split_reads_past_the_breakpoint_create_nothing():
    assert anthropic_usage(100, 60, [(50, 300)]) == {
        "input_tokens": 40, "cache_read_input_tokens": 60, "cache_creation_input_tokens": 0}
    assert anthropic_usage(100, 0, [(50, 300), (80, 300)]) == {
        "input_tokens": 20, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 80}


def block(cc, text_="x"):
    return {"type": "text", "text": text_, "cache_control": cc}


@pytest.mark.parametrize("extra, needle", [
    ({"system": [block({"type": "ephemeral", "ttl": "10m"})]}, "system.0.cache_control.ttl: Input should be '5m' or '1h'"),
    ({"system": [block({"type": "persistent"})]}, "system.0.cache_control.type: Input should be 'ephemeral'"),
    ({"system": [block(CC5, "")]}, "system.0.text: cache_control cannot be set for empty text blocks"),
    ({"system": [block(CC5)] * 3, "tools": [TOOL, {**TOOL, "name": "b"}]},
     "A maximum of 4 blocks with cache_control may be provided. Found 5."),
    ({"system": [block(CC5), block(CC1H)]}, "must not come after a ttl='5m'"),
    ({"messages": [{"role": "user", "content": [block({"type": "ephemeral", "ttl": 300})]}]},
     "messages.0.content.0.cache_control.ttl"),
])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_bad_cache_control_is_a_400_naming_the_field(live, extra, needle, path):
    body = {"model": M, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **extra}
    r = httpx.post(live.url + path, json=body, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert needle in err["error"]["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/responses", {"input": "hi"}),
])
def test_prompt_cache_retention_outside_the_two_values_is_a_400(live, path, body):
    r = httpx.post(live.url + path, json={"model": M, "prompt_cache_retention": "7d", **body}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt_cache_retention"
    r = httpx.post(live.url + path, json={"model": M, "prompt_cache_key": 7, **body}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_key"


def test_prompt_cache_key_is_the_session_on_every_openai_api_ahead_of_session_ids(oai, live):
    msgs = [{"role": "user", "content": "hi"}]
    oai.chat.completions.create(model=M, messages=msgs, max_tokens=2, prompt_cache_key="pck-1")
    assert last(live).session_id == "pck-1"
    oai.completions.create(model=M, prompt="hi", max_tokens=2, extra_body={"prompt_cache_key": "pck-2"})
    assert last(live).session_id == "pck-2"
    oai.responses.create(model=M, input="hi", max_output_tokens=2, prompt_cache_key="pck-3")
    assert last(live).session_id == "pck-3"
    oai.chat.completions.create(model=M, messages=msgs, max_tokens=2, prompt_cache_key="pck-1", user="u",
                                extra_body={"session_id": "sid-body"})
    assert last(live).session_id == "pck-1"        # one key, one route, whatever the session
    oai.chat.completions.create(model=M, messages=msgs, max_tokens=2, prompt_cache_key="pck-1",
                                extra_headers={"x-session-id": "sid-hdr"})
    assert last(live).session_id == "pck-1"
    oai.chat.completions.create(model=M, messages=msgs, max_tokens=2, extra_body={"session_id": "sid-body"},
                                extra_headers={"x-session-id": "sid-hdr"})
    assert last(live).session_id == "sid-hdr"      # without a key: the header, then the body's id
    oai.chat.completions.create(model=M, messages=msgs, max_tokens=2, prompt_cache_key="pck-1", user="u")
    assert last(live).session_id == "pck-1"        # the cache key beats the user


def test_retention_24h_pins_the_prompt_and_in_memory_does_not(oai, live):
    msgs = [{"role": "user", "content": "keep me"}]
    oai.chat.completions.create(model=M, messages=msgs, max_tokens=2, extra_body={"prompt_cache_retention": "24h"})
    assert last(live).pins == ((len(last(live).prompt_ids), 86400),)
    oai.chat.completions.create(model=M, messages=msgs, max_tokens=2,
                                extra_body={"prompt_cache_retention": "in_memory"})
    assert last(live).pins == ()
    oai.responses.create(model=M, input="keep", max_output_tokens=2, extra_body={"prompt_cache_retention": "24h"})
    assert last(live).pins == ((len(last(live).prompt_ids), 86400),)


def test_cached_tokens_reported_on_every_api_streamed_included(oai, live):
    msgs = [{"role": "user", "content": "hi"}]
    assert oai.chat.completions.create(model=M, messages=msgs, max_tokens=2).usage.prompt_tokens_details.cached_tokens == 4
    assert oai.completions.create(model=M, prompt="hi there", max_tokens=2).usage.prompt_tokens_details.cached_tokens == 4
    assert oai.responses.create(model=M, input="hi", max_output_tokens=2).usage.input_tokens_details.cached_tokens == 4
    chunks = list(oai.chat.completions.create(model=M, messages=msgs, max_tokens=2, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 4
    chunks = list(oai.completions.create(model=M, prompt="hi there", max_tokens=2, stream=True,
                                         stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 4
    events = list(oai.responses.create(model=M, input="hi", max_output_tokens=2, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.usage.input_tokens_details.cached_tokens == 4


KEY = "sk-pinner-0001"


@pytest.fixture(scope="module")
def pinning(serve, tmp_path_factory, scripted_backend):
    p = tmp_path_factory.mktemp("keys") / "keys.yaml"
    p.write_text(f"- key: {KEY}\n  tenant: acme\n  pin_tokens: 2048\n")
    return serve(scripted_backend(), ServeConfig(api_keys=str(p)))


def test_the_keys_pin_tokens_reach_the_worker_as_pin_cap(pinning):
    body = {"model": M, "max_tokens": 2, "system": [block(CC5, SYS)], "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(pinning.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=10)
    assert r.status_code == 200, r.text
    greq = pinning.backend.requests[-1]
    assert (greq.tenant, greq.pin_cap, len(greq.pins)) == ("acme", 2048, 1)
    del body["system"]
    httpx.post(pinning.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=10)
    assert pinning.backend.requests[-1].pin_cap == -1          # no pin asked: no cap sent


def test_a_negative_pin_tokens_is_refused_by_the_key_file(tmp_path):
    from tandem.router.auth import load_keys
    p = tmp_path / "k.yaml"
    p.write_text(f"- key: {KEY}\n  tenant: acme\n  pin_tokens: -1\n")
    with pytest.raises(ValueError, match="pin_tokens"):
        load_keys(str(p))
