"""The in-process engine: model + pools + prefix cache + scheduler, driven by one thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import queue
import threading
import uuid
from collections.abc import AsyncGenerator, Callable, Iterator

import torch

from tandem.cache.allocator import PagedAllocator
from tandem.cache.kv_pool import KVPool
from tandem.cache.null import NullCache
from tandem.cache.tiers.factory import TierSite, build_tiers
from tandem.cache.req_to_token import ReqToTokenPool
from tandem.cache.unified import UnifiedRadixCache
from tandem.core.config import EngineConfig
from tandem.core.messages import GenerateRequest
from tandem.core.types import Completion, Req, SamplingParams, StreamChunk, check_token_ids
from tandem.engine.attention import make_attention_backend
from tandem.engine.commands import Abort, Command, Evict, Pause, Submit, Unpin
from tandem.engine.connector import KVConnector
from tandem.engine.cuda_graph import make_decode_graph
from tandem.engine.describe import components_clause
from tandem.engine.host_sizing import host_pool_tokens
from tandem.engine.hybrid import HybridConfig, make_hybrid
from tandem.engine.model_runner import ModelRunner
from tandem.engine.overlap import DeviceLane, Launched, resolve_overlap
from tandem.engine.queries import CheckInvariants, EngineSnapshot, PinReport, Query, Snapshot, Stats, answer
from tandem.engine.request_kv import RequestKV
from tandem.engine.sampler import Sampler
from tandem.engine.sched.scheduler import Scheduler
from tandem.engine.sched.spec.speculator import make_speculator
from tandem.engine.step_loop import StepLoop
from tandem.engine.verify_graph import make_verify_graph

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' -> bfloat16 on CUDA and on CPUs with native bf16, else float32 (engine/loader.py)."""
    from tandem.engine.loader import resolve_dtype as _resolve

    return _resolve(name, device)


