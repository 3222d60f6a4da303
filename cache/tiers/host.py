"""Host tier (L2): host pools mirroring the device pools' layout, and the cache's collaborator for
moving requests' KV to the host and back."""

from __future__ import annotations

from typing import Any, Callable, Hashable, Mapping, Sequence

import torch

from tandem.cache.allocator import PagedAllocator
from tandem.cache.kv_pool import KVPool
from tandem.cache.radix.copier import KVCopier
from tandem.cache.radix.tree import concat_values
from tandem.cache.tiers.base import CachePort

WRITE_POLICIES = ("write_through", "write_back")


class HostStore:
    """Host pool of one auxiliary component: ``rows`` host rows (row 0 padding) shaped like the
    device pool's, a ``PagedAllocator(rows, 1)`` and a copier."""

    def __init__(self, name: str, device_data: torch.Tensor, rows: int):
        if rows < 1:
            raise ValueError(f"host store {name!r}: rows={rows} must be >= 1")
        self.name = name
        shape = list(device_data.shape)
        shape[2] = rows + 1
        self.data = torch.zeros(shape, dtype=device_data.dtype, device="cpu",
                                pin_memory=device_data.device.type == "cuda")
        self.allocator = PagedAllocator(rows, 1)
        self.copier = KVCopier(device_data, self.data)

    @property
    def bytes_per_row(self) -> int:
        return self.data[:, :, 0].numel() * self.data.element_size()


