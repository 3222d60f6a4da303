"""decode/migration.py's FrozenRequests: a frozen request's expiry fires once, ``ttl_s`` after its
hold, unless the request ended first (copied or released)."""

from __future__ import annotations

import asyncio

from tandem.decode.migration import FrozenRequests


def test_an_ended_hold_never_expires_and_a_live_one_expires_once():
    async def run():
        expired, done = [], asyncio.Event()

        def expire(rid: str) -> None:
            expired.append(rid)
            frozen.end(rid)             # what release_frozen does
            done.set() if rid == "b" else None

        frozen = FrozenRequests(expire, ttl_s=0.05)
        frozen.hold("a")
        frozen.hold("b")               # same delay, later: fires after a's would have
        frozen.hold("b")               # a second hold replaces the first timer
        assert "a" in frozen and len(frozen) == 2
        assert frozen.end("a") and not frozen.end("a") and not frozen.end("never")
        await asyncio.wait_for(done.wait(), 10)
        await asyncio.sleep(0)
        return expired, len(frozen)

    assert asyncio.run(run()) == (["b"], 0)