class Engine(StepLoop):
    def __init__(self, config: EngineConfig | None = None, *, loaded=None,
                 hybrid: HybridConfig | None = None, kv_events=None, role: str = "colocated",
                 name: str | None = None, connector: Callable[["Engine"], KVConnector] | None = None):
        """``loaded``: a loaded model (else ``config.model``); ``hybrid``: hybrid pool sizes (default
        ``config.hybrid``); ``kv_events``: the prefix cache's publisher; ``role``: "colocated" |
        "prefill" | "decode" (its defaults); ``name``: the startup line's; ``connector(engine)``: its KVConnector."""
        self.role, self.name = role, name or role
        self._kv_events = kv_events
        from tandem.engine.loader import load_model

        self.config = cfg = config or EngineConfig()
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(cfg.num_threads or os.cpu_count() or 1)
        self.loaded = loaded or load_model(cfg.model, device=self.device, dtype=self.dtype,
                                           sliding_window=cfg.sliding_window,
                                           context_length=cfg.context_length, weights=cfg.weights)
        self.dtype = self.loaded.dtype
        from tandem.engine.loader import describe_dtype, describe_weights
        dtype_why = describe_dtype(cfg.dtype, self.device) if loaded is None else \
            str(self.dtype).removeprefix("torch.")
        self.numerics = f"dtype {dtype_why}; weights {describe_weights(self.loaded.model)}"
        arch = self.loaded.arch
        self.arch = arch
        self.tokenizer = self.loaded.tokenizer
        self.model_name = self.loaded.name
        self.max_context = cfg.context_length or arch.max_position
        cc = cfg.cache
        num_pages = cc.max_total_tokens // cc.page_size
        self.allocator = PagedAllocator(num_pages, cc.page_size)
        self.req_to_token = ReqToTokenPool(cc.max_running_requests, self.max_context, self.device)
        self.hybrid = make_hybrid(self.loaded, cc, cfg.scheduler.chunked_prefill_size,
                                  self.allocator, self.req_to_token, self.device, self.dtype,
                                  hybrid or cfg.hybrid)
        self.kv_pool = self.hybrid.kv_pool if self.hybrid.active else KVPool(
            num_pages * cc.page_size, cc.page_size, arch.num_layers, arch.num_kv_heads,
            arch.head_dim, self.dtype, self.device)
        backend = make_attention_backend(cfg.attention_backend, self.device)
        if self.device.type == "cpu":
            from tandem.core.onednn import describe as describe_isa
            self.numerics += f"; {describe_isa()}"
        self.numerics += f"; attention {backend.name}"
        self.cache = self._make_cache()
        self.runner = ModelRunner(self.loaded, self.kv_pool, self.req_to_token, self.allocator, backend)
        self.runner.decode_graph, graph_line = make_decode_graph(self.runner, cfg, hybrid=self.hybrid.active,
                                                                 role=role)
        if graph_line:
            self.startup_line = f"{getattr(self, 'startup_line', self.name)}; {graph_line}"
        self.kv = RequestKV(req_to_token_pool=self.req_to_token, allocator=self.allocator,
                            kv_pool=self.kv_pool, cache=self.cache, hybrid=self.hybrid,
                            device=self.device)
        sc = cfg.scheduler
        speculator, spec_line = make_speculator(cfg, self.loaded.arch, self.max_context)
        self.spec_status = spec_line
        self.runner.verify_graph, verify_line = make_verify_graph(self.runner, self.runner.decode_graph,
                                                                  speculator)
        if verify_line:
            self.startup_line += f"; {verify_line}"
        self.scheduler = Scheduler(
            kv=self.kv, tokenizer=self.tokenizer, max_context=self.max_context,
            chunked_prefill_size=sc.chunked_prefill_size, max_batch_tokens=sc.max_batch_tokens,
            schedule_policy=sc.schedule_policy if self.cache.retains else "fcfs",
            retraction_policy=sc.retraction_policy, debug_invariants=cc.debug_invariants,
            debug_retract_every=sc.debug_retract_every, grammar=self.grammar,
            connector=connector(self) if connector is not None else None, speculator=speculator)
        self.connector = self.scheduler.connector
        self.sampler = Sampler(cfg.seed, grammar=self.grammar)
        self.overlap = resolve_overlap(cfg.overlap_schedule, cfg.disable_overlap_schedule,
                                       self.device, self.hybrid.active)
        self._lane = DeviceLane(self.runner, self.device, cfg.seed) if self.overlap else None
        self._inflight: Launched | None = None
        self.startup_line += f"; overlap schedule {'on' if self.overlap else 'off'}"
        self.startup_line += f"; speculative {spec_line}"
        self._grammar = None
        self._grammar_lock = threading.Lock()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._callbacks: dict[str, Callable[[StreamChunk], None]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._error: BaseException | None = None
        self._step_started: float | None = None
        self._thread = threading.Thread(target=self._loop, name="tandem-engine", daemon=True)
        self._thread.start()

    def _make_cache(self):
        cc = self.config.cache
        h = self.hybrid
        if cc.disable_prefix_cache:
            n, why = 0, "off: the prefix cache is disabled"
        else:
            bpt = self.kv_pool.bytes_per_token + (h.swa_pool.bytes_per_token
                                                  if h.active and h.swa_pool is not None else 0)
            n, why = host_pool_tokens(cc.host_pool_tokens, self.role, self.allocator.size, bpt,
                                      cc.page_size)
        tiers = [] if cc.disable_prefix_cache else build_tiers(self.tier_site(), {
            "host": {"tokens": n, "write_policy": cc.host_write_policy} if n else None})
        host = next((t for t in tiers if t.name == "host"), None)
        self.host_pool_tokens = n
        mb = lambda t: t * self.kv_pool.bytes_per_token / 2**20   # noqa: E731
        self.startup_line = (f"{self.name}: {self.model_name} on {self.device} ({self.numerics}), device KV "
                             f"pool {self.allocator.size} tokens ({mb(self.allocator.size):.0f} MB), "
                             f"host KV pool {n} tokens ({mb(n):.0f} MB; {why}); "
                             + components_clause(h, h.full_pool if h.active else self.kv_pool,
                                                 self.allocator.size, cc.page_size, host))
        log.info("%s", self.startup_line)
        if cc.disable_prefix_cache:
            return NullCache(self.allocator, self.hybrid.components)
        return UnifiedRadixCache(cc, self.allocator, components=self.hybrid.components, tiers=tiers,
                                 events=self._kv_events)

    def tier_site(self) -> TierSite:
        """This engine's pools as the tier factory takes them (cache/tiers/factory.py)."""
        h = self.hybrid
        return TierSite(self.kv_pool, h.full_pool if h.active else self.kv_pool, self.model_name,
                        h.component_data(), tuple(c for c in h.components if c.name != "full"),
                        h.host_stores, self.config.cache)

    def grammar(self):
        """The engine's GrammarCompiler (thread-safe; built on first use: llguidance's tokenizer
        over this model's vocabulary and logits width)."""
        with self._grammar_lock:
            if self._grammar is None:
                from tandem.engine.grammar import GrammarCompiler
                self._grammar = GrammarCompiler(self.tokenizer, vocab_size=self.arch.vocab_size)
            return self._grammar

    async def check_constraint(self, params: SamplingParams) -> None:
        """Compile ``params.constraint`` (off the event loop and the engine thread; cached); raises
        InvalidRequest when it does not compile. A no-op without a constraint."""
        if params.constraint is not None:
            await asyncio.wrap_future(self.grammar().compile(params.constraint))

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped the engine thread, or None while it is healthy."""
        return self._error

    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                     chat: bool = False, rid: str | None = None,
                     session_id: str | None = None) -> GenerateRequest:
        if isinstance(prompt, str):
            text = prompt
            if chat:
                text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            ids = self.tokenizer.encode(text, add_special_tokens=not chat)
        else:
            ids = list(prompt)
        return GenerateRequest(rid or f"req-{uuid.uuid4().hex[:12]}", tuple(ids),
                               params or SamplingParams(), session_id)

    def submit(self, greq: GenerateRequest, on_chunk: Callable[[StreamChunk], None]) -> None:
        if self._error is not None:
            raise RuntimeError(f"engine thread died: {self._error!r}")
        req = Req(list(greq.prompt_ids), greq.params, rid=greq.rid, session_id=greq.session_id,
                  cache_salt=greq.cache_salt, trace=greq.trace, tenant=greq.tenant, pins=greq.pins,
                  pin_cap=greq.pin_cap)
        if greq.resume is not None:
            req.output_ids = list(greq.resume.output_ids)
        check_token_ids(itertools.chain(req.prompt_ids, req.output_ids), self.arch.vocab_size)
        self.scheduler.validate(req)
        self.send(Submit(req, on_chunk, greq.group, greq.resume))

    def abort(self, rid: str, error: str | None = None) -> None:
        self.send(Abort(rid, error))

    def send(self, command: Command) -> None:
        """Queue ``command`` for the engine thread (the next drain, before the next step)."""
        self._inbox.put(command)
        self._wake.set()

    async def stream(self, greq: GenerateRequest) -> AsyncGenerator[StreamChunk, None]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[StreamChunk] = asyncio.Queue()
        await self.check_constraint(greq.params)
        self.submit(greq, lambda c: loop.call_soon_threadsafe(q.put_nowait, c))
        finished = False
        try:
            while not finished:
                chunk = await q.get()
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            if not finished:
                self.abort(greq.rid)

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                 chat: bool = False, rid: str | None = None, session_id: str | None = None,
                 timeout: float | None = None) -> Completion:
        return self.generate_many([self.make_request(prompt, params, chat=chat, rid=rid,
                                                     session_id=session_id)], timeout=timeout)[0]

    def generate_many(self, greqs: list[GenerateRequest], timeout: float | None = None) -> list[Completion]:
        done = threading.Event()
        chunks: dict[str, list[StreamChunk]] = {g.rid: [] for g in greqs}
        left = [len(greqs)]
        lock = threading.Lock()

        def on_chunk(c: StreamChunk) -> None:
            with lock:
                chunks[c.rid].append(c)
                if c.finish_reason is not None:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

        for g in greqs:
            self.submit(g, on_chunk)
        if not done.wait(timeout):
            for g in greqs:
                self.abort(g.rid, error="timed out")
            done.wait(10)
        out = []
        for g in greqs:
            cs = chunks[g.rid] or [StreamChunk(g.rid, (), "", "abort", error="no response from the engine")]
            last = cs[-1]
            out.append(Completion(g.rid, "".join(c.text for c in cs),
                                  [t for c in cs for t in c.token_ids], last.prompt_tokens,
                                  last.cached_tokens, last.finish_reason, last.error))
        return out

    def query(self, q: Query) -> concurrent.futures.Future:
        """``q.future``, answered on the engine thread between steps (engine/queries.py)."""
        if self._error is not None or not self._thread.is_alive():
            q.future.set_exception(RuntimeError(f"engine thread is not running: {self._error!r}"))
            return q.future
        self.send(q)
        return q.future

    def unpin(self, prefix_hash: str, tenant: str | None = None) -> concurrent.futures.Future:
        """A Future of the tokens unpinned: the pins of the prefix ``prefix_hash`` names
        (``cache.pins()``'s hash; only ``tenant``'s when given) end now."""
        cmd = Unpin(prefix_hash, tenant)
        self.send(cmd)
        return cmd.future

    def evict(self, tokens: int) -> concurrent.futures.Future:
        """A Future of the device tokens evicted from unlocked cache (up to ``tokens``)."""
        cmd = Evict(tokens)
        self.send(cmd)
        return cmd.future

    def handle(self):
        """The typed, async way a worker reaches this engine (engine/handle.py)."""
        from tandem.engine.handle import EngineHandle
        return EngineHandle(self)

    def snapshot(self, timeout: float = 30.0) -> EngineSnapshot:
        """Blocking: the engine's accounting (tests, CLI), read on the engine thread."""
        return self._ask(Snapshot(), timeout)

    def pins(self, timeout: float = 30.0) -> dict:
        """Blocking: the cache's pins (engine/queries.py ``PinReport``), read on the engine thread."""
        return self._ask(PinReport(), timeout)

    def stats(self, timeout: float = 30.0) -> dict:
        """Blocking: a copy of the scheduler's counters, read on the engine thread."""
        return self._ask(Stats(), timeout)

    def check_invariants(self, timeout: float = 30.0) -> None:
        """Blocking: the ownership recount on the engine thread (raises AssertionError)."""
        self._ask(CheckInvariants(), timeout)

    def _ask(self, q: Query, timeout: float):
        """``q``'s answer: on the engine thread, or directly once that thread has stopped cleanly."""
        if not self._thread.is_alive() and self._error is None:
            return answer(self, q)
        return self.query(q).result(timeout)

    @contextlib.contextmanager
    def paused_for_tests(self, timeout_s: float = 30.0) -> Iterator[None]:
        """Test-only: the engine thread waits between steps (inbox drained, no step in flight)
        while the ``with`` body reads private structures (the tree, the pools) from the calling
        thread; it goes on at the block's end, or after ``timeout_s``. The product never pauses."""
        cmd = Pause(threading.Event(), timeout_s)
        self.send(cmd)
        cmd.future.result(timeout_s)
        try:
            yield
        finally:
            cmd.resume.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        with self._grammar_lock:
            if self._grammar is not None:
                self._grammar.shutdown()
            self._grammar = None
        self.sampler.close()
        if self._lane is not None:
            self._lane.close()
        for tier in self.kv.cache.tiers:
            tier.close()
