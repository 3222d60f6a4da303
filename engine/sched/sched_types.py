"""The scheduler's own request record and the plan of one step."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tandem.core.messages import SampleGroup
from tandem.core.types import Req, StreamChunk, TokenLogprob
from tandem.engine.sched.output import OutputTracker

if TYPE_CHECKING:
    from tandem.cache.tiers.base import Prefetch
    from tandem.engine.grammar import Matcher
    from tandem.engine.sched.spec.speculator import DraftState


@dataclass(eq=False)
class SchedReq:
    """One request inside the scheduler."""

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
    spec: DraftState | None = None      # its n-gram index and acceptance (engine/sched/spec/)

    @property
    def rid(self) -> str:
        return self.req.rid


@dataclass(frozen=True)
class PlanEntry:
    """``sr`` extends its KV from position ``start`` (its ``computed_len`` when planned) by ``n``
    tokens into ``slots`` ``[n]``; ``samples``: that reaches ``seq_len`` (plus the tokens still in
    flight, ``sr.ahead``), so its last position's logits pick the next token. A verify step
    (engine/sched/spec/): ``draft`` holds the last ``k = len(draft)`` of the ``n`` input tokens, guessed
    tokens after the pending one; each of the ``k + 1`` positions' logits picks a token.

        position:  start        start+1 .. start+k
        input:     pending tok  draft[0] .. draft[k-1]
    """

    sr: SchedReq
    n: int
    slots: torch.Tensor
    samples: bool
    start: int = 0
    draft: tuple[int, ...] = ()


@dataclass
class StepPlan:
    """One step: ``entries`` run in one forward (mixed prefill chunks and decodes); ``chunks`` are
    what planning itself streams, before the forward: requests the scheduler ended without running
    them (e.g. no KV room ever, a grammar that failed to compile)."""

    entries: list[PlanEntry] = field(default_factory=list)
    chunks: list[StreamChunk] = field(default_factory=list)

    def add(self, sr: SchedReq, n: int, slots: torch.Tensor, draft: tuple[int, ...] = ()) -> None:
        r = sr.req
        self.entries.append(PlanEntry(sr, n, slots, r.computed_len + n - len(draft) == r.seq_len + sr.ahead,
                                      r.computed_len, draft))

    def holds(self, sr: SchedReq) -> bool:
        return any(e.sr is sr for e in self.entries)

    @property
    def sampling(self) -> list[PlanEntry]:
        return [e for e in self.entries if e.samples]

    @property
    def drafts(self) -> bool:
        """Some entry verifies a draft (its forward needs the logits of every draft position)."""
        return any(e.draft for e in self.entries)

    @property
    def sample_rows(self) -> list[int]:
        """Indices into the forward's ``[B, V]`` logits of the sampling entries."""
        return [i for i, e in enumerate(self.entries) if e.samples]


def new_stats() -> dict:
    """The scheduler's counters (shared with RequestKV and Retraction), all zero."""
    return {"steps": 0, "retractions": 0, "prompt_tokens": 0, "cached_tokens": 0,
            "prompt_tokens_computed": 0, "generated_tokens": 0, "evicted_tokens": 0,
            "retraction_restores": 0, "retraction_recomputes": 0, "retraction_aborts": 0,
            "backup_tokens": 0, "backup_seconds": 0.0, "restore_tokens": 0, "restore_seconds": 0.0,
            "spec_drafted_tokens": 0, "spec_accepted_tokens": 0, "spec_verify_steps": 0,
            "spec_steps_declined": 0}


class SchedulerObserver:
    """A test- and bench-facing view of scheduler decisions: append one to ``Scheduler.observers``
    (empty by default, so nothing is called in serving)."""

    def admitted(self, sr: SchedReq) -> None:
        """``sr`` took a row (a first admission, a restore after retraction, or a reservation)."""

    def unadmitted(self, sr: SchedReq) -> None:
        """The admission of ``sr`` this step was undone (no slots after all)."""

    def retracted(self, sr: SchedReq) -> None:
        """``sr`` is about to be retracted (backed up to the host, or dropped to recompute)."""
