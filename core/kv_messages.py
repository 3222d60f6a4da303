"""The wire messages of a KV handoff between two workers (a handshake, a transfer request, its
result, an abort): frozen, msgpack-encoded, never pickle; ``decode`` raises ValueError naming a bad
field. A :class:`PrefillResult` is sent only once no write of its transfer can still land. Here,
not in transfer/, because they cross processes and both roles read them (notes: core/README.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Self

import msgpack

from tandem.core.pool_layout import PoolLayout
from tandem.core.transfer_state import TransferState
from tandem.core.types import TokenLogprob

_MAX_INT = 2**63 - 1


def _fail(cls: type, name: str, want: str, got: Any) -> ValueError:
    return ValueError(f"{cls.__name__}.{name} must be {want}, got {type(got).__name__} {got!r:.80}")


def _int(cls: type, name: str, v: Any, lo: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= _MAX_INT:
        raise _fail(cls, name, f"an int >= {lo}", v)
    return v


def _str(cls: type, name: str, v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise _fail(cls, name, "a non-empty str", v)
    return v


def _float(cls: type, name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _fail(cls, name, "a finite number", v)
    return float(v)


def _logprob(cls: type, name: str, v: Any) -> float:
    x = _float(cls, name, v)
    if x > 0.0:
        raise _fail(cls, name, "a log-probability (<= 0)", x)
    return x


def _list(cls: type, name: str, v: Any) -> list[Any]:
    if not isinstance(v, (list, tuple)):
        raise _fail(cls, name, "a list", v)
    return list(v)


def _int_tuple(cls: type, name: str, v: Any) -> tuple[int, ...]:
    items = _list(cls, name, v)
    for i, x in enumerate(items):
        _int(cls, f"{name}[{i}]", x)
    return tuple(items)


def _fields(cls: type, d: Any) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise ValueError(f"{cls.__name__}: expected a map, got {type(d).__name__}")
    want = {f.name for f in fields(cls)}
    have = set(d) - {"type"}
    if want - have:
        raise ValueError(f"{cls.__name__}: missing field {sorted(want - have)[0]!r}")
    if have - want:
        raise ValueError(f"{cls.__name__}: unknown field {sorted(map(str, have - want))[0]!r}")
    return d


@dataclass(frozen=True)
class RegionInfo:
    """Where a registered region lives (``mem_type`` DRAM/VRAM, ``dev_id``) and its geometry."""

    name: str
    base_addr: int
    dev_id: int
    mem_type: str
    layout: PoolLayout

    def to_wire(self) -> dict[str, Any]:
        lay = self.layout
        return {"name": self.name, "base_addr": self.base_addr, "dev_id": self.dev_id,
                "mem_type": self.mem_type, "num_layers": lay.num_layers, "rows": lay.rows,
                "page_size": lay.page_size, "row_bytes": lay.row_bytes, "kinds": lay.kinds}

    @classmethod
    def from_wire(cls, d: Any) -> "RegionInfo":
        want = {"name", "base_addr", "dev_id", "mem_type", "num_layers", "rows", "page_size",
                "row_bytes", "kinds"}
        if not isinstance(d, dict) or set(d) != want:
            got = sorted(map(str, d)) if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"RegionInfo: fields must be {sorted(want)}, got {got}")
        if d["mem_type"] not in ("DRAM", "VRAM"):
            raise _fail(cls, "mem_type", '"DRAM" or "VRAM"', d["mem_type"])
        lay = {k: _int(cls, k, d[k], lo=1) for k in ("num_layers", "rows", "page_size", "row_bytes", "kinds")}
        return cls(name=_str(cls, "name", d["name"]), base_addr=_int(cls, "base_addr", d["base_addr"]),
                   dev_id=_int(cls, "dev_id", d["dev_id"]), mem_type=d["mem_type"],
                   layout=PoolLayout(**lay))


class _Message:
    TYPE: ClassVar[str]

    def _to_wire(self) -> dict[str, Any]:
        """The fields as plain msgpack data (each message's own)."""
        raise NotImplementedError

    @classmethod
    def _from_wire(cls, d: dict[str, Any]) -> _Message:
        """The message from :meth:`_to_wire`'s fields, checked (each message's own)."""
        raise NotImplementedError

    def encode(self) -> bytes:
        out: bytes = msgpack.packb({"type": self.TYPE, **self._to_wire()}, use_bin_type=True)
        return out

    @classmethod
    def decode(cls, data: bytes) -> Self:
        msg = decode_message(data)
        if not isinstance(msg, cls):
            raise ValueError(f"expected a {cls.__name__}, got a {type(msg).__name__}")
        return msg


@dataclass(frozen=True)
class Handshake(_Message):
    """Sent once per peer pair: who I am, my NIXL agent metadata, and my regions."""

    TYPE: ClassVar[str] = "handshake"
    agent_name: str
    agent_metadata: bytes
    regions: tuple[RegionInfo, ...]

    def region(self, name: str) -> RegionInfo:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(f"peer {self.agent_name!r} has no region {name!r}; it has {[r.name for r in self.regions]}")

    def _to_wire(self) -> dict[str, Any]:
        return {"agent_name": self.agent_name, "agent_metadata": self.agent_metadata,
                "regions": [r.to_wire() for r in self.regions]}

    @classmethod
    def _from_wire(cls, d: dict[str, Any]) -> "Handshake":
        if not isinstance(d["agent_metadata"], bytes) or not d["agent_metadata"]:
            raise _fail(cls, "agent_metadata", "non-empty bytes", d["agent_metadata"])
        regions = tuple(RegionInfo.from_wire(r) for r in _list(cls, "regions", d["regions"]))
        names = [r.name for r in regions]
        if len(set(names)) != len(names):
            raise ValueError(f"Handshake.regions repeats a name: {names}")
        return cls(_str(cls, "agent_name", d["agent_name"]), d["agent_metadata"], regions)


@dataclass(frozen=True)
class RegionPages:
    """Destination pages of one region (e.g. "kv", "swa", "mamba")."""

    region: str
    pages: tuple[int, ...]


@dataclass(frozen=True)
class KVTransferRequest(_Message):
    """Decode -> prefill: write transfer ``transfer_id``'s KV into these pages of ``agent_name`` before
    ``deadline`` (Unix seconds)."""

    TYPE: ClassVar[str] = "kv_transfer_request"
    transfer_id: int
    agent_name: str
    dst_pages: tuple[RegionPages, ...]
    deadline: float
    digest: bool = False

    def __post_init__(self) -> None:
        names = [rp.region for rp in self.dst_pages]
        if len(set(names)) != len(names):
            raise ValueError(f"KVTransferRequest.dst_pages repeats a region: {names}")

    def pages(self, region: str) -> tuple[int, ...]:
        for rp in self.dst_pages:
            if rp.region == region:
                return rp.pages
        raise KeyError(f"transfer {self.transfer_id} names no pages for region {region!r}")

    @property
    def regions(self) -> tuple[str, ...]:
        return tuple(rp.region for rp in self.dst_pages)

    def _to_wire(self) -> dict[str, Any]:
        return {"transfer_id": self.transfer_id, "agent_name": self.agent_name,
                "dst_pages": {rp.region: list(rp.pages) for rp in self.dst_pages},
                "deadline": self.deadline, "digest": self.digest}

    @classmethod
    def _from_wire(cls, d: dict[str, Any]) -> "KVTransferRequest":
        dp = d["dst_pages"]
        if not isinstance(dp, dict) or not all(isinstance(k, str) and k for k in dp):
            raise _fail(cls, "dst_pages", "a map of region name -> page list", dp)
        pages = tuple(RegionPages(k, _int_tuple(cls, f"dst_pages[{k!r}]", v)) for k, v in dp.items())
        if not isinstance(d["digest"], bool):
            raise _fail(cls, "digest", "a bool", d["digest"])
        return cls(_int(cls, "transfer_id", d["transfer_id"]), _str(cls, "agent_name", d["agent_name"]),
                   pages, _float(cls, "deadline", d["deadline"]), d["digest"])


_RESULT_STATES = (TransferState.DONE, TransferState.FAILED, TransferState.ABORTED)


@dataclass(frozen=True)
class PrefillResult(_Message):
    """Prefill -> decode, the answer to a :class:`KVTransferRequest`: DONE, FAILED or ABORTED;
    ``in_flight``: the pages must never be reused. Fields: core/README.md."""

    TYPE: ClassVar[str] = "prefill_result"
    transfer_id: int
    status: TransferState
    worker: str
    first_token: int | None = None
    error: str = ""
    in_flight: bool = False
    bytes: int = 0
    pages: int = 0
    cached_tokens: int = 0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    digest: str = ""
    first_logprob: float | None = None
    first_top_logprobs: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status is TransferState.DONE

    def _to_wire(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["status"] = self.status.value
        d["first_top_logprobs"] = [[t, v] for t, v in self.first_top_logprobs]
        d["prompt_logprobs"] = [[lp.token_id, lp.logprob, lp.rank, [[t, v] for t, v in lp.top]]
                                for lp in self.prompt_logprobs]
        return d

    @classmethod
    def _from_wire(cls, d: dict[str, Any]) -> "PrefillResult":
        states = {s.value: s for s in _RESULT_STATES}
        if d["status"] not in states:
            raise _fail(cls, "status", f"one of {sorted(states)}", d["status"])
        ft = d["first_token"]
        if ft is not None:
            _int(cls, "first_token", ft)
        for name in ("error", "digest"):
            if not isinstance(d[name], str):
                raise _fail(cls, name, "a str", d[name])
        if not isinstance(d["in_flight"], bool):
            raise _fail(cls, "in_flight", "a bool", d["in_flight"])
        lp = d["first_logprob"]
        if lp is not None:
            lp = _logprob(cls, "first_logprob", lp)
        top = _pairs(cls, "first_top_logprobs", d["first_top_logprobs"])
        if top and lp is None:
            raise _fail(cls, "first_top_logprobs", "empty without a first_logprob", d["first_top_logprobs"])
        if lp is not None and ft is None:
            raise _fail(cls, "first_logprob", "None without a first_token", lp)
        return cls(transfer_id=_int(cls, "transfer_id", d["transfer_id"]), status=states[d["status"]],
                   worker=_str(cls, "worker", d["worker"]), first_token=ft, error=d["error"],
                   in_flight=d["in_flight"], bytes=_int(cls, "bytes", d["bytes"]),
                   pages=_int(cls, "pages", d["pages"]),
                   cached_tokens=_int(cls, "cached_tokens", d["cached_tokens"]),
                   prefill_s=_float(cls, "prefill_s", d["prefill_s"]),
                   transfer_s=_float(cls, "transfer_s", d["transfer_s"]), digest=d["digest"],
                   first_logprob=lp, first_top_logprobs=top,
                   prompt_logprobs=_prompt_logprobs(cls, d["prompt_logprobs"]))


def _pairs(cls: type, name: str, v: Any) -> tuple[tuple[int, float], ...]:
    """``[[token id, logprob], ...]`` -> a tuple of pairs."""
    out = []
    for i, pair in enumerate(_list(cls, name, v)):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise _fail(cls, f"{name}[{i}]", "a [token id, logprob] pair", pair)
        out.append((_int(cls, f"{name}[{i}][0]", pair[0]), _logprob(cls, f"{name}[{i}][1]", pair[1])))
    return tuple(out)


def _prompt_logprobs(cls: type, v: Any) -> tuple[TokenLogprob, ...]:
    """``[[token id, logprob, rank, [[token id, logprob], ...]], ...]`` -> TokenLogprobs."""
    out = []
    for i, e in enumerate(_list(cls, "prompt_logprobs", v)):
        name = f"prompt_logprobs[{i}]"
        if not isinstance(e, (list, tuple)) or len(e) != 4:
            raise _fail(cls, name, "a [token id, logprob, rank, alternatives] list", e)
        out.append(TokenLogprob(_int(cls, f"{name}[0]", e[0]), _logprob(cls, f"{name}[1]", e[1]),
                                _pairs(cls, f"{name}[3]", e[3]), _int(cls, f"{name}[2]", e[2], lo=1)))
    return tuple(out)


@dataclass(frozen=True)
class Abort(_Message):
    """Either side: stop transfer ``transfer_id`` (client abort, deadline, shutdown)."""

    TYPE: ClassVar[str] = "abort"
    transfer_id: int
    reason: str = ""

    def _to_wire(self) -> dict[str, Any]:
        return {"transfer_id": self.transfer_id, "reason": self.reason}

    @classmethod
    def _from_wire(cls, d: dict[str, Any]) -> "Abort":
        if not isinstance(d["reason"], str):
            raise _fail(cls, "reason", "a str", d["reason"])
        return cls(_int(cls, "transfer_id", d["transfer_id"]), d["reason"])


Message = Handshake | KVTransferRequest | PrefillResult | Abort
MESSAGE_TYPES: dict[str, type[Message]] = {c.TYPE: c for c in (Handshake, KVTransferRequest, PrefillResult, Abort)}


def decode_message(data: bytes) -> Message:
    """Decode any KV handoff message; ValueError (naming the field) if it is malformed."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"expected bytes, got {type(data).__name__}")
    try:
        d = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, max_bin_len=1 << 26,
                            max_str_len=1 << 20, max_array_len=1 << 24, max_map_len=1 << 16)
    except Exception as e:
        raise ValueError(f"not a msgpack message: {type(e).__name__}: {e}") from None
    if not isinstance(d, dict) or "type" not in d:
        raise ValueError("message: missing field 'type'")
    cls = MESSAGE_TYPES.get(d["type"]) if isinstance(d["type"], str) else None
    if cls is None:
        raise ValueError(f"message: unknown type {d['type']!r}")
    return cls._from_wire(_fields(cls, d))
