"""The page hash chain (pinned by tests/core/test_page_hash.py), tenant salts at its root, and the
page-aligned edge compare; the definition is in core/README.md.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence


def page_hashes(tokens: Sequence[int], page_size: int, parent: int | None = None) -> list[int]:
    """The chained hashes of ``tokens``' whole pages; ``parent``: the hash of the page before them."""
    out = []
    h = parent
    blake = hashlib.blake2b
    for i in range(0, len(tokens) - page_size + 1, page_size):
        d = blake(digest_size=8)
        if h is not None:
            d.update(h.to_bytes(8, "little"))
        d.update(array("q", tokens[i:i + page_size]).tobytes())
        h = int.from_bytes(d.digest(), "little")
        out.append(h)
    return out


SALT_SHIFT = 32


def cache_salt(*parts: str | None) -> int:
    """The salt ``parts`` name: nonzero, below 2**31, stable across processes; 0 when all are empty."""
    named = [p for p in parts if p]
    if not named:
        return 0
    d = hashlib.blake2b("\x00".join(named).encode(), digest_size=4).digest()
    return (int.from_bytes(d, "little") & 0x7FFFFFFF) or 1


def salted(ids: Sequence[int], salt: int) -> list[int]:
    """``ids`` as a cache key under ``salt``: a list whose first id carries the salt (``ids`` if unsalted)."""
    if not salt or not len(ids):
        return ids if type(ids) is list else list(ids)
    out = list(ids)
    out[0] += salt << SALT_SHIFT
    return out


def common_pages(edge: Sequence[int], key: Sequence[int], pos: int, end: int, page_size: int) -> int:
    """The common prefix of ``edge`` and ``key[pos:end]``: the whole overlap, else whole pages."""
    n = min(len(edge), end - pos)
    if edge[:n] == key[pos:pos + n]:
        return n
    lo, hi = page_size, n
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if edge[lo:mid] == key[pos + lo:pos + mid]:
            lo = mid
        else:
            hi = mid
    return lo - lo % page_size
