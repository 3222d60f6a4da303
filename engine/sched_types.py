"""The scheduler's own request record and the plan of one step.

A :class:`SchedReq` lives from ``Scheduler.add`` to the request's finish; it survives
retraction (its :class:`OutputTracker` knows how much text was already streamed). A
:class:`StepPlan` is what ``Scheduler.schedule()`` decides and the engine loop executes: which
requests extend by how many tokens into which slots, plus requests finished without running.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tandem.core.messages import SampleGroup
from tandem.core.types import Req, StreamChunk, TokenLogprob
from tandem.engine.output import OutputTracker

if TYPE_CHECKING:
    from tandem.cache.tiers.base import Prefetch
    from tandem.engine.grammar import Matcher


@dataclass(eq=False)
class SchedReq:
    """One request inside the scheduler. ``req.req_pool_idx`` is its row while it holds KV.

    Token ranges of the row (positions of ``req.all_ids``)::

        0              locked_len           computed_len              seq_len
        |--- tree-owned ---|--- request-owned ---|--- no KV yet ---------|
         a locked cache      slots this request    the next tokens to compute
         prefix (shared,     alone owns (freed     (during decode: the last
         owned by the tree)  or handed to the      sampled token, so
                             cache at release)     computed_len == seq_len - 1)

    ``locked_len`` is page-aligned and ``== len(slots the cache returned)`` after every hand-over
    (0 with a null cache: the request then owns its whole row). The cache handle locked for the
    tree-owned range is ``req.last_node``.

    Constrained decoding: ``grammar`` is the compile in flight (a Future of a CompiledGrammar,
    set at ``Scheduler.add`` when the request has a constraint); ``matcher`` is the request's
    grammar state, made once that future is done (at admission; a decode worker's ``resume``).
    The matcher has accepted exactly ``req.output_ids``, so it survives retraction unchanged.
    ``group``: the OpenAI ``n`` group the request samples for (core.messages.SampleGroup).
    ``receive``: a peer writes its prompt's KV (the role's KVConnector said so at ``add``),
    until it is activated (a retracted request is then recomputed here like any other).
    ``prefetches``: the tiers' read-ahead of its prefix in flight, by tier name (set at
    ``Scheduler.add``, engine/request_kv.py ``prefetch``; each stopped by its admission when the
    walk reaches its tier, and cleared).

    Overlap scheduling (engine/overlap.py) plans a step before the previous one's tokens are
    back: ``inflight`` counts the planned steps that include the request and were not applied
    yet (``Scheduler.advance`` adds one, ``Scheduler.apply`` takes it back); ``ahead`` counts the
    tokens those steps sample for it, which are not in ``req.output_ids`` yet (so its next
    decode's input token lives on the device). Both are 0 between steps of the plain loop.
    ``prompt_logprobs``: the prompt tokens' logprobs computed so far (the request asked for them:
    engine/logprobs.py ``take_prompt_logprobs``), sent with the first token's chunk.
    """

    req: Req
    tracker: OutputTracker
    locked_len: int = 0
    grammar: Future | None = None
    matcher: Matcher | None = None
    group: SampleGroup | None = None
    receive: bool = False
    prefetches: dict[str, Prefetch] | None = None
    inflight: int = 0
    ahead: int = 0
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def rid(self) -> str:
        return self.req.rid


@dataclass(frozen=True)
class PlanEntry:
    """``sr`` extends its KV from position ``start`` (its ``computed_len`` when planned) by ``n``
    tokens into ``slots`` ``[n]``; ``samples``: that reaches ``seq_len`` (plus the tokens still
    in flight, ``sr.ahead``), so its last position's logits pick the next token."""

    sr: SchedReq
    n: int
    slots: torch.Tensor
    samples: bool
    start: int = 0


@dataclass
class StepPlan:
    """One step: ``entries`` run in one forward (mixed prefill chunks and decodes);
    ``chunks`` are what planning itself streams, before the forward: requests the scheduler
    ended without running them (e.g. no KV room ever, a grammar that failed to compile).
    Entries that sample are ``sampling`` (in entry order)."""

    entries: list[PlanEntry] = field(default_factory=list)
    chunks: list[StreamChunk] = field(default_factory=list)

    def add(self, sr: SchedReq, n: int, slots: torch.Tensor) -> None:
        r = sr.req
        self.entries.append(PlanEntry(sr, n, slots, r.computed_len + n == r.seq_len + sr.ahead,
                                      r.computed_len))

    def holds(self, sr: SchedReq) -> bool:
        return any(e.sr is sr for e in self.entries)

    @property
    def sampling(self) -> list[PlanEntry]:
        return [e for e in self.entries if e.samples]

    @property
    def sample_rows(self) -> list[int]:
        """Indices into the forward's ``[B, V]`` logits of the sampling entries."""
        return [i for i, e in enumerate(self.entries) if e.samples]


def new_stats() -> dict:
    """The scheduler's counters (shared with RequestKV and Retraction), all zero."""
    return {"steps": 0, "retractions": 0, "prompt_tokens": 0, "cached_tokens": 0,
            "prompt_tokens_computed": 0, "generated_tokens": 0, "evicted_tokens": 0,
            "retraction_restores": 0, "retraction_recomputes": 0, "retraction_aborts": 0,
            "backup_tokens": 0, "backup_seconds": 0.0, "restore_tokens": 0, "restore_seconds": 0.0}


class SchedulerObserver:
    """A test- and bench-facing view of scheduler decisions: append one to
    ``Scheduler.observers`` (empty by default, so nothing is called in serving). Called on the
    engine thread, before the decision takes effect; must not change the scheduler."""

    def admitted(self, sr: SchedReq) -> None:
        """``sr`` took a row (a first admission, a restore after retraction, or a reservation)."""

    def unadmitted(self, sr: SchedReq) -> None:
        """The admission of ``sr`` this step was undone (no slots after all)."""

    def retracted(self, sr: SchedReq) -> None:
        """``sr`` is about to be retracted (backed up to the host, or dropped to recompute)."""
