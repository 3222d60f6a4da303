"""CUDA-graph decode: a pure-decode step replays a captured graph instead of launching every
kernel of every layer from Python (one replay per step, not one launch per kernel)."""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from dataclasses import dataclass

import torch

from tandem.engine.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

FIELDS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "prefix_lens",
          "extend_lens", "extend_starts")
FILLED = 6
PAD_SLOT = 0
PAD_ROW = 0


def capture_sizes(max_bs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to 128, every 16 up to 256, every 32
    beyond, and ``max_bs`` itself (the last)."""
    if max_bs < 1:
        raise ValueError(f"max_bs={max_bs} must be >= 1")
    sizes = [s for s in (1, 2, 4) if s < max_bs]
    s = 8
    while s < max_bs:
        sizes.append(s)
        s += 8 if s < 128 else 16 if s < 256 else 32
    sizes.append(max_bs)
    return sizes


def padded_size(batch_size: int, sizes: list[int]) -> int | None:
    """The smallest of ``sizes`` (ascending) >= ``batch_size``, or None when none is."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class GraphChoice:
    """``size``: the captured batch size to replay, or None (eager); ``reason`` says why."""

    size: int | None
    reason: str


def choose(fb: ForwardBatch, sizes: list[int], return_all_logits: bool = False) -> GraphChoice:
    """Graph or eager for one step (pure: reads the batch's host-side lists only)."""
    if return_all_logits:
        return GraphChoice(None, "all logits")
    if not fb.is_decode:
        return GraphChoice(None, "prefill or mixed step")
    if fb.state_indices is not None:
        return GraphChoice(None, "recurrent state")
    size = padded_size(fb.batch_size, sizes)
    if size is None:
        return GraphChoice(None, f"batch {fb.batch_size} > {sizes[-1]} captured")
    return GraphChoice(size, "replay")


class DecodeBuffers:
    """The static inputs every capture and replay reads: ``data: [8, max_bs]`` int64 on the device
    (rows named by :data:`FIELDS`), written in place by :meth:`fill`."""

    def __init__(self, max_bs: int, device: torch.device | str):
        pad = torch.zeros((len(FIELDS), max_bs), dtype=torch.int64)
        pad[FIELDS.index("out_cache_loc")] = PAD_SLOT
        pad[FIELDS.index("req_pool_indices")] = PAD_ROW
        pad[FIELDS.index("seq_lens")] = 1
        pad[FIELDS.index("extend_lens")] = 1
        pad[FIELDS.index("extend_starts")] = torch.arange(max_bs)
        self.max_bs = max_bs
        self.pad = pad.to(device)                  # [8, max_bs] padding template
        self.data = self.pad.clone()               # [8, max_bs] the static buffers

    def fill(self, fb: ForwardBatch, size: int) -> None:
        """Columns ``0 .."""
        B = fb.batch_size
        if not B <= size <= self.max_bs:
            raise ValueError(f"batch {B} does not fit captured size {size} (max {self.max_bs})")
        src = torch.stack([getattr(fb, f) for f in FIELDS[:FILLED]])      # [6, B]
        self.data[:FILLED, :B].copy_(src)
        if size > B:
            self.data[:FILLED, B:size].copy_(self.pad[:FILLED, B:size])

    def batch(self, size: int, req_to_token: torch.Tensor, kv_pool, seq_lens_cpu: list[int]) -> ForwardBatch:
        """A ForwardBatch over columns ``0 .. size-1`` (the same storage every time)."""
        if len(seq_lens_cpu) != size:
            raise ValueError(f"{len(seq_lens_cpu)} host seq_lens for a batch of {size}")
        cols = {f: self.data[i, :size] for i, f in enumerate(FIELDS)}
        return ForwardBatch(**cols, req_to_token=req_to_token, kv_pool=kv_pool,
                            seq_lens_cpu=list(seq_lens_cpu),
                            prefix_lens_cpu=[n - 1 for n in seq_lens_cpu], extend_lens_cpu=[1] * size)


class DecodeGraphRunner:
    """Pure-decode steps of a ModelRunner through captured graphs (``mode="cuda"``) or their eager
    stand-in (``mode="standin"``: the same fill / pad / slice, no graph)."""

    def __init__(self, runner, sizes: list[int], *, mode: str):
        if mode not in ("cuda", "standin"):
            raise ValueError(f"mode={mode!r}: expected 'cuda' or 'standin'")
        if not sizes or sorted(set(sizes)) != list(sizes):
            raise ValueError(f"capture sizes {sizes} must be ascending and distinct")
        self.runner = runner
        self.mode = mode
        self.sizes = list(sizes)
        self.buffers = DecodeBuffers(self.sizes[-1], runner.device)
        self.stats: Counter = Counter()
        self._graphs: dict[int, tuple] = {}
        self.capture_seconds = 0.0
        self.pool = None                           # the graphs' memory pool (a verify graph shares it)
        if mode == "cuda":
            self._capture_all()

    def size_for(self, fb: ForwardBatch, return_all_logits: bool = False) -> int | None:
        """The captured size to replay ``fb`` with, or None (eager); counts the decision."""
        c = choose(fb, self.sizes, return_all_logits)
        if c.size is not None and (fb.req_to_token is not self.runner.req_to_token_pool.req_to_token
                                   or fb.kv_pool is not self.runner.kv_pool):
            c = GraphChoice(None, "other pools")
        self.stats["replay" if c.size is not None else f"eager: {c.reason}"] += 1
        return c.size

    def run(self, fb: ForwardBatch, size: int) -> torch.Tensor:
        """Logits ``[B, V]`` (float32) of the decode step ``fb`` through captured size ``size``."""
        B = fb.batch_size
        self.buffers.fill(fb, size)
        if self.mode == "cuda":
            graph, logits, _ = self._graphs[size]
            graph.replay()
            return logits[:B]
        r = self.runner
        static = self.buffers.batch(size, r.req_to_token_pool.req_to_token, r.kv_pool,
                                    fb.seq_lens_cpu + [1] * (size - B))
        r.backend.init_forward(static)
        return r.model.forward(static, r.backend)[:B]

    def summary(self) -> str:
        """The startup line."""
        if self.mode == "cuda":
            return (f"cuda graph: captured decode batch sizes {_ranges(self.sizes)} in "
                    f"{self.capture_seconds:.2f} s (--disable-cuda-graph turns it off)")
        return f"cuda graph stand-in (eager, no capture): decode batch sizes {_ranges(self.sizes)}"

    @torch.inference_mode()
    def _capture_all(self) -> None:
        r = self.runner
        t0 = time.perf_counter()
        self._sync()
        pool = None
        r2t = r.req_to_token_pool.req_to_token
        for size in reversed(self.sizes):
            self.buffers.data.copy_(self.buffers.pad)
            fb = self.buffers.batch(size, r2t, r.kv_pool, [1] * size)
            r.backend.init_forward(fb)
            graph, logits = self._capture_one(lambda fb=fb: r.model.forward(fb, r.backend), pool)
            pool = graph.pool()
            self._graphs[size] = (graph, logits, fb)
        self.pool = pool
        self._sync()
        self.capture_seconds = time.perf_counter() - t0

    def _sync(self) -> None:
        torch.cuda.synchronize(self.runner.device)

    def _capture_one(self, forward, pool):
        return capture_graph(self.runner.device, forward, pool)


def capture_graph(dev: torch.device, forward, pool):
    """``(graph, out)``: ``forward()`` run twice on a side stream (warm-up: triton compiles, the
    allocator settles), then captured into ``pool`` (None: a new one); ``out`` is what the capture
    returned, rewritten by every replay."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out


def _ranges(sizes: list[int]) -> str:
    return ",".join(map(str, sizes))


def make_decode_graph(runner, config, *, hybrid: bool, role: str = "colocated"
                      ) -> tuple[DecodeGraphRunner | None, str | None]:
    """The engine's graph runner, or None where graphs do not apply, and its clause of the startup
    line (captured sizes and time, or why none; None on the CPU)."""
    if runner.device.type != "cuda":
        return None, None
    why = None
    if config.disable_cuda_graph:
        why = "--disable-cuda-graph"
    elif role == "prefill":
        why = "prefill engines do not decode"
    elif not getattr(runner.backend, "capturable", False):
        why = f"{type(runner.backend).__name__} is not capturable"
    elif hybrid:
        why = "hybrid model (SWA / recurrent pools)"
    if why is not None:
        return None, f"cuda graph: off ({why})"
    max_bs = min(config.cuda_graph_max_bs or config.cache.max_running_requests,
                 config.cache.max_running_requests)
    g = DecodeGraphRunner(runner, capture_sizes(max_bs), mode="cuda")
    log.info("%s", g.summary())
    return g, g.summary()
