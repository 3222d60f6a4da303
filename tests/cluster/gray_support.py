"""Shared by the gray-failure tests (test_gray_failures.py, test_gray_transfer.py): a 1P+2D cluster
config with a short progress deadline, the healthy oracle, streamed chats, idle checks."""

from __future__ import annotations

import os
import signal  # noqa: F401
import threading
import time

import httpx

from tandem.core.config import CacheConfig, EngineConfig, MigrationConfig, ServeConfig
from tandem.core.types import SamplingParams

OUT = 64          # tokens per stream: the faults land after 4 (mid-decode) or before the first
PROGRESS_S = 3.0
TOPICS = ("rivers", "bridges", "volcanoes", "glaciers")


def gray_cfg(**kw) -> ServeConfig:
    # speculation off: the faults must land while streams decode (after 4 tokens, or before the
    # first), and the module repeats its prompts, so the tenant's n-gram pool would draft whole
    # replies and a stream would end in a handful of steps (a fresh-clone run missed the window:
    # "the late requests were not opened on the decode worker"); migration with drafts is
    # test_migration_cluster's forced-migration test
    engine = EngineConfig(device="cpu", num_threads=1, speculative_algorithm="off",
                          cache=CacheConfig(page_size=16, max_total_tokens=4096, max_running_requests=16))
    return ServeConfig(prefill=1, decode=kw.pop("decode", 2), transfer_timeout_s=30.0, engine_config=engine,
                       progress_timeout_s=PROGRESS_S, migration=MigrationConfig(policy="off"), **kw)


def messages(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Write a long paragraph about {topic}."}]


_oracles: dict[tuple[int, str], dict[str, str]] = {}   # (id of the loaded model, engine config) -> texts


def oracle(loaded, cfg) -> dict[str, str]:
    """The healthy texts of :data:`TOPICS` (each alone, greedy, ``OUT`` tokens): computed once per
    model and engine config in this process (both gray modules ask for the same)."""
    from tandem.engine.engine import Engine

    key = (id(loaded), cfg.engine_config.model_dump_json())
    if key not in _oracles:
        e = Engine(cfg.engine_config, loaded=loaded)
        try:
            _oracles[key] = {t: e.generate(e.tokenizer.apply_chat_template(messages(t)),
                                           SamplingParams(max_tokens=OUT, ignore_eos=True)).text for t in TOPICS}
        finally:
            e.shutdown()
    return dict(_oracles[key])


def serve(cfg, loaded):
    """(backend, server, the healthy texts): the oracle runs in this process while the workers start."""
    from concurrent.futures import ThreadPoolExecutor

    from tandem.cluster.launch import launch_disaggregated

    from serve_support import Server

    with ThreadPoolExecutor(1) as pool:
        want = pool.submit(oracle, loaded, cfg)
        backend = launch_disaggregated(cfg, loaded=loaded)
        return backend, Server(backend, cfg), want.result()


chunks: dict[str, int] = {}   # key -> content chunks received so far


def stream_chat(server, topic: str, out: dict, key: str) -> None:
    """A streamed chat: (text, finish reason, error, seconds) into ``out[key]``."""
    text, finish, err, t0 = [], None, None, time.monotonic()
    chunks[key] = 0
    try:
        s = server.client.chat.completions.create(
            model="smollm2", messages=messages(topic), max_tokens=OUT, temperature=0, stream=True,
            extra_body={"ignore_eos": True}, extra_headers={"X-Session-Id": key})
        for ev in s:
            if ev.choices:
                text.append(ev.choices[0].delta.content or "")
                chunks[key] += bool(ev.choices[0].delta.content)
                finish = ev.choices[0].finish_reason or finish
    except Exception as e:  # noqa: BLE001 - reported, and the test fails on it
        err = repr(e)
    out[key] = ("".join(text), finish, err, time.monotonic() - t0)


def start_streams(server, out: dict, prefix: str) -> list[threading.Thread]:
    ths = [threading.Thread(target=stream_chat, args=(server, t, out, f"{prefix}-{t}")) for t in TOPICS]
    for th in ths:
        th.start()
    return ths


def pid_of(w) -> int:
    import ray

    return ray.get(w.handle.info.remote(), timeout=30)["pid"]


def wait_for(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, what
        time.sleep(0.05)


def wait_idle(server, timeout: float = 60.0) -> list[dict]:
    end = time.monotonic() + timeout
    while True:
        kv = httpx.get(server.url + "/debug/kv", timeout=30).json()
        ws = kv["workers"]
        if all(w.get("leaked_tokens") == 0 and w.get("request_tokens") == 0 and w.get("locked_tokens") == 0
               and w.get("invariants") == "ok" and w.get("live_transfers") == 0 for w in ws):
            return ws
        assert time.monotonic() < end, ws
        time.sleep(0.2)


def check_texts(out: dict, want: dict, prefix: str, within: float) -> None:
    for t in TOPICS:
        text, finish, err, took = out[f"{prefix}-{t}"]
        assert err is None and finish == "length", (t, out[f"{prefix}-{t}"])
        assert text == want[t], f"{prefix}-{t}: text differs from the healthy cluster's"
        assert took < within, f"{prefix}-{t} took {took:.1f}s"


def wait_rejoined(backend, server, w) -> None:
    wait_for(lambda: w.suspect_since is None and w.alive, 30, f"{w.name} did not rejoin")
    h = httpx.get(server.url + "/health", timeout=30).json()
    assert h["workers"][w.name]["alive"] and not h["workers"][w.name]["suspect"], h


def stream_events(server, topic: str, out: dict, key: str) -> None:
    """A streamed chat read as raw SSE events: (text, finish reason, every error event's message)
    into ``out[key]`` (the OpenAI client raises on the first error event; this counts them)."""
    import json

    text, finish, errors = [], None, []
    chunks[key] = 0
    body = {"model": "smollm2", "messages": messages(topic), "max_tokens": OUT, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=300,
                      headers={"X-Session-Id": key}) as r:
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if ev.get("error"):
                errors.append(str(ev["error"].get("message", ev["error"])))
            for c in ev.get("choices") or ():
                if (c.get("delta") or {}).get("content"):
                    text.append(c["delta"]["content"])
                    chunks[key] += 1
                finish = c.get("finish_reason") or finish
    out[key] = ("".join(text), finish, errors)
