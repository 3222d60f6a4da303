"""Issue 52's goal, from outside: the `anthropic` SDK against a real ``tandem serve`` (1P+1D,
SmolLM2, small device and host pools). A session marks a ~500-token system prompt with
``cache_control`` (1 h); an unmarked control session has a system prompt of the same size; then
enough other sessions to overflow every pool of both workers. The marked session's next turn reads
its whole system prompt from cache (``cache_read_input_tokens``), the control's was evicted. Then
``DELETE /admin/cache/pins/{hash}`` ends the pin and the prefix is an ordinary one: the next
overflow evicts it too. (A pin's end at its TTL is the same unpin on the cache's clock:
tests/cache/test_pins.py, with a fake clock.)"""

from __future__ import annotations

import random

import httpx
import pytest

from support.serve import ServeProcess

anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.ray

WORDS = ("river stone maple copper lantern orbit velvet harbor signal meadow quartz falcon ember "
         "glacier pepper canyon willow marble thunder saddle prism cobalt juniper anchor").split()
POOL, HOST = 1536, 1024          # per worker: 2,560 tokens of KV in all; a system prompt ~500
WORDS_PER_PROMPT = 450


def system_prompt(seed: int) -> str:
    rng = random.Random(seed)
    return f"Agent {seed} rules: " + " ".join(rng.choice(WORDS) for _ in range(WORDS_PER_PROMPT)) + "."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServeProcess(["--prefill", "1", "--decode", "1", "--max-total-tokens", str(POOL),
                      "--host-pool-tokens", str(HOST), "--pin-share", "0.5"],
                     tmp_path_factory.mktemp("pc") / "serve.log")
    try:
        yield s.url()
    finally:
        s.stop()


def pinned(server: str) -> list[dict]:
    """Every worker's pinned prefixes (GET /admin/cache/pins, all tenants)."""
    return [p for ps in httpx.get(server + "/admin/cache/pins", timeout=30).json()["tenants"].values() for p in ps]


def turn(client, system, question: str):
    return client.messages.create(model="smollm2", max_tokens=2, system=system,
                                  messages=[{"role": "user", "content": question}]).usage


def test_a_marked_system_prompt_outlives_an_overflow_and_an_unmarked_one_does_not(server):
    c = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=300)
    marked = [{"type": "text", "text": system_prompt(1), "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    control = system_prompt(2)
    first = turn(c, marked, "Who are you?")
    assert first.cache_creation_input_tokens >= 400, first       # the breakpoint's prefix, written now
    sys_tokens = first.cache_creation_input_tokens + first.cache_read_input_tokens
    ctl = turn(c, control, "Who are you?")
    assert ctl.cache_creation_input_tokens == 0 and ctl.input_tokens >= 400, ctl
    pins = pinned(server)
    assert any(p["tokens"] >= sys_tokens - 16 for p in pins), pins

    def overflow(seed0: int) -> None:
        for s in range(seed0, seed0 + 9):                         # 9 x ~500 tokens > 2,560
            turn(c, system_prompt(s), "Who are you?")

    overflow(100)
    again = turn(c, marked, "And what do you do?")
    assert again.cache_read_input_tokens >= sys_tokens, (again, sys_tokens)     # the whole system prompt
    ctl2 = turn(c, control, "And what do you do?")
    assert ctl2.cache_read_input_tokens < ctl.input_tokens // 2, ctl2           # the control was evicted

    for h in {p["hash"] for p in pinned(server)}:
        assert httpx.delete(f"{server}/admin/cache/pins/{h}", timeout=30).json()["unpinned"] > 0
    assert pinned(server) == []
    overflow(200)
    unpinned = turn(c, [{"type": "text", "text": system_prompt(1)}], "And what do you do?")
    assert unpinned.cache_read_input_tokens < sys_tokens // 2, unpinned         # ordinary again: evicted
