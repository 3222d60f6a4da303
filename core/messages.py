"""Messages between roles (HTTP front door -> serving backend -> workers). Small, frozen, no torch.

Encoded for the wire with :func:`to_wire` / :func:`from_wire` (msgpack-compatible plain dicts,
never pickle); ``from_wire`` validates field names and types.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from tandem.core.types import InvalidRequest, SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    """One generation, already tokenized. ``rid`` is unique per request; ``session_id`` groups turns."""

    rid: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    session_id: str | None = None

    def to_wire(self) -> dict[str, Any]:
        d = asdict(self)
        d["prompt_ids"] = list(self.prompt_ids)
        d["params"]["stop"] = list(self.params.stop)
        d["params"]["stop_token_ids"] = list(self.params.stop_token_ids)
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "GenerateRequest":
        if not isinstance(d, dict) or set(d) != {f.name for f in fields(cls)}:
            raise InvalidRequest(f"GenerateRequest fields mismatch: {sorted(d) if isinstance(d, dict) else type(d)}")
        if not isinstance(d["rid"], str):
            raise InvalidRequest("GenerateRequest.rid must be a string")
        ids = d["prompt_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise InvalidRequest("GenerateRequest.prompt_ids must be a list of ints")
        p = d["params"]
        names = {f.name for f in fields(SamplingParams)}
        if not isinstance(p, dict) or not set(p) <= names:
            raise InvalidRequest(f"GenerateRequest.params has unknown fields: {sorted(set(p) - names)}")
        p = dict(p)
        p["stop"] = tuple(p.get("stop", ()))
        p["stop_token_ids"] = tuple(p.get("stop_token_ids", ()))
        sid = d["session_id"]
        if sid is not None and not isinstance(sid, str):
            raise InvalidRequest("GenerateRequest.session_id must be a string or null")
        return cls(rid=d["rid"], prompt_ids=tuple(ids), params=SamplingParams(**p).validate(), session_id=sid)
