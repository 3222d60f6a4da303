"""The engine's typed commands: everything another thread asks of the engine thread."""

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
    the copy to the new worker."""

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
class Unpin:
    """End the pins of the prefix ``prefix_hash`` names (only ``tenant``'s when given)."""

    prefix_hash: str
    tenant: str | None = None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass(frozen=True)
class Inspect:
    fn: Callable[..., Any]
    args: tuple = ()
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


Command = Submit | Abort | Activate | Migrate | Release | Evict | Unpin | Inspect
