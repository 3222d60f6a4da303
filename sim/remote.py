"""Simulated workers behind the real workers' actor protocol (``tandem serve --engine sim`` on Ray)."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, generate_latest

from tandem.cache.unified import UnifiedRadixCache
from tandem.core.config import ServeConfig
from tandem.core.gie import GIECollector, GIESample
from tandem.core.messages import GenerateRequest
from tandem.core.detokenizer import IncrementalDetokenizer
from tandem.core.types import StreamChunk
from tandem.sim.cost_model import get_profile
from tandem.sim.workers import PrefillWorker, SimRequest

DEFAULT_CONTEXT = 8192


class _SimRole:
    role = "worker"

    def __init__(self, name: str, cfg: ServeConfig):
        self.name, self.cfg = name, cfg
        self.profile = get_profile(cfg.sim_profile)
        self.speedup = float(cfg.sim_speedup)
        self.page_size = cfg.engine_config.cache.page_size
        self.draining = False
        self.metrics = CollectorRegistry()
        self._t0: float | None = None

    def now(self) -> float:
        """Simulated seconds since the first call."""
        loop = asyncio.get_running_loop()
        if self._t0 is None:
            self._t0 = loop.time()
        return (loop.time() - self._t0) * self.speedup

    async def sleep(self, sim_s: float) -> None:
        await asyncio.sleep(max(sim_s, 0.0) / self.speedup)

    def info(self, **extra) -> dict:
        return {"name": self.name, "role": self.role, "model_name": self.cfg.engine_config.model,
                "max_context": int(self.cfg.engine_config.context_length or DEFAULT_CONTEXT),
                "page_size": self.page_size, "device": "sim", "regions": [], "peers": [],
                "draining": self.draining, **extra}

    def metrics_text(self) -> bytes:
        return generate_latest(self.metrics)


class SimPrefillRole(_SimRole):
    role = "prefill"

    def __init__(self, name: str, cfg: ServeConfig, publisher=None):
        super().__init__(name, cfg)
        self.capacity = self.profile.decode_kv_tokens
        self.publisher = publisher
        cache = UnifiedRadixCache.simulated(page_size=self.page_size, capacity_tokens=self.capacity,
                                            events=publisher)
        self.worker = PrefillWorker(0, self.profile, cache, 1)
        self._ids = itertools.count()
        self._done: dict[int, asyncio.Future[None]] = {}
        self._wake = asyncio.Event()            # (an asyncio primitive binds a loop on first use)
        self._task: asyncio.Task | None = None
        self.metrics.register(GIECollector(self._gie, cfg.engine_config.model, name, self.role))

    def _gie(self) -> GIESample:
        w = self.worker
        return GIESample(len(w.queue), int(w.current is not None), w.cache.stats().device, self.capacity,
                         self.page_size)

    def stats(self) -> dict:
        w, now = self.worker, (self.now() if self._t0 is not None else 0.0)
        return {"worker": self.name, "role": self.role, "waiting": len(w.queue),
                "running": int(w.current is not None), "total_tokens": self.capacity,
                "available_tokens": max(self.capacity - w.cache.stats().device, 0),
                "pending_s": w.pending_s(now) / self.speedup, "draining": self.draining,
                "requests": w.stats.requests, "cached_tokens": w.stats.hit_tokens}

    async def prefill(self, req_wire: dict) -> dict:
        """Queue the prompt; returns ``{"cached_tokens", "prompt_tokens"}`` when its prefill ends."""
        greq = GenerateRequest.from_wire(req_wire)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())
        r = SimRequest(next(self._ids), self.now(), len(greq.prompt_ids), greq.params.max_tokens,
                       list(greq.cache_key))
        fut = self._done[r.rid] = asyncio.get_running_loop().create_future()
        self.worker.enqueue(r, self.now())
        self._wake.set()
        await fut
        return {"cached_tokens": r.cached_tokens, "prompt_tokens": r.prompt_tokens}

    async def _loop(self) -> None:
        w = self.worker
        while True:
            await self._wake.wait()
            self._wake.clear()
            while w.queue:
                end = w.start(self.now())
                if end is None:     # not idle (cannot be: finish() ran) or nothing queued
                    break
                await self.sleep(end - self.now())
                r = w.finish(self.now())
                fut = self._done.pop(r.rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(None)

    def debug_kv(self) -> dict:
        try:
            self.worker.cache.check()
            verdict = "ok"
        except AssertionError as e:
            verdict = str(e)[:4000]
        return {"worker": self.name, "role": self.role, "leaked_tokens": 0, "invariants": verdict,
                "live_transfers": 0}

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.publisher is not None:
            self.publisher.close()


class _Flight:
    __slots__ = ("req", "queue", "ctx", "left", "rng", "need")

    def __init__(self, req: GenerateRequest, need: int):
        self.req, self.need = req, need
        self.queue: asyncio.Queue[int] = asyncio.Queue()
        self.ctx = len(req.prompt_ids)
        self.left = req.params.max_tokens
        self.rng = random.Random(req.rid)


class SimDecodeRole(_SimRole):
    role = "decode"

    def __init__(self, name: str, cfg: ServeConfig, tokenizer):
        super().__init__(name, cfg)
        self.capacity = cfg.decode_max_total_tokens or self.profile.decode_kv_tokens
        self.tokenizer = tokenizer
        vocab = int(tokenizer.vocab_size)
        specials = set(getattr(tokenizer, "eos_token_ids", ()) or ())
        bos = getattr(tokenizer, "bos_token_id", None)
        specials |= {bos} if bos is not None else set()
        first = max(specials, default=-1) + 1
        self._lo, self._hi, self._specials = (first if first < vocab // 2 else 0), vocab, specials
        self.reserved = 0
        self.waiting = 0
        self.running: list[_Flight] = []
        self._room = asyncio.Condition()
        self._stepper: asyncio.Task | None = None
        self.counts = {"ok": 0, "failed": 0}
        self.active = 0
        self.metrics.register(GIECollector(self._gie, cfg.engine_config.model, name, self.role))

    def _gie(self) -> GIESample:
        return GIESample(self.waiting, len(self.running), self.reserved, self.capacity, self.page_size)

    def stats(self) -> dict:
        return {"worker": self.name, "role": self.role, "waiting": self.waiting,
                "running": len(self.running), "total_tokens": self.capacity,
                "available_tokens": max(self.capacity - self.reserved, 0), "draining": self.draining,
                **self.counts}

    async def generate(self, greq: GenerateRequest, prefill) -> AsyncIterator[StreamChunk]:
        """``prefill``: an object with ``async prefill(req_wire) -> dict``, or None (prefilled here)."""
        self.active += 1
        try:
            async for c in self._generate(greq, prefill):
                yield c
        finally:
            self.active -= 1

    async def _generate(self, greq: GenerateRequest, prefill) -> AsyncIterator[StreamChunk]:
        n = len(greq.prompt_ids)
        try:
            if prefill is not None:
                res = await prefill.prefill(greq.to_wire())
                cached = int(res["cached_tokens"])
            else:
                await self.sleep(self.profile.prefill_s(n))
                cached = 0
        except Exception as e:  # noqa: BLE001
            self.counts["failed"] += 1
            yield StreamChunk(greq.rid, (), "", "abort", n, error=f"prefill failed: {type(e).__name__}: {e}"[:300])
            return
        f = _Flight(greq, n + greq.params.max_tokens)
        self.waiting += 1
        try:
            async with self._room:
                await self._room.wait_for(lambda: self.reserved == 0 or self.reserved + f.need <= self.capacity)
                self.reserved += f.need
        finally:
            self.waiting -= 1
        detok = IncrementalDetokenizer(self.tokenizer, list(greq.prompt_ids[-5:]))
        joined = False
        try:
            await self.sleep(self.profile.kv_transfer_s(n))
            self.running.append(f)
            joined = True
            if self._stepper is None or self._stepper.done():
                self._stepper = asyncio.get_running_loop().create_task(self._steps())
            emitted = 0
            f.queue.put_nowait(self._token(f))
            while True:
                tok = await f.queue.get()
                emitted += 1
                text = detok.add(tok)
                if emitted >= greq.params.max_tokens:
                    self.counts["ok"] += 1
                    yield StreamChunk(greq.rid, (tok,), text + detok.flush(), "length", n, cached, emitted,
                                      worker=self.name)
                    return
                yield StreamChunk(greq.rid, (tok,), text)
        finally:
            if joined and f in self.running:
                self.running.remove(f)
            async with self._room:
                self.reserved -= f.need
                self._room.notify_all()

    def _token(self, f: _Flight) -> int:
        t = f.rng.randrange(self._lo, self._hi)
        while t in self._specials:
            t = f.rng.randrange(self._lo, self._hi)
        f.left -= 1
        f.ctx += 1
        return t

    async def _steps(self) -> None:
        while self.running:
            batch = list(self.running)
            await self.sleep(self.profile.decode_step_s(len(batch), sum(x.ctx for x in batch)))
            for f in batch:
                if f in self.running and f.left > 0:
                    f.queue.put_nowait(self._token(f))

    def debug_kv(self) -> dict:
        leaked = self.reserved if self.active == 0 else 0
        return {"worker": self.name, "role": self.role, "leaked_tokens": leaked, "invariants": "ok",
                "live_transfers": 0}

    def close(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()
