"""``tandem serve --engine sim``: the real front door and router over simulated workers."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import random
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from prometheus_client import REGISTRY, generate_latest

from tandem.cache.unified import UnifiedRadixCache
from tandem.core.config import ServeConfig
from tandem.core.messages import GenerateRequest
from tandem.core.detokenizer import IncrementalDetokenizer
from tandem.core.types import StreamChunk, TandemError
from tandem.router.deferred import DeferredDispatch
from tandem.router.dispatch import Dispatcher, Route
from tandem.router.policies import AdmissionLimits, PolicyConfig
from tandem.sim import metrics as sm
from tandem.sim.cost_model import get_profile
from tandem.sim.workers import DecodeWorker, EventSink, PrefillWorker, SimRequest

log = logging.getLogger(__name__)

DEFAULT_CONTEXT = 8192


@dataclass(eq=False)
class _Flight:
    """One request in the simulated cluster: its SimRequest and the stream the caller reads."""

    sim: SimRequest
    req: GenerateRequest
    route: Route
    prefill: PrefillWorker
    decode: DecodeWorker
    detok: IncrementalDetokenizer
    out: asyncio.Queue[StreamChunk] = field(default_factory=asyncio.Queue)
    rng: random.Random = field(default_factory=random.Random)
    emitted: int = 0
    stage: str = "queued"
    aborted: bool = False


class SimServingBackend:
    """ServingBackend over cost-model workers (module docstring). ``generate``/``abort``/``health``
    run on the front door's event loop (the workers' tasks start there on first use);
    ``metrics_text`` runs off it and only reads."""

    def __init__(self, cfg: ServeConfig, tokenizer, profile: str | None = None, *,
                 speedup: float | None = None):
        """``tokenizer``: the model's (cluster/launch.py ``load_tokenizer``), or any object with
        ``vocab_size``, ``decode`` and the special-token ids."""
        if cfg.prefill < 1:
            raise TandemError("--engine sim needs at least one prefill worker (--prefill >= 1)")
        self.cfg = cfg
        self.profile = get_profile(profile or cfg.sim_profile)
        self.speedup = float(speedup if speedup is not None else cfg.sim_speedup)
        if self.speedup <= 0:
            raise TandemError(f"sim speedup must be > 0, got {self.speedup}")
        ec = cfg.engine_config
        self.tokenizer = tokenizer
        self.vocab_size = int(tokenizer.vocab_size)
        self.model_name = ec.model
        self.max_context = int(ec.context_length or DEFAULT_CONTEXT)
        specials = set(getattr(tokenizer, "eos_token_ids", ()) or ())
        bos = getattr(tokenizer, "bos_token_id", None)
        specials |= {bos} if bos is not None else set()
        # output ids: the vocabulary past its leading special tokens (SmolLM2: ids 0..16)
        first = max(specials, default=-1) + 1
        self._out_lo = first if first < self.vocab_size // 2 else 0
        self._specials = specials

        self.page_size = ec.cache.page_size
        prefill_cap = self.profile.decode_kv_tokens
        decode_cap = cfg.decode_max_total_tokens or self.profile.decode_kv_tokens
        self.dispatch = Dispatcher(
            cfg.policy, PolicyConfig(kv_block_size=self.page_size, index_capacity=prefill_cap,
                                     estimator=self.profile.estimator(), seed=ec.seed),
            AdmissionLimits(cfg.admission_max_queue, cfg.admission_max_pending_s), clock=self.now)
        self.queue = DeferredDispatch(self.dispatch, cfg.dispatch_queue_size, cfg.dispatch_queue_ttl_s,
                                      poll_s=0.05, refresh=self._refresh_snapshots,
                                      prefer_sessions=cfg.dispatch_prefer_sessions)
        use_events = cfg.kv_events if cfg.kv_events is not None else cfg.policy == "kv_events"
        self.prefills: list[PrefillWorker] = []
        for i in range(cfg.prefill):
            sink = EventSink(self.dispatch.state, [i]) if use_events else None
            cache = UnifiedRadixCache.simulated(page_size=self.page_size, capacity_tokens=prefill_cap,
                                                eviction=ec.cache.eviction_policy
                                                if ec.cache.eviction_policy in ("lru", "lfu", "fifo") else "lru",
                                                events=sink)
            self.prefills.append(PrefillWorker(i, self.profile, cache, 1))
        self.decodes = [DecodeWorker(cfg.prefill + j, self.profile, decode_cap) for j in range(cfg.decode)]
        self.names = {w.id: f"prefill-{i}" for i, w in enumerate(self.prefills)}
        self.names.update({w.id: f"decode-{j}" for j, w in enumerate(self.decodes)})
        self._nic_free = [0.0] * cfg.prefill
        self._flights: dict[str, _Flight] = {}
        self._by_sim: dict[int, _Flight] = {}
        self._sim_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._t0 = 0.0
        self._wake: dict[int, asyncio.Event] = {}
        self._tasks: set[asyncio.Task] = set()
        self._prefill_by_id = {p.id: p for p in self.prefills}
        self._decode_by_id = {d.id: d for d in self.decodes}
        for p in self.prefills:
            self.dispatch.add_worker(p.id, "prefill", self.names[p.id], prefill_cap)
        for d in self.decodes:
            self.dispatch.add_worker(d.id, "decode", self.names[d.id], decode_cap)

    # ------------------------------------------------------------------ clock and tasks
    def now(self) -> float:
        """Simulated seconds since the workers started (0 before)."""
        if self._loop is None:
            return 0.0
        return (self._loop.time() - self._t0) * self.speedup

    async def _sleep_until(self, t: float) -> None:
        dt = (t - self.now()) / self.speedup
        await asyncio.sleep(max(dt, 0.0))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("simulated worker task failed", exc_info=task.exception())

    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None:
            raise TandemError("SimServingBackend is bound to another event loop")
        self._loop, self._t0 = loop, loop.time()
        for p in self.prefills:
            self._wake[p.id] = asyncio.Event()
            self._spawn(self._prefill_loop(p))
        for d in self.decodes:
            self._wake[d.id] = asyncio.Event()
            self._spawn(self._decode_loop(d))

    # ------------------------------------------------------------------ workers
    async def _prefill_loop(self, pw: PrefillWorker) -> None:
        name = self.names[pw.id]
        while True:
            await self._wake[pw.id].wait()
            self._wake[pw.id].clear()
            while pw.queue:
                start = self.now()
                end = pw.start(start)
                r = pw.current
                if end is None or r is None:    # not idle (cannot be: finish() ran) or nothing queued
                    break
                f = self._by_sim[r.rid]
                f.stage = "prefill"
                sm.PREFILL_TOKENS.labels(name, "cached").inc(r.cached_tokens)
                sm.PREFILL_TOKENS.labels(name, "computed").inc(r.prompt_tokens - r.cached_tokens)
                sm.BUSY.labels(name, "prefill").inc(max(end - start, 0.0))
                await self._sleep_until(end)
                pw.finish(self.now())
                self._prefilled(f)

    def _prefilled(self, f: _Flight) -> None:
        """Prefill done: reserve KV room on the decode worker and send, or wait for room."""
        if f.aborted:
            self._finish_flight(f)
            return
        f.stage = "kv_wait"
        if f.decode.reserve(f.sim):
            self._transfer(f)

    def _transfer(self, f: _Flight) -> None:
        f.stage = "transfer"
        p = f.prefill.id
        now = self.now()
        begin = max(now, self._nic_free[p])
        self._nic_free[p] = begin + self.profile.kv_transfer_s(f.sim.prompt_tokens)
        sm.TRANSFER_BYTES.labels(self.names[p]).inc(f.sim.prompt_tokens * self.profile.kv_bytes_per_token)
        self._spawn(self._arrive(f, self._nic_free[p]))

    async def _arrive(self, f: _Flight, at: float) -> None:
        await self._sleep_until(at)
        dw = f.decode
        if not f.aborted:
            f.stage = "decode"
        f.sim.ttft_at = self.now()
        wake = dw.join(f.sim, self.now())
        if f.aborted:
            f.sim.remaining = 0
        else:
            self._emit(f)
            self.dispatch.prefill_done(f.route)
        if wake:
            self._wake[dw.id].set()

    async def _decode_loop(self, dw: DecodeWorker) -> None:
        name = self.names[dw.id]
        while True:
            await self._wake[dw.id].wait()
            self._wake[dw.id].clear()
            while True:
                emitting = list(dw.running)
                busy = dw.stats.busy_s
                _, admitted, nxt = dw.step(self.now())
                sm.BUSY.labels(name, "decode").inc(dw.stats.busy_s - busy)
                if emitting:
                    sm.DECODE_TOKENS.labels(name).inc(len(emitting))
                for r in emitting:
                    f = self._by_sim.get(r.rid)
                    if f is not None and not f.aborted:
                        self._emit(f)
                for r in admitted:
                    f = self._by_sim.get(r.rid)
                    if f is not None:
                        self._transfer(f)
                if nxt is None:
                    break
                await self._sleep_until(nxt)

    def _emit(self, f: _Flight) -> None:
        """One output token for ``f`` (the final chunk when it is the last)."""
        if f.aborted or f.stage == "done":
            return
        n = f.req.params.max_tokens
        tok = f.rng.randrange(self._out_lo, self.vocab_size)
        while tok in self._specials:
            tok = f.rng.randrange(self._out_lo, self.vocab_size)
        f.emitted += 1
        self.dispatch.grow(f.route, 1)
        text = f.detok.add(tok)
        s = f.sim
        if f.emitted >= n:
            text += f.detok.flush()
            f.out.put_nowait(StreamChunk(f.req.rid, (tok,), text, "length", s.prompt_tokens,
                                         s.cached_tokens, f.emitted, worker=self.names[f.decode.id]))
            self._finish_flight(f)
        else:
            f.out.put_nowait(StreamChunk(f.req.rid, (tok,), text))

    def _finish_flight(self, f: _Flight) -> None:
        if f.stage == "done":
            return
        f.stage = "done"
        self._flights.pop(f.req.rid, None)
        self._by_sim.pop(f.sim.rid, None)
        self.dispatch.release(f.route)

    # ------------------------------------------------------------------ ServingBackend
    def _refresh_snapshots(self) -> None:
        now = self.now()
        for p in self.prefills:
            snap = p.snapshot(now)
            self.dispatch.update_snapshot(p.id, dataclasses.replace(snap, pending_s=self._prefill_pending_s(p, now)))
        for d in self.decodes:
            self.dispatch.update_snapshot(d.id, d.snapshot(now))

    def _prefill_pending_s(self, pw: PrefillWorker, now: float) -> float:
        """Simulated seconds before a new request's KV could leave prefill worker ``pw``: its
        compute queue, or its NIC's backlog (transfers scheduled, plus those of the requests queued
        or in service, which go first), whichever is longer; a prefill whose KV waits for the NIC
        has not given its first token either."""
        ahead = list(pw.queue) + ([pw.current] if pw.current is not None else [])
        nic = max(self._nic_free[pw.id] - now, 0.0) + sum(self.profile.kv_transfer_s(r.prompt_tokens) for r in ahead)
        return max(pw.pending_s(now), nic)

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[StreamChunk, None]:
        self._ensure_started()
        route = await self.queue.route(req)
        now = self.now()
        pw, dw = self._prefill_by_id[route.prefill], self._decode_by_id[route.decode]
        n = len(req.prompt_ids)
        sim = SimRequest(next(self._sim_ids), now, n, req.params.max_tokens, list(req.cache_key))
        f = _Flight(sim, req, route, pw, dw, rng=random.Random(req.rid),
                    detok=IncrementalDetokenizer(self.tokenizer, list(req.prompt_ids[-5:])))
        self._flights[req.rid] = f
        self._by_sim[sim.rid] = f
        pw.enqueue(sim, now, route.decision.matched_tokens)
        self._wake[pw.id].set()
        finished = False
        try:
            while True:
                chunk = await f.out.get()
                finished = chunk.finish_reason is not None
                yield chunk
                if finished:
                    return
        finally:
            if not finished:
                self._abort(f)

    def _abort(self, f: _Flight) -> None:
        """Stop ``f`` where it is, keeping the workers' accounting whole."""
        if f.aborted or f.stage == "done":
            return
        f.aborted = True
        s = f.sim
        if f.stage == "queued" and f.prefill.remove(s):
            self._finish_flight(f)
        elif f.stage == "kv_wait" and s in f.decode.waiting:
            f.decode.waiting.remove(s)
            self._finish_flight(f)
        elif f.stage == "decode":
            if s in f.decode.running:
                s.remaining = 1
            else:
                s.remaining = 0
            self._finish_flight(f)
        # "prefill" / "transfer": the simulated GPU work in progress completes; the request is
        # dropped when it does (_prefilled, _arrive)
        if f.stage == "transfer":
            self._finish_flight(f)

    async def abort(self, rid: str) -> None:
        f = self._flights.get(rid)
        if f is not None:
            self._abort(f)
            f.out.put_nowait(StreamChunk(rid, (), "", "abort", f.sim.prompt_tokens, f.sim.cached_tokens,
                                         f.emitted, error="aborted by the client"))

    async def health(self) -> dict:
        return {"status": "ok", "mode": "sim", "model": self.model_name, "profile": self.profile.name,
                "speedup": self.speedup, "prefill_alive": len(self.prefills),
                "decode_alive": len(self.decodes), "in_flight": len(self._flights)}

    def metrics_text(self) -> bytes:
        now = self.now() if self._loop is not None else 0.0
        for p in self.prefills:
            name = self.names[p.id]
            sm.PREFILL_QUEUE.labels(name).set(len(p.queue))
            sm.PREFILL_PENDING.labels(name).set(p.pending_s(now))
            sm.CACHE_TOKENS.labels(name).set(p.cache.stats().device)
        for d in self.decodes:
            name = self.names[d.id]
            sm.DECODE_RUNNING.labels(name).set(len(d.running))
            sm.DECODE_KV.labels(name).set(d.reserved)
        return generate_latest(REGISTRY)

    def close(self) -> None:
        for t in list(self._tasks):
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(t.cancel)
