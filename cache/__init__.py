"""KV bookkeeping: allocators, pools (device, host), the unified radix tree, eviction, invariants."""
