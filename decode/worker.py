"""DecodeWorker: reserve pages, have a prefill worker WRITE the prompt's KV into them, decode."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Callable

from prometheus_client import Counter, Histogram

from tandem.core import tracing
from tandem.core.config import EngineConfig
from tandem.core.kv_messages import PrefillResult
from tandem.core.messages import GenerateRequest
from tandem.core.types import InvalidRequest, StreamChunk, TokenLogprob
from tandem.decode.connector import DecodeHandle
from tandem.decode.groups import GroupGates
from tandem.decode.local_prefill import LocalRule, PrefillCosts, SentPrefixes
from tandem.decode.migration import MigrationSource
from tandem.decode.reply_push import ReplyPush
from tandem.worker.kv_flow import KVReceiver
from tandem.worker.kv_flow_types import Failed, KVSource, Landed, Stop
from tandem.worker.kv_flow_types import SourceUnavailable as PrefillUnavailable
from tandem.worker.kv_regions import KV
from tandem.worker.receiving import ComputeHere
from tandem.worker.role_worker import RoleWorker

__all__ = ["DecodeWorker", "PrefillClient", "PrefillUnavailable"]

log = logging.getLogger(__name__)

PrefillClient = KVSource     # decode's name for whoever writes a prompt's KV (worker/kv_flow.py)
_REUSE_WAIT_S, _REUSE_WAIT_STEPS = 0.01, 200
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
COUNTS = ("remote", "local", "ok", "failed", "aborted", "quarantined_tokens", "redispatched", "digest_failures",
          "kv_bytes_received", "migrated_out", "migrated_in", "migration_bytes", "migration_reused_tokens",
          "pushed", "push_failed", "push_skipped", "pushed_tokens")


@dataclass(eq=False)
class _Job:
    """A remote request's stream on this worker."""

    rid: str
    resumed: bool = False
    logprobs: bool = False
    prompt_logprobs: int = 0
    stop: Stop = field(default_factory=Stop)
    landed: bool = False
    here: bool = False             # the connector's local-prefill rule took it: computed here
    ended: bool = False
    timings: dict = field(default_factory=dict)
    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)
    gate: asyncio.Event | None = None


