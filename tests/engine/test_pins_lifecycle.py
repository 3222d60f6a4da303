"""A request's pins (issue 52: Anthropic ``cache_control`` / OpenAI ``prompt_cache_retention``) land in
the cache of the worker where the request ends, whatever happened to it on the way: retracted and
restored from the host pool, retracted and recomputed, or resumed on another worker after a
migration or a failover (the resume carries the request's pins). The real scheduler, cache and
pools on the stand-in model (fake_model.py), with the invariant check after every step."""

from __future__ import annotations

import pytest

from tandem.core.messages import GenerateRequest, Resume
from tandem.core.types import SamplingParams

from fake_model import oracle
from test_scheduler_fake import Driver, idle, make, prompt


def _pinned(e) -> list[tuple[str, int]]:
    return [(p["tenant"], p["tokens"]) for p in e.cache.pins()]


@pytest.mark.parametrize("host", [0, 512])
def test_pins_survive_retraction(host):
    e = make(tokens=1024, host=host, retract_every=2)
    d = Driver(e)
    p = prompt(5, 30)
    e.submit(GenerateRequest("r", tuple(p), SamplingParams(max_tokens=12, ignore_eos=True),
                             tenant="acme", pins=((24, 300),)), d.chunks["r"].append)
    d.run()
    st = e.scheduler.stats
    assert st["retractions"] >= 2 and (st["retraction_restores"] > 0) == bool(host)
    assert d.tokens("r") == oracle(p, 12)
    assert _pinned(e) == [("acme", 24)]          # the 24-token breakpoint, page-aligned (page 4)
    assert e.cache.pinned_tokens == {"acme": 24}
    idle(e)


def test_pins_travel_with_a_resumed_request():
    """A failover or a migration by recompute: the new worker gets the request (its pins too)
    and the tokens the client has; the prefix is pinned there when the request ends."""
    a, b = make(), make()
    p, n = prompt(3, 21), 12
    da, db = Driver(a), Driver(b)
    greq = GenerateRequest("m", tuple(p), SamplingParams(max_tokens=n, ignore_eos=True), tenant="t",
                           pins=((16, 3600),))
    a.submit(greq, da.chunks["m"].append)
    for _ in range(5):
        da.step()
    a.abort("m")                                   # A is gone as far as this request goes
    da.run()
    sent = [t for c in da.chunks["m"] for t in c.token_ids]
    from dataclasses import replace
    b.submit(replace(greq, resume=Resume(tuple(sent), len(da.text("m")))), db.chunks["m"].append)
    db.run()
    assert sent + db.tokens("m") == oracle(p, n)
    assert _pinned(b) == [("t", 16)]
    idle(a)
    idle(b)
