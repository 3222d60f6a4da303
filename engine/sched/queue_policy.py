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
    """A waiting request whose long prefix another request is computing waits, then hits the
    cache instead of computing that prefix again. The computing requests: those still in chunked
    prefill (``prefilling``: their cache keys; every policy, since they are ahead of any waiting
    request) and, with ``in_step`` (lpm), the ones admitted earlier in this step.

    ``should_wait(ids)``: they share at least ``THRESHOLD`` tokens with ``ids`` and at least a
    page more than the cache holds (``cached_len_fn``, on cache keys); otherwise ``ids`` is
    admitted (and, with ``in_step``, joins them). A wait ends once that prefix is cached or its
    request stops prefilling. The router predicts the whole shared prefix as reused
    (router/policies.py ``predicted_cached``): this makes the reuse equal the prediction."""

    THRESHOLD = 32

    def __init__(self, cached_len_fn: Callable[[Sequence[int]], int], page_size: int,
                 prefilling: Sequence[Sequence[int]] = (), in_step: bool = True):
        self.cached_len, self.page_size, self.in_step = cached_len_fn, page_size, in_step
        self.tree = UnifiedRadixCache.simulated(page_size=page_size)
        for ids in prefilling:
            self.tree.insert(ids)

    def should_wait(self, ids: Sequence[int]) -> bool:
        shared = self.tree.peek(ids)
        if shared >= self.THRESHOLD and shared >= self.cached_len(ids) + self.page_size:
            return True
        if self.in_step:
            self.tree.insert(ids)
        return False
