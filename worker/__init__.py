"""What prefill and decode workers share: the role worker (NIXL agent owner, live handoffs, held
KV), the regions a transfer moves, digests, the engine handle base, the actor shell's pieces, and
the tier attach. See worker/README.md."""