def _as_rows(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(torch.int64)
    return torch.tensor([int(value)], dtype=torch.int64)


class HostTier:
    """The host (L2) :class:`~tandem.cache.tiers.base.KVTier`. A component without a
    :class:`HostStore` in ``stores`` never gets host copies (host-only nodes fail its vote)."""

    def __init__(self, device_pool: KVPool, num_tokens: int, write_policy: str = "write_through",
                 stores: Sequence[HostStore] = ()):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown host write policy {write_policy!r}; expected one of {WRITE_POLICIES}")
        ps = device_pool.page_size
        if num_tokens < ps:
            raise ValueError(f"host_pool_tokens={num_tokens} holds no page of page_size={ps}")
        num_pages = num_tokens // ps
        self.page_size = ps
        self.write_policy = write_policy
        self.pool = KVPool(num_pages * ps, ps, len(device_pool.layer_ids), device_pool.num_kv_heads,
                           device_pool.head_dim, dtype=device_pool.dtype, device="cpu",
                           layer_ids=device_pool.layer_ids, pin_memory=True)
        self.allocator = PagedAllocator(num_pages, ps)
        self.copier = KVCopier(device_pool.kv_data, self.pool.kv_data)
        self.stores: dict[str, HostStore] = {st.name: st for st in stores}
        if len(self.stores) != len(stores):
            raise ValueError(f"host stores repeat a name: {[st.name for st in stores]}")
        self._aux: list[tuple[int, Any, HostStore]] = []
        self._port: CachePort | None = None

    @property
    def port(self) -> CachePort:
        """The bound cache's port (RuntimeError before :meth:`bind`)."""
        if self._port is None:
            raise RuntimeError("the host tier is not bound to a cache yet")
        return self._port

    @property
    def write_through(self) -> bool:
        return self.write_policy == "write_through"

    name = "host"
    prefetching = False

    def bind(self, port: CachePort) -> None:
        if self._port is not None and self._port is not port:
            raise ValueError("a HostTier serves one cache")
        if port.allocator is None or port.page_size != self.page_size:
            raise ValueError("a host tier needs a device allocator with the same page_size")
        comps = {c.name: (i, c) for i, c in enumerate(port.components)}
        unknown = set(self.stores) - set(comps)
        if unknown:
            raise ValueError(f"host stores {sorted(unknown)} name no component of the cache "
                             f"({sorted(comps)})")
        self._port = port
        self._aux = [(*comps[name], st) for name, st in self.stores.items()]

    def lookup(self, token_ids, m) -> int:
        """The tokens below ``m``'s device prefix that only the host holds."""
        return m.host_hit_length

    def load(self, token_ids, m, *, session_id=None) -> bool:
        return self.restore(m.best_match_node) is not None

    def prefetch(self, token_ids, m, *, session_id=None) -> None:
        return None

    def on_insert(self, node, created: bool, adopted: bool) -> None:
        if created and self.write_through:
            self.copy_node(node)

    def on_evict(self, node) -> None:
        """Back ``node`` up before it leaves the device (FULL KV, then each component's data)."""
        if node.host is None or self.stores:
            self.copy_node(node)

    def on_spill(self, spills) -> None:
        pass

    def as_dict(self) -> dict:
        return {"write_policy": self.write_policy,
                **{name: {"used": u, "size": n} for name, (u, n) in self.usage().items()}}

    def close(self) -> None:
        self.synchronize()

    def used(self) -> int:
        return self.port.tree.hosted.size

    def usage(self) -> dict[str, tuple[int, int]]:
        """``{"full": (tokens with a host copy, host pool tokens), name: (rows used, rows)}``."""
        t = self.port.tree
        out = {"full": (t.hosted.size, self.allocator.size)}
        for i, _, st in self._aux:
            out[st.name] = (t.hosted.aux_size[i], st.allocator.size)
        return out

    def synchronize(self) -> None:
        self.copier.synchronize()
        for _, _, st in self._aux:
            st.copier.synchronize()

    def poll(self) -> None:
        self.copier.poll()
        for _, _, st in self._aux:
            st.copier.poll()

    def copy_node(self, nd) -> bool:
        """Copy what ``nd`` has on the device and not yet on the host to new host slots: its FULL
        KV, then each component's data (same-name transfer), evicting unlocked host
        copies when short."""
        t = self.port.tree
        if nd.host is None:
            if self.allocator.available_size() < len(nd.key):
                self.port.make_room_host(len(nd.key) - self.allocator.available_size())
            host_slots = self.allocator.alloc(len(nd.key))
            if host_slots is None:
                return False
            self.copier.to_host(nd.value, host_slots)
            t.hosted.set(nd, host_slots)
        for i, c, st in self._aux:
            if nd.aux[i] is not None and nd.aux_host[i] is None:
                self._copy_aux(nd, i, c, st)
        return True

    def copy_aux(self, nd, i: int) -> None:
        """Before component ``i``'s device data on ``nd`` is dropped (a component eviction):
        copy it to the host if ``nd`` has a FULL host copy and the component a host store."""
        if nd.host is None or nd.aux_host[i] is not None:
            return
        for j, c, st in self._aux:
            if j == i:
                self._copy_aux(nd, i, c, st)

    def _copy_aux(self, nd, i: int, c, st: HostStore) -> bool:
        t = self.port.tree
        v = nd.aux[i]
        n = c.size(v)
        if st.allocator.available_size() < n:
            self.port.make_room_host(n - st.allocator.available_size(), i)
        rows = st.allocator.alloc(n)
        if rows is None:
            return False
        st.copier.to_host(_as_rows(v), rows)
        t.hosted.set_aux(nd, i, rows if c.per_token else int(rows[0]))
        return True

    def backup(self, token_ids: Sequence[int], slots: torch.Tensor, last_node, *,
               extra: Mapping[str, Any] | Callable[[], Mapping[str, Any] | None] | None = None,
               session_id: Hashable | None = None) -> tuple[Any, int]:
        """Retraction: move a request's KV to the host tier and free its device slots."""
        c = self.port
        _, node = c.cache(token_ids, slots, last_node, extra=extra, session_id=session_id)
        t = c.tree
        freed = 0
        nd = node
        while nd is not t.root and nd.lock_ref == 1 and nd.value is not None and nd.ndc == 0:
            if not self.copy_node(nd):
                break
            freed += t.drop_device(nd)
            nd = nd.parent
        c.settle()
        return node, freed

    def restore(self, node) -> torch.Tensor | None:
        """Bring the host-only nodes on root..``node`` back to the device, then the components' data its
        ``lock_span`` covers. Returns the device slots of the whole path, or None when the device has no
        room for the FULL KV. Does not lock ``node``."""
        c = self.port
        t = c.tree
        if node.parent is None and node is not t.root:
            raise ValueError(f"restore({node}): the node is not in the tree")
        path = t.path(node)
        todo = [nd for nd in path if nd.value is None]
        t.lock(node, +1)
        try:
            if todo:
                need = sum(len(nd.key) for nd in todo)
                alloc = c.allocator
                if alloc.available_size() < need:
                    c.make_room(need - alloc.available_size())
                slots = alloc.alloc(need)
                if slots is None:
                    return None
                self.copier.to_device(torch.cat([nd.host for nd in todo]), slots)
                off = 0
                for nd in todo:
                    t.set_device(nd, slots[off:off + len(nd.key)])
                    off += len(nd.key)
            for i, comp, st in self._aux:
                self._restore_aux(path, i, comp, st)
        finally:
            t.lock(node, -1)
            c.settle()
        return concat_values([nd.value for nd in path])

    def _restore_aux(self, path: list, i: int, comp, st: HostStore) -> None:
        if not path:
            return
        t, floor = self.port.tree, path[-1].end - comp.lock_span
        todo = []
        for nd in reversed(path):
            if nd.end <= floor:
                break
            if nd.aux[i] is None and nd.aux_host[i] is not None:
                todo.append(nd)
        if not todo:
            return
        todo.reverse()
        sizes = [comp.size(nd.aux_host[i]) for nd in todo]
        alloc = comp.allocator
        if alloc.available_size() < sum(sizes):
            self.port.make_room_aux(i, sum(sizes) - alloc.available_size())
        rows = alloc.alloc(sum(sizes))
        if rows is None:
            return
        st.copier.to_device(torch.cat([_as_rows(nd.aux_host[i]) for nd in todo]), rows)
        off = 0
        for nd, n in zip(todo, sizes):
            part = rows[off:off + n]
            off += n
            value = part.clone() if comp.per_token else int(part[0])
            t.aux.set(nd, i, value)
            comp.bind(nd, value)

    @staticmethod
    def host_only(node) -> bool:
        return node is not None and node.value is None
