"""How a page of token ids is named and compared: the one definition that the cache's KV events
publish (cache/radix/events.py, cache/radix/tree.py) and the router's indexes match
(router/prefix_index.py). If these functions change, every published hash changes, so the tests
pin their output to fixed values (tests/core/test_page_hash.py).

- :func:`page_hashes`: the page hash chain ``h_i = BLAKE2b-64(h_{i-1} as 8 little-endian bytes
  || the page's token ids as int64 little-endian)``, with no parent bytes for the first page,
  the first 8 digest bytes read as a little-endian unsigned int. A hash names the page's whole
  prefix, so anyone holding the token ids can rebuild it without the worker's slot ids. The
  hashes travel as vLLM ``BlockStored``/``BlockRemoved`` uint64 block hashes.
- :func:`cache_salt` / :func:`salted`: tenant isolation at the root of the chain. A request's
  salt (a nonzero 31-bit int; 0: none) is added, shifted past every token id, to its FIRST token
  id in the key every cache and index sees (never in what the model computes). The first page,
  and so every hash of the chain, the radix edges, the host and L3 tiers' keys, the KV events and
  the router's prefix indexes, then differ between salts, while one salt's repeat still matches.
- :func:`common_pages`: the page-aligned common prefix of a radix edge and a key, found by a
  binary search over slice compares (both radix trees walk edges this way).
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence


def page_hashes(tokens: Sequence[int], page_size: int, parent: int | None = None) -> list[int]:
    """The chained hashes of the whole pages of ``tokens`` (module docstring); a trailing
    partial page is ignored. ``parent`` is the hash of the page before ``tokens[0]`` (None: the
    first page of a sequence)."""
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


SALT_SHIFT = 32     # token ids stay below 2**32; a salted first id stays below 2**63 (int64)


def cache_salt(*parts: str | None) -> int:
    """The salt of a cache namespace named by ``parts`` (tenant, then the request's own
    ``cache_salt``): a nonzero int below 2**31, the same in every process. No non-empty part:
    0 (no salt, the shared namespace)."""
    named = [p for p in parts if p]
    if not named:
        return 0
    d = hashlib.blake2b("\x00".join(named).encode(), digest_size=4).digest()
    return (int.from_bytes(d, "little") & 0x7FFFFFFF) or 1


def salted(ids: Sequence[int], salt: int) -> list[int]:
    """``ids`` as a cache key under ``salt`` (module docstring): a list, ``ids`` itself when it
    already is one and ``salt`` is 0; else a copy whose first id carries the salt."""
    if not salt or not len(ids):
        return ids if type(ids) is list else list(ids)
    out = list(ids)
    out[0] += salt << SALT_SHIFT
    return out


def common_pages(edge: Sequence, key: Sequence, pos: int, end: int, page_size: int) -> int:
    """Length of the common prefix of ``edge`` and ``key[pos:end]``, given that their first
    page matches: the whole overlap ``min(len(edge), end - pos)`` if it all matches, else
    rounded down to whole pages. Compares slices (``edge`` and ``key`` of one type, list or
    tuple), O(log n) of them."""
    n = min(len(edge), end - pos)
    if edge[:n] == key[pos:pos + n]:
        return n
    lo, hi = page_size, n               # edge[:lo] matches; the first mismatch lies in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if edge[lo:mid] == key[pos + lo:pos + mid]:
            lo = mid
        else:
            hi = mid
    return lo - lo % page_size
