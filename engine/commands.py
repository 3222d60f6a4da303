"""The engine's typed commands: everything another thread asks of the engine thread.

Commands change the engine (a request, its KV, the cache); queries (engine/queries.py) only read
it. Each names one verb; none carries a function to run."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.engine.queries import Query

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
class Land:
    """A prefilled request's KV landed here (no write into it is in flight any more): decode on
    from ``first_token``, sampled by the prefill worker (with ``logprob`` when the request asked)."""

    rid: str
    first_token: int
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class LandResumed:
    """A migrated request's KV landed here: decode on from its own tokens (they came with it)."""

    rid: str


@dataclass(frozen=True)
class Store:
    """A sequence received only to be cached landed here: cache it; it finishes "stored"."""

    rid: str


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
class Pause:
    """Test-only (``Engine.paused_for_tests``): between steps, the engine thread sets ``future``
    and waits (at most ``timeout_s``) for ``resume``, so a test may read the engine's private
    structures without a race. The product never sends it."""

    resume: threading.Event
    timeout_s: float
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


Handoff = Land | LandResumed | Store | Release | Migrate     # Scheduler.handoff's events
Command = Submit | Abort | Land | LandResumed | Store | Migrate | Release | Evict | Unpin | Pause | Query
