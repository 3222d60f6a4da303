"""Fixtures for the HTTP front door tests: a real uvicorn server on 127.0.0.1 in a thread.

``ScriptedBackend`` is a TEST DOUBLE: it stands in for the engine in protocol-only tests (SSE
framing, error objects, auth, body limits, disconnect -> abort). It generates no model output, only a
fixed script, one character per token. Tests of real generation use LocalEngineBackend over an Engine
(test_http_engine.py).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass

import pytest
import uvicorn

from tandem.core.config import ServeConfig
from tandem.core.messages import GenerateRequest
from tandem.core.types import InvalidRequest, StreamChunk, TokenLogprob
from tandem.router.http import create_app

SCRIPT = "Hello from Tandem!"


class CharTokenizer:
    """Test double of core/tokenizer.py: one token per character (id = code point)."""

    vocab_size = 0x110000

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(ch) for ch in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if any("[bad-template]" in msg["content"] for msg in messages):
            raise ValueError("this template refuses that")   # like a jinja raise_exception()
        text = "".join(f"<{msg['role']}>{msg['content']}\n" for msg in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def scripted_logprob(token_id: int, position: int, top: int) -> TokenLogprob:
    """The canned logprob of ScriptedBackend's token at ``position``: the token itself is the most
    likely, then ids +1, +2, ... each 1 nat less likely."""
    lp = -0.25 * (position % 4)
    return TokenLogprob(token_id, lp, tuple((token_id + k, lp - k) for k in range(top)))


class ScriptedBackend:
    """Stands in for the engine in protocol-only tests. Replies with SCRIPT, one char per token,
    honouring max_tokens (finish "length") and stop strings (finish "stop"); reports
    cached_tokens = min(4, prompt); with ``params.logprobs`` each chunk carries
    :func:`scripted_logprob`. Markers in the prompt change behaviour:
    ``[hang]`` one token then waits until aborted, ``[error]`` one token then an error finish,
    ``[refuse]`` raises InvalidRequest before any chunk, ``[say]TEXT[/say]`` (the last one in the
    prompt) replies TEXT instead of SCRIPT (canned tool calls, JSON), ``[stop-str]`` reports
    the first stop string as the one that matched."""

    model_name = "scripted-model"
    max_context = 256
    script = SCRIPT

    def __init__(self, max_context: int = 256):
        self.max_context = max_context
        self.tokenizer = CharTokenizer()
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.abort_seen = threading.Event()

    async def generate(self, req: GenerateRequest):
        self.requests.append(req)
        prompt = self.tokenizer.decode(req.prompt_ids)
        n_prompt, cached = len(req.prompt_ids), min(4, len(req.prompt_ids))
        if "[refuse]" in prompt:
            raise InvalidRequest("scripted refusal")
        reply, finish, stop_str = SCRIPT, "stop", None
        if "[say]" in prompt:
            reply = prompt[prompt.rindex("[say]") + 5:].split("[/say]", 1)[0]
        for stop in req.params.stop:   # the engine excludes a stop string from the text
            if stop in reply:
                reply, stop_str = reply[: reply.index(stop)], stop
        if len(reply) > req.params.max_tokens:
            reply, finish = reply[: req.params.max_tokens], "length"
        if not reply:
            yield StreamChunk(req.rid, (), "", finish, n_prompt, cached, 0)
            return
        for i, ch in enumerate(reply):
            await asyncio.sleep(0.001)
            if "[error]" in prompt and i == 1:
                yield StreamChunk(req.rid, (), "", "abort", n_prompt, cached, i, error="scripted failure")
                return
            done = i + 1 == len(reply)
            lps = (scripted_logprob(ord(ch), i, req.params.top_logprobs),) if req.params.logprobs else ()
            yield StreamChunk(req.rid, (ord(ch),), ch, finish if done else None, n_prompt, cached, i + 1,
                              logprobs=lps, stop_str=stop_str if done and finish == "stop" else None)
            if "[hang]" in prompt:
                await asyncio.Event().wait()   # until the front door cancels us (client gone)

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)
        self.abort_seen.set()

    async def health(self) -> dict:
        return {"status": "ok", "backend": "scripted"}

    def metrics_text(self) -> bytes:
        from prometheus_client import REGISTRY, generate_latest
        return generate_latest(REGISTRY)


@dataclass
class LiveServer:
    url: str
    backend: object
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def start_server(backend, config: ServeConfig) -> LiveServer:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(backend, config), log_level="warning",
                                           lifespan="off", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    return LiveServer(f"http://127.0.0.1:{port}", backend, server, thread)


@pytest.fixture(scope="session")
def serve():
    """``serve(backend, config) -> LiveServer``; stopped at the end of the session. (A fixture, so
    test modules never import this conftest by name.)"""
    servers: list[LiveServer] = []

    def start(backend, config: ServeConfig) -> LiveServer:
        servers.append(start_server(backend, config))
        return servers[-1]

    yield start
    for srv in servers:
        srv.stop()


@pytest.fixture(scope="session")
def scripted_backend():
    """The ScriptedBackend class, for a module that serves its own config over it."""
    return ScriptedBackend


@pytest.fixture(scope="session")
def live(serve):
    """Scripted backend, no API key, a 64 KiB body limit."""
    return serve(ScriptedBackend(), ServeConfig(max_body_bytes=64 * 1024))


@pytest.fixture(scope="session")
def live_agent(serve):
    """Scripted backend with room for tool prompts (64k characters of context)."""
    return serve(ScriptedBackend(max_context=1 << 16), ServeConfig())


@pytest.fixture(scope="session")
def live_auth(serve):
    """Scripted backend behind an API key (a second app in the same process)."""
    return serve(ScriptedBackend(), ServeConfig(api_key="sk-test-key"))
