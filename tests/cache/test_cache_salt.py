"""Tenant isolation at the root of the page-hash chain (core/page_hash.py ``cache_salt`` /
``salted``, issue 40): a salted key shares no radix edge, no page hash and no KV event with
another salt's or the unsalted key of the same tokens; a salt's own repeat still matches; the
router's exact index (hashes of the salted key) finds exactly what the salted events stored."""

from __future__ import annotations

from tandem.cache.radix.events import BlockStored
from tandem.cache.radix.tree import RadixTree
from tandem.cache.unified import UnifiedRadixCache
from tandem.core.page_hash import SALT_SHIFT, cache_salt, page_hashes, salted
from tandem.core.types import Req, SamplingParams
from tandem.router.prefix_index import GlobalBlockIndex, KVEvent, block_hashes

PS = 4
PROMPT = list(range(100, 140))          # 10 pages
A, B = cache_salt("acme"), cache_salt("globex")


def test_salts_are_stable_nonzero_and_distinct():
    assert cache_salt() == cache_salt(None, "") == 0
    assert A == cache_salt("acme") and 0 < A < 1 << 31 and A != B
    assert cache_salt("acme", "x") not in (A, cache_salt("acme", "y"), 0)
    assert salted(PROMPT, 0) is PROMPT                      # no salt: the key itself, no copy
    key = salted(PROMPT, A)
    assert key[0] == PROMPT[0] + (A << SALT_SHIFT) < 2**63 and key[1:] == PROMPT[1:]
    assert PROMPT[0] == 100                                 # the caller's list is untouched


def test_every_hash_of_the_chain_differs_between_salts():
    plain, ha, hb = (page_hashes(salted(PROMPT, s), PS) for s in (0, A, B))
    assert len(plain) == len(ha) == 10
    assert not set(plain) & set(ha) and not set(ha) & set(hb) and not set(plain) & set(hb)
    assert ha == page_hashes(salted(PROMPT, A), PS)          # a repeat: the same chain


def test_radix_cache_matches_only_the_same_salt():
    cache = UnifiedRadixCache.simulated(page_size=PS, debug_invariants=True)
    assert cache.insert(salted(PROMPT, A)) == 0
    assert cache.match(salted(PROMPT, A)).prefix_len == 40   # A's repeat hits
    assert cache.match(salted(PROMPT, B)).prefix_len == 0    # B's identical prompt does not
    assert cache.match(PROMPT).prefix_len == 0               # nor does the shared namespace
    assert cache.peek(salted(PROMPT, B)) == cache.peek(PROMPT) == 0
    assert cache.insert(salted(PROMPT, B)) == 0              # B caches its own copy beside A's
    assert cache.match(salted(PROMPT[:20] + [7] * 8, B)).prefix_len == 20
    cache.check()
    assert cache.stats().evictable == 80                     # two copies, one per tenant


def test_events_and_the_routers_exact_index_keep_tenants_apart():
    tree = RadixTree(page_size=PS, record_events=True)
    tree.insert(salted(PROMPT, A), None)
    [ev] = [e for e in tree.events if isinstance(e, BlockStored)]
    assert ev.block_hashes == page_hashes(salted(PROMPT, A), PS) and ev.parent_block_hash is None
    index = GlobalBlockIndex()
    index.apply(KVEvent(0, "stored", tuple(ev.block_hashes), len(PROMPT)))
    assert index.known_prefix(block_hashes(salted(PROMPT, A), PS)) == 10
    assert index.known_prefix(block_hashes(salted(PROMPT, B), PS)) == 0
    assert index.known_prefix(block_hashes(PROMPT, PS)) == 0


def test_a_request_keys_the_cache_with_its_salt_and_computes_its_tokens():
    r = Req(list(PROMPT), SamplingParams(), cache_salt=A)
    r.output_ids.append(5)
    assert r.all_ids == PROMPT + [5]                         # what the model computes
    assert r.cache_ids == salted(PROMPT + [5], A)            # what the caches see
    assert Req(list(PROMPT), SamplingParams()).cache_ids == PROMPT
