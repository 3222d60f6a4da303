"""UnifiedRadixCache: the prefix cache the scheduler talks to (one class, nine verbs)."""

from __future__ import annotations

import time
from typing import Any, Callable, Hashable, Mapping, Sequence

import torch

from tandem.cache.allocator import PagedAllocator
from tandem.cache.radix.components import FULL, TreeComponent, insert_values, released_floor
from tandem.cache.radix.events import AllBlocksCleared, BlockPinned, BlockUnpinned, EventPublisher
from tandem.cache.radix.eviction import make_policy
from tandem.cache.tiers.base import KVTier
from tandem.cache.tiers.host import HostTier
from tandem.cache.radix.sanity import check
from tandem.cache.match import _NO_COMPONENTS, CacheStats, MatchResult
from tandem.cache.port import TierPort
from tandem.cache.radix.tree import Node, RadixTree, concat_values as _concat
from tandem.core.config import CacheConfig

class UnifiedRadixCache:

    retains = True

    def __init__(self, config: CacheConfig, allocator: PagedAllocator | None = None,
                 components: Sequence[Any] = (FULL,),
                 host: HostTier | None = None, events: EventPublisher | None = None,
                 clock: Callable[[], float] = time.monotonic, tiers: Sequence[KVTier] = ()):
        if FULL not in components:
            raise ValueError(f"components={components!r} must include FULL")
        aux = [c for c in components if c is not FULL]
        if not all(isinstance(c, TreeComponent) for c in aux):
            raise TypeError(f"components must be FULL or TreeComponent instances, got {components!r}")
        names = [c.name for c in aux]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate components {names}")
        ps = config.page_size
        if allocator is not None and allocator.page_size != ps:
            raise ValueError(f"allocator page_size={allocator.page_size} != config page_size={ps}")
        self.config = config
        self.page_size = ps
        self.allocator = allocator
        self.publisher = events
        self._debug = config.debug_invariants
        self._capacity: int | None = None
        self._aux = tuple(aux)
        self._aux_index = {c.name: i for i, c in enumerate(aux)}
        self.policy = make_policy(config.eviction_policy, session_ttl_s=config.session_ttl_s,
                                  clock=clock)
        self._clock = clock
        self.pin_refused = 0            # pins past their tenant's cap (served unpinned)
        self.pin_hits = 0               # matches whose device prefix reads a pinned one
        self._tree = RadixTree(ps, self.policy, aux, record_events=events is not None)
        self.host: HostTier | None = None
        self.tiers: tuple[KVTier, ...] = ()
        self._port = TierPort(self)
        for tier in ((host,) if host is not None else ()) + tuple(tiers):
            self.add_tier(tier)
        if events is not None:
            events.publish([AllBlocksCleared()])

    @classmethod
    def simulated(cls, page_size: int = 1, capacity_tokens: int | None = None, eviction: str = "lru",
                  *, components: Sequence[Any] = (FULL,), session_ttl_s: float = 300.0,
                  debug_invariants: bool = False, clock: Callable[[], float] = time.monotonic,
                  events: EventPublisher | None = None) -> "UnifiedRadixCache":
        """A cache with no pools (values are token positions), for routing and scheduling
        simulation. With ``capacity_tokens``, every insert evicts to stay within it."""
        cfg = CacheConfig(page_size=page_size, eviction_policy=eviction,
                          session_ttl_s=session_ttl_s, debug_invariants=debug_invariants)
        cache = cls(cfg, components=components, events=events, clock=clock)
        cache._capacity = capacity_tokens
        return cache

    def add_tier(self, tier: KVTier) -> None:
        """Bind ``tier`` and append it to :attr:`tiers` (admission order: after the ones already
        there). The tier raises ValueError when it cannot serve this cache. Call before the
        first request."""
        if self.tier(tier.name) is not None:
            raise ValueError(f"the cache already has a {tier.name!r} tier")
        if tier.name == "host" and self.tiers:
            raise ValueError("the host tier comes before every other tier")
        tier.bind(self._port)
        self.tiers += (tier,)
        if isinstance(tier, HostTier):
            self.host = tier

    @property
    def aux_components(self) -> tuple:
        return self._aux

    def tier(self, name: str) -> KVTier | None:
        """The tier called ``name``, or None."""
        return next((t for t in self.tiers if t.name == name), None)

    def match(self, token_ids: Sequence[int], *, session_id: Hashable | None = None,
              priority: int | None = None) -> MatchResult:
        """The longest reusable page-aligned prefix of ``token_ids``. Does not lock; may split an
        edge (structure only)."""
        t = self._tree
        if session_id is not None:
            self.policy.touch_session(session_id)
        path = t.match(self._key(token_ids), session_id, priority)
        n_dev, n_best = t.vote(path)
        root = t.root
        last_dev = path[n_dev - 1] if n_dev else root
        best = path[n_best - 1] if n_best else root
        dev_path = path if n_dev == len(path) else path[:n_dev]
        if self.host is None:
            last_host = last_dev
        else:
            last_host = next((nd for nd in reversed(path[:n_best]) if nd.host is not None), root)
        if n_dev and path[0].pin:     # pins cover root..n: the match read a pinned prefix
            self.pin_hits += 1
        comps = ({c.name: c.finalize(dev_path) for c in self._aux} if self._aux else _NO_COMPONENTS)
        result = MatchResult(last_dev.end, [nd.value for nd in dev_path], last_dev,
                             last_host, best, best.end - last_dev.end, comps)
        if self._debug:
            self._after()
        return result

    def peek(self, token_ids: Sequence[int]) -> int:
        """Length of the reusable device prefix of ``token_ids``, with no side effect at all: no
        split, no policy touch, no load-back."""
        return self._tree.peek(self._key(token_ids))

    def insert(self, token_ids: Sequence[int], value: torch.Tensor | None = None, *,
               extra: Mapping[str, Any] | None = None, session_id: Hashable | None = None,
               priority: int = 0) -> int:
        """Cache the page-aligned prefix of ``token_ids``; ``value[i]`` is the slot of token i (None
        only in simulated mode)."""
        key = self._key(token_ids)
        value = self._slots(value, len(key))
        cached, _, _ = self._insert(key, value, extra, session_id, priority)
        self._enforce_capacity()
        self._after()
        return cached

    def cache(self, token_ids: Sequence[int], slots: torch.Tensor | None, last_node: Node | None,
              *, extra: Mapping[str, Any] | Callable[[], Mapping[str, Any] | None] | None = None,
              session_id: Hashable | None = None, priority: int = 0) -> tuple[torch.Tensor, Node]:
        """Hand a request's computed KV to the tree."""
        key = self._key(token_ids)
        n = len(key)
        slots = self._slots(slots, n)
        t = self._tree
        last_node = t.root if last_node is None else last_node
        protected = last_node.end
        if protected > n:
            raise ValueError(f"last_node covers {protected} tokens but only {n} page-aligned "
                             f"tokens were given")
        if callable(extra):
            extra = extra()
        cached, node, _ = self._insert(key, slots, extra, session_id, priority)
        if cached > protected and self.allocator is not None and slots is not None:
            self.allocator.free(slots[protected:cached])
        t.lock(node, +1)
        t.lock(last_node, -1)
        self._enforce_capacity()
        indices = _concat([nd.value for nd in t.path(node)])
        self._after()
        return indices, node

    def _insert(self, key: list, value, extra, session_id, priority) -> tuple[int, Node, bool]:
        t = self._tree
        if session_id is not None:
            self.policy.touch_session(session_id)
        aux = insert_values(self._aux, extra, len(key), simulated=self.allocator is None)
        if aux and not key:
            for c, v in zip(self._aux, aux):
                if v is not None and not c.per_token:
                    c.free(v)
        floor = released_floor(self._aux, aux, len(key), self.page_size)
        if aux is not None and 0 < floor < len(key):
            first = [v if c.per_token else None for c, v in zip(self._aux, aux)]
            cached, _, _ = t.insert(key[:floor], value, first, session_id, priority)
            cached2, node, created = t.insert(key, value, aux, session_id, priority)
            if cached >= floor:
                cached = cached2
        else:
            cached, node, created = t.insert(key, value, aux, session_id, priority)
        for tier in self.tiers:
            tier.on_insert(node, created, bool(aux))
        return cached, node, created

    def lock(self, node: Node | None) -> None:
        """Protect the path root..node from eviction (device and host copies). None: no-op."""
        if node is None:
            return
        self._tree.lock(node, +1)
        if self._debug:
            self._after()

    def unlock(self, node: Node | None) -> None:
        """Undo one :meth:`lock`. Raises ValueError if the node is not locked. None: no-op."""
        if node is None:
            return
        self._tree.lock(node, -1)
        if self._debug:
            self._after()

    def pin(self, node: Node | None, num_tokens: int, ttl_s: float, *, tenant: str = "",
            cap: int | None = None) -> int | None:
        """Keep root..``num_tokens`` of ``node``'s path (page-aligned down, at most ``node.end``)
        for ``ttl_s`` seconds (at most ``CacheConfig.pin_max_ttl_s``): its pages are evicted after
        every unpinned page, demoted to the host tier first. ``cap``: the most pinned tokens
        ``tenant`` may hold (None: ``pin_share`` of the device pool). Returns the tokens newly
        charged to ``tenant``, or None when that would pass its cap (nothing pinned; counted in
        ``pin_refused``). Never evicts, never fails a request."""
        if node is None or node is self._tree.root or num_tokens < self.page_size or ttl_s <= 0:
            return 0
        t = self._tree
        now = self._expire_pins()
        n = min(num_tokens, node.end) // self.page_size * self.page_size
        until = now + min(ttl_s, self.config.pin_max_ttl_s)
        got = t.pins.pin(node, n, until, tenant, self._pin_cap() if cap is None else cap)
        if got is None:
            self.pin_refused += 1
        elif t.record_events:           # the router's index learns the pin (router/prefix_index.py)
            t.events.append(BlockPinned(t.pins.path_hashes(node, n), until - now))
        self._after()
        return got

    def _pin_cap(self) -> int | None:
        size = self.allocator.size if self.allocator is not None else self._capacity
        return None if size is None else int(size * self.config.pin_share)

    def pins(self) -> list[dict]:
        """The live pinned prefixes: ``{"tenant", "hash"`` (the last page's chain hash, hex),
        ``"tokens", "tier"`` ("device" or "host"), ``"expires_in_s"}``, longest first."""
        return self._tree.pins.report(self._expire_pins())

    def unpin(self, prefix_hash: str, tenant: str | None = None) -> int:
        """End the pins of the prefix whose last page hashes to ``prefix_hash`` (as :meth:`pins`
        names it; only ``tenant``'s when given). Returns the tokens unpinned (0: none such)."""
        t = self._tree
        ended = t.pins.end(prefix_hash, tenant)
        if ended is None:
            return 0
        n, gone = ended
        if t.record_events and gone:
            t.events.append(BlockUnpinned(gone))
        self._after()
        return n

    def _expire_pins(self) -> float:
        """End the pins past their time; the cache clock's now."""
        now = self._clock()
        if self._tree.pins.expiry:
            self._tree.pins.expire(now)
        return now

    @property
    def pinned_tokens(self) -> dict[str, int]:
        """Pinned tokens per tenant (on any tier)."""
        return dict(self._tree.pins.tokens)

    def evict(self, num_tokens: int, component: str = "full") -> int:
        """Free at least ``num_tokens`` of unlocked cache if there is that much; returns how much
        was freed."""
        if num_tokens <= 0:
            return 0
        if component == "full":
            freed = self._evict_device(num_tokens)
        elif component == "host":
            self._expire_pins()
            freed = self._tree.hosted.evict(num_tokens)
        elif component in self._aux_index:
            backup = self.host.copy_aux if self.host is not None else None
            freed = self._tree.aux.evict(self._aux_index[component], num_tokens, backup=backup)
        else:
            raise ValueError(f"unknown component {component!r}")
        self._after()
        return freed

    def _evict_device(self, num_tokens: int) -> int:
        t = self._tree
        self._expire_pins()
        if self.policy.time_dependent:
            self.policy.begin_pass()
            t.leaves.rebuild()
        freed = 0
        while freed < num_tokens:
            nd = t.leaves.pop()
            if nd is None:
                break
            for tier in self.tiers:
                tier.on_evict(nd)
            freed += t.drop_device(nd)
        return freed

    def _enforce_capacity(self) -> None:
        if self._capacity is not None:
            over = self._tree.evictable + self._tree.protected - self._capacity
            if over > 0:
                self._evict_device(over)

    def stats(self) -> CacheStats:
        t = self._tree
        comps = ({c.name: (t.aux.evictable[i], t.aux.protected[i]) for i, c in enumerate(self._aux)}
                 if self._aux else _NO_COMPONENTS)
        return CacheStats(t.evictable, t.protected, t.hosted.size if self.host else 0, comps)

    def check(self, extra_owned: Any = None) -> None:
        """Recount everything; raise AssertionError listing every violation."""
        if self.host is not None:
            self.host.synchronize()
        errs = check(self._tree, allocator=self.allocator, extra_owned=extra_owned,
                     host_allocator=self.host.allocator if self.host else None,
                     host_stores={n: st.allocator for n, st in self.host.stores.items()}
                     if self.host else None)
        if errs:
            raise AssertionError(f"{len(errs)} cache invariant violation(s):\n" + "\n".join(errs))

    def _key(self, token_ids: Sequence[int]) -> list:
        if type(token_ids) is not list:
            token_ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        r = len(token_ids) % self.page_size
        return token_ids[:len(token_ids) - r] if r else token_ids

    def _slots(self, value, n: int) -> torch.Tensor | None:
        if value is None:
            if self.allocator is not None:
                raise ValueError("a cache with pools needs the slot ids of the tokens (value=None)")
            return None
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value)
        if len(value) < n:
            raise ValueError(f"{len(value)} slots for {n} page-aligned tokens")
        return value.to(device="cpu", dtype=torch.int64)

    def _spill(self) -> None:
        t = self._tree
        if t.spills:
            spills, t.spills = t.spills, []
            for tier in self.tiers:
                tier.on_spill(spills)

    def _free_device(self) -> None:
        t = self._tree
        if t.spills:
            self._spill()
        if t.device_frees:
            if self.allocator is not None:
                # no copier wait: a D2H copy has read its device slots when to_host returns
                self.allocator.free(torch.cat(t.device_frees))
            t.device_frees = []

    def _free_host(self) -> None:
        t = self._tree
        if t.spills:
            self._spill()
        host = self.host
        if host is None:        # the tree holds host copies only with a host tier
            return
        if t.hosted.frees:
            host.allocator.free(torch.cat(t.hosted.frees))
            t.hosted.frees = []
        if t.hosted.aux_frees:
            for i, v in t.hosted.aux_frees:
                host.stores[self._aux[i].name].allocator.free(
                    v if isinstance(v, torch.Tensor) else torch.tensor([int(v)], dtype=torch.int64))
            t.hosted.aux_frees = []

    def _free_aux(self) -> None:
        t = self._tree
        if t.spills:
            self._spill()
        if t.aux.frees:
            # no copier wait: a D2H copy has read its device rows when to_host returns
            for i, v in t.aux.frees:
                self._aux[i].free(v)
            t.aux.frees = []

    def _after(self) -> None:
        t = self._tree
        if t.device_frees:
            self._free_device()
        if t.hosted.frees or t.hosted.aux_frees:
            self._free_host()
        if t.aux.frees or t.spills:
            self._free_aux()
        if self.host is not None:
            self.host.poll()
        if t.events and self.publisher is not None:     # recorded only with one
            self.publisher.publish(t.events)
            t.events = []
        if self._debug:
            self.check()
