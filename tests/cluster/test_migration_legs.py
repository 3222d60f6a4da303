"""cluster/migration.py and cluster/legs.py on stand-ins for the pool, the dispatcher and the
decode actors (no Ray): which leg comes next, each move's phases, and what it adds to
tandem_decode_migrations_total."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import REGISTRY

from tandem.cluster import migration
from tandem.cluster.legs import Legs
from tandem.cluster.migration import Migrator
from tandem.cluster.moves import Phase
from tandem.cluster.workers import DECODE, WorkerRef
from tandem.core.config import MigrationConfig
from tandem.core.messages import GenerateRequest
from tandem.core.types import SamplingParams, StreamChunk
from tandem.router import rebalance
from tandem.router.rebalance import MoveReason, MoveRequest


class _Actor:
    """A decode actor's handle: records every call; ``generate`` answers a stream token."""

    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls
        for verb in ("freeze", "release_frozen"):
            setattr(self, verb, SimpleNamespace(remote=lambda rid, v=verb: self._call(v, rid)))
        self.generate = SimpleNamespace(options=lambda **_: SimpleNamespace(remote=self._generate))

    def _call(self, verb: str, rid: str):
        self.calls.append((verb, self.name, rid))   # sent at once, as Ray sends it; awaiting is optional
        done = asyncio.get_running_loop().create_future()
        done.set_result(True)
        return done

    def _generate(self, wire: dict, source: str | None, router: str | None):
        self.calls.append(("generate", self.name, source, len(wire.get("resume") or {}) > 0))
        return f"stream-{self.name}-{len(self.calls)}"


def _cluster(cfg: MigrationConfig | None = None):
    calls: list = []
    s, t = (WorkerRef(f"decode-{i}", DECODE, i, None) for i in (0, 1))
    for w in (s, t):
        w.handle = _Actor(w.name, calls)
    pool = SimpleNamespace(get={s.wid: s, t.wid: t}.get, named={s.name: s, t.name: t}.get)
    views = [SimpleNamespace(worker_id=w.wid, alive=True, running_tokens=0, in_flight=0) for w in (s, t)]
    dispatch = SimpleNamespace(snapshots=dict, view=lambda: SimpleNamespace(decode=views),
                               move=lambda r, wid: calls.append(("move", wid)))
    live: dict = {}   # the backend's streams, as the Migrator sees them: worker-side rid -> Legs
    m = Migrator(pool, dispatch, lambda: dict(live), cfg=cfg or MigrationConfig(policy="off", precopy=False))
    m.live_legs = live
    return m, s, t, calls


def _open(m, rid: str, route, d) -> Legs:
    """``rid``'s first leg on ``d``, filed where the backend files it (its stream's ``legs``)."""
    legs = m.live_legs[rid] = Legs.start(m, _req(rid), route, d, None)
    return legs


def _streaming(rid: str, first=(5,)):
    """A cluster and ``rid``'s legs on decode-0, with ``first`` streamed to its client."""
    m, s, t, calls = _cluster()
    route = SimpleNamespace(decode=s.wid, decode_tokens=3, decode_open=True)
    legs = _open(m, rid, route, s)
    legs.add(_chunk(rid, first))
    return m, s, t, calls, legs


def _req(rid: str) -> GenerateRequest:
    return GenerateRequest(rid, (1, 2, 3), SamplingParams(max_tokens=8))


def _chunk(rid: str, ids=(), finish=None, error=None) -> StreamChunk:
    return StreamChunk(rid, tuple(ids), "x" * len(ids), finish, 3, error=error)


def _count(reason: str, outcome: str) -> float:
    return REGISTRY.get_sample_value("tandem_decode_migrations_total", {"reason": reason, "outcome": outcome}) or 0.0


