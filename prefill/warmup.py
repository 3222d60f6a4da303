"""Prefix warm-up (P->P): another prefill worker, the KVSource, computes a popular prefix or finds
it in its cache, holds it and WRITEs it into pages reserved here past this cache's match; this
worker caches it, so requests sharing the prefix are computed here from past it. The receiving
side is the reply push's (prefill/store.py); ``WorkerOptions.prefix_warmup`` turns it on."""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from tandem.core.messages import GenerateRequest
from tandem.prefill.store import ReplyStore
from tandem.worker.kv_flow_types import KVSource


async def warm_up(store: ReplyStore, prefix_ids: Sequence[int], source: KVSource,
                  cache_salt: int = 0) -> int:
    """Receive ``prefix_ids``' KV from ``source`` and cache it here; the tokens received (0:
    nothing moved: no room, the source failed, or this cache already held it)."""
    wire = GenerateRequest(f"warm-{secrets.token_hex(6)}", tuple(prefix_ids), cache_salt=cache_salt).to_wire()
    return await store.store(wire, source)
