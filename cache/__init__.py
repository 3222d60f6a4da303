"""KV bookkeeping: allocators, pools (device, host), the unified radix tree, eviction, invariants.

Imports nothing from engine/ or transfer/ (see README.md).
"""
