"""Waiting-queue ordering: longest cached prefix first, in-queue prefix sharing deprioritized."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tandem.engine.sched.queue_policy import order
from tandem.cache.unified import UnifiedRadixCache


@dataclass
class R:
    name: str
    prompt_ids: list


def test_lpm_orders_by_cached_prefix_and_defers_in_queue_sharers():
    cache = UnifiedRadixCache.simulated()
    system = list(range(1000, 1040))                           # 40 tokens, cached
    cache.insert(system)
    doc = list(range(2000, 2050))                              # 50 tokens, not cached
    waiting = [R("cold", [7] * 10), R("doc1", doc + [1]), R("sys", system + [5]),
               R("doc2", doc + [2]), R("cold2", [8] * 10)]
    match = lambda r: cache.peek(r.prompt_ids)
    got = [r.name for r in order(waiting, match, "lpm")]
    # sys hits 40 tokens; doc2 shares 50 uncached tokens with doc1 queued ahead: it waits.
    assert got == ["sys", "cold", "doc1", "cold2", "doc2"]
    assert [r.name for r in order(waiting, match, "fcfs")] == [r.name for r in waiting]
    assert [r.name for r in order(waiting, match, "lpm", max_lpm_queue=4)] == [r.name for r in waiting]
    with pytest.raises(ValueError, match="unknown schedule policy"):
        order(waiting, match, "sjf")
