"""The health monitor: heartbeats, progress deadlines (suspect, then replaced), dead workers out of
rotation and relaunched, and discovery of workers other routers started (cluster/README.md). What it
finds (suspect, dead, a KV write late) it pushes into the streams waiting on that worker: ``alarms``
(cluster/alarms.py).

After :meth:`Supervisor.shutdown` no thread of ours touches Ray.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from tandem.cluster.alarms import Alarms
from tandem.cluster.workers import DECODE, PREFILL, WorkerPool, WorkerRef, replacement_name
from tandem.router import metrics as rm
from tandem.router.dispatch import Dispatcher
from tandem.router.view import WorkerSnapshot

if TYPE_CHECKING:
    from collections.abc import Callable

    from ray import ObjectRef

    from tandem.cluster.kv_feed import KVEventFeed
    from tandem.cluster.workers import Launching

log = logging.getLogger(__name__)

MONITOR_PERIOD_S = 1.0
PROBE_WAIT_S = 0.5
STUCK_STEP_FACTOR = 3.0
PING_TIMEOUT_S = 10.0
FORGET_TIMEOUT_S = 30.0
HELPER_JOIN_S = 10.0
DISCOVER_EVERY = 2


class Supervisor:
    """``launcher`` is cluster/launch.py's :class:`Launcher` (spawn, info, pair); ``feed`` the
    KV-event feed or None."""

    def __init__(self, pool: WorkerPool, dispatch: Dispatcher, launcher: Launching, *, restart: bool = True,
                 feed: KVEventFeed | None = None, discover: bool | None = None, progress_timeout_s: float = 5.0,
                 progress_replace_s: float = 60.0, router_id: str | None = None,
                 router_lease_s: float | None = None) -> None:
        """``discover``: adopt workers this router did not start; ``router_id`` and ``router_lease_s``
        (None: the worker's default lease): sent with each heartbeat."""
        self.router_id, self.router_lease_s = router_id, router_lease_s
        self.pool, self.dispatch, self.launcher, self.feed = pool, dispatch, launcher, feed
        self.progress_timeout_s, self.progress_replace_s = progress_timeout_s, progress_replace_s
        self._pings: dict[WorkerRef, ObjectRef[float]] = {}
        self._stats: dict[WorkerRef, ObjectRef[dict[str, Any]]] = {}
        self.restart = restart
        self.discover = launcher.detached if discover is None else discover
        self.restarts = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._restarting: set[tuple[str, int]] = set()
        self._launching: dict[tuple[str, int], WorkerRef] = {}
        self._helpers: set[threading.Thread] = set()
        self._pair_lock = threading.Lock()
        self._adopting: set[str] = set()
        self._rounds = itertools.count()
        self.alarms = Alarms()   # rung when a worker is found suspect, dead or late with a KV write

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="tandem-monitor", daemon=True)
        self._thread.start()

    def shutdown(self, kill: bool = True) -> None:
        """Stop the monitor, kill every worker (and any being launched) unless ``kill`` is
        False (detached workers outlive this router), join the helpers."""
        import ray

        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=PING_TIMEOUT_S + 2 * MONITOR_PERIOD_S)
        with self.pool.lock:
            doomed = self.pool.everyone() + list(self._launching.values()) if kill else []
        for w in doomed:
            try:
                ray.kill(w.handle)
            except Exception:  # noqa: BLE001
                pass
        for th in list(self._helpers):
            th.join(timeout=HELPER_JOIN_S)

    def _helper(self, target: Callable[[WorkerRef], object], w: WorkerRef, name: str) -> None:
        th = threading.Thread(target=self._run_helper, args=(target, w), name=name, daemon=True)
        with self.pool.lock:
            self._helpers.add(th)
        th.start()

    def _run_helper(self, target: Callable[[WorkerRef], object], w: WorkerRef) -> None:
        try:
            target(w)
        finally:
            with self.pool.lock:
                self._helpers.discard(threading.current_thread())

    def register(self, w: WorkerRef, info: dict[str, Any]) -> None:
        """``w`` joins the rotation: the dispatcher routes to it, its KV events are followed."""
        self.dispatch.add_worker(w.wid, w.role, w.name, self.launcher.capacity[w.role])
        if self.feed is not None and info.get("kv_events"):
            self.feed.add(w.wid, info["kv_events"], info.get("kv_replay"))

    def retire(self, w: WorkerRef) -> None:
        """``w`` (drained, now stopped) leaves for good: out of the pool, the dispatcher, the feed."""
        with self.pool.lock:
            self.pool.remove(w)
        self.dispatch.remove_worker(w.wid)
        if self.feed is not None:
            self.feed.remove(w.wid)

    def mark_dead(self, w: WorkerRef, why: str) -> None:
        """Out of rotation now; peers forget its agent (in a thread of its own, off the loop)."""
        with self.pool.lock:
            if not w.alive:
                return
            w.alive, w.error = False, why
        self.alarms.ring(w.wid)
        self.dispatch.mark_dead(w.wid)
        if self.feed is not None:
            self.feed.remove(w.wid)
        log.warning("%s worker %s is dead (%s)", w.role, w.name, why)
        if not self._stop.is_set():
            self._helper(self._forget, w, f"tandem-forget-{w.name}")

    def _watch(self) -> None:
        while not self._stop.wait(MONITOR_PERIOD_S):
            live = self.pool.everyone(alive_only=True)
            if not self._probe(live) or self._stop.is_set():
                return
            self._judge(live)
            if self.restart and not self._stop.is_set():
                self._replace_dead()
            if self.discover and next(self._rounds) % DISCOVER_EVERY == 0 and not self._stop.is_set():
                self._discover()

    def _probe(self, live: list[WorkerRef]) -> bool:
        """One heartbeat and one ``stats()`` outstanding per worker, waiting at most ``PROBE_WAIT_S``.
        A failed heartbeat is a dead worker. False: Ray shut down under us."""
        import ray

        try:
            for w in live:
                if w not in self._pings:
                    self._pings[w] = w.api.progress(self.router_id, self.router_lease_s)
                if w not in self._stats:
                    self._stats[w] = w.api.stats()
            refs = [self._pings[w] for w in live] + [self._stats[w] for w in live]
            ready = set(ray.wait(refs, num_returns=len(refs), timeout=PROBE_WAIT_S)[0]) if refs else set()
        except BaseException:  # noqa: BLE001
            return False
        now = time.monotonic()
        for w in live:
            if self._pings[w] in ready:
                try:
                    w.step_s = float(ray.get(self._pings.pop(w)))
                    w.last_answer = now
                except Exception as e:
                    if self._stop.is_set():
                        return False
                    self.mark_dead(w, f"ping failed: {type(e).__name__}")
                    continue
            if self._stats[w] in ready:
                self._take_stats(w, self._stats.pop(w))
        for gone in [w for w in list(self._pings) + list(self._stats) if not w.alive]:
            self._pings.pop(gone, None)
            self._stats.pop(gone, None)
        return True

    def _take_stats(self, w: WorkerRef, ref: ObjectRef[dict[str, Any]]) -> None:
        import ray

        try:
            stats = ray.get(ref)
            snap = WorkerSnapshot.from_stats(stats, self.dispatch.clock())
        except Exception as e:  # noqa: BLE001
            log.info("stats of %s unavailable: %s", w.name, e)
            return
        w.writing = dict(stats.get("writing") or {})
        if any(s > self.progress_timeout_s for s in w.writing.values()):
            self.alarms.ring(w.wid)   # a request waiting on that write re-dispatches
        if snap.draining and w.alive:
            w.retiring = True
        self.dispatch.update_snapshot(w.wid, snap)

    def _judge(self, live: list[WorkerRef]) -> None:
        """Progress deadlines: silent for ``progress_timeout_s`` (or one engine step ``STUCK_STEP_FACTOR``
        times that) is suspect; answering again, it rejoins; suspect for ``progress_replace_s``, replaced."""
        now = time.monotonic()
        for w in live:
            if not w.alive:
                continue
            silent = now - w.last_answer
            stuck = w.step_s > STUCK_STEP_FACTOR * self.progress_timeout_s
            if w.suspect_since is None:
                if silent > self.progress_timeout_s or stuck:
                    w.suspect_since = now
                    self.alarms.ring(w.wid)
                    self.dispatch.mark_suspect(w.wid)
                    rm.WORKER_STALLS.labels(w.role, "suspect").inc()
                    log.warning("%s worker %s made no progress (%s): suspect, out of rotation", w.role, w.name,
                                f"in one step for {w.step_s:.1f}s" if stuck else f"silent for {silent:.1f}s")
            elif w.last_answer > w.suspect_since and not stuck:
                self._rejoin(w)
            elif now - w.suspect_since > self.progress_replace_s:
                rm.WORKER_STALLS.labels(w.role, "replaced").inc()
                self.mark_dead(w, f"made no progress for {now - w.suspect_since + self.progress_timeout_s:.0f}s")
        rm.WORKERS_SUSPECT.set(sum(w.suspect_since is not None for w in self.pool.everyone(alive_only=True)))

    def _rejoin(self, w: WorkerRef) -> None:
        """``w`` answers again: the requests moved off it while it was stuck are aborted there
        (their pages go back to its pool), then it takes requests again."""
        import ray

        stale = sorted(w.stale)
        try:
            ray.get([w.api.abort(rid, "moved to another worker while this one made no progress")
                     for rid in stale], timeout=PING_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001
            log.info("aborting stale requests on %s: %s", w.name, e)
            return
        w.stale -= set(stale)
        w.suspect_since = None
        self.dispatch.mark_suspect(w.wid, False)
        rm.WORKER_STALLS.labels(w.role, "rejoined").inc()
        log.warning("%s worker %s answers again: %d stale requests aborted there; back in rotation",
                    w.role, w.name, len(stale))

    def _discover(self) -> None:
        """Adopt the namespace's workers this router does not know (each in a helper thread)."""
        try:
            found = self.launcher.discover()
        except BaseException as e:  # noqa: BLE001
            log.info("discovery failed: %s", e)
            return
        with self.pool.lock:
            known = {w.name for w in self.pool.everyone()} | {w.name for w in self._launching.values()}
            new = [w for w in found if w.name not in known and w.name not in self._adopting]
            self._adopting |= {w.name for w in new}
        for w in new:
            self._helper(self._adopt, w, f"tandem-adopt-{w.name}")

    def _adopt(self, w: WorkerRef) -> None:
        try:
            got = self.launcher.answering([w])
            if not got or self._stop.is_set():
                return
            info = got[0][1]
            if info.get("draining"):
                return
            with self._pair_lock:
                self._pair_with_everyone(w)
                with self.pool.lock:
                    if self._stop.is_set() or self.pool.named(w.name) is not None:
                        return
                    self.pool.add(w)
                    self.register(w, info)
            log.warning("adopted %s worker %s", w.role, w.name)
        except BaseException as e:  # noqa: BLE001
            if not self._stop.is_set():
                log.info("adopting %s failed: %s", w.name, e)
        finally:
            with self.pool.lock:
                self._adopting.discard(w.name)

    def _pair_with_everyone(self, w: WorkerRef) -> None:
        """``w`` (new or adopted) learns its peers: the other role's live workers, and a decode
        worker the other decode workers too (live migration moves KV between them)."""
        for other in self.pool.alive(DECODE if w.role == PREFILL else PREFILL):
            p, d = (w, other) if w.role == PREFILL else (other, w)
            self.launcher.pair(p, d)
        if w.role == DECODE:
            for other in self.pool.alive(DECODE):
                if other.name != w.name:
                    self.launcher.pair_decodes(w, other)

    def _forget(self, w: WorkerRef) -> None:
        import ray

        peers = self.pool.alive(DECODE if w.role == PREFILL else PREFILL)
        calls = [p.decode_api.remove_prefill(w.name) if w.role == PREFILL else p.prefill_api.remove_peer(w.name)
                 for p in peers]
        if w.role == DECODE:
            calls += [d.decode_api.remove_decode(w.name) for d in self.pool.alive(DECODE) if d is not w]
        try:
            ray.get(calls, timeout=FORGET_TIMEOUT_S)
        except Exception as e:
            log.info("forgetting %s: %s", w.name, e)
        if self._stop.is_set():
            return
        try:
            ray.kill(w.handle)
        except Exception:
            pass

    def _replace_dead(self) -> None:
        """Relaunch each dead worker in its own thread (model loads overlap)."""
        with self.pool.lock:
            gone = [w for w in self.pool.everyone() if not w.alive and w.retiring]
            dead = [w for w in self.pool.everyone()
                    if not w.alive and not w.retiring and (w.role, w.slot) not in self._restarting]
            self._restarting |= {(w.role, w.slot) for w in dead}
        for w in gone:
            log.warning("%s worker %s retired", w.role, w.name)
            self.retire(w)
        for w in dead:
            self._helper(self._replace, w, f"tandem-restart-{w.name}")

    def _replace(self, w: WorkerRef) -> None:
        import ray

        name = replacement_name(w.name)
        new = None
        try:
            new = self.launcher.spawn(w.role, w.slot, name)
            with self.pool.lock:
                self._launching[(w.role, w.slot)] = new
            if self._stop.is_set():
                raise RuntimeError("shutting down")
            info = self.launcher.info([new])[0]
            with self._pair_lock:
                self._pair_with_everyone(new)
                with self.pool.lock:
                    adopted = self.pool.named(name)
                    if adopted is not None and not self._stop.is_set():
                        self.pool.remove(w)
                        self.dispatch.remove_worker(w.wid)
                        self._launching.pop((w.role, w.slot), None)
                        self._restarting.discard((w.role, w.slot))
                        return
                    stale = self._stop.is_set() or not self.pool.replace(w, new)
                    if not stale:
                        self.restarts += 1
                        self.dispatch.remove_worker(w.wid)
                        self.register(new, info)
                        self._launching.pop((w.role, w.slot), None)
                    self._restarting.discard((w.role, w.slot))
        except BaseException as e:  # noqa: BLE001
            with self.pool.lock:
                self._restarting.discard((w.role, w.slot))
                self._launching.pop((w.role, w.slot), None)
            if not self._stop.is_set():
                log.error("relaunching %s failed: %s", w.name, e)
            if new is not None and ray.is_initialized():
                try:
                    ray.kill(new.handle)
                except BaseException:  # noqa: BLE001
                    pass
            return
        if stale:
            return
        log.warning("%s replaced by %s", w.name, name)
