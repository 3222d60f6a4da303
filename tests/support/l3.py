"""Cleanup after a test that killed a Mooncake master under live store clients."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager


@contextmanager
def master_back(master):
    """Stop ``master`` (if it still runs) and, for the block, run a master on its ports again:
    the clients left to the dead one reconnect to it, so their pending calls and their teardown
    (a client's close, its destructor) end at once instead of waiting for Mooncake to give up.
    Stopped after the block. Where its ports were taken meanwhile, the block runs without it."""
    from tandem.cache.tiers.l3 import mooncake as mc

    master.stop()
    try:
        again = mc.MasterProcess(address=master.address)
    except RuntimeError:
        again = None
    try:
        yield
    finally:
        if again is not None:
            again.stop()


def join_store_threads(others, timeout: float = 60.0) -> None:
    """Wait out the store calls abandoned to a dead master (threads named ``l3-store`` that are
    not in ``others``, the threads there before), so their teardown does not run on in later
    tests' time (inside :func:`master_back`, they end at once)."""
    end = time.monotonic() + timeout
    for t in set(threading.enumerate()) - others:
        if t.name.startswith("l3-store"):
            t.join(max(0.0, end - time.monotonic()))
