"""How many tokens one L3 fetch asks the store for, and how long it may wait for them."""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass

PRIOR_PREFILL_TOK_S = 576.0     # docs/PERFORMANCE.md: the 2-thread CPU prefill rate
_ALPHA = 0.2
_PROBE_GETS = 4


@dataclass
class ReadBudget:
    """The bound of one fetch. ``deadline_s``: any fetch's wait; ``token_bytes``: bytes read per token;
    ``prefill_tok_s``: the recompute rate a read competes with (None: never wait past the deadline);
    ``max_tokens``: a fixed cap. ``observe`` may run on two threads: the estimate is best-effort."""

    deadline_s: float
    token_bytes: int
    prefill_tok_s: float | None = None
    max_tokens: int | None = None
    read_bytes_per_s: float | None = None

    def __post_init__(self):
        if self.token_bytes <= 0:
            raise ValueError(f"token_bytes must be positive, got {self.token_bytes}")

    @property
    def read_tok_s(self) -> float | None:
        """Tokens per second the store delivers (None: not measured yet)."""
        r = self.read_bytes_per_s
        return None if r is None else r / self.token_bytes

    def wait_s(self, n: int) -> float:
        """Seconds a fetch of ``n`` tokens may wait on the store: ``deadline_s``, or, when reading
        beats recomputing, as long as recomputing ``n`` tokens would take if that is longer."""
        read, prefill = self.read_tok_s, self.prefill_tok_s
        if read is None or prefill is None or read <= prefill:
            return self.deadline_s
        return max(self.deadline_s, n / prefill)

    def tokens(self, n: int) -> int:
        """Of ``n`` tokens past the match, how many a fetch asks for: what the store delivers in
        :meth:`wait_s` at the measured rate, at most ``max_tokens``, at most ``n``."""
        read = self.read_tok_s
        if read is not None:
            n = min(n, int(self.wait_s(n) * read))
        if self.max_tokens is not None:
            n = min(n, self.max_tokens)
        return max(n, 0)

    def observe(self, nbytes: int, seconds: float) -> None:
        """One get of ``nbytes`` took ``seconds`` (the first sets the estimate, then an EWMA)."""
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        old = self.read_bytes_per_s
        self.read_bytes_per_s = rate if old is None else old + _ALPHA * (rate - old)

    def probe(self, store, nbytes: int) -> float | None:
        """Measure the read rate of ``store`` (an ``L3Store``) with a few gets of one ``nbytes``
        value written under a fresh probe key; returns the estimate (None: the store did
        not answer)."""
        key, payload = random.getrandbits(63), os.urandom(nbytes)
        if not store.put(key, payload, kind="probe"):
            return None
        for _ in range(_PROBE_GETS):
            t0 = time.perf_counter()
            got = store.get(key, kind="probe")
            if got is None:
                return None
            self.observe(len(got), time.perf_counter() - t0)
        return self.read_bytes_per_s
