"""The HTTP side: one streamed request -> one :class:`Record`, and the two ways of driving a workload."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass

import httpx

from tandem.loadtest.loadgen.report import Record
from tandem.loadtest.loadgen.workloads import Session, TimedRequest


@dataclass(frozen=True)
class ClientConfig:
    url: str
    model: str | None = None
    api_key: str | None = None
    temperature: float = 0.0
    seed: int | None = None
    timeout_s: float = 300.0
    session_header: bool = True


def make_http(cfg: ClientConfig) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    return httpx.AsyncClient(base_url=cfg.url.rstrip("/"), headers=headers,
                             timeout=httpx.Timeout(cfg.timeout_s, connect=min(10.0, cfg.timeout_s)),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))


async def resolve_model(http: httpx.AsyncClient) -> str:
    """The first model id of GET /v1/models."""
    r = await http.get("/v1/models")
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise ValueError(f"{http.base_url}/v1/models lists no model; pass --model")
    return data[0]["id"]


async def fetch_metrics(http: httpx.AsyncClient) -> str | None:
    """GET /metrics as text; None when the server has none (or is unreachable)."""
    try:
        r = await http.get("/metrics", timeout=10.0)
        return r.text if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def _event_text(ev: dict) -> str:
    """The output text an SSE event carries (chat delta content or completion text), "" if none."""
    for c in ev.get("choices") or ():
        delta = c.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else c.get("text")
        if text:
            return text
    return ""


def _error_message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return body[:300].decode(errors="replace")


class StreamClient:
    """Sends one streamed generation and times it. ``t0`` (perf_counter) is the run's start."""

    def __init__(self, http: httpx.AsyncClient, cfg: ClientConfig, model: str, t0: float):
        self.http, self.cfg, self.model, self.t0 = http, cfg, model, t0

    def _body(self, max_tokens: int, exact: bool) -> dict:
        body = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": max_tokens, "temperature": self.cfg.temperature}
        if self.cfg.seed is not None:
            body["seed"] = self.cfg.seed
        if exact:
            body["min_tokens"] = max_tokens
        return body

    async def chat(self, messages: list[dict], *, max_tokens: int, exact: bool = False,
                   session: str | None = None, turn: int = 0, tools: tuple[dict, ...] = ()) -> Record:
        body = self._body(max_tokens, exact) | {"messages": messages}
        if tools:
            body["tools"] = list(tools)
        headers = {"X-Session-Id": session} if session and self.cfg.session_header else {}
        return await self._send("/v1/chat/completions", body, headers, Record(session, turn, 0.0))

    async def completion(self, prompt: str | list[int], *, max_tokens: int, exact: bool = True,
                         scheduled: float | None = None, session: str | None = None, turn: int = 0) -> Record:
        body = self._body(max_tokens, exact) | {"prompt": prompt}
        headers = {"X-Session-Id": session} if session and self.cfg.session_header else {}
        return await self._send("/v1/completions", body, headers, Record(session, turn, 0.0, scheduled))

    async def _send(self, path: str, body: dict, headers: dict, rec: Record) -> Record:
        sent = time.perf_counter()
        rec.start = sent - self.t0
        parts: list[str] = []
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                async with self.http.stream("POST", path, json=body, headers=headers) as resp:
                    rec.status, rec.request_id = resp.status_code, resp.headers.get("x-request-id")
                    if resp.status_code != 200:
                        rec.retry_after = resp.headers.get("retry-after")
                        rec.error, rec.error_detail = f"http_{resp.status_code}", _error_message(await resp.aread())
                        return rec
                    await self._read_events(resp, rec, sent, parts)
        except TimeoutError:
            rec.error, rec.error_detail = "timeout", f"no end of stream within {self.cfg.timeout_s:g} s"
        except httpx.TimeoutException as e:
            rec.error, rec.error_detail = "timeout", f"{type(e).__name__}: {e}"[:300]
        except httpx.TransportError as e:
            rec.error, rec.error_detail = "connection", f"{type(e).__name__}: {e}"[:300]
        finally:
            rec.e2e = time.perf_counter() - sent
            rec.text = "".join(parts)
        if rec.ok and rec.completion_tokens is None:
            rec.completion_tokens = len(rec.itl) + (rec.ttft is not None)
        return rec

    @staticmethod
    async def _read_events(resp: httpx.Response, rec: Record, sent: float, parts: list[str]) -> None:
        last = None
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            try:
                ev = json.loads(data)
            except ValueError:
                rec.error, rec.error_detail = "protocol", f"unparsable event {data[:200]!r}"
                return
            if ev.get("error"):
                err = ev["error"]
                rec.error = "stream_error"
                rec.error_detail = str(err.get("message") if isinstance(err, dict) else err)[:300]
                return
            text = _event_text(ev)
            if text:
                now = time.perf_counter()
                if last is None:
                    rec.ttft = now - sent
                else:
                    rec.itl.append(now - last)
                last = now
                parts.append(text)
            usage = ev.get("usage")
            if usage:
                rec.prompt_tokens = usage.get("prompt_tokens")
                rec.completion_tokens = usage.get("completion_tokens")
                rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        rec.error, rec.error_detail = "incomplete", "the stream ended without data: [DONE]"


