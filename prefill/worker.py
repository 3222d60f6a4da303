"""PrefillWorker: run a prompt, then WRITE its KV pages into a decode worker's preallocated pages.

Plain Python (no Ray; prefill/actor.py is the Ray shell). Owns an :class:`Engine` whose scheduler
holds finished requests' KV (``hold_finished``) and a :class:`KVTransferAgent` over the engine's
KV pool (``kv_data: [L, 2, rows, H_kv, D]``, one region "kv").

One request (``prefill``), push model as in SGLang PD::

    decode                                   prefill (this)
    reserve pages [p, n) ──KVTransferRequest──> engine: prompt, max_tokens=1  (queue + prefill)
                                               held slots of positions [p, n) -> src pages
                         <══ NIXL WRITE ══════ write_pages(src -> dst, notif=KVTransferDone)
                         <── result dict ───── poll until DONE/ERR, then release_held

Positions are page-aligned identically on both sides (same page_size; ``p`` is a multiple of it),
so source page ``i`` of the range goes to destination page ``i``.

Contract of :meth:`PrefillWorker.prefill` (decode relies on it to free pages safely): it returns
(or raises) only when no WRITE of this transfer can still be in flight. The one exception is a
result with ``in_flight=True`` (a write that neither finished nor failed within
``IN_FLIGHT_LIMIT`` transfer timeouts); decode must then never reuse those pages.
The source KV stays held (locked) until the write is out of flight, on success and on failure.

Result dict (crosses the process boundary): ``status`` ("ok" | "failed" | "aborted"),
``first_token`` (int or None), ``error`` (str), ``in_flight`` (bool), ``bytes``, ``pages``,
``cached_tokens`` (prompt tokens this worker's prefix cache served), ``prefill_s`` (engine arrival
to first token), ``transfer_s`` (write posted to DONE), ``worker``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from tandem.core.config import EngineConfig
from tandem.core.messages import GenerateRequest
from tandem.core.types import StreamChunk, TandemError
from tandem.engine.metrics import register_engine_metrics
from tandem.transfer.agent import KVTransferAgent, Region
from tandem.transfer.messages import Handshake, KVTransferDone, KVTransferRequest, TransferStatus
from tandem.transfer.state import TransferRegistry, TransferState

log = logging.getLogger(__name__)

REGION = "kv"
IN_FLIGHT_LIMIT = 10          # give up waiting for a stuck write after this many transfer timeouts
ABORT_TOMBSTONE_S = 120.0     # an abort that arrives before its request is remembered this long
_POLL_S = 0.0005
ENGINE_CALL_TIMEOUT_S = 120.0

_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                     5.0, 10.0, 30.0)


@dataclass
class _Job:
    """One prefill request in this worker. ``aborted`` is set by :meth:`PrefillWorker.abort`."""

    rid: str
    transfer_id: int
    aborted: str = ""


class PrefillWorker:
    """Owns an Engine (holding finished KV) and a NIXL agent. Methods run on one asyncio loop."""

    def __init__(self, name: str, config: EngineConfig | None = None, *, engine=None, loaded=None,
                 transfer_timeout_s: float = 30.0, agent_opts: dict | None = None,
                 kv_events: bool = False):
        """``kv_events``: publish the prefix cache's KV events on a ZMQ PUB socket bound to
        127.0.0.1 (an ephemeral port, named by :attr:`kv_events_endpoint`) for the router."""
        self.kv_publisher = None
        if engine is None:
            from tandem.engine.engine import Engine
            if kv_events:
                from tandem.cache.radix.events import KVEventPublisher
                self.kv_publisher = KVEventPublisher("tcp://127.0.0.1:0")
            engine = Engine(config or EngineConfig(), loaded=loaded, kv_events=self.kv_publisher)
        self.name = name
        self.engine = engine
        # Set before any request is submitted: finished requests keep their KV until sent.
        engine.scheduler.hold_finished = True
        self.page_size = engine.kv_pool.page_size
        self.transfer_timeout_s = transfer_timeout_s
        self.agent = KVTransferAgent(name, [Region.of(REGION, engine.kv_pool.kv_data, self.page_size)],
                                     **(agent_opts or {}))
        self.transfers = TransferRegistry()
        self._jobs: dict[str, _Job] = {}
        self._tombstones: dict[str, float] = {}   # rid -> monotonic time of an early abort
        self.counts = {"ok": 0, "failed": 0, "aborted": 0, "bytes": 0, "pages": 0}
        self.metrics = CollectorRegistry()
        register_engine_metrics(engine, worker=name, role="prefill", registry=self.metrics)
        self._bytes = Counter("tandem_kv_transfer_bytes_total",
                              "KV bytes written to decode workers.", registry=self.metrics)
        self._seconds = Histogram("tandem_kv_transfer_seconds",
                                  "One KV transfer: WRITE posted to completion.",
                                  buckets=_TRANSFER_BUCKETS, registry=self.metrics)
        self._outcomes = Counter("tandem_kv_transfers_total", "KV transfers by outcome.",
                                 labelnames=("status",), registry=self.metrics)

    # ------------------------------------------------------------------ bootstrap
    def handshake(self) -> bytes:
        """This worker's :class:`Handshake` (NIXL metadata + region layout), encoded."""
        return self.agent.handshake().encode()

    def add_peer(self, handshake: bytes) -> str:
        """Load a decode worker's handshake so this worker can WRITE into its pages."""
        hs = Handshake.decode(handshake)
        self.agent.add_peer(hs.agent_name, hs.agent_metadata, hs.regions)
        return hs.agent_name

    def remove_peer(self, name: str) -> None:
        """Forget a (dead) decode worker; writes to it fail from now on."""
        self.agent.remove_peer(name)

    # ------------------------------------------------------------------ one request
    async def prefill(self, req_wire: dict, xfer: bytes, dst_prefix_len: int) -> dict:
        """Prefill ``req_wire`` (a GenerateRequest on the wire) and write positions
        ``[dst_prefix_len, len(prompt))`` into ``xfer``'s (a KVTransferRequest) pages."""
        greq = GenerateRequest.from_wire(req_wire)
        req = KVTransferRequest.decode(xfer)
        rid, tid = greq.rid, req.transfer_id
        out = {"status": TransferStatus.FAILED, "first_token": None, "error": "", "in_flight": False,
               "bytes": 0, "pages": 0, "cached_tokens": 0, "prefill_s": 0.0, "transfer_s": 0.0,
               "worker": self.name}
        self._expire_tombstones()
        if rid in self._jobs:
            return self._fail(out, f"request {rid} is already being prefilled on {self.name}")
        if self._tombstones.pop(rid, None) is not None:
            out["status"] = "aborted"
            return self._fail(out, f"request {rid} was aborted before it reached {self.name}")
        err = self._check(greq, req, dst_prefix_len)
        if err:
            return self._fail(out, err)
        job = self._jobs[rid] = _Job(rid, tid)
        self.transfers.add(tid, self.transfer_timeout_s, TransferState.BOOTSTRAPPED)
        # Shielded: if this call is cancelled the job still runs to its end (held KV released,
        # no write left in flight); it only stops early.
        task = asyncio.ensure_future(self._run_job(job, greq, req, dst_prefix_len, out))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            job.aborted = job.aborted or f"prefill of {rid} cancelled"
            self.engine.abort(rid, error=job.aborted)
            raise

    async def _run_job(self, job: _Job, greq: GenerateRequest, req: KVTransferRequest, start: int,
                       out: dict) -> dict:
        try:
            return await self._run(job, greq, req, start, out)
        finally:
            del self._jobs[job.rid]
            if job.transfer_id in self.transfers:
                self.transfers.remove(job.transfer_id)

    async def _run(self, job: _Job, greq: GenerateRequest, req: KVTransferRequest, start: int,
                   out: dict) -> dict:
        rid, tid, n = job.rid, job.transfer_id, len(greq.prompt_ids)
        # (1) the prompt, one sampled token (its params: temperature, seed, min_tokens)
        p = greq.params
        params = dataclasses.replace(p, max_tokens=1, min_tokens=min(p.min_tokens, 1))
        t0 = time.monotonic()
        try:
            last = await self._run_prompt(dataclasses.replace(greq, params=params))
        except TandemError as e:  # InvalidRequest or a dead engine: nothing is held
            self.transfers.fail(tid, str(e))
            return self._fail(out, f"prefill of {rid} on {self.name} refused: {e}")
        out["prefill_s"] = time.monotonic() - t0
        if last.finish_reason == "abort":  # aborted or failed inside the engine: KV already freed
            self.transfers.fail(tid, last.error or "aborted")
            out["status"] = "aborted" if job.aborted else TransferStatus.FAILED
            return self._fail(out, job.aborted or f"prefill of {rid} on {self.name} failed: "
                                                  f"{last.error or 'aborted'}")
        first = last.token_ids[-1]
        out["first_token"] = first
        # (2) from here the request's KV is held: release it on every path below
        try:
            if job.aborted:
                self.transfers.fail(tid, job.aborted)
                out["status"] = "aborted"
                return self._fail(out, job.aborted)
            slots, cached = await self._call(lambda s: (s.held_slots(rid, start, n),
                                                        s.held[rid].req.cached_len))
            out["cached_tokens"] = cached
            if int(slots[0]) % self.page_size:
                raise AssertionError(f"{rid}: position {start} maps to slot {int(slots[0])}, "
                                     f"not a page start (page_size {self.page_size})")
            src = (slots[:: self.page_size] // self.page_size).tolist()
            return await self._write(job, req, src, first, out)
        finally:
            await self._call(lambda s: s.release_held(rid))

    async def _write(self, job: _Job, req: KVTransferRequest, src: list[int], first: int,
                     out: dict) -> dict:
        tid = job.transfer_id
        dst = list(req.pages(REGION))
        notif = KVTransferDone(tid, TransferStatus.OK, first).encode()
        self.transfers.advance(tid, TransferState.TRANSFERRING)
        t0 = time.monotonic()
        # The agent's own deadline is far away: only a transport error or completion ends the
        # write, so "not PROC" really means "not in flight" (see the module contract).
        limit = self.transfer_timeout_s * IN_FLIGHT_LIMIT
        try:
            h = self.agent.write_pages(req.agent_name, REGION, src, dst, notif=notif, timeout_s=limit * 2)
        except (KeyError, ValueError) as e:  # unknown peer, bad pages: nothing was posted
            self.transfers.fail(tid, str(e))
            return self._fail(out, f"transfer {tid} not posted: {e}")
        status = self.agent.poll(h)
        while status == "PROC":
            if time.monotonic() - t0 > limit:
                out["in_flight"] = True
                self.transfers.fail(tid, "write still in flight")
                log.error("transfer %d to %s still in flight after %.0fs; its pages stay held",
                          tid, req.agent_name, limit)
                self.agent.release(h)  # the agent keeps an in-flight request and retries later
                return self._fail(out, f"transfer {tid} to {req.agent_name} still in flight after {limit:.0f}s")
            await asyncio.sleep(_POLL_S)
            status = self.agent.poll(h)
        seconds = time.monotonic() - t0
        self.agent.release(h)
        out["transfer_s"] = seconds
        if status != "DONE":
            self.transfers.fail(tid, h.error)
            return self._fail(out, f"transfer {tid} to {req.agent_name} failed: {h.error}")
        self.transfers.advance(tid, TransferState.DONE)
        self._bytes.inc(h.nbytes)
        self._seconds.observe(seconds)
        self.counts["bytes"] += h.nbytes
        self.counts["pages"] += len(src)
        out.update(bytes=h.nbytes, pages=len(src))
        if job.aborted:  # aborted while writing: the bytes landed but decode no longer wants them
            out["status"] = "aborted"
            return self._fail(out, job.aborted)
        out["status"] = TransferStatus.OK
        self.counts["ok"] += 1
        self._outcomes.labels("ok").inc()
        return out

    async def abort(self, rid: str, reason: str = "") -> bool:
        """Stop ``rid``: in the engine it is aborted (KV freed); while its write is in flight the
        write finishes first and the result says "aborted". An abort that arrives before the
        request is remembered, so the late request is refused. True if ``rid`` was live here."""
        why = reason or f"request {rid} aborted"
        job = self._jobs.get(rid)
        if job is None:
            self._tombstones[rid] = time.monotonic()
            return False
        job.aborted = why
        self.engine.abort(rid, error=why)
        return True

    # ------------------------------------------------------------------ helpers
    def _check(self, greq: GenerateRequest, req: KVTransferRequest, start: int) -> str:
        n, ps = len(greq.prompt_ids), self.page_size
        if not 0 <= start < n or start % ps:
            return f"dst_prefix_len={start} must be a multiple of page_size={ps} below the prompt length {n}"
        if req.regions != (REGION,):
            return f"transfer {req.transfer_id} names regions {list(req.regions)}, this worker sends only {REGION!r}"
        need = -(-(n - start) // ps)
        if len(req.pages(REGION)) != need:
            return (f"transfer {req.transfer_id}: positions [{start}, {n}) need {need} pages of "
                    f"{ps}, got {len(req.pages(REGION))}")
        if req.agent_name not in self.agent.peers:
            return f"decode worker {req.agent_name!r} is not a peer of {self.name} (peers: {self.agent.peers})"
        return ""

    async def _run_prompt(self, greq: GenerateRequest) -> StreamChunk:
        """Submit to the engine and wait for the final chunk."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[StreamChunk] = loop.create_future()

        def on_chunk(c: StreamChunk) -> None:
            if c.finish_reason is not None:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(c))

        self.engine.submit(greq, on_chunk)
        return await done

    async def _call(self, fn):
        """``fn(scheduler)`` on the engine thread; raises instead of waiting forever on a dead one."""
        err = getattr(self.engine, "_error", None)   # set by the engine thread when it crashes
        if err is not None:
            raise RuntimeError(f"engine thread died: {err!r}")
        # shielded: cancelling the caller must not cancel the engine's future (it sets it later)
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self.engine.call(fn))),
                                      ENGINE_CALL_TIMEOUT_S)

    def _fail(self, out: dict, error: str) -> dict:
        if out["status"] == TransferStatus.OK:
            out["status"] = TransferStatus.FAILED
        out["error"] = error
        key = "aborted" if out["status"] == "aborted" else "failed"
        self.counts[key] += 1
        self._outcomes.labels(key).inc()
        return out

    def _expire_tombstones(self) -> None:
        cutoff = time.monotonic() - ABORT_TOMBSTONE_S
        for rid in [r for r, t in self._tombstones.items() if t < cutoff]:
            del self._tombstones[rid]

    # ------------------------------------------------------------------ observability
    async def stats(self) -> dict:
        """Pool accounting and counters (for tests and /health)."""
        def snap(s):
            return {"available_tokens": s.alloc.available_size(), "evictable_tokens": s.cache.evictable_size(),
                    "total_tokens": s.alloc.size, "held": len(s.held), "running": len(s.running),
                    "waiting": len(s.waiting), "rows_free": s.r2t.available_size()}
        return {"worker": self.name, "role": "prefill", **(await self._call(snap)),
                "live_transfers": len(self.transfers), **self.counts}

    def metrics_text(self) -> bytes:
        return generate_latest(self.metrics)

    def check_alive(self) -> None:
        """Raise if the engine thread died (the cluster then replaces this worker)."""
        err = getattr(self.engine, "_error", None)
        if err is not None:
            raise RuntimeError(f"{self.name}: engine thread died: {err!r}")

    @property
    def kv_events_endpoint(self) -> str | None:
        return self.kv_publisher.endpoint if self.kv_publisher is not None else None

    def close(self) -> None:
        try:
            self.engine.shutdown()
        finally:
            self.agent.close()
            if self.kv_publisher is not None:
                self.kv_publisher.close()
