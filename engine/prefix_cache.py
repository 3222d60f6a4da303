"""The engine's view of the prefix cache: five verbs over whatever cache/ provides.

Contract (mirrors SGLang's cache_unfinished_req / cache_finished_req):
- ``match(ids, session_id) -> (slots, node)``: the longest reusable page-aligned prefix's slots
  (int64 ``[m]``) and the handle to lock. Does not lock.
- ``lock(node)`` / ``unlock(node)``: protect / release the path from the root to ``node``.
- ``cache(ids, slots, node, session_id) -> (slots', node')``: hand the page-aligned ``ids`` with
  their ``slots`` to the tree. The tree keeps one copy of each page; the request's duplicate
  slots are freed and ``slots'`` are the canonical ones (the caller rewrites its row).
  The lock moves from ``node`` to ``node'``.
- ``evict(n) -> freed``: free at least ``n`` tokens of unlocked cache if it can.
- ``disabled``: when True the cache keeps nothing (every match a miss); the engine then frees a
  finished request's slots itself.
"""

from __future__ import annotations

import torch


class NoPrefixCache:
    """Every match a miss and nothing kept: ``--disable-prefix-cache``."""

    disabled = True

    def match(self, ids, session_id=None):
        return torch.empty(0, dtype=torch.int64), None

    def lock(self, node) -> None:
        pass

    def unlock(self, node) -> None:
        pass

    def cache(self, ids, slots, node, session_id=None):
        return slots, node

    def evict(self, n: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def check(self, extra_owned=None) -> None:
        pass
