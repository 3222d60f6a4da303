"""Small frozen messages between roles, encoded as plain dicts (:func:`to_wire`, never pickle);
``from_wire`` validates field names and types (ValueError).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from tandem.core.page_hash import salted
from tandem.core.types import Constraint, InvalidRequest, SamplingParams

MAX_N = 8


@dataclass(frozen=True)
class SampleGroup:
    """Member ``index`` of ``size`` samples of one prompt; it reuses a sibling's prompt KV on its worker."""

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
    """A moved request's ``output_ids`` (the last has no KV), ``streamed_chars`` and ``cached_tokens``."""

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
    """One tokenized generation; ``tenant``, ``cache_salt``, ``trace``: the front door's, kept by every copy."""

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
    pins: tuple[tuple[int, int], ...] = ()     # (prefix tokens, ttl s): keep them cached (router/prompt_cache.py)
    pin_cap: int = -1                          # the tenant's pinned-token cap (-1: the worker's default share)

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
        d["pins"] = [list(p) for p in self.pins]
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "GenerateRequest":
        names = {f.name for f in fields(cls)}
        # "group", "priority", "resume", "tenant", "cache_salt", "trace", "pins", "pin_cap" may be
        # absent: an older sender
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
        cap = d.get("pin_cap", -1)
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < -1:
            raise InvalidRequest(f"GenerateRequest.pin_cap must be an int >= -1, got {cap!r}")
        return cls(rid=d["rid"], prompt_ids=tuple(ids), params=_params_from_wire(d["params"]),
                   session_id=sid, group=_group_from_wire(d.get("group")), priority=prio,
                   resume=_resume_from_wire(d.get("resume")), tenant=tenant, cache_salt=salt, trace=trace,
                   pins=_pins_from_wire(d.get("pins", [])), pin_cap=cap)


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


MAX_PINS = 4            # Anthropic's breakpoint limit; OpenAI's retention asks for one


def _pins_from_wire(p: Any) -> tuple[tuple[int, int], ...]:
    def ok(x: Any) -> bool:
        return (isinstance(x, list) and len(x) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in x))

    if not isinstance(p, list) or len(p) > MAX_PINS or not all(ok(x) for x in p):
        raise InvalidRequest(f"GenerateRequest.pins must be at most {MAX_PINS} [tokens, ttl_s] pairs of "
                             f"positive ints, got {p!r}"[:300])
    return tuple((x[0], x[1]) for x in p)
