"""The SLO planner: measured latency and queue depth -> how many prefill and decode workers."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tandem.core.config import PlannerConfig

WINDOW_S = 20.0
MAX_SAMPLES = 4096


class LatencyWindow:
    """Recent TTFT and inter-token latency samples (seconds), each kept for ``window_s``."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s, self.clock = window_s, clock
        self._ttft: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        self._itl: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)

    def ttft(self, s: float) -> None:
        self._ttft.append((self.clock(), s))

    def itl(self, s: float) -> None:
        self._itl.append((self.clock(), s))

    def _recent(self, q: deque) -> list[float]:
        cut = self.clock() - self.window_s
        while q and q[0][0] < cut:
            q.popleft()
        return [v for _, v in q]

    def percentile(self, which: str, p: float) -> float | None:
        """The ``p`` quantile (0..1) of the recent ``"ttft"`` or ``"itl"`` samples; None when
        there are none."""
        vals = sorted(self._recent(self._ttft if which == "ttft" else self._itl))
        if not vals:
            return None
        return vals[min(int(math.ceil(p * len(vals))) - 1, len(vals) - 1)] if p > 0 else vals[0]


@dataclass(frozen=True)
class Observation:
    prefill: int                    # workers serving now (alive, not draining)
    decode: int
    pending: int = 0                # workers asked for (or draining) and not settled yet
    ttft_s: float | None = None     # the window's percentile, None without samples
    itl_s: float | None = None
    prefill_queue: int = 0          # requests waiting on the prefill workers, all routers'


@dataclass(frozen=True)
class Plan:
    prefill: int
    decode: int
    reason: str = "hold"


class Planner:
    """Keeps, per role, when it was last seen busy (for the scale-down delay)."""

    def __init__(self, cfg: PlannerConfig):
        self.cfg = cfg
        self._busy_at = {"prefill": float("-inf"), "decode": float("-inf")}
        self._started: float | None = None

    @staticmethod
    def _up(n: int, measured: float, target: float) -> int:
        return min(max(math.ceil(n * measured / target) - n, 1), max(n, 1))

    def plan(self, o: Observation, now: float) -> Plan:
        c = self.cfg
        if self._started is None:
            self._started = now
            self._busy_at = {"prefill": now, "decode": now}
        p, d = o.prefill, o.decode
        why: list[str] = []
        if o.pending:
            return Plan(p, d, "settling")
        ttft_over = o.ttft_s is not None and o.ttft_s > c.ttft_slo_s
        queue_over = o.prefill_queue > c.queue_per_prefill * max(p, 1)
        if ttft_over or queue_over:
            step = self._up(p, o.ttft_s or 0.0, c.ttft_slo_s) if ttft_over else 1
            p, why = p + step, why + [f"ttft {o.ttft_s:.3g}s > {c.ttft_slo_s:g}s" if ttft_over else
                                      f"prefill queue {o.prefill_queue} > {c.queue_per_prefill}/worker"]
        if o.itl_s is not None and o.itl_s > c.itl_slo_s:
            d, why = d + self._up(d, o.itl_s, c.itl_slo_s), why + [f"itl {o.itl_s:.3g}s > {c.itl_slo_s:g}s"]
        busy_p = o.prefill_queue > 0 or (o.ttft_s is not None and o.ttft_s > c.scale_down_fraction * c.ttft_slo_s)
        busy_d = o.itl_s is not None and o.itl_s > c.scale_down_fraction * c.itl_slo_s
        for role, busy in (("prefill", busy_p), ("decode", busy_d)):
            if busy:
                self._busy_at[role] = now
        if p == o.prefill and p > c.min_prefill and not busy_p and now - self._busy_at["prefill"] >= c.scale_down_after_s:
            p, why = p - 1, why + ["prefill idle"]
            self._busy_at["prefill"] = now
        if d == o.decode and d > c.min_decode and not busy_d and now - self._busy_at["decode"] >= c.scale_down_after_s:
            d, why = d - 1, why + ["decode idle"]
            self._busy_at["decode"] = now
        for role, n, low in (("prefill", p, c.min_prefill), ("decode", d, c.min_decode)):
            if n < low:                     # e.g. a worker out of rotation: the count read low
                why.append(f"{role} {n} below its minimum {low}")
        p = min(max(p, c.min_prefill), c.max_prefill)
        d = min(max(d, c.min_decode), c.max_decode)
        return Plan(p, d, "; ".join(why) if (p, d) != (o.prefill, o.decode) else "hold")
