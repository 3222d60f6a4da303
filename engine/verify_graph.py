"""CUDA-graph verify steps: a speculative verify step (engine/sched/spec/) replays a graph captured for
its (batch size, width), every request padded to ``width`` query tokens, instead of launching every
kernel of every layer from Python (engine/README.md, "CUDA graphs")."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import torch

from tandem.engine.cuda_graph import PAD_ROW, PAD_SLOT, capture_graph, capture_sizes, padded_size
from tandem.engine.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

VERIFY_MAX_BS = 32        # the largest batch captured: a graph holds its size x width rows of
                          # float32 logits, and a wider step's kernels outlast their launches
TOKEN_FIELDS = ("input_ids", "positions", "out_cache_loc")
REQ_FIELDS = ("req_pool_indices", "seq_lens", "prefix_lens")


def verify_widths(max_draft: int) -> list[int]:
    """Query tokens per request to capture: ``1 + k`` for k = 1, 2, 4, ... below ``max_draft``, then
    ``1 + max_draft`` (8 draft tokens: 2, 3, 5, 9). A step pads to the smallest width >= its widest
    request, so padding adds fewer draft positions than the widest request drafts, with
    1 + log2(max_draft) graphs per batch size."""
    if max_draft < 1:
        raise ValueError(f"max_draft={max_draft} must be >= 1")
    widths, k = [], 1
    while k < max_draft:
        widths.append(1 + k)
        k *= 2
    return widths + [1 + max_draft]


def verify_sizes(max_bs: int) -> list[int]:
    """Batch sizes to capture: the decode graph's (``capture_sizes``) up to VERIFY_MAX_BS."""
    return capture_sizes(min(max_bs, VERIFY_MAX_BS))


@dataclass(frozen=True)
class VerifyChoice:
    """``size`` x ``width``: the captured shape to replay, or None (eager); ``reason`` says why."""

    size: int | None
    width: int | None
    reason: str


def choose_verify(fb: ForwardBatch, sizes: list[int], widths: list[int], max_context: int,
                  return_all_logits: bool = False) -> VerifyChoice:
    """Graph or eager for a verify step (``fb.logit_rows`` set; pure: reads host-side lists and
    shapes only). A verify step samples every token (engine/sched/spec/speculator.py ``logit_layout``):
    fewer logit rows than tokens means a prefill chunk rides along."""
    eager = lambda why: VerifyChoice(None, None, why)   # noqa: E731
    if return_all_logits:
        return eager("all logits")
    if fb.logit_rows is None:
        return eager("not a verify step")
    if fb.state_indices is not None:
        return eager("recurrent state")
    if fb.logit_rows.shape[0] != fb.num_tokens:
        return eager("prefill chunk")
    n = max(fb.extend_lens_cpu)
    width = padded_size(n, widths)
    if width is None:
        return eager(f"width {n} > {widths[-1]} captured")
    size = padded_size(fb.batch_size, sizes)
    if size is None:
        return eager(f"batch {fb.batch_size} > {sizes[-1]} captured")
    if max(fb.prefix_lens_cpu) + width > max_context:
        return eager("context end")
    return VerifyChoice(size, width, "replay")


