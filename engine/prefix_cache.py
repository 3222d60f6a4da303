"""The engine's view of the prefix cache: five verbs over whatever cache/ provides.

Contract (mirrors SGLang's cache_unfinished_req / cache_finished_req):
- ``match(ids, session_id) -> (slots, node, components)``: the longest reusable page-aligned
  prefix's slots (int64 ``[m]``), the handle to lock, and what each auxiliary component needs
  about it (``{"swa": SWA rows [m] (-1 = tombstone), "mamba": StateCopy | None}``; empty for
  FULL-only caches). Does not lock.
- ``lock(node)`` / ``unlock(node)``: protect / release the path from the root to ``node``.
- ``cache(ids, slots, node, session_id, extra=None) -> (slots', node')``: hand the page-aligned
  ``ids`` with their ``slots`` (and component data ``extra``: ``{"swa": rows [n], "mamba": row}``)
  to the tree. The tree keeps one copy of each page; the request's duplicate slots (and rows) are
  freed and ``slots'`` are the canonical ones (the caller rewrites its row). The lock moves from
  ``node`` to ``node'``.
- ``evict(n, component="full") -> freed``: free at least ``n`` tokens of unlocked cache if it can
  (``"swa"`` / ``"mamba"``: tombstone that component's data only).
- ``disabled``: when True the cache keeps nothing (every match a miss); the engine then frees a
  finished request's slots itself.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

NO_COMPONENTS = MappingProxyType({})


class NoPrefixCache:
    """Every match a miss and nothing kept: ``--disable-prefix-cache``."""

    disabled = True

    def match(self, ids, session_id=None):
        return torch.empty(0, dtype=torch.int64), None, NO_COMPONENTS

    def lock(self, node) -> None:
        pass

    def unlock(self, node) -> None:
        pass

    def cache(self, ids, slots, node, session_id=None, extra=None):
        return slots, node

    def evict(self, n: int, component: str = "full") -> int:
        return 0

    def evictable_size(self, component: str = "full") -> int:
        return 0

    def check(self, extra_owned=None) -> None:
        pass
