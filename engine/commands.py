"""The engine's typed commands: everything another thread asks of the engine thread.

Every message on the engine's inbox is one of these frozen dataclasses; ``Engine`` dispatches
them with ``match`` and raises on anything else. State changes only through the verbs below;
``Inspect`` reads (a named, read-only method of the caller's: snapshots, invariant checks, page
ids of held KV) and never emits chunks.

    Submit(req, group, on_chunk)       queue a request; on_chunk gets every chunk (engine thread)
    Abort(rid, error)                  finish rid with "abort" wherever it waits, runs or receives
    Activate(rid, first_token, ...)    decode: rid's KV arrived (with prefill's first token, or
                                       none for a request resumed from another decode worker);
                                       prefill: a prompt received only to be cached (no first
                                       token, no output): it is cached and finishes "stored"
    Migrate(rid, future)               decode: end rid here with "migrated"; its KV is held until
                                       a Release (the new worker copies it first)
    Release(rid)                       prefill: rid's held KV was sent (or will never be): let it go
    Evict(tokens, future)              future <- device tokens evicted from unlocked cache
    Inspect(fn, args, future)          future <- fn(*args) on the engine thread (read-only)
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.core.messages import Resume, SampleGroup
    from tandem.core.types import Req, StreamChunk, TokenLogprob


@dataclass(frozen=True)
class Submit:
    req: Req
    on_chunk: Callable[[StreamChunk], None]
    group: SampleGroup | None = None
    resume: Resume | None = None


@dataclass(frozen=True)
class Abort:
    rid: str
    error: str | None = None


@dataclass(frozen=True)
class Activate:
    """The KV of a request in WAITING_FOR_KV landed (no write into it is in flight any more);
    ``first_token`` was sampled by the prefill worker, with ``logprob`` when the request asked;
    None for a resumed request (its tokens came with it), and for a fresh one received only to
    be cached (it finishes "stored", its KV in the cache)."""

    rid: str
    first_token: int | None
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class Migrate:
    """Finish decoding ``rid`` here with "migrated" (its stream's last chunk), keeping its KV for
    the copy to the new worker. ``future``: True once done; ValueError when ``rid`` is not
    decoding here (nothing changes then)."""

    rid: str
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass(frozen=True)
class Release:
    """A held request's KV may be cached / freed: its write finished or never started."""

    rid: str


@dataclass(frozen=True)
class Evict:
    """Evict up to ``tokens`` of unlocked device cache (to the host tier where it has one)."""

    tokens: int
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass(frozen=True)
class Inspect:
    fn: Callable[..., Any]
    args: tuple = ()
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


Command = Submit | Abort | Activate | Migrate | Release | Evict | Inspect