class _Budget:
    """At most ``n`` requests in the whole run (None: no limit)."""

    def __init__(self, n: int | None):
        self.left = n

    def take(self) -> bool:
        if self.left is None:
            return True
        if self.left <= 0:
            return False
        self.left -= 1
        return True


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, file=sys.stderr, unit="req", disable=not enabled, dynamic_ncols=True)


async def run_sessions(client: StreamClient, sessions: list[Session], *, concurrency: int | None = None,
                       max_requests: int | None = None, progress: bool = True) -> list[Record]:
    records: list[Record] = []
    total = sum(len(s.turns) for s in sessions)
    total = min(total, max_requests) if max_requests is not None else total
    sem = asyncio.Semaphore(concurrency or max(1, len(sessions)))
    budget = _Budget(max_requests)

    async def one(s: Session, bar) -> None:
        async with sem:
            replies: list[str] = []
            for t, turn in enumerate(s.turns):
                if t and turn.think_s > 0:
                    await asyncio.sleep(turn.think_s)
                if not budget.take():
                    return
                rec = await client.chat(s.messages(t, replies), max_tokens=turn.max_tokens,
                                        exact=turn.exact_output, session=s.sid, turn=t, tools=s.tools)
                records.append(rec)
                bar.update(1)
                if not rec.ok:
                    bar.set_postfix_str(f"errors: {sum(not r.ok for r in records)}")
                    return
                replies.append(rec.text)

    with _progress(total, progress) as bar:
        await asyncio.gather(*(one(s, bar) for s in sessions))
    return sorted(records, key=lambda r: r.start)


async def run_timed(client: StreamClient, requests: list[TimedRequest], *, concurrency: int | None = None,
                    max_requests: int | None = None, progress: bool = True) -> list[Record]:
    reqs = requests[:max_requests] if max_requests is not None else requests
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    records: list[Record] = []

    async def one(r: TimedRequest, bar) -> None:
        async def send() -> Record:
            prompt = list(r.prompt) if isinstance(r.prompt, tuple) else r.prompt
            return await client.completion(prompt, max_tokens=r.max_tokens, exact=r.exact_output,
                                           scheduled=r.arrival_s, turn=0)
        if sem is None:
            rec = await send()
        else:
            async with sem:
                rec = await send()
        records.append(rec)
        bar.update(1)

    start = client.t0
    with _progress(len(reqs), progress) as bar:
        tasks = []
        for r in reqs:
            delay = start + r.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(r, bar)))
        await asyncio.gather(*tasks)
    return sorted(records, key=lambda r: r.start)


async def run_arrivals(client: StreamClient, sessions: list[Session], starts: list[float], *,
                       retry_429: bool = False, progress: bool = False) -> list[Record]:
    """Session ``i`` starts ``starts[i]`` seconds after ``client.t0`` and sends its turns one after
    another (each after the previous reply plus its think time); a failed turn ends its session.
    With ``retry_429`` a turn refused with 429 is sent once more after its Retry-After (both
    records are kept; the retry's ``scheduled`` is the refusal's end)."""
    if len(starts) != len(sessions):
        raise ValueError(f"{len(sessions)} sessions but {len(starts)} start times")
    records: list[Record] = []

    async def one(s: Session, at: float, bar) -> None:
        await asyncio.sleep(max(0.0, client.t0 + at - time.perf_counter()))
        replies: list[str] = []
        for t, turn in enumerate(s.turns):
            if t and turn.think_s > 0:
                await asyncio.sleep(turn.think_s)
            msgs = s.messages(t, replies)
            rec = await client.chat(msgs, max_tokens=turn.max_tokens, exact=turn.exact_output,
                                    session=s.sid, turn=t, tools=s.tools)
            records.append(rec)
            bar.update(1)
            if rec.status == 429 and retry_429:
                wait = float(rec.retry_after) if rec.retry_after and rec.retry_after.isdigit() else 1.0
                await asyncio.sleep(wait)
                rec = await client.chat(msgs, max_tokens=turn.max_tokens, exact=turn.exact_output,
                                        session=s.sid, turn=t, tools=s.tools)
                rec.scheduled = rec.start - wait
                records.append(rec)
                bar.update(1)
            if not rec.ok:
                return
            replies.append(rec.text)

    with _progress(sum(len(s.turns) for s in sessions), progress) as bar:
        await asyncio.gather(*(one(s, at, bar) for s, at in zip(sessions, starts)))
    return sorted(records, key=lambda r: r.start)