class DecodeWorker(RoleWorker):
    """A decode engine composed with a :class:`KVReceiver` (prompts, migrated requests), the
    sender's :class:`MigrationSource` (frozen requests) and a :class:`ReplyPush`."""

    role, HANDLE = "decode", DecodeHandle

    def __init__(self, name: str, config: EngineConfig | None = None, **kw):
        """RoleWorker's arguments. Options this role reads (core/config.py ``WorkerOptions``):
        ``kv_digest`` verifies received pages, ``debug_corrupt_kv`` corrupts them first (test
        lever), ``local_prefill_threshold`` (decode/local_prefill.py), ``reply_push`` and
        ``debug_push_fault`` (decode/reply_push.py), ``kv_events``, ``l3``."""
        super().__init__(name, config, **kw)
        self.handle: DecodeHandle
        engine, options = self.engine, self.options
        self.local_prefill_threshold = options.local_prefill_threshold
        self.prefill_costs = PrefillCosts()
        self._sent = SentPrefixes(engine.kv.page_size)
        self.counts = dict.fromkeys(COUNTS, 0)
        self._jobs: dict[str, _Job] = {}
        self._groups = GroupGates()   # n > 1: the prompt's KV moves once per group (decode/groups.py)
        self.last_timings: dict = {}
        self._metrics()
        self.receiver = KVReceiver(name, self.handle, self.agent, self.transfer_timeout_s, self.counts,
                                   digest=options.kv_digest, corrupt=options.debug_corrupt_kv,
                                   on_failure=self._count_failure, on_redispatch=self._count_redispatch)
        self.migration = MigrationSource(self.handle, self.sender, self.counts, 2 * self.transfer_timeout_s)
        self.push = ReplyPush(name, self.handle, self.migration, self._sent, self.counts, options,
                              can_push=lambda peer: peer in self.agent.peers,
                              whole_pages_only=set(self.regions) != {KV}, page_size=self.page_size)

    # test levers, settable on a running worker
    debug_corrupt_kv = property(lambda self: self.receiver.corrupt,
                                lambda self, on: setattr(self.receiver, "corrupt", on),
                                doc="corrupt every received page run before the digest check")
    debug_push_fault = property(lambda self: self.push.fault, lambda self, f: setattr(self.push, "fault", f),
                                doc='"fail": every reply push\'s write answers FAILED, unwritten')

    def _metrics(self) -> None:
        m = self.metrics
        self._path = Counter("tandem_decode_prefill_total",
                             "Requests by where their prompt was prefilled (remote, local).",
                             labelnames=("path",), registry=m)
        for path in ("remote", "local"):
            self._path.labels(path)
        self._failures = Counter("tandem_kv_receive_failures_total",
                                 "Requests whose KV was not received, by reason.",
                                 labelnames=("reason",), registry=m)
        self._redispatch = Counter("tandem_prefill_redispatch_total",
                                   "Requests re-sent to another prefill worker after theirs died "
                                   "before writing.", registry=m)
        self._digest_failures = Counter("tandem_kv_digest_failures_total",
                                        "Transfers whose received KV did not match prefill's digest.",
                                        registry=m)
        self._mig_bytes = Counter("tandem_decode_migration_bytes_total",
                                  "KV bytes received from another decode worker by migrated requests.",
                                  registry=m)
        self._mig_reused = Counter("tandem_decode_migration_reused_tokens_total",
                                   "Tokens of migrated requests found in this worker's own cache (the "
                                   "pre-copied prompt and generated pages, a shared prefix): not "
                                   "copied.", registry=m)
        self._wait = Histogram("tandem_kv_receive_seconds",
                               "Decode side: pages reserved to KV received (prefill + transfer).",
                               buckets=_BUCKETS, registry=m)

    # the KVSource side and the migration's verbs (decode/migration.py, decode/reply_push.py)
    async def freeze(self, rid: str) -> None:
        await self.migration.freeze(rid)

    def release_frozen(self, rid: str) -> None:
        self.migration.release(rid)

    async def migrate_out(self, req_wire: dict, xfer: bytes, dst_prefix_len: int) -> PrefillResult:
        return await self.migration.write(req_wire, xfer, dst_prefix_len)

    async def push_out(self, req_wire: dict, xfer: bytes, dst_prefix_len: int) -> PrefillResult:
        return await self.push.write(req_wire, xfer, dst_prefix_len)

    async def write_kv(self, req_wire: dict, xfer: bytes, dst_prefix_len: int) -> PrefillResult:
        """This worker as a KVSource: the held KV of ``req_wire["rid"]``, a pushed sequence or a
        frozen request, into ``xfer``'s pages."""
        if req_wire["rid"] in self.push.pushing:
            return await self.push_out(req_wire, xfer, dst_prefix_len)
        return await self.migrate_out(req_wire, xfer, dst_prefix_len)

    async def generate(self, greq: GenerateRequest, prefill: KVSource | None = None,
                       alternate: Callable[[str], KVSource | None] | None = None
                       ) -> AsyncGenerator[StreamChunk, None]:
        """Stream ``greq``'s chunks. Refusals (bad prompt) raise InvalidRequest before the first
        chunk; every other failure is a final chunk with finish_reason "abort" and
        ``error``."""
        for _ in range(_REUSE_WAIT_STEPS):   # a re-route may beat the old attempt's cleanup here
            if greq.rid not in self._jobs:
                break
            await asyncio.sleep(_REUSE_WAIT_S)
        else:
            raise InvalidRequest(f"request id {greq.rid} is already running on {self.name}")
        await self.handle.check_constraint(greq.params)
        await self.push.settled(greq)   # the session's previous reply is where it is going
        remote = prefill is not None and prefill.name in self.agent.peers
        push = self.push.wanted(greq, prefill)
        if push:   # its KV is held when it finishes normally, then pushed (decode/reply_push.py)
            self.handle.connector.hold(greq.rid)
        if remote:
            fresh = greq.resume is None
            plps = len(greq.prompt_ids) - 1 if fresh and greq.params.prompt_logprobs is not None else 0
            job = self._jobs[greq.rid] = _Job(greq.rid, resumed=not fresh, logprobs=greq.params.logprobs and fresh,
                                              prompt_logprobs=plps)
            inner = self._generate_remote(job, greq, prefill, alternate)
        else:
            self._count_path("local")
            inner = self.handle.stream(greq)
        out_ids: list[int] = []
        t0, first, spec = time.time(), None, (0, 0)
        try:
            async for c in inner:
                if c.token_ids:
                    out_ids.extend(c.token_ids)
                    first = first or time.time()
                if c.finish_reason is not None:
                    spec = c.spec_tokens
                yield c
        finally:
            await inner.aclose()  # runs the inner cleanup now, not whenever it is collected
            if push:
                self.push.ended(greq, prefill, out_ids)
            if remote:
                self._jobs.pop(greq.rid, None)
                if not job.here:
                    self.last_timings = job.timings
                self._groups.open(greq, job.gate)
            if greq.trace:
                path = "remote" if remote and not job.here else "local"
                tracing.record("decode", greq.trace, t0, **{
                    "tandem.worker": self.name, "tandem.rid": greq.rid, "tandem.path": path,
                    "tandem.tokens": len(out_ids), "tandem.first_token_s": first - t0 if first else None,
                    "tandem.resumed": greq.resume is not None, "tandem.spec_drafted": spec[0],
                    "tandem.spec_accepted": spec[1]})

    def _local_rule(self, greq: GenerateRequest, peer: str) -> LocalRule:
        return LocalRule(self.local_prefill_threshold, self._sent.held(peer, greq.cache_key),
                         replace(self.prefill_costs), self.page_size)

    def _count_path(self, path: str) -> None:
        self.counts[path] += 1
        self._path.labels(path).inc()

    async def _generate_remote(self, job: _Job, greq: GenerateRequest, prefill: KVSource,
                               alternate=None) -> AsyncGenerator[StreamChunk, None]:
        """The prompt (P->D) and migration (D->D) flows: receive, count, land, stream; or, when the
        local-prefill rule takes a fresh prompt as the engine queues it, the engine's own chunks."""
        loop = asyncio.get_running_loop()
        job.gate = await self._groups.enter(greq, job.stop.event, self.transfer_timeout_s)
        def on_chunk(c: StreamChunk) -> None:
            loop.call_soon_threadsafe(job.chunks.put_nowait, c)

        if not job.resumed and self.local_prefill_threshold != 0:   # decided as the engine queues it
            self.handle.connector.rule(greq.rid, self._local_rule(greq, prefill.name))
        got: Landed | Failed | ComputeHere | None = None
        try:
            try:
                got = await self.receiver.receive(
                    greq, prefill, on_chunk=on_chunk,
                    stop=job.stop, check=lambda r: self._check(job, r), alternate=alternate)
            finally:
                job.here = isinstance(got, ComputeHere)
                self._count_path("local" if job.here else "remote")
            if isinstance(got, ComputeHere):     # the connector's rule prefills it here
                job.landed = True
                self._groups.open(greq, job.gate)
                async for c in self._chunks(job):
                    yield c
                return
            if isinstance(got, Failed):
                job.ended = True
                yield got.final or StreamChunk(greq.rid, (), "", "abort", len(greq.prompt_ids), error=got.error,
                                               prefill_died=got.redispatch)
                return
            job.landed = True
            self._received(job, greq, got)
            r = got.result
            if r.first_token is None:          # a resumed request (a fresh one's is checked)
                self.handle.land_resumed(greq.rid)
            else:
                self.handle.land(greq.rid, r.first_token, None if r.first_logprob is None else
                                 TokenLogprob(r.first_token, r.first_logprob, r.first_top_logprobs))
            async for c in self._stream(job, greq, r):
                yield c
        finally:
            if not job.ended and job.landed:
                self.handle.abort(greq.rid)

    def _received(self, job: _Job, greq: GenerateRequest, got: Landed) -> None:
        res, r = got.reservation, got.result
        self._wait.observe(got.receive_s)
        job.timings.update(reserve_s=got.reserve_s, prefill_s=r.prefill_s, transfer_s=r.transfer_s,
                           receive_s=got.receive_s, bytes=r.bytes, prefix_len=res.prefix_len, t2=time.monotonic())
        self.counts["ok"] += 1
        self.counts["kv_bytes_received"] += r.bytes
        if greq.resume is not None:
            self.counts["migrated_in"] += 1
            self.counts["migration_bytes"] += r.bytes
            self.counts["migration_reused_tokens"] += res.prefix_len
            self._mig_bytes.inc(r.bytes)
            self._mig_reused.inc(res.prefix_len)
        else:
            self._sent.add(got.source.name, greq.cache_key)
            self.prefill_costs.observe(len(greq.prompt_ids) - r.cached_tokens, r.prefill_s, got.receive_s)

    def _check(self, job: _Job, result: PrefillResult) -> str:
        if (result.first_token is None) != job.resumed:
            return (f"{job.rid} {'resumes' if job.resumed else 'is fresh'}, but prefill worker {result.worker} "
                    f"sent {'a' if result.first_token is not None else 'no'} first token")
        if job.logprobs and result.first_logprob is None:
            return (f"prefill worker {result.worker} sent no logprob for the first token of {job.rid}, "
                    f"which asked for logprobs")
        if len(result.prompt_logprobs) != job.prompt_logprobs:
            return (f"prefill worker {result.worker} sent {len(result.prompt_logprobs)} prompt logprobs "
                    f"for {job.rid}, which needs {job.prompt_logprobs}")
        return ""

    async def abort(self, rid: str, reason: str = "") -> bool:
        """Abort ``rid`` here; a transfer in progress is failed and prefill is told to abort."""
        job = self._jobs.get(rid)
        if job is None or job.landed:
            self.handle.abort(rid, error=reason or None)
            return job is not None
        job.stop.set(reason or f"request {rid} aborted")
        return True

    async def _stream(self, job: _Job, greq: GenerateRequest, result: PrefillResult) -> AsyncIterator[StreamChunk]:
        t2 = job.timings.pop("t2")
        while True:
            c = await job.chunks.get()
            if "activate_s" not in job.timings:
                job.timings["activate_s"] = time.monotonic() - t2
                self._groups.open(greq, job.gate)
                if c.finish_reason is None:
                    c = replace(c, prompt_tokens=len(greq.prompt_ids), cached_tokens=result.cached_tokens)
                if result.prompt_logprobs and c.token_ids:
                    c = replace(c, prompt_logprobs=result.prompt_logprobs)
            elif "first_decode_step_s" not in job.timings:
                job.timings["first_decode_step_s"] = time.monotonic() - t2 - job.timings["activate_s"]
            if c.finish_reason is not None:
                job.ended = True
                yield replace(c, cached_tokens=result.cached_tokens)
                return
            yield c

    async def _chunks(self, job: _Job) -> AsyncIterator[StreamChunk]:
        """A request computed here: its chunks as the engine made them."""
        while not job.ended:
            c = await job.chunks.get()
            job.ended = c.finish_reason is not None
            yield c

    def _count_failure(self, reason: str) -> None:
        if reason == "digest":
            self.counts["digest_failures"] += 1
            self._digest_failures.inc()
        key = "aborted" if reason == "aborted" else "failed"
        self.counts[key] += 1
        self._failures.labels(reason).inc()

    def _count_redispatch(self) -> None:
        self.counts["redispatched"] += 1
        self._redispatch.inc()

    def _extra_stats(self, snap) -> dict:
        c = self.prefill_costs
        return {"jobs": len(self._jobs), "cleanups": len(self.receiver.background) + len(self.push.tasks),
                "prefill_costs": {"per_token_s": c.per_token_s, "overhead_s": c.overhead_s,
                                  "samples": c.samples},
                "reserved": snap.detached, "last_timings": dict(self.last_timings)}

    async def drain(self, timeout_s: float = 10.0) -> None:
        """Wait (at most ``timeout_s``) for the background settles and pushes."""
        await self.receiver.drain(timeout_s)
        if self.push.tasks:
            await asyncio.wait(list(self.push.tasks), timeout=timeout_s)
