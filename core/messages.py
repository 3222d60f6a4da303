"""Messages between roles (HTTP front door -> serving backend -> workers). Small, frozen, no torch.

Encoded for the wire with :func:`to_wire` / :func:`from_wire` (msgpack-compatible plain dicts,
never pickle); ``from_wire`` validates field names and types.

OpenAI's ``n`` (several samples of one prompt) is fanned out by the front door: ``n``
GenerateRequests with the same prompt, each its own rid, stream and abort, tied by a
:class:`SampleGroup`. A backend that knows nothing of groups serves them as independent requests
(correct, but the prompt is computed n times); the engine uses the group to compute it once: a
member with ``index > 0`` waits for member 0's prompt KV and reuses it (see SampleGroup).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from tandem.core.page_hash import salted
from tandem.core.types import Constraint, InvalidRequest, SamplingParams

MAX_N = 8   # the most samples one request may ask for (OpenAI ``n``)


@dataclass(frozen=True)
class SampleGroup:
    """Membership of one of ``size`` samples of one prompt (filled by the front door).

    ``id`` names the group (the HTTP request's id); members are ``index`` 0..size-1, sent to the
    backend in index order, all with the same prompt_ids and session_id. Contract for a backend
    that shares the prompt (engine/scheduler.py): a member is not admitted while a sibling on the
    same worker is still computing the prompt (the leader, or whichever member arrived first),
    then reuses that sibling's cached prompt KV (all of it but the last, partial page); a member
    never waits for a sibling that is not on its worker, so a disaggregated backend must route
    every member to the same prefill and decode workers for the prompt to be computed once.
    Seeds differ per member (the front door sets seed + index).
    """

    id: str
    index: int = 0
    size: int = 1

    def validate(self) -> "SampleGroup":
        if not isinstance(self.id, str) or not self.id:
            raise InvalidRequest("SampleGroup.id must be a non-empty string")
        if not (isinstance(self.size, int) and 1 <= self.size <= MAX_N):
            raise InvalidRequest(f"SampleGroup.size must be in [1, {MAX_N}], got {self.size!r}")
        if not (isinstance(self.index, int) and 0 <= self.index < self.size):
            raise InvalidRequest(f"SampleGroup.index must be in [0, {self.size}), got {self.index!r}")
        return self

    @property
    def leader(self) -> bool:
        return self.index == 0


@dataclass(frozen=True)
class Resume:
    """Where a request moved from another decode worker stands: the tokens it has generated
    (``output_ids``; the last one has no KV yet), how many characters of text its stream has
    already sent (``streamed_chars``) and the prompt tokens its first worker served from cache
    (``cached_tokens``, for usage). Sampling needs nothing more: seeded draws are keyed by
    position, and a grammar's state is the constraint after ``output_ids``."""

    output_ids: tuple[int, ...]
    streamed_chars: int = 0
    cached_tokens: int = 0

    def validate(self) -> "Resume":
        if not self.output_ids or not all(isinstance(t, int) and t >= 0 for t in self.output_ids):
            raise InvalidRequest("Resume.output_ids must be a non-empty list of token ids")
        if self.streamed_chars < 0 or self.cached_tokens < 0:
            raise InvalidRequest("Resume.streamed_chars and cached_tokens must be >= 0")
        return self


@dataclass(frozen=True)
class GenerateRequest:
    """One generation, already tokenized. ``rid`` is unique per request; ``session_id`` groups turns;
    ``group`` ties the n samples of one prompt (None for n = 1); ``priority`` orders requests that
    wait in the router's deferred-dispatch queue (lower first, vLLM's convention; 0 by default);
    ``resume``: the request continues what another decode worker generated (live migration).

    Filled by the front door from the caller's API key (router/auth.py): ``tenant`` (who asked;
    "" when the server has no keys), ``cache_salt`` (the prefix-cache namespace, core/page_hash.py:
    the tenant's, narrowed by the body's ``cache_salt``; 0: shared) and ``trace`` (a W3C
    ``traceparent`` the workers continue their spans under; "" when tracing is off). Every copy
    of the request (a re-route, a retraction, a live migration) keeps them."""

    rid: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    session_id: str | None = None
    group: SampleGroup | None = None
    priority: int = 0
    resume: Resume | None = None
    tenant: str = ""
    cache_salt: int = 0
    trace: str = ""

    @property
    def cache_key(self) -> tuple[int, ...]:
        """``prompt_ids`` as the prefix caches and indexes key them (salted by ``cache_salt``)."""
        return tuple(salted(self.prompt_ids, self.cache_salt)) if self.cache_salt else self.prompt_ids

    def to_wire(self) -> dict[str, Any]:
        d = asdict(self)
        d["prompt_ids"] = list(self.prompt_ids)
        d["params"]["stop"] = list(self.params.stop)
        d["params"]["stop_token_ids"] = list(self.params.stop_token_ids)
        if self.resume is not None:
            d["resume"]["output_ids"] = list(self.resume.output_ids)
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "GenerateRequest":
        names = {f.name for f in fields(cls)}
        # "group", "priority", "resume", "tenant", "cache_salt", "trace" may be absent: an older sender
        if not isinstance(d, dict) or not ({"rid", "prompt_ids", "params", "session_id"} <= set(d) <= names):
            raise InvalidRequest(f"GenerateRequest fields mismatch: {sorted(d) if isinstance(d, dict) else type(d)}")
        if not isinstance(d["rid"], str):
            raise InvalidRequest("GenerateRequest.rid must be a string")
        ids = d["prompt_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise InvalidRequest("GenerateRequest.prompt_ids must be a list of ints")
        sid = d["session_id"]
        if sid is not None and not isinstance(sid, str):
            raise InvalidRequest("GenerateRequest.session_id must be a string or null")
        prio = d.get("priority", 0)
        if isinstance(prio, bool) or not isinstance(prio, int):
            raise InvalidRequest("GenerateRequest.priority must be an int")
        tenant, salt, trace = d.get("tenant", ""), d.get("cache_salt", 0), d.get("trace", "")
        if not isinstance(tenant, str) or not isinstance(trace, str) or len(trace) > 512:
            raise InvalidRequest("GenerateRequest.tenant and trace must be strings (trace at most 512)")
        if isinstance(salt, bool) or not isinstance(salt, int) or not 0 <= salt < 1 << 31:
            raise InvalidRequest(f"GenerateRequest.cache_salt must be an int in [0, 2**31), got {salt!r}")
        return cls(rid=d["rid"], prompt_ids=tuple(ids), params=_params_from_wire(d["params"]),
                   session_id=sid, group=_group_from_wire(d.get("group")), priority=prio,
                   resume=_resume_from_wire(d.get("resume")), tenant=tenant, cache_salt=salt, trace=trace)


def _params_from_wire(p: Any) -> SamplingParams:
    names = {f.name for f in fields(SamplingParams)}
    if not isinstance(p, dict) or not set(p) <= names:
        raise InvalidRequest(f"GenerateRequest.params has unknown fields: "
                             f"{sorted(set(p) - names) if isinstance(p, dict) else type(p).__name__}")
    p = dict(p)
    p["stop"] = tuple(p.get("stop", ()))
    p["stop_token_ids"] = tuple(p.get("stop_token_ids", ()))
    c = p.get("constraint")
    if c is not None:
        cnames = {f.name for f in fields(Constraint)}
        if not isinstance(c, dict) or not ({"kind"} <= set(c) <= cnames):
            raise InvalidRequest(f"GenerateRequest.params.constraint must be an object with fields "
                                 f"{sorted(cnames)}, got {c!r}"[:300])
        p["constraint"] = Constraint(**c)
    return SamplingParams(**p).validate()


def _resume_from_wire(r: Any) -> Resume | None:
    if r is None:
        return None
    names = {f.name for f in fields(Resume)}
    if not isinstance(r, dict) or set(r) != names or not isinstance(r["output_ids"], list):
        raise InvalidRequest(f"GenerateRequest.resume must be an object with fields {sorted(names)}")
    return Resume(tuple(r["output_ids"]), r["streamed_chars"], r["cached_tokens"]).validate()


def _group_from_wire(g: Any) -> SampleGroup | None:
    if g is None:
        return None
    gnames = {f.name for f in fields(SampleGroup)}
    if not isinstance(g, dict) or set(g) != gnames:
        raise InvalidRequest(f"GenerateRequest.group must be an object with fields {sorted(gnames)}")
    return SampleGroup(**g).validate()
