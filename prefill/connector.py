"""The prefill role's side of the engine: finished prompts whose KV is held until it is sent.

:class:`PrefillConnector` is the scheduler's KVConnector on a prefill worker (engine/connector.py):
a request that finishes normally (its one sampled token) keeps its row and locked KV (``Keep.HELD``)
until a ``Release``. :class:`PrefillHandle` is how the prefill worker
reaches it:

    held_pages(rid, start) -> HeldKV    page ids of positions [start, len(prompt)) and usage;
                                        hybrid models: the SWA rows of the window decode keeps
                                        past ``start`` and the working state row (the state at
                                        the prompt's end), engine/hybrid.py ``transfer_rows``
    release_held(rid)                   the write ended (or never started): cache / free the KV
    page_digest(regions) -> str         digest of the regions' pages about to be sent
    receive(greq, on_chunk), cancel(rid, why), store(rid)
                                        a decode worker's finished sequence written into
                                        reserved pages (worker/receiving.py), then cached
                                        (prefill/store.py; ``store`` sends the engine's ``Store``)
"""

from __future__ import annotations

from tandem.worker.receiving import Keep, ReceivingConnector, ReceivingHandle


class PrefillConnector(ReceivingConnector):
    """Engine thread, except :meth:`expect` and :meth:`forget`: every computed prompt that
    finishes normally is held for sending; a received one ("stored") goes to the cache."""

    def keeps(self, rid: str, reason: str) -> Keep:
        return Keep.NO if reason in ("abort", "stored") else Keep.HELD


class PrefillHandle(ReceivingHandle):
    """``receive``, ``cancel``, ``page_digest``: worker/receiving.py; ``held_pages``,
    ``release_held``, ``store``: engine/handle.py."""

    ROLE, CONNECTOR = "prefill", PrefillConnector
    connector: PrefillConnector
