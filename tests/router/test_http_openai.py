"""The front door through the real `openai` client, against ScriptedBackend (a test double: these
check the protocol mapping, not generation)."""

from __future__ import annotations

import httpx
import openai
import pytest


@pytest.fixture()
def script(live) -> str:
    """What ScriptedBackend replies, one character per token."""
    return live.backend.script


@pytest.fixture()
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=10)


def chat_prompt_len(*messages: tuple[str, str]) -> int:
    return len("".join(f"<{r}>{c}\n" for r, c in messages) + "<assistant>")


def test_chat_non_streamed(script, client, live):
    out = client.chat.completions.create(model="scripted-model",
                                         messages=[{"role": "user", "content": "hi"}])
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert out.model == "scripted-model"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == script
    assert out.choices[0].finish_reason == "stop"
    n = chat_prompt_len(("user", "hi"))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        n, len(script), n + len(script))
    assert out.usage.prompt_tokens_details.cached_tokens == 4
    greq = live.backend.requests[-1]
    assert greq.rid == out.id
    # chat without max_tokens may use the rest of the context; OpenAI's default temperature is 1
    assert greq.params.max_tokens == live.backend.max_context - n
    assert greq.params.temperature == 1.0


def test_chat_streamed_with_usage(script, client):
    stream = client.chat.completions.create(
        model="scripted-model", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True}, max_tokens=5)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == script[:5]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert last.usage.prompt_tokens_details.cached_tokens == 4
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


def test_completion_non_streamed_and_streamed(script, client, live):
    out = client.completions.create(model="scripted-model", prompt="Once upon", max_tokens=3)
    assert out.id.startswith("cmpl-") and out.object == "text_completion"
    assert out.choices[0].text == script[:3] and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len("Once upon"), 3)

    chunks = list(client.completions.create(model="scripted-model", prompt=[72, 105], stream=True,
                                            stream_options={"include_usage": True}))
    assert live.backend.requests[-1].prompt_ids == (72, 105)
    # /v1/completions defaults to 16 tokens, like OpenAI
    assert live.backend.requests[-1].params.max_tokens == 16
    assert "".join(c.choices[0].text for c in chunks if c.choices) == script[:16]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == 2 + 16


def test_sampling_fields_and_session_reach_the_backend(client, live):
    out = client.chat.completions.create(
        model="scripted-model", messages=[{"role": "user", "content": "x"}], temperature=0.5,
        top_p=0.9, seed=7, stop=["Tan", "!"], max_completion_tokens=40,
        extra_body={"top_k": 20, "min_tokens": 2, "ignore_eos": True},
        extra_headers={"X-Session-Id": "conv-42"})
    assert out.choices[0].message.content == "Hello from " and out.choices[0].finish_reason == "stop"
    p = live.backend.requests[-1].params
    assert (p.temperature, p.top_p, p.seed, p.stop, p.max_tokens, p.top_k, p.min_tokens, p.ignore_eos) == (
        0.5, 0.9, 7, ("Tan", "!"), 40, 20, 2, True)
    assert live.backend.requests[-1].session_id == "conv-42"

    client.completions.create(model="scripted-model", prompt="x", stop="o", user="alice", max_tokens=1,
                              extra_body={"top_k": -1})
    greq = live.backend.requests[-1]
    assert greq.session_id == "alice" and greq.params.stop == ("o",) and greq.params.top_k == 0
    client.completions.create(model="scripted-model", prompt="x", user="alice", max_tokens=1,
                              extra_body={"session_id": "s-1"})
    assert live.backend.requests[-1].session_id == "s-1"   # session_id wins over user


def test_max_tokens_beyond_the_context_is_a_400_with_the_numbers(client, live):
    ctx = live.backend.max_context
    for kw in ({"max_tokens": 10 ** 30}, {"max_tokens": ctx - 3}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="scripted-model", prompt="abcd", **kw)
        n = kw["max_tokens"]
        assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
        assert f"maximum context length is {ctx} tokens" in e.value.message
        assert f"requested {4 + n} tokens (4 in the prompt, {n} in the completion)" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="scripted-model", messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=10 ** 6)
    assert e.value.param == "max_completion_tokens" and "in the messages" in e.value.message
    client.completions.create(model="scripted-model", prompt="abcd", max_tokens=ctx - 4)   # fits exactly
    assert live.backend.requests[-1].params.max_tokens == ctx - 4
    client.chat.completions.create(model="scripted-model", messages=[{"role": "user", "content": "hi"}])
    n_prompt = len(live.backend.requests[-1].prompt_ids)
    assert live.backend.requests[-1].params.max_tokens == ctx - n_prompt   # omitted: the room left


def test_models_and_unknown_model(client, live):
    models = client.models.list()
    assert [mo.id for mo in models.data] == ["scripted-model"]
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "model_not_found"


def test_backend_refusal_and_failure(client):
    with pytest.raises(openai.BadRequestError, match="scripted refusal"):
        client.completions.create(model="scripted-model", prompt="[refuse]")
    with pytest.raises(openai.InternalServerError, match="scripted failure"):
        client.completions.create(model="scripted-model", prompt="[error]")
    with pytest.raises(openai.APIError, match="scripted failure"):
        list(client.completions.create(model="scripted-model", prompt="[error]", stream=True))


def test_api_key(live_auth):
    ok = openai.OpenAI(base_url=live_auth.url + "/v1", api_key="sk-test-key", max_retries=0, timeout=10)
    assert ok.completions.create(model="scripted-model", prompt="hi", max_tokens=2).choices[0].text == "He"
    bad = openai.OpenAI(base_url=live_auth.url + "/v1", api_key="sk-wrong", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(live_auth.url + "/v1/completions", json={"model": "scripted-model", "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(live_auth.url + "/health").status_code == 200
    assert httpx.get(live_auth.url + "/metrics").status_code == 200


def test_front_door_imports_neither_torch_nor_the_engine():
    import subprocess
    import sys

    code = ("import sys, tandem.router.http, tandem.router.backend, tandem.router.routes_openai, "
            "tandem.router.anthropic; "
            "bad = [m for m in ('torch', 'tandem.engine') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