class VerifyBuffers:
    """The static inputs every capture and replay reads, int64 on the device, written in place by
    :meth:`fill`: ``tok: [3, max_bs * max_w]`` (rows :data:`TOKEN_FIELDS`, request ``b``'s token
    ``j`` at column ``b * w + j``), ``req: [3, max_bs]`` (rows :data:`REQ_FIELDS`), ``rows:
    [max_bs * max_w]`` (the logit rows); per width ``w`` the constants ``const[w]: [5, max_bs]``
    (``extend_lens`` = w, ``extend_starts`` = b * w, then a padding request's ``REQ_FIELDS``)."""

    def __init__(self, max_bs: int, widths: list[int], device: torch.device | str):
        n = max_bs * widths[-1]
        tok = torch.zeros((len(TOKEN_FIELDS), n), dtype=torch.int64)
        tok[TOKEN_FIELDS.index("out_cache_loc")] = PAD_SLOT
        b = torch.arange(max_bs)
        self.max_bs = max_bs
        self.tok_pad = tok.to(device)             # padding tokens: id 0, position 0, into PAD_SLOT
        self.tok = self.tok_pad.clone()
        self.req = torch.zeros((len(REQ_FIELDS), max_bs), dtype=torch.int64, device=device)
        self.rows = torch.zeros(n, dtype=torch.int64, device=device)
        self.const = {w: torch.stack([torch.full_like(b, w), b * w, torch.full_like(b, PAD_ROW),
                                      torch.full_like(b, w), torch.zeros_like(b)]).to(device)
                      for w in widths}
        self._iota = torch.arange(n, device=device)

    def fill(self, fb: ForwardBatch, size: int, w: int) -> None:
        """Write ``fb`` (B requests of at most ``w`` tokens each) padded to ``size`` x ``w``: each
        request's tokens first, then padding tokens (after the real ones, so causal attention keeps
        them out of every real row); requests ``B .. size-1`` are all padding. No host sync."""
        B, T, rows = fb.batch_size, fb.num_tokens, fb.logit_rows
        if rows is None:
            raise ValueError("a verify step needs its logit_rows")
        if not B <= size <= self.max_bs or w not in self.const or max(fb.extend_lens_cpu) > w:
            raise ValueError(f"batch {B} of widths up to {max(fb.extend_lens_cpu)} does not fit "
                             f"captured shape {size} x {w} (max batch {self.max_bs}, widths {sorted(self.const)})")
        Tp, c = size * w, self.const[w]
        owner = torch.repeat_interleave(self._iota[:B], fb.extend_lens, output_size=T)        # [T]
        dst = owner * w + self._iota[:T] - fb.extend_starts[owner]      # [T] padded column of each token
        tok = self.tok[:, :Tp]
        tok.copy_(self.tok_pad[:, :Tp])
        tok.index_copy_(1, dst, torch.stack([getattr(fb, f) for f in TOKEN_FIELDS]))
        self.req[:, :B].copy_(torch.stack([fb.req_pool_indices, fb.prefix_lens + w, fb.prefix_lens]))
        self.req[:, B:size].copy_(c[2:, B:size])
        R = rows.shape[0]
        self.rows[:R].copy_(dst[rows])
        self.rows[R:Tp].zero_()

    def fill_padding(self, size: int, w: int) -> None:
        """Every request padding (what a capture runs)."""
        Tp = size * w
        self.tok[:, :Tp].copy_(self.tok_pad[:, :Tp])
        self.req[:, :size].copy_(self.const[w][2:, :size])
        self.rows[:Tp].copy_(self._iota[:Tp])

    def batch(self, size: int, w: int, req_to_token: torch.Tensor, kv_pool,
              prefix_lens_cpu: list[int]) -> ForwardBatch:
        """A ForwardBatch over the first ``size`` requests of ``w`` tokens (the same storage every
        time); its ``logit_rows`` are all ``size * w``: the caller slices the first R."""
        if len(prefix_lens_cpu) != size:
            raise ValueError(f"{len(prefix_lens_cpu)} host prefix lens for a batch of {size}")
        Tp, c = size * w, self.const[w]
        tok, req = self.tok[:, :Tp], self.req[:, :size]             # rows: TOKEN_FIELDS, REQ_FIELDS
        return ForwardBatch(input_ids=tok[0], positions=tok[1], out_cache_loc=tok[2],
                            req_pool_indices=req[0], seq_lens=req[1], prefix_lens=req[2],
                            extend_lens=c[0, :size], extend_starts=c[1, :size],
                            req_to_token=req_to_token, kv_pool=kv_pool,
                            seq_lens_cpu=[p + w for p in prefix_lens_cpu],
                            prefix_lens_cpu=list(prefix_lens_cpu), extend_lens_cpu=[w] * size,
                            logit_rows=self.rows[:Tp])


