"""The long run of ``tandem chaos``: rounds of the plan for ``--duration``, timed faults, samples."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field

from tandem.loadtest.chaos import sampler
from tandem.loadtest.chaos.client import RunConfig, run_plan
from tandem.loadtest.chaos.plan import make_plan

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_seconds(spec: str | float) -> float:
    """``"30m"``, ``"90s"``, ``"1.5h"``, ``"45"`` -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(spec))
    if not m:
        raise ValueError(f"{spec!r}: expected a duration such as 90s, 30m, 2h")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_stop(spec: str) -> tuple[float, str, float]:
    """``"decode@30+10"`` -> (30.0, "decode", 10.0): SIGSTOP a decode worker 30 s in, for 10 s;
    ``"decode-1@30+10"``: the worker named decode-1."""
    m = re.fullmatch(r"((?:decode|prefill)(?:-\d+)?)@(\d+(?:\.\d+)?)\+(\d+(?:\.\d+)?)", spec)
    if not m:
        raise ValueError(f"--stop {spec!r}: expected ROLE@SECONDS+SECONDS or NAME@SECONDS+SECONDS "
                         f"(ROLE decode or prefill, NAME e.g. decode-1)")
    return float(m.group(2)), m.group(1), float(m.group(3))


def parse_router_kill(spec: str, routers: int) -> tuple[float, int]:
    """``"1@40"`` -> (40.0, 1): SIGKILL router 1 (``--also-url``'s first) 40 s in."""
    m = re.fullmatch(r"(\d+)@(\d+(?:\.\d+)?)", spec)
    if not m or not 1 <= int(m.group(1)) < routers:
        raise ValueError(f"--kill-router {spec!r}: expected I@SECONDS with 1 <= I < {routers} "
                         f"(router 0 must survive: the run checks the KV through it)")
    return float(m.group(2)), int(m.group(1))


def sample_every_s(args) -> float:
    """``--sample-every`` in seconds; by default once a minute in a soak (``--duration``), else never."""
    if args.sample_every is None:
        return 60.0 if parse_seconds(args.duration) > 0 else 0.0
    return parse_seconds(args.sample_every)


@dataclass
class Soak:
    """What the run did beside the requests."""

    events: list[str] = field(default_factory=list)
    series: sampler.Series = field(default_factory=sampler.Series)
    rounds: int = 0

    def log(self, t: float, msg: str) -> None:
        self.events.append(f"{t:.1f}s {msg}")
        print(f"tandem chaos: {t:.1f}s {msg}", file=sys.stderr)


async def _at(t0: float, at: float, coro_fn) -> None:
    await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
    await coro_fn()


async def _stop(soak: Soak, t0: float, who: str, dur: float, roots: list[int], urls: list[str]) -> None:
    role = who.split("-")[0]
    procs = await asyncio.to_thread(sampler.local_processes, urls)
    pids = (await asyncio.to_thread(sampler.actor_pids, roots + list(procs.values())))[role]
    pid = sampler.actor_named(who, pids) if "-" in who else (pids[0] if pids else None)
    if pid is None:
        soak.log(time.perf_counter() - t0, f"stop: no {who} actor process found on this machine "
                                           f"({role} processes: {pids})")
        return
    os.kill(pid, signal.SIGSTOP)
    soak.log(time.perf_counter() - t0, f"SIGSTOP {who}@{pid} for {dur:g}s")
    try:
        await asyncio.sleep(dur)
    finally:
        os.kill(pid, signal.SIGCONT)
        soak.log(time.perf_counter() - t0, f"SIGCONT {who}@{pid}")


async def _kill_router(soak: Soak, t0: float, i: int, cfg: RunConfig, wait_s: float = 30.0) -> None:
    """SIGKILL router ``i`` once a request streams through it (waiting up to ``wait_s``)."""
    end = time.perf_counter() + wait_s
    while not cfg.inflight.get(i) and time.perf_counter() < end:
        await asyncio.sleep(0.05)
    pid = (await asyncio.to_thread(sampler.local_processes, [cfg.routers()[i]])).get("router-0")
    if pid is None:
        soak.log(time.perf_counter() - t0, f"kill-router: nothing listens at {cfg.routers()[i]}")
        return
    cfg.dead.add(i)
    os.kill(pid, signal.SIGKILL)
    soak.log(time.perf_counter() - t0, f"SIGKILL router {i} ({cfg.routers()[i]}, pid {pid}) with "
                                       f"{cfg.inflight.get(i, 0)} request(s) in flight")


async def _sample_loop(soak: Soak, t0: float, every: float, http, cfg: RunConfig, roots: list[int],
                       done: asyncio.Event) -> None:
    while True:
        t = time.perf_counter() - t0
        urls = [u for i, u in enumerate(cfg.routers()) if i not in cfg.dead]
        stats = await asyncio.to_thread(sampler.sample_all, urls, roots)
        try:
            kv = sampler.kv_totals((await http.get("/debug/kv", timeout=60)).json()["workers"])
        except Exception as e:  # noqa: BLE001
            kv = None
            soak.log(t, f"sample: GET /debug/kv failed: {type(e).__name__}")
        soak.series.add(t, stats, kv)
        try:
            await asyncio.wait_for(done.wait(), every)
            return
        except asyncio.TimeoutError:
            pass


async def run(args, cfg: RunConfig, http, on_kill) -> tuple[list, Soak]:
    """The rounds, the faults and the samples (see the module docstring) -> (outcomes, Soak)."""
    soak = Soak()
    duration = parse_seconds(args.duration)
    roots = list(args.ray_root_pid)
    stops = [parse_stop(s) for s in args.stop]
    kills = [parse_router_kill(s, len(cfg.routers())) for s in args.kill_router]
    rounds_cfg = RunConfig(cfg.url, cfg.model, cfg.api_key, cfg.timeout_s, [], cfg.urls, cfg.stall_s, cfg.dead,
                           cfg.inflight)
    t0 = time.perf_counter()
    done = asyncio.Event()
    tasks = [asyncio.ensure_future(_at(t0, at, lambda r=role: on_kill(r))) for at, role in cfg.kill]
    tasks += [asyncio.ensure_future(_at(t0, at, lambda r=role, d=d: _stop(soak, t0, r, d, roots, cfg.routers())))
              for at, role, d in stops]
    tasks += [asyncio.ensure_future(_at(t0, at, lambda i=i: _kill_router(soak, t0, i, rounds_cfg)))
              for at, i in kills]
    every = sample_every_s(args)
    sampling = asyncio.ensure_future(_sample_loop(soak, t0, every, http, cfg, roots, done)) if every > 0 else None
    outcomes = []
    try:
        while True:
            plans = make_plan(args.seed + soak.rounds, args.sessions, args.turns, max_tokens=args.max_tokens,
                              p_mid=args.abort_mid, p_early=args.abort_early)
            outcomes += await run_plan(rounds_cfg, plans)
            soak.rounds += 1
            if time.perf_counter() - t0 >= duration:
                break
        for t in tasks:
            await t
    finally:
        for t in tasks:
            t.cancel()
        done.set()
        if sampling is not None:
            await sampling
    return outcomes, soak