def test_a_move_freezes_continues_on_the_target_and_is_done_when_the_target_streams():
    async def run():
        m, s, t, calls, legs = _streaming("r1", (5, 6))
        ok0 = _count("admin", "ok")
        assert await m.migrate("r1") == t.name and m.moves["r1"].phase is Phase.FROZEN
        assert ("freeze", s.name, "r1") in calls
        assert await legs.next_leg(_chunk("r1", (), "migrated"))
        assert legs.worker is t and m.moves["r1"].phase is Phase.COPYING
        assert calls[-1] == ("generate", t.name, s.name, True)   # resumed, its KV from the source
        assert not await legs.next_leg(_chunk("r1", (7,)))
        legs.add(_chunk("r1", (7,)))
        assert "r1" not in m.moves and _count("admin", "ok") == ok0 + 1 and legs.ids == [5, 6, 7]
        assert m.counts["migrations"] == 1 and m.counts["admin"] == 1
        legs.close()
        assert m.moves == {} and m.where() == {"r1": t}   # the Migrator filed nothing of its own

    asyncio.run(run())


def test_a_target_that_fails_first_falls_back_to_the_source_and_counts_a_failure():
    async def run():
        m, s, t, calls, legs = _streaming("r2")
        failed0 = _count("drain", "failed")
        await m.migrate("r2", reason=MoveReason.DRAIN)
        await legs.next_leg(_chunk("r2", (), "migrated"))
        assert legs.target_died() is not None             # the target died: an empty abort for next_leg
        assert await legs.next_leg(_chunk("r2", (), "abort", error="target died"))
        assert legs.worker is s and ("release_frozen", s.name, "r2") in calls
        assert calls[-1] == ("generate", s.name, None, True)      # back on the source, from its cache
        assert "r2" not in m.moves and m.counts["fallbacks"] == 1 and _count("drain", "failed") == failed0 + 1

    asyncio.run(run())


def test_a_client_gone_mid_move_releases_the_frozen_kv_and_counts_an_abort():
    async def run():
        m, s, t, calls = _cluster()
        legs = _open(m, "r3", "route", s)
        aborted0 = _count("admin", "aborted")
        await m.migrate("r3")
        legs.close()
        assert ("release_frozen", s.name, "r3") in calls and _count("admin", "aborted") == aborted0 + 1
        assert m.moves == {}

    asyncio.run(run())


def test_a_request_that_is_not_decoding_is_refused_and_counts_nothing():
    async def run():
        m, s, t, calls = _cluster()
        _open(m, "r4", "route", s)

        async def refuse(rid):
            raise ValueError(f"{rid} is not decoding")

        s.handle.freeze = SimpleNamespace(remote=refuse)
        before = {o: _count("admin", o) for o in ("ok", "failed", "aborted")}
        try:
            await m.migrate("r4")
        except ValueError as e:
            assert "not decoding" in str(e)
        else:
            raise AssertionError("migrate did not refuse")
        assert m.moves == {} and m.counts["refused"] == 1 and m.counts["migrations"] == 0
        assert {o: _count("admin", o) for o in before} == before

    asyncio.run(run())


def test_a_stuck_source_resumes_on_a_peer_which_recomputes():
    async def run():
        m, s, t, calls, legs = _streaming("r5")
        assert legs.prestop() and legs.worker is t
        assert calls[-1] == ("generate", t.name, None, True) and m.moves["r5"].reason is MoveReason.PRESTOP
        assert legs.target_died() is None                 # nothing frozen to fall back to
        ok0 = _count("prestop", "ok")
        legs.add(_chunk("r5", (6,)))
        assert _count("prestop", "ok") == ok0 + 1 and m.counts["prestop"] == 1

    asyncio.run(run())