class VerifyGraphRunner:
    """Verify steps of a ModelRunner through graphs captured per (batch size, width)
    (``mode="cuda"``) or their eager stand-in (``mode="standin"``: the same fill / pad / slice, no
    graph).

    Fixed per captured shape (size x w): the batch (``size``), the tokens (``size * w``), every
    extend length (``w``, so the triton extend kernel's grid and ``max_extend_len``), each
    request's first token's column (``b * w``) and the logit rows' count; the backend's
    ``init_forward`` metadata is the capture's. Read from device buffers at replay: token ids,
    positions, KV slots, request rows, prefix and sequence lengths, which rows are sampled, so one
    graph serves any prefix lengths (the extend kernel loops over the prefix it loads)."""

    def __init__(self, runner, sizes: list[int], widths: list[int], *, mode: str, pool=None):
        if mode not in ("cuda", "standin"):
            raise ValueError(f"mode={mode!r}: expected 'cuda' or 'standin'")
        for name, xs in (("batch sizes", sizes), ("widths", widths)):
            if not xs or sorted(set(xs)) != list(xs):
                raise ValueError(f"verify {name} {xs} must be ascending and distinct")
        if widths[0] < 2:
            raise ValueError(f"verify widths {widths} must be >= 2 (width 1 is a decode)")
        self.runner = runner
        self.mode = mode
        self.sizes, self.widths = list(sizes), list(widths)
        self.buffers = VerifyBuffers(self.sizes[-1], self.widths, runner.device)
        self.max_context = int(runner.req_to_token_pool.req_to_token.shape[1])
        self.stats: Counter = Counter()
        self.tokens: Counter = Counter()         # "real" tokens replayed and "run" (padded) ones
        self._graphs: dict[tuple[int, int], tuple] = {}
        self.capture_seconds = 0.0
        self.pool = pool
        if mode == "cuda":
            self._capture_all()

    def shape_for(self, fb: ForwardBatch, return_all_logits: bool = False) -> tuple[int, int] | None:
        """The captured ``(size, width)`` to replay the verify step ``fb`` with, or None (eager);
        counts the decision."""
        c = choose_verify(fb, self.sizes, self.widths, self.max_context, return_all_logits)
        if c.size is not None and (fb.req_to_token is not self.runner.req_to_token_pool.req_to_token
                                   or fb.kv_pool is not self.runner.kv_pool):
            c = VerifyChoice(None, None, "other pools")
        self.stats["replay" if c.size is not None else f"eager: {c.reason}"] += 1
        if c.size is None or c.width is None:
            return None
        self.tokens["real"] += fb.num_tokens
        self.tokens["run"] += c.size * c.width
        return c.size, c.width

    def run(self, fb: ForwardBatch, shape: tuple[int, int]) -> torch.Tensor:
        """Logits ``[R, V]`` (float32) at ``fb.logit_rows`` of the verify step ``fb`` through the
        captured ``shape``."""
        size, w = shape
        self.buffers.fill(fb, size, w)
        R = fb.num_tokens if fb.logit_rows is None else fb.logit_rows.shape[0]
        if self.mode == "cuda":
            graph, logits, _ = self._graphs[shape]
            graph.replay()
            return logits[:R]
        r = self.runner
        static = self.buffers.batch(size, w, r.req_to_token_pool.req_to_token, r.kv_pool,
                                    fb.prefix_lens_cpu + [0] * (size - fb.batch_size))
        r.backend.init_forward(static)
        return r.model.forward(static, r.backend)[:R]

    def summary(self) -> str:
        """The startup line's clause."""
        what = (f"verify widths {','.join(map(str, self.widths))} x batch sizes "
                f"{','.join(map(str, self.sizes))}")
        if self.mode == "cuda":
            return f"cuda graph: captured {what} in {self.capture_seconds:.2f} s"
        return f"cuda graph stand-in (eager, no capture): {what}"

    @torch.inference_mode()
    def _capture_all(self) -> None:
        r = self.runner
        t0 = time.perf_counter()
        self._sync()
        r2t = r.req_to_token_pool.req_to_token
        for w in reversed(self.widths):           # the largest first: later ones reuse its memory
            for size in reversed(self.sizes):
                self.buffers.fill_padding(size, w)
                fb = self.buffers.batch(size, w, r2t, r.kv_pool, [0] * size)
                r.backend.init_forward(fb)
                graph, logits = self._capture_one(lambda fb=fb: r.model.forward(fb, r.backend), self.pool)
                self.pool = graph.pool()
                self._graphs[(size, w)] = (graph, logits, fb)
        self._sync()
        self.capture_seconds = time.perf_counter() - t0

    def _sync(self) -> None:
        torch.cuda.synchronize(self.runner.device)

    def _capture_one(self, forward, pool):
        return capture_graph(self.runner.device, forward, pool)


def make_verify_graph(runner, decode_graph, speculator) -> tuple[VerifyGraphRunner | None, str | None]:
    """The engine's verify graph runner where a decode graph was captured (the same conditions:
    CUDA, graphs on, a capturable backend, no hybrid pools, not a prefill engine) and speculation
    is on, and its clause of the startup line; else (None, None): the decode graph's clause says
    why."""
    if decode_graph is None or speculator is None or decode_graph.mode != "cuda":
        return None, None
    g = VerifyGraphRunner(runner, verify_sizes(decode_graph.sizes[-1]), verify_widths(speculator.max_draft),
                          mode="cuda", pool=decode_graph.pool)
    log.info("%s", g.summary())
    return g, g.summary()
