"""Waiting-queue order: ``fcfs`` or ``lpm`` (longest cached prefix first), for the scheduler."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from tandem.cache.unified import UnifiedRadixCache

SCHEDULE_POLICIES = ("fcfs", "lpm")


def order(waiting: Sequence[Any], match_len_fn: Callable[[Any], int], policy: str = "lpm", *,
          token_ids_fn: Callable[[Any], Sequence[int]] = lambda r: r.prompt_ids,
          check_threshold: int = 32, deprioritize_threshold: int = 32,
          max_lpm_queue: int = 128, page_size: int = 1) -> list:
    """``waiting`` in the order to admit."""
    if policy == "fcfs" or (policy == "lpm" and len(waiting) > max_lpm_queue):
        return list(waiting)
    if policy != "lpm":
        raise ValueError(f"unknown schedule policy {policy!r}; expected one of {SCHEDULE_POLICIES}")
    in_queue = UnifiedRadixCache.simulated(page_size=page_size)
    keys = []
    for i, r in enumerate(waiting):
        cached = match_len_fn(r)
        later = False
        if cached <= check_threshold:
            ids = token_ids_fn(r)
            if in_queue.peek(ids) >= deprioritize_threshold:
                later = True
            else:
                in_queue.insert(ids)
        keys.append((later, -cached, i))
    keys.sort()
    return [waiting[i] for _, _, i in keys]


class InStepPrefixes:
    """lpm within a step: a request whose prefix an earlier admission of this step computes waits a
    step, then hits the cache."""

    THRESHOLD = 32

    def __init__(self, cached_len_fn: Callable[[Sequence[int]], int], page_size: int):
        self.cached_len = cached_len_fn
        self.tree = UnifiedRadixCache.simulated(page_size=page_size)

    def should_wait(self, ids: Sequence[int]) -> bool:
        if self.cached_len(ids) <= self.THRESHOLD and self.tree.peek(ids) >= self.THRESHOLD:
            return True
        self.tree.insert(ids)
        return False
