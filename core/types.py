"""Core request types; who fills which field is noted beside it. No torch."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tandem.core.page_hash import salted

_req_counter = itertools.count()


class ReqStatus(enum.Enum):
    WAITING = "waiting"          # queued, nothing computed
    PREFILLING = "prefilling"    # some prompt chunks computed (chunked prefill)
    WAITING_FOR_KV = "waiting_for_kv"   # decode: pages reserved, the prompt's KV is being received
    RUNNING = "running"          # decoding
    RETRACTED = "retracted"      # evicted from the device under memory pressure; KV backed up or dropped
    FINISHED_STOP = "stop"       # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"   # max_tokens or the context limit reached
    FINISHED_ABORT = "abort"     # aborted by the client or by an error
    MIGRATED = "migrated"        # decode: moved to another decode worker, which finishes it

    @property
    def finished(self) -> bool:
        return self in FINISHED


FINISHED = frozenset({ReqStatus.FINISHED_STOP, ReqStatus.FINISHED_LENGTH, ReqStatus.FINISHED_ABORT,
                      ReqStatus.MIGRATED})


class TandemError(Exception):
    """Base class for errors Tandem reports to a user (bad input, bad model path, ...)."""


class InvalidRequest(TandemError, ValueError):
    """A request that cannot be served as given (the message says why, with the numbers)."""


def check_token_ids(ids: Iterable[int], vocab_size: int | None) -> None:
    """The one vocabulary check: InvalidRequest naming the first id outside ``0..vocab_size-1``
    (only negative ids when ``vocab_size`` is unknown). The engine runs it on every request it
    takes (engine.py ``submit``); the front door, on ids a client sends (a 400 naming the field)."""
    for t in ids:
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            top = vocab_size - 1 if vocab_size else "?"
            raise InvalidRequest(f"token id {t} is outside the vocabulary (0..{top})")


class Overloaded(TandemError):
    """Every eligible worker is past its admission limits: retry after ``retry_after_s`` (a 429)."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = max(int(retry_after_s), 1)


MAX_TOP_LOGPROBS = 20   # OpenAI's limit for top_logprobs (chat and completions alike here)
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "lark", "structural_tag")


@dataclass(frozen=True)
class Constraint:
    """What the output must match (engine/grammar.py; kinds: core/README.md); it ends when complete."""

    kind: str
    spec: str = ""
    strict: bool = True

    def validate(self) -> "Constraint":
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidRequest(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, "
                                 f"got {self.kind!r}")
        if not isinstance(self.spec, str) or not isinstance(self.strict, bool):
            raise InvalidRequest(f"constraint spec must be a string and strict a bool, got "
                                 f"{type(self.spec).__name__} and {type(self.strict).__name__}")
        if self.kind != "json_object" and not self.spec:
            raise InvalidRequest(f"a {self.kind} constraint needs a non-empty spec")
        return self

    def key(self) -> tuple[str, str, bool]:
        """The grammar cache key (two requests with equal keys share one compiled grammar)."""
        return (self.kind, self.spec, self.strict)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's logprob and the ``top`` alternatives, most likely first (a greedy token is ``top[0]``)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 0    # prompt logprobs: 1 + how many tokens are more likely (0: not computed)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens; :meth:`validate` raises :class:`InvalidRequest`. Fields: core/README.md."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    constraint: Constraint | None = None
    prompt_logprobs: int | None = None
    speculative: bool = True

    def validate(self) -> "SamplingParams":
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequest(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop must be a list of non-empty strings")
        if not isinstance(self.logprobs, bool):
            raise InvalidRequest(f"logprobs must be a bool, got {self.logprobs!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                                 f"got {self.top_logprobs!r}")
        if not isinstance(self.speculative, bool):
            raise InvalidRequest(f"speculative must be a bool, got {self.speculative!r}")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs to be true")
        pl = self.prompt_logprobs
        if pl is not None and (isinstance(pl, bool) or not isinstance(pl, int) or not 0 <= pl <= MAX_TOP_LOGPROBS):
            raise InvalidRequest(f"prompt_logprobs must be null or an integer in [0, {MAX_TOP_LOGPROBS}], "
                                 f"got {pl!r}")
        if self.constraint is not None:
            if not isinstance(self.constraint, Constraint):
                raise InvalidRequest(f"constraint must be a Constraint, got {type(self.constraint).__name__}")
            self.constraint.validate()
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Req:
    """One generation request, as the scheduler sees it; each field's owner is noted beside it."""

    prompt_ids: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: f"req-{next(_req_counter)}")
    session_id: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    cache_salt: int = 0                 # the prefix-cache namespace (core/page_hash.py; 0: shared)
    trace: str = ""                     # W3C traceparent of its spans (retraction, L3 fetch); "": none
    tenant: str = ""                    # whose pin budget its pins use (the front door's)
    pins: tuple[tuple[int, int], ...] = ()  # (prefix tokens, ttl s): pinned in the cache when it finishes
    pin_cap: int = -1                   # the tenant's pinned-token cap (-1: the cache's default share)

    status: ReqStatus = ReqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None     # row in ReqToTokenPool while it holds KV on the device
    cached_len: int = 0                 # prompt tokens served from the prefix cache (for usage stats)
    computed_len: int = 0               # tokens whose KV is in the request's row (prefix + computed)
    last_node: Any = None               # cache handle locked for this request (None = none locked)
    admissions: int = 0                 # times admitted (re-admission after retraction adds one)
    finish_reason: str | None = None
    error: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    admitted_time: float | None = None   # the scheduler's first admission (queue wait = it - arrival)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def cache_ids(self) -> list[int]:
        """``all_ids`` salted by ``cache_salt``: the prefix cache's key."""
        return salted(self.all_ids, self.cache_salt)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished


@dataclass(frozen=True)
class StreamChunk:
    """One step's new ids and text and the finish reason once; usage on the first and final chunks."""

    rid: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    worker: str = ""        # final chunk, disaggregated: the decode worker that served it
    logprobs: tuple[TokenLogprob, ...] = ()
    stop_str: str | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    queue_s: float | None = field(default=None, compare=False)   # seconds queued (docstring)
    # a failure's final chunk, before any token, because the prefill worker died (the decode
    # worker's Ray client saw it): the router may route the request again without that worker
    prefill_died: bool = False
    spec_tokens: tuple[int, int] = field(default=(0, 0), compare=False)  # final: (drafted, accepted)


@dataclass(frozen=True)
class Completion:
    """A finished request's result (the sync API's return value)."""

    rid: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str
    error: str | None = None