def test_a_dead_worker_s_request_fails_over_to_a_live_peer_which_recomputes():
    """Failover (cluster/stream.py's DECODE_DIED row): the request resumes on the live decode worker
    after what its client has, its KV recomputed there; no migration is counted (nothing moved)."""
    async def run():
        m, s, t, calls, legs = _streaming("r7", (5, 6))
        s.alive = False
        m.dispatch.view().decode[0].alive = False
        ok0 = _count("prestop", "ok")
        assert await legs.failover(s, wait_s=0.0)
        assert legs.worker is t and calls[-1] == ("generate", t.name, None, True)
        assert ("move", t.wid) in calls and m.where()["r7"] is t and m.counts["failovers"] == 1
        legs.add(_chunk("r7", (7,)))
        assert legs.ids == [5, 6, 7] and m.moves == {} and _count("prestop", "ok") == ok0

    asyncio.run(run())


def test_a_failover_with_no_live_peer_waits_for_one_then_gives_up_or_resumes():
    """1P+1D: the only decode worker died. With none in rotation the request waits up to the wait
    (None past it); a replacement that joins within it takes the request."""
    async def run():
        m, s, t, calls, legs = _streaming("r8")
        views = m.dispatch.view().decode
        for v in views:
            v.alive = False
        assert await m.failover(legs, s, wait_s=0.15) is None
        assert legs.worker is s and m.counts["failovers"] == 0

        looked = []
        target = m.target

        def replacement_joins(exclude):   # it comes into rotation after the router looked twice
            looked.append(exclude)
            views[1].alive = len(looked) > 2
            return target(exclude)

        m.target = replacement_joins
        assert await legs.failover(s, wait_s=30.0) and legs.worker is t and len(looked) == 3

    asyncio.run(run())


# A new migration trigger touches two files (cluster/README.md): router/rebalance.py (its
# MoveReason, its planner, in PERIODIC when it runs on the policy's clock) and core/config.py
# (its MigrationConfig field). The two tests below hold the rest of the product to that.

def test_a_planner_in_periodic_is_carried_out_and_counted_under_its_reason(monkeypatch):
    def plan_every(decodes, running, cfg, exclude):   # a trigger written only where planners live
        return [MoveRequest(rid, wid, None, MoveReason.PRESSURE) for rid, wid, _ in running]

    monkeypatch.setattr(migration, "PERIODIC", (plan_every,))

    async def run():
        m, s, t, calls, legs = _streaming("r6")
        assert await m.rebalance_once(MigrationConfig()) == ["r6"]
        assert ("freeze", s.name, "r6") in calls and m.moves["r6"].reason is MoveReason.PRESSURE
        assert m.counts["pressure"] == 1
        await legs.next_leg(_chunk("r6", (), "migrated"))
        ok0 = _count("pressure", "ok")
        legs.add(_chunk("r6", (6,)))
        assert _count("pressure", "ok") == ok0 + 1

    asyncio.run(run())


ROOT = Path(__file__).resolve().parents[2]


def test_only_the_planners_module_and_the_config_name_a_periodic_trigger():
    """The periodic triggers' reasons, planners and thresholds are named in no other product file:
    everything else (the Migrator, its counts, the metric's labels) is generic over MoveReason."""
    attrs = {"PRESSURE", "REBALANCE", "high", "low", "spread"}   # MoveReason.X, cfg.x
    names = {p.__name__ for p in rebalance.PERIODIC} | {"plan_moves"}
    strings = {r.value for r in (MoveReason.PRESSURE, MoveReason.REBALANCE)}
    home = {"router/rebalance.py", "core/config.py"}
    bad = []
    for pkg in ("cluster", "router", "core", "decode", "prefill", "sim", "worker"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(f.relative_to(ROOT))
            for node in ast.walk(ast.parse(f.read_text())) if rel not in home else ():
                if (isinstance(node, ast.Attribute) and node.attr in attrs
                        or isinstance(node, ast.Name) and node.id in names
                        or isinstance(node, ast.Constant) and node.value in strings):
                    bad.append(f"{rel}:{node.lineno} names {ast.unparse(node)}")
    assert not bad, "\n".join(bad)
