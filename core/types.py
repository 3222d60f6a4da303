"""Core request types: who fills which field is noted beside it.

A request's life: the API layer builds a :class:`Req` from a prompt and :class:`SamplingParams`;
the scheduler moves it WAITING -> PREFILLING -> RUNNING (-> RETRACTED -> RUNNING) -> a finished
status (a disaggregated decode worker: WAITING_FOR_KV -> RUNNING); the
engine appends sampled tokens to ``output_ids``. Nothing here imports torch, so the router can use
these types without a model.
"""

from __future__ import annotations

import enum
import itertools
import time
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


class Overloaded(TandemError):
    """Every eligible worker is past its admission limits: try again in ``retry_after_s``
    seconds (the front door answers 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = max(int(retry_after_s), 1)


MAX_TOP_LOGPROBS = 20   # OpenAI's limit for top_logprobs (chat and completions alike here)
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "lark", "structural_tag")


@dataclass(frozen=True)
class Constraint:
    """What the output must match, decoded under a token bitmask (engine/grammar.py enforces it).

    Filled by the front door (response_format, tool_choice); read by the sampler. ``spec`` is text:

    - ``json_schema``: a JSON Schema, serialized JSON (``strict`` below says how unsupported keywords
      are treated: refused when strict, ignored otherwise);
    - ``json_object``: any JSON object (``spec`` is ignored, "" by convention);
    - ``regex``: a regular expression the whole output must match;
    - ``lark``: a grammar in llguidance's Lark dialect (EBNF-like; may embed ``%json {schema}``);
    - ``structural_tag``: serialized JSON ``{"tags": [{"begin", "schema", "end"}], "triggers": [..]}``:
      free text, but whatever follows a trigger must be one of the tags (lazy tool-call grammars).

    The output ends where the grammar is complete (EOS is the only token allowed then).
    """

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
    """One generated token's log-probability and the ``top`` alternatives ((token id, logprob),
    most likely first). Both come from ``log_softmax`` of the logits the sampler drew from: the
    model's logits with the constraint's bitmask and min_tokens bans applied, before temperature,
    top-k and top-p (so a greedy token is always ``top[0]``)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 0    # prompt logprobs: 1 + how many tokens are more likely (0: not computed)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. Validated by :meth:`validate` (raises :class:`InvalidRequest`).

    temperature == 0 means greedy. top_k <= 0 means off; top_p == 1.0 means off.
    ``stop`` strings are matched on the detokenized output and excluded from the returned text.
    ``stop_token_ids`` finish with reason "stop"; EOS does too unless ``ignore_eos``.
    ``min_tokens`` suppresses EOS/stop tokens until that many tokens were generated.
    ``logprobs``: report each sampled token's logprob (StreamChunk.logprobs), with the
    ``top_logprobs`` (0..MAX_TOP_LOGPROBS) most likely alternatives. ``prompt_logprobs`` (None =
    off, else 0..MAX_TOP_LOGPROBS alternatives): report each prompt token's logprob given the
    tokens before it (StreamChunk.prompt_logprobs). ``constraint``: decode under a
    grammar (None = unconstrained).
    """

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
    """One generation request, as the scheduler sees it.

    Fields set at creation (API layer): rid, prompt_ids, params, session_id, arrival, cache_salt, trace.
    Fields owned by the scheduler: status, req_pool_idx, prefix_len, cached_len, computed_len,
    last_node (an opaque cache handle), finish_reason.
    Fields owned by the engine's output step: output_ids, first_token_time, finish_time.
    """

    prompt_ids: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: f"req-{next(_req_counter)}")
    session_id: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    cache_salt: int = 0                 # the prefix-cache namespace (core/page_hash.py; 0: shared)
    trace: str = ""                     # W3C traceparent of its spans (retraction, L3 fetch); "": none

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
        """``all_ids`` as the prefix cache's key: salted by ``cache_salt`` (a copy; ``all_ids``
        itself when there is no salt)."""
        return salted(self.all_ids, self.cache_salt)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished


@dataclass(frozen=True)
class StreamChunk:
    """What a caller receives per step: the new token ids and text, and the finish reason once.

    ``prompt_tokens`` / ``cached_tokens`` are reported by the final chunk and by the chunk of the
    first generated token (the same figures, so a stream can state its usage up front); other
    chunks leave them 0. ``logprobs`` (only when the request asked for them): one entry per id in
    ``token_ids``, same order. ``prompt_logprobs`` (only when the request asked for them, on the
    chunk of the first generated token): one entry per prompt token after the first (the
    first has no context), each with its ``rank``. ``queue_s`` (the chunks that report the
    prompt's figures): the seconds the request waited in this engine's queue before its admission. ``stop_str``: the stop string that finished the request (finish_reason "stop"), None
    when EOS or a stop token id did.
    """

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
