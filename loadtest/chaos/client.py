"""Drive a chaos plan against a live server over its OpenAI API, hanging up as the plan says."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from tandem.loadtest.chaos.plan import SessionPlan, Turn


@dataclass
class Outcome:
    sid: str
    turn: int
    messages: list[dict]
    max_tokens: int
    planned: str
    kind: str = "failed"
    text: str = ""
    finish_reason: str | None = None
    reason: str = ""
    started: float = 0.0
    seconds: float = 0.0
    chunks: int = 0
    router: int = 0
    retried: bool = False

    def body(self, stream: bool) -> dict:
        return {"model": "", "messages": self.messages, "max_tokens": self.max_tokens,
                "temperature": 0, "stream": stream}


@dataclass
class RunConfig:
    url: str
    model: str
    api_key: str | None = None
    timeout_s: float = 120.0
    kill: list[tuple[float, str]] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    stall_s: float | None = None
    dead: set[int] = field(default_factory=set)
    inflight: dict[int, int] = field(default_factory=dict)

    def routers(self) -> list[str]:
        return self.urls or [self.url]


async def _one(http: httpx.AsyncClient, cfg: RunConfig, o: Outcome, turn: Turn,
               retry: httpx.AsyncClient | None = None) -> None:
    """One request; ``retry``: router 0's client, for a resend after a killed router."""
    body = o.body(stream=True) | {"model": cfg.model}
    headers = {"X-Session-Id": o.sid}
    t0 = time.perf_counter()
    o.started = t0
    stall = cfg.stall_s or cfg.timeout_s
    timeout = httpx.Timeout(cfg.timeout_s, read=stall)

    async def stream() -> None:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers,
                               timeout=timeout) as r:
            if r.status_code != 200:
                raw = (await r.aread()).decode(errors="replace")
                try:
                    msg = json.loads(raw)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    msg = raw[:200]
                o.kind, o.reason = "failed", f"HTTP {r.status_code}: {msg}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                if "error" in ev:
                    o.kind, o.reason = "failed", f"stream error: {ev['error'].get('message', ev['error'])}"
                    return
                for ch in ev.get("choices", ()):
                    piece = (ch.get("delta") or {}).get("content") or ""
                    if piece:
                        o.text += piece
                        o.chunks += 1
                    if ch.get("finish_reason"):
                        o.finish_reason = ch["finish_reason"]
                if turn.abort == "mid" and o.chunks >= turn.abort_after and o.finish_reason is None:
                    o.kind = "aborted_mid"
                    return
            if o.finish_reason == "abort":
                o.kind, o.reason = "failed", "finish_reason abort without an error message"
            elif o.finish_reason is not None:
                o.kind = "completed"
            else:
                o.kind, o.reason = "failed", "stream ended without a finish_reason"

    task = asyncio.ensure_future(stream())
    here: int | None = o.router
    cfg.inflight[o.router] = cfg.inflight.get(o.router, 0) + 1
    try:
        if turn.abort == "early":
            await asyncio.sleep(turn.early_delay_s)
            if not task.done():
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                o.kind = "aborted_early" if o.chunks == 0 else "aborted_mid"
            else:
                await task
        else:
            await task
    except httpx.ReadTimeout:
        o.kind, o.reason = "failed", f"hung: no byte for {stall:g} s after {o.chunks} chunk(s)"
    except httpx.HTTPError as e:
        cfg.inflight[o.router] -= 1
        here = None
        o.kind, o.reason = "failed", f"{type(e).__name__}: {str(e)[:200] or 'connection failed'}"
        if retry is not None and o.router in cfg.dead and isinstance(e, httpx.TransportError):
            o.text, o.chunks, o.finish_reason, o.reason = "", 0, None, ""
            o.router, o.retried = 0, True
            await _one(retry, cfg, o, turn)
            return
    finally:
        if here is not None:
            cfg.inflight[here] -= 1
    o.seconds = time.perf_counter() - t0
    if o.kind == "failed" and not o.reason:
        o.reason = "no reason given"


async def run_session(https: list[httpx.AsyncClient], cfg: RunConfig, plan: SessionPlan, t0: float,
                      router: int = 0) -> list[Outcome]:
    await asyncio.sleep(max(0.0, plan.start_s - (time.perf_counter() - t0)))
    history = [{"role": "system", "content": plan.system}]
    out = []
    for i, turn in enumerate(plan.turns):
        msgs = history + [{"role": "user", "content": turn.user}]
        o = Outcome(plan.sid, i, msgs, turn.max_tokens, turn.abort, router=router)
        if router in cfg.dead:
            o.router = 0
        await _one(https[o.router], cfg, o, turn, https[0] if o.router else None)
        out.append(o)
        history = msgs + [{"role": "assistant", "content": o.text}]
    return out


async def run_plan(cfg: RunConfig, plans: list[SessionPlan], on_kill=None) -> list[Outcome]:
    """Every session concurrently; ``cfg.kill``: at each time, ``on_kill(role)`` (a coroutine)."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=len(plans) + 8, max_keepalive_connections=len(plans) + 8)
    urls = cfg.routers()
    https = [httpx.AsyncClient(base_url=u, headers=headers, limits=limits) for u in urls]
    try:
        t0 = time.perf_counter()
        killers = [asyncio.ensure_future(_kill_at(at, role, on_kill, t0)) for at, role in cfg.kill]
        results = await asyncio.gather(*(run_session(https, cfg, p, t0, i % len(urls))
                                         for i, p in enumerate(plans)))
        for k in killers:
            await k
    finally:
        for h in https:
            await h.aclose()
    return [o for r in results for o in r]


async def _kill_at(at: float, role: str, on_kill, t0: float) -> None:
    await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
    if on_kill is not None:
        await on_kill(role)
