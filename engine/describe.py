"""The cache half of an engine's startup line: its components and their pools.

``Engine.startup_line`` (which ``tandem serve`` prints for the colocated engine and every Ray
worker) ends with :func:`components_clause`:

    ...; components full+swa: full 2 layers x 1024 tokens, page 4 (0.5 MiB); swa window 8,
    1024 rows x 2 layers (0.5 MiB); host swa 512 rows (0.3 MiB)
    ...; components full+mamba: full 1 layers x 1024 tokens, page 4 (0.3 MiB); mamba 10 state
    slots x 3 layers (17.6 KiB/slot, 0.2 MiB); host mamba 10 rows (0.2 MiB)
"""

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
