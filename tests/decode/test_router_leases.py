"""decode/leases.py: a stream's router must keep renewing its lease, or the stream is aborted;
a worker that was itself stopped does not blame the routers for its own gap."""

from __future__ import annotations

from tandem.decode.leases import JUMP_S, TICK_S, RouterLeases


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _run(leases: RouterLeases, clock: Clock, seconds: float, renew: tuple[str, ...] = ()) -> list[str]:
    """Tick once a second for ``seconds``, the routers in ``renew`` renewing each tick."""
    gone = []
    for _ in range(int(seconds / TICK_S)):
        clock.t += TICK_S
        for r in renew:
            leases.renew(r)
        gone += leases.expired()
    return gone


def test_a_silent_router_s_streams_expire_once_and_a_renewing_router_s_never_do():
    clock = Clock()
    leases = RouterLeases(lease_s=5.0, clock=clock)
    leases.open("a1", "router-a")
    leases.open("a2", "router-a")
    leases.open("b1", "router-b")
    leases.open("local", None)            # no lease: never expired
    assert _run(leases, clock, 4.0, renew=("router-a", "router-b")) == []
    gone = _run(leases, clock, 7.0, renew=("router-b",))   # router-a is killed
    assert sorted(gone) == ["a1", "a2"]
    assert _run(leases, clock, 20.0, renew=("router-b",)) == []   # each expired once, b renews
    assert set(leases.streams) == {"b1"}
    leases.close("b1")
    assert leases.streams == {}


def test_the_worker_s_own_stop_restarts_every_lease():
    clock = Clock()
    leases = RouterLeases(lease_s=5.0, clock=clock)
    leases.open("a1", "router-a")
    leases.renew("router-a")
    clock.t += 60.0                       # SIGSTOPped for a minute: no tick ran
    assert leases.expired() == []         # a late tick: the gap was ours
    assert _run(leases, clock, 3.0, renew=("router-a",)) == []
    clock.t += JUMP_S                     # a late tick within the bound is not a jump...
    assert leases.expired() == []
    assert _run(leases, clock, 3.0) == ["a1"]   # ...and the router, silent since, has lost it


def test_a_router_s_heartbeat_sets_its_own_lease():
    clock = Clock()
    leases = RouterLeases(lease_s=15.0, clock=clock)
    leases.open("short", "router-s")
    leases.open("default", "router-d")
    leases.renew("router-s", 3.0)         # router-s names a 3 s lease; router-d names none
    leases.renew("router-d")
    assert _run(leases, clock, 4.0) == ["short"]   # past 3 s: only router-s's stream
    assert _run(leases, clock, 10.0) == []         # router-d's 15 s are not over yet
    assert _run(leases, clock, 2.0) == ["default"]
