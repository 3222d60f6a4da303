"""The cache half of an engine's startup line: its components and their pools."""

from __future__ import annotations


def _mib(t) -> float:
    return t.numel() * t.element_size() / 2**20


def components_clause(hybrid, full_pool, full_tokens: int, page_size: int, host=None) -> str:
    """``"components full+swa: <pool>; <pool>; host <component pools>"`` for one engine."""
    names = [c.name for c in hybrid.components]
    parts = [f"full {len(full_pool.layer_ids)} layers x {full_tokens} tokens, page {page_size} "
             f"({_mib(full_pool.kv_data):.1f} MiB)"]
    parts += [f"{name} {desc}" for name, desc in hybrid.describe().items()]
    if host is not None and host.stores:
        parts.append("host " + ", ".join(f"{n} {st.allocator.size} rows ({_mib(st.data):.1f} MiB)"
                                         for n, st in host.stores.items()))
    return f"components {'+'.join(names)}: " + "; ".join(parts)
