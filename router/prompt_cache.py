"""Prompt caching as clients ask for it (issue 52): Anthropic ``cache_control`` breakpoints and
OpenAI ``prompt_cache_retention``, checked as the providers check them, turned into the pins a
:class:`~tandem.core.messages.GenerateRequest` carries (``(prefix tokens, ttl s)``), and the
usage they report. The worker's cache keeps a pinned prefix (cache/radix/pins.py); a pin past
the tenant's cap is served unpinned, never refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from tandem.router.openai_protocol import APIError

MAX_BREAKPOINTS = 4
TTLS_S = {"5m": 300, "1h": 3600}
RETENTION_S = {"in_memory": 0, "24h": 86400}    # the worker caps a pin at CacheConfig.pin_max_ttl_s


@dataclass(frozen=True)
class Breakpoint:
    """A block marked ``cache_control``: ``where`` is ``("tools", i)``, ``("system", j)`` or
    ``("messages", i, j)`` (``j`` None: the message's string content); ``ttl_s`` its TTL."""

    where: tuple
    ttl_s: int


def _ttl(cc: Any, param: str) -> int:
    if not isinstance(cc, dict):
        raise APIError(400, f"{param}: cache_control must be an object", param=param)
    if cc.get("type") != "ephemeral":
        raise APIError(400, f"{param}.type: Input should be 'ephemeral'", param=f"{param}.type")
    ttl = cc.get("ttl", "5m")
    if ttl not in TTLS_S:
        raise APIError(400, f"{param}.ttl: Input should be '5m' or '1h'", param=f"{param}.ttl")
    return TTLS_S[ttl]


def _block(b: Any, where: tuple, param: str, out: list[Breakpoint]) -> None:
    if not isinstance(b, dict) or "cache_control" not in b or b["cache_control"] is None:
        return
    ttl = _ttl(b["cache_control"], f"{param}.cache_control")
    if b.get("type") == "text" and b.get("text") == "":
        raise APIError(400, f"{param}.text: cache_control cannot be set for empty text blocks",
                       param=f"{param}.text")
    out.append(Breakpoint(where, ttl))


def breakpoints(tools: Any, system: Any, messages: Sequence[Any]) -> list[Breakpoint]:
    """The request's breakpoints in prompt order (tools, system, messages); 400s as Anthropic
    answers them: a type other than ephemeral, a TTL other than 5m/1h, one on an empty text
    block, more than :data:`MAX_BREAKPOINTS`, or a 1h one after a 5m one."""
    out: list[Breakpoint] = []
    for i, t in enumerate(tools or ()):
        _block(t, ("tools", i), f"tools.{i}", out)
    if isinstance(system, list):
        for j, b in enumerate(system):
            _block(b, ("system", j), f"system.{j}", out)
    for i, msg in enumerate(messages):
        content = msg.content if hasattr(msg, "content") else msg.get("content")
        if isinstance(content, list):
            for j, b in enumerate(content):
                _block(b, ("messages", i, j), f"messages.{i}.content.{j}", out)
    if len(out) > MAX_BREAKPOINTS:
        raise APIError(400, f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                            f"Found {len(out)}.", param="cache_control")
    for a, b in zip(out, out[1:]):
        if b.ttl_s > a.ttl_s:
            raise APIError(400, "a ttl='1h' cache_control block must not come after a ttl='5m' one "
                                "(longer TTLs first)", param="cache_control")
    return out


def retention_pins(retention: str | None, prompt_len: int) -> tuple[tuple[int, int], ...]:
    """OpenAI ``prompt_cache_retention``: ``"24h"`` pins the whole prompt, ``"in_memory"`` (the
    default) pins nothing. The value itself is checked by the request model (a Literal)."""
    ttl = RETENTION_S.get(retention or "in_memory", 0)
    return ((prompt_len, ttl),) if ttl and prompt_len else ()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def breakpoint_pins(bps: list[Breakpoint], ids: Sequence[int],
                    render_upto: Callable[[Breakpoint], list[int] | None]) -> tuple[tuple[int, int], ...]:
    """Each breakpoint's prefix length in the prompt ``ids``: the tokens ``ids`` shares with the
    prompt rendered only up to that block (``render_upto``; None: it cannot be rendered alone,
    no pin). A template's closing tokens after the block are not part of the prefix."""
    out = []
    for bp in bps:
        head = render_upto(bp)
        n = common_prefix(head, ids) if head else 0
        if n:
            out.append((n, bp.ttl_s))
    return tuple(out)


def anthropic_usage(prompt: int, cached: int, pins: Sequence[tuple[int, int]]) -> dict:
    """Anthropic's input split: ``cache_read_input_tokens`` the prompt tokens served from any cache
    tier, ``cache_creation_input_tokens`` the tokens of breakpoint prefixes written now (the longest
    breakpoint prefix past what was read), ``input_tokens`` the rest (the three sum to the prompt)."""
    written = max((n for n, _ in pins), default=0)
    creation = max(0, min(written, prompt) - cached)
    return {"input_tokens": max(0, prompt - cached - creation), "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": creation}
