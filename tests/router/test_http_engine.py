"""The front door over a real in-process Engine (LocalEngineBackend) with a tiny random Llama on the
CPU: generation numbers in usage, streamed == non-streamed text, and a client hanging up mid-stream
frees the request's KV in the engine. Skipped when the engine package is not importable."""

from __future__ import annotations

import importlib.util
import json
import time

import httpx
import pytest

if importlib.util.find_spec("torch") is None or importlib.util.find_spec("tandem.engine.engine") is None:
    pytest.skip("the in-process engine is not available", allow_module_level=True)

import openai  # noqa: E402
from prometheus_client import REGISTRY  # noqa: E402

from tandem.core.config import CacheConfig, EngineConfig, ServeConfig  # noqa: E402
from tandem.router.backend import LocalEngineBackend, ServingBackend  # noqa: E402

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 2, 4, 2, 16, 128
CONTEXT = 1024


def write_tiny_model(path) -> None:
    """A random 2-layer Llama with a byte-level tokenizer (256 bytes + 3 specials) in HF layout."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None}))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "intermediate_size": FFN,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "eos_token_id": vocab - 1}))
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.5

    w = {"model.embed_tokens.weight": rnd(vocab, HIDDEN), "model.norm.weight": torch.ones(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": torch.ones(HIDDEN),
              p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
              p + "self_attn.q_proj.weight": rnd(HEADS * HEAD_DIM, HIDDEN),
              p + "self_attn.k_proj.weight": rnd(KV_HEADS * HEAD_DIM, HIDDEN),
              p + "self_attn.v_proj.weight": rnd(KV_HEADS * HEAD_DIM, HIDDEN),
              p + "self_attn.o_proj.weight": rnd(HIDDEN, HEADS * HEAD_DIM),
              p + "mlp.gate_proj.weight": rnd(FFN, HIDDEN),
              p + "mlp.up_proj.weight": rnd(FFN, HIDDEN),
              p + "mlp.down_proj.weight": rnd(HIDDEN, FFN)}
    save_file(w, str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tandem.engine.engine import Engine

    path = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_model(path)
    cfg = EngineConfig(model=str(path), device="cpu", num_threads=1, context_length=CONTEXT,
                       cache=CacheConfig(max_total_tokens=2 * CONTEXT, max_running_requests=4))
    e = Engine(cfg)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def served(engine, serve):
    backend = LocalEngineBackend(engine)
    assert isinstance(backend, ServingBackend)
    return serve(backend, ServeConfig(mode="colocated"))


@pytest.fixture()
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_streamed_equals_non_streamed(client, engine):
    card = client.models.list().data[0]
    model = card.id
    assert model == engine.model_name
    assert card.speculative == engine.spec_status and card.speculative.startswith(("ngram", "off"))
    msgs = [{"role": "user", "content": "hello"}]
    n_prompt = len(engine.tokenizer.encode(engine.tokenizer.apply_chat_template(msgs)))
    kw = dict(model=model, messages=msgs, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    out = client.chat.completions.create(**kw)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (n_prompt, 8)
    assert 0 <= out.usage.prompt_tokens_details.cached_tokens < n_prompt
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == out.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8


def test_completion_prompt_ids_and_the_context_limit(client, engine):
    ids = [i % 256 for i in range(CONTEXT - 6)]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=engine.model_name, prompt=ids, max_tokens=100)
    assert e.value.code == "context_length_exceeded" and f"requested {CONTEXT + 94} tokens" in e.value.message
    out = client.completions.create(model=engine.model_name, prompt=ids, max_tokens=6,
                                    temperature=0.8, seed=3, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 6   # exactly the context that is left
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=engine.model_name, prompt=[engine.tokenizer.vocab_size])
    assert "vocabulary" in e.value.message


def test_disconnect_mid_stream_frees_the_engines_kv(served, engine):
    def idle() -> tuple[int, int, int]:
        snap = engine.snapshot()
        return snap.waiting, snap.running, snap.available_tokens

    def aborted() -> float:
        return REGISTRY.get_sample_value("tandem_requests_total", {"status": "aborted"}) or 0.0

    free_before, aborted_before = idle()[2], aborted()
    body = {"model": engine.model_name, "prompt": "abc", "max_tokens": CONTEXT - 8, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=30) as r:
        next(r.iter_raw())   # generation is under way; hang up
    deadline = time.monotonic() + 10
    while (idle()[:2] != (0, 0) or aborted() == aborted_before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborted() == aborted_before + 1   # cut short by the hang-up, not finished
    waiting, running, free = idle()
    assert (waiting, running) == (0, 0)
    # everything the request held went back to the pool (or sits in the prefix cache, evictable)
    evictable = engine.snapshot().evictable_tokens
    assert free + evictable >= free_before
    assert httpx.get(served.url + "/health").json()["status"] == "ok"


def test_anthropic_messages_stream_over_the_engine(served, engine):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0, timeout=60)
    kw = dict(model=engine.model_name, max_tokens=8, extra_body={"temperature": 0}, system="Be brief.",
              messages=[{"role": "user", "content": "hello"}])
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert whole.usage.output_tokens == final.usage.output_tokens <= 8
    assert whole.stop_reason in ("end_turn", "max_tokens")
    n_prompt = len(engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}])))
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == n_prompt
    assert final.usage.cache_read_input_tokens > 0      # the second request reused the first's prefix


def test_debug_kv_reports_the_engines_accounting_and_invariants(served, engine):
    r = httpx.get(served.url + "/debug/kv", timeout=30)
    assert r.status_code == 200
    (w,) = r.json()["workers"]
    assert w["invariants"] == "ok" and w["leaked_tokens"] == 0 and w["total_tokens"] == engine.allocator.size
    assert httpx.post(served.url + "/debug/kill", params={"worker": "colocated-0"}).status_code == 404  # off
    assert "migrations" not in r.json()                 # not an AdminBackend: nothing moves here


def test_the_admin_verbs_are_404_on_a_backend_that_cannot_move_requests(served):
    for path, params in (("/admin/migrate", {"rid": "x"}), ("/admin/drain", {"worker": "colocated-0"}),
                         ("/admin/undrain", {"worker": "colocated-0"})):
        r = httpx.post(served.url + path, params=params, timeout=30)
        assert r.status_code == 404 and "live migration needs decode workers" in r.text, (path, r.text)


def test_cache_control_pins_the_system_prompt_in_the_engine_and_admin_ends_it(served, engine):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0, timeout=60)
    system = "You are a pinned assistant. Keep this whole prompt cached for an hour. " * 3
    kw = dict(model=engine.model_name, max_tokens=4, extra_body={"temperature": 0},
              system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
              messages=[{"role": "user", "content": "hello"}])
    first = client.messages.create(**kw)
    pins = httpx.get(served.url + "/admin/cache/pins", timeout=30).json()
    [p] = pins["tenants"][""]
    n = p["tokens"]
    head = engine.tokenizer.encode(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>")
    assert n == len(head) and p["tier"] == "device" and 3590 < p["expires_in_s"] <= 3600
    assert pins["pinned_tokens"] == {"": {"colocated-0": n}}
    # what the first request wrote at the breakpoint, and what it read, sum with the rest to the prompt
    u = first.usage
    assert u.cache_creation_input_tokens == n - u.cache_read_input_tokens > 0
    second = client.messages.create(**kw)
    assert second.usage.cache_read_input_tokens >= n and second.usage.cache_creation_input_tokens == 0
    assert engine.pins()["hits"] >= 1
    r = httpx.delete(served.url + f"/admin/cache/pins/{p['hash']}", timeout=30)
    assert r.status_code == 200 and r.json() == {"unpinned": n}
    assert httpx.get(served.url + "/admin/cache/pins", timeout=30).json()["tenants"] == {}
    assert httpx.delete(served.url + f"/admin/cache/pins/{p['hash']}", timeout=30).status_code == 404
    engine.check_invariants()
