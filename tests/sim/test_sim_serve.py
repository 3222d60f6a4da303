"""``tandem serve --engine sim``: the real front door and router over cost-model workers.

The HTTP tests run uvicorn in a thread on 127.0.0.1 over SimServingBackend (real SmolLM2
tokenizer from the GGUF, no weights, no Ray) with 2 prefill + 2 decode workers, and talk to it
with the openai client. The accounting tests drive the backend directly with a tiny tokenizer.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from tandem.cluster.launch import load_tokenizer
from tandem.core.config import ServeConfig
from tandem.core.messages import GenerateRequest
from tandem.core.types import SamplingParams
from tandem.router.http import create_app
from tandem.sim.backend import SimServingBackend
from tandem.sim.cost_model import get_profile

openai = pytest.importorskip("openai")


def _start(backend, cfg: ServeConfig):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(backend, cfg), log_level="warning",
                                           lifespan="off", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    return f"http://127.0.0.1:{port}", server, thread


@pytest.fixture(scope="module")
def sim(smollm2_gguf):
    cfg = ServeConfig(engine="sim", prefill=2, decode=2, policy="session")
    backend = SimServingBackend(cfg, load_tokenizer(cfg.engine_config.model))
    url, server, thread = _start(backend, cfg)
    yield url, backend
    server.should_exit = True
    thread.join(timeout=10)
    backend.close()


@pytest.fixture(scope="module")
def client(sim):
    return openai.OpenAI(base_url=sim[0] + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_non_streamed_chat_takes_cost_model_time(sim, client):
    url, backend = sim
    t0 = time.perf_counter()
    r = client.chat.completions.create(model=backend.model_name, max_tokens=12,
                                       messages=[{"role": "user", "content": "Say something."}])
    elapsed = time.perf_counter() - t0
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content
    u = r.usage
    assert u.completion_tokens == 12 and u.prompt_tokens > 5
    # at least the 11 decode steps after the first token, as the profile prices them
    prof = get_profile("llama3-8b-h100")
    assert elapsed >= 0.9 * 11 * prof.decode_step_s(1, u.prompt_tokens)


def test_streamed_chat(sim, client):
    url, backend = sim
    stream = client.chat.completions.create(
        model=backend.model_name, max_tokens=10, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Stream please."}])
    text, finish, usage = "", None, None
    for ev in stream:
        if ev.usage is not None:
            usage = ev.usage
        for c in ev.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish == "length" and text
    assert usage is not None and usage.completion_tokens == 10


def test_second_turn_of_a_session_hits_the_cache(sim, client):
    url, backend = sim
    msgs = [{"role": "system", "content": "You are a terse assistant. " * 8},
            {"role": "user", "content": "First question about routing?"}]
    hdr = {"X-Session-Id": "sess-42"}
    r1 = client.chat.completions.create(model=backend.model_name, max_tokens=6, messages=msgs,
                                        extra_headers=hdr)
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "And a follow-up?"}]
    r2 = client.chat.completions.create(model=backend.model_name, max_tokens=6, messages=msgs,
                                        extra_headers=hdr)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= r1.usage.prompt_tokens - 1 > 0     # the whole first prompt (page size 1)
    assert cached < r2.usage.prompt_tokens


def test_metrics_export_sim_gauges(sim, client):
    url, backend = sim
    client.chat.completions.create(model=backend.model_name, max_tokens=4,
                                   messages=[{"role": "user", "content": "metrics"}])
    text = httpx.get(url + "/metrics", timeout=10).text
    gauges = {"prefill": ("tandem_sim_prefill_queue", "tandem_sim_prefill_pending_seconds",
                          "tandem_sim_prefix_cache_tokens"),
              "decode": ("tandem_sim_decode_running", "tandem_sim_decode_kv_tokens")}
    for role, names in gauges.items():
        for name, w in ((n, f"{role}-{i}") for n in names for i in (0, 1)):
            assert re.search(rf'^{name}{{worker="{w}"}} ', text, re.M), (name, w)
    assert re.search(r'^tandem_sim_decode_tokens_total\{worker="decode-\d"\} [1-9]', text, re.M)
    assert re.search(r'^tandem_sim_prefill_tokens_total\{kind="computed",worker="prefill-\d"\} [1-9]',
                     text, re.M)
    assert re.search(r'^tandem_requests_total\{status="ok"\} [1-9]', text, re.M)   # the front door's
    h = httpx.get(url + "/health", timeout=10).json()
    assert h["status"] == "ok" and h["mode"] == "sim"
    # idle again: every simulated worker gave its KV back
    assert all(d.reserved == 0 and not d.running for d in backend.decodes)
    assert all(not p.queue and p.current is None for p in backend.prefills)


# -- the backend alone -----------------------------------------------------------------------------
class _Tok:
    vocab_size = 300
    eos_token_ids = {0}
    bos_token_id = None
    name = "tiny"

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def _req(rid, n=40, max_tokens=50, prompt=None):
    return GenerateRequest(rid, tuple(prompt or range(1, n + 1)), SamplingParams(max_tokens=max_tokens))


def test_abort_mid_decode_frees_the_simulated_kv():
    async def main():
        b = SimServingBackend(ServeConfig(engine="sim", prefill=1, decode=1, sim_speedup=20.0),
                              tokenizer=_Tok())
        gen = b.generate(_req("a"))
        chunks = [await gen.__anext__() for _ in range(3)]
        assert all(len(c.token_ids) == 1 for c in chunks)
        await gen.aclose()                            # the client went away
        for _ in range(200):
            if b.decodes[0].reserved == 0 and not b.decodes[0].running:
                break
            await asyncio.sleep(0.01)
        assert b.decodes[0].reserved == 0 and not b._flights
        # the same prompt again: served from the simulated cache, deterministic for its rid
        out = [c async for c in b.generate(_req("a", max_tokens=5))]
        again = [c async for c in b.generate(_req("a", max_tokens=5))]
        assert [c.token_ids for c in out] == [c.token_ids for c in again]
        assert out[-1].finish_reason == "length" and out[-1].cached_tokens == 39
        assert out[-1].completion_tokens == 5 and out[-1].prompt_tokens == 40
        b.close()

    asyncio.run(main())


def test_serve_flags_reach_the_config():
    from tandem.cluster.cli import build_parser
    from tandem.cluster.config import serve_config_from_args

    args = build_parser().parse_args(["serve", "--engine", "sim", "--prefill", "2", "--decode", "2",
                                      "--sim-profile", "llama3-70b-h100x8", "--sim-speedup", "4"])
    cfg = serve_config_from_args(args)
    assert (cfg.engine, cfg.sim_profile, cfg.sim_speedup) == ("sim", "llama3-70b-h100x8", 4.0)


def test_predicted_wait_past_the_limit_is_overloaded():
    """admission_max_pending_s through the dispatcher: the simulated prefill worker reports its
    queue's predicted seconds, and a request past the limit is refused until the queue drains."""
    from tandem.core.types import Overloaded

    async def main():
        cfg = ServeConfig(engine="sim", prefill=1, decode=1, admission_max_pending_s=0.5, sim_speedup=20.0,
                          dispatch_queue_size=0)      # refused at once, not deferred
        b = SimServingBackend(cfg, tokenizer=_Tok())
        first = asyncio.get_running_loop().create_task(_drain(b.generate(_req("a", n=15000, max_tokens=2))))
        await asyncio.sleep(0)                        # routed: ~0.53 s of prefill queued
        assert b.prefills[0].pending_s(b.now()) > 0.5
        with pytest.raises(Overloaded) as e:
            await b.generate(_req("b", n=100, max_tokens=2)).__anext__()
        assert e.value.retry_after_s == 1
        out = await first
        assert out[-1].finish_reason == "length"
        assert [c async for c in b.generate(_req("b", n=100, max_tokens=2))][-1].finish_reason == "length"
        b.close()

    asyncio.run(main())


async def _drain(gen):
    return [c async for c in gen]
