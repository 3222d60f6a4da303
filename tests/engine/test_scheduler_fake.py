"""The scheduler, the KV manager, the cache and the pools, driven step by step with a stand-in model.

``KVEchoModel`` (fake_model.py) replaces only the model: every other part is the real one. Its
output is a hash of the tokens read back through each request's KV slots, so :func:`oracle`
(pure Python) is the exact expected output of any schedule, and a misplaced slot raises. Every
engine here runs with ``debug_invariants`` (exact slot ownership after every step), and these
tests pin step plans, admission order, retraction victims, chunk boundaries and the
receive/activate/cancel sequence of the roles' KV connectors in milliseconds.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from tandem.core.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.core.messages import GenerateRequest
from tandem.core.types import Req, ReqStatus, SamplingParams
from tandem.decode.connector import DecodeConnector
from tandem.engine.commands import Land, LandResumed, Release
from tandem.engine.queries import held_kv
from tandem.engine.engine import Engine
from tandem.engine.sched.sched_types import SchedulerObserver
from tandem.prefill.connector import PrefillConnector

from fake_model import fake_loaded, oracle


OVERLAP = pytest.mark.parametrize("overlap", ["off", "on"])   # engine/overlap.py: same outputs


def make(page_size=4, tokens=256, rows=8, chunk=16, batch=256, host=0, policy="fcfs", cache=True,
         retract_every=0, retraction_policy="default", connector=None, overlap="off", spec="ngram") -> Engine:
    """``spec="off"`` for the tests that pin each step's widths (a draft widens a decode)."""
    cfg = EngineConfig(device="cpu", dtype="float32", num_threads=1, overlap_schedule=overlap,
                       speculative_algorithm=spec, cache=CacheConfig(
        page_size=page_size, max_total_tokens=tokens, max_running_requests=rows,
        disable_prefix_cache=not cache, host_pool_tokens=host, debug_invariants=True),
        scheduler=SchedulerConfig(chunked_prefill_size=chunk, max_batch_tokens=batch,
                                  schedule_policy=policy, debug_retract_every=retract_every,
                                  retraction_policy=retraction_policy))
    e = Engine(cfg, loaded=fake_loaded(), connector=connector)
    e.shutdown()            # the test drives e.step() itself
    return e


class Driver:
    """Submits requests to a stopped engine, steps it, and records chunks and step plans."""

    def __init__(self, e: Engine):
        self.e = e
        self.chunks: dict[str, list] = defaultdict(list)
        self.plans: list[list[tuple[str, int]]] = []

    def submit(self, rid: str, prompt: list[int], n: int, session: str | None = None, **params):
        p = SamplingParams(max_tokens=n, ignore_eos=True, **params)
        self.e.submit(GenerateRequest(rid, tuple(prompt), p, session), self.chunks[rid].append)

    def step(self) -> list[tuple[str, int]]:
        plan = self.e.step()
        entries = [(en.sr.rid, en.n) for en in plan.entries]
        self.plans.append(entries)
        return entries

    def run(self, limit: int = 5000) -> None:
        for _ in range(limit):
            self.step()
            if not self.e.scheduler.has_work() and self.e._inbox.empty():
                return
        raise AssertionError(f"not done after {limit} steps")

    def tokens(self, rid: str) -> list[int]:
        return [t for c in self.chunks[rid] for t in c.token_ids]

    def text(self, rid: str) -> str:
        return "".join(c.text for c in self.chunks[rid])

    def final(self, rid: str):
        return self.chunks[rid][-1]


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7 + i * 13) % 94 for i in range(n)]


def text_of(ids: list[int]) -> str:
    return "".join(chr(33 + t) for t in ids)     # ids 0..93 are "!".."~"


def idle(e: Engine) -> None:
    """Nothing is held: no row, no request-owned or locked slot, no leak."""
    snap = e.snapshot()
    assert (snap.running, snap.waiting, snap.retracted, snap.detached) == (0, 0, 0, 0), snap
    assert snap.locked_tokens == 0 and snap.request_tokens == 0 and snap.leaked_tokens == 0, snap
    assert snap.rows_free == e.req_to_token.size
    e.scheduler.check_invariants()


# ---------------------------------------------------------------------------------- plans
def test_chunked_prefill_plans_and_mixed_steps():
    e = make(chunk=16, spec="off")                 # pins each step's widths
    d = Driver(e)
    d.submit("a", prompt(1, 40), 3)
    assert d.step() == [("a", 16)]
    d.submit("b", prompt(2, 10), 2)
    assert d.step() == [("a", 16)]                 # a's chunk takes the whole budget
    assert d.step() == [("a", 8), ("b", 8)]        # a finishes its prompt, b starts in the rest
    assert d.step() == [("a", 1), ("b", 2)]        # a decodes while b finishes its prompt
    d.run()
    assert d.tokens("a") == oracle(prompt(1, 40), 3) and d.tokens("b") == oracle(prompt(2, 10), 2)
    assert d.text("a") == text_of(oracle(prompt(1, 40), 3))
    idle(e)


def test_batch_token_budget_counts_decodes_first():
    e = make(chunk=64, batch=20)
    d = Driver(e)
    for i in range(4):
        d.submit(f"r{i}", prompt(i, 4), 6)
    assert d.step() == [("r0", 4), ("r1", 4), ("r2", 4), ("r3", 4)]
    d.submit("late", prompt(9, 30), 2)
    assert d.step() == [("r0", 1), ("r1", 1), ("r2", 1), ("r3", 1), ("late", 16)]   # 20 - 4
    d.run()
    for i in range(4):
        assert d.tokens(f"r{i}") == oracle(prompt(i, 4), 6)
    idle(e)


def test_rows_bound_admissions_and_queue_order_is_fcfs():
    e = make(rows=2)
    d = Driver(e)
    for i in range(3):
        d.submit(f"r{i}", prompt(i, 8), 2)
    assert [rid for rid, _ in d.step()] == ["r0", "r1"]       # two rows
    d.run()
    assert all(d.tokens(f"r{i}") == oracle(prompt(i, 8), 2) for i in range(3))
    idle(e)


# ---------------------------------------------------------------------------------- the cache
@pytest.mark.parametrize("page_size", [1, 4])
@OVERLAP
def test_prefix_reuse_equals_no_cache_and_the_oracle(page_size, overlap):
    system = prompt(5, 21)
    out = {}
    for cache in (True, False):
        e = make(page_size=page_size, cache=cache, overlap=overlap)
        d = Driver(e)
        d.submit("first", system + prompt(1, 5), 4)
        d.run()
        d.submit("second", system + prompt(2, 7), 4)
        d.run()
        out[cache] = (d.tokens("first"), d.tokens("second"), d.final("second").cached_tokens)
        idle(e)
    assert out[True][:2] == out[False][:2] == (oracle(system + prompt(1, 5), 4),
                                              oracle(system + prompt(2, 7), 4))
    assert out[True][2] == 21 // page_size * page_size and out[False][2] == 0


def test_lpm_admits_the_cached_prefix_first_and_waits_for_an_in_step_sharer():
    e = make(policy="lpm", chunk=256)
    d = Driver(e)
    shared = prompt(3, 48)
    d.submit("warm", shared + [33], 1)
    d.run()
    d.submit("cold", prompt(8, 40), 1)
    d.submit("hit", shared + [34, 35], 1)
    d.submit("doc1", prompt(11, 60) + [1], 1)
    d.submit("doc2", prompt(11, 60) + [2], 1)      # shares 60 uncached tokens with doc1
    assert [rid for rid, _ in d.step()] == ["hit", "cold", "doc1"]
    assert [rid for rid, _ in d.step()] == ["doc2"]
    d.run()
    assert d.final("doc2").cached_tokens == 60 // 4 * 4
    idle(e)


@OVERLAP
def test_eviction_makes_room_and_outputs_stay_exact(overlap):
    e = make(tokens=64, chunk=64, overlap=overlap)
    d = Driver(e)
    for i in range(6):                             # each needs ~8 pages; the cache must evict
        d.submit(f"r{i}", prompt(i, 26), 4)
        d.run()
        assert d.tokens(f"r{i}") == oracle(prompt(i, 26), 4)
    assert e.scheduler.stats["evicted_tokens"] > 0
    idle(e)


# ---------------------------------------------------------------------------------- retraction
def _pressure(e: Engine, n_req=5, plen=14, out=20):
    d = Driver(e)
    for i in range(n_req):
        d.submit(f"r{i}", prompt(i, plen + i), out)
    d.run()
    for i in range(n_req):
        want = oracle(prompt(i, plen + i), out)
        assert d.tokens(f"r{i}") == want, f"r{i} tokens differ after retraction"
        assert d.text(f"r{i}") == text_of(want), f"r{i} streamed text differs after retraction"
        assert d.final(f"r{i}").error is None
    return d


@pytest.mark.parametrize("host", [0, 512])
@OVERLAP
def test_retraction_under_pressure_restores_or_recomputes_exactly(host, overlap):
    e = make(tokens=96, page_size=4, chunk=64, host=host, overlap=overlap)
    _pressure(e)
    st = e.scheduler.stats
    assert st["retractions"] > 0
    if host:
        assert st["retraction_restores"] > 0 and st["retraction_recomputes"] == 0
    else:
        assert st["retraction_recomputes"] > 0 and st["retraction_restores"] == 0
    idle(e)


def test_the_victim_is_the_request_with_fewest_outputs_then_longest_prompt():
    e = make(tokens=64, page_size=4, chunk=64)
    d = Driver(e)
    d.submit("old", prompt(1, 10), 30)
    for _ in range(6):
        d.step()                                   # old has 5 outputs
    d.submit("long", prompt(2, 13), 30)
    d.submit("short", prompt(3, 9), 30)
    seen, s = [], e.scheduler

    class Spy(SchedulerObserver):
        def retracted(self, sr):
            others = [o.req for o in s.running.values() if o is not sr]
            key = (len(sr.req.output_ids), -len(sr.req.prompt_ids))
            assert all(key <= (len(r.output_ids), -len(r.prompt_ids)) for r in others), "not the rule's victim"
            seen.append((sr.rid, len(sr.req.output_ids)))

    s.observers.append(Spy())
    d.run()
    # pinned: short was admitted last (the pool was full), so it has the fewest outputs each time
    assert seen == [("short", 8), ("long", 17), ("short", 16)]
    for rid, p in (("old", prompt(1, 10)), ("long", prompt(2, 13)), ("short", prompt(3, 9))):
        assert d.tokens(rid) == oracle(p, 30)
    idle(e)


@pytest.mark.parametrize("host", [0, 512])
@OVERLAP
def test_forced_retraction_lever_keeps_outputs_exact(host, overlap):
    e = make(tokens=1024, host=host, retract_every=3, overlap=overlap)
    _pressure(e, n_req=3, out=12)
    st = e.scheduler.stats
    assert st["retractions"] >= 3
    assert (st["retraction_restores"] > 0) == bool(host) and (st["retraction_recomputes"] > 0) != bool(host)
    idle(e)


@OVERLAP
def test_abort_while_waiting_running_and_retracted_frees_everything(overlap):
    e = make(tokens=96, page_size=4, chunk=64, host=512, retract_every=2, rows=3, overlap=overlap)
    d = Driver(e)
    for i in range(3):
        d.submit(f"r{i}", prompt(i, 12), 40)
    d.submit("waiting", prompt(7, 12), 5)      # no row for it while the three run
    s = e.scheduler
    for _ in range(20):
        d.step()
        if s.retraction.retracted:     # just retracted by the lever: restored next step
            break
    retracted = [sr.rid for sr in s.retraction.retracted]
    running = list(s.running)
    assert retracted and running and [sr.rid for sr in s.waiting] == ["waiting"], (retracted, running)
    for rid in {retracted[0], running[0], "waiting"}:
        e.abort(rid)
    d.run()
    for rid in {retracted[0], running[0], "waiting"}:
        assert d.final(rid).finish_reason == "abort"
    idle(e)


# ---------------------------------------------------------------------------------- roles
@OVERLAP
def test_decode_receive_activate_cancel_through_the_connectors(overlap):
    """The roles' sequence on stopped engines: prefill holds a finished prompt's KV (its
    connector), decode reserves a row + cached prefix + pages for a request it expects, the
    prompt's KV is copied as the NIXL WRITE would, Release frees prefill's copy, Land decodes
    from the first token; a cancelled (aborted) reservation frees its pages."""
    pre, dec = make(connector=PrefillConnector, overlap=overlap), make(connector=DecodeConnector, overlap=overlap)
    p = prompt(4, 19)
    # prefill: run the prompt to its first token; the connector holds the KV
    dp = Driver(pre)
    dp.submit("x", p, 1)
    dp.run()
    first = dp.tokens("x")[0]
    held = held_kv(pre, "x", 0)
    assert pre.scheduler.detached["x"].req.finished
    # decode: expect, submit, one step reserves
    dd = Driver(dec)
    fut = dec.connector.expect("x")
    dd.submit("x", p, 6)
    assert dd.step() == [] and fut.done()
    res = fut.result()
    assert res.prefix_len == 0 and len(res.pages) == len(held.pages) == 5
    assert dec.scheduler.detached["x"].req.status is ReqStatus.WAITING_FOR_KV
    ps = 4
    src = [r for pg in held.pages for r in range(pg * ps, pg * ps + ps)]
    dst = [r for pg in res.pages for r in range(pg * ps, pg * ps + ps)]
    dec.kv_pool.kv_data[:, :, dst] = pre.kv_pool.kv_data[:, :, src]
    pre.send(Release("x"))
    dp.step()
    assert "x" not in pre.scheduler.detached
    idle(pre)
    dec.send(Land("x", first))
    dd.run()
    assert dd.tokens("x") == oracle(p, 6)
    idle(dec)
    # a second reservation hits decode's own cache for the prompt's aligned prefix, then is cancelled
    fut2 = dec.connector.expect("y")
    dd.submit("y", list(p) + [40, 41], 3)
    dd.step()
    res2 = fut2.result()
    assert res2.prefix_len == 16 and len(res2.pages) == 2
    dec.abort("y", "transfer failed")
    dd.step()
    c = dd.final("y")
    assert c.finish_reason == "abort" and c.error == "transfer failed"
    idle(dec)


def _disaggregated(pre: Engine, dec: Engine, rid: str, p: list[int], n: int) -> Driver:
    """Prefill ``p`` on ``pre``, reserve on ``dec``, copy the pages as the WRITE does, Release,
    Land: returns ``dec``'s driver with ``rid`` decoding."""
    dp, dd = Driver(pre), Driver(dec)
    dp.submit(rid, p, 1)
    dp.run()
    held = held_kv(pre, rid, 0)
    fut = dec.connector.expect(rid)
    dd.submit(rid, p, n)
    dd.step()
    res, ps = fut.result(), pre.kv_pool.page_size
    src = [r for pg in held.pages for r in range(pg * ps, pg * ps + ps)]
    dst = [r for pg in res.pages for r in range(pg * ps, pg * ps + ps)]
    dec.kv_pool.kv_data[:, :, dst] = pre.kv_pool.kv_data[:, :, src]
    pre.send(Release(rid))
    dp.step()
    dec.send(Land(rid, dp.tokens(rid)[0]))
    return dd


def test_a_received_request_retracted_without_a_host_pool_is_recomputed_here():
    """Found by the retraction cluster test: once activated, a received request is an ordinary
    one; retracted with nowhere to back it up it is recomputed here, not reserved again for a
    transfer that will never come."""
    pre, dec = make(connector=PrefillConnector), make(connector=DecodeConnector, retract_every=2)
    p = prompt(6, 13)
    dd = _disaggregated(pre, dec, "x", p, 9)
    dd.run()
    assert dd.tokens("x") == oracle(p, 9) and dd.final("x").error is None
    assert dec.scheduler.stats["retraction_recomputes"] > 0
    idle(pre)
    idle(dec)


def test_handoff_events_are_checked_and_late_ones_ignored():
    """A Land for a request that is not receiving (held, or already gone) is refused with
    the states named; one for a request that ended meanwhile has nothing left to apply."""
    pre = make(connector=PrefillConnector)
    d = Driver(pre)
    d.submit("x", prompt(1, 9), 1)
    d.run()
    with pytest.raises(ValueError, match="Land for x, which is FINISHED_LENGTH"):
        pre.scheduler.handoff(Land("x", 3))
    assert pre.scheduler.handoff(Release("x")) is None and "x" not in pre.scheduler.detached
    assert pre.scheduler.handoff(Release("x")) is None     # late: nothing left
    idle(pre)


def test_snapshot_counts_every_token_class():
    e = make(tokens=128, host=256)
    d = Driver(e)
    d.submit("a", prompt(1, 21), 30)
    for _ in range(4):
        d.step()
    snap = e.snapshot()
    assert snap.running == 1 and snap.request_tokens == 4 and snap.leaked_tokens == 0   # 23 = 20 + 3
    assert snap.available_tokens + snap.evictable_tokens + snap.locked_tokens + snap.request_tokens == 128
    d.run()
    snap = e.snapshot()
    assert snap.locked_tokens == snap.request_tokens == 0 and snap.host_used_tokens > 0


# ---------------------------------------------------------------------------------- random schedules
@pytest.mark.parametrize("seed", range(24))
@OVERLAP
def test_random_schedules_match_the_oracle(seed, overlap):
    """Seeded random workloads over random pool sizes, page sizes, chunk budgets, host tiers,
    retraction levers, shared prefixes, arrivals and aborts: every request that completes
    equals the oracle (tokens and streamed text), every aborted one ends "abort", and at the
    end nothing is held."""
    import random

    rng = random.Random(seed)
    ps = rng.choice([1, 2, 4, 8])
    e = make(page_size=ps, tokens=rng.choice([64, 96, 160, 400]) // ps * ps, rows=rng.choice([2, 4, 8]),
             chunk=rng.choice([16, 32, 64]), batch=rng.choice([48, 256]),
             host=rng.choice([0, 0, 64, 1024]), policy=rng.choice(["fcfs", "lpm"]),
             cache=rng.random() < 0.85, retract_every=rng.choice([0, 0, 3, 7]),
             retraction_policy=rng.choice(["default", "session"]), overlap=overlap)
    d = Driver(e)
    systems = [prompt(100 + i, rng.randint(8, 24)) for i in range(2)]
    want, aborted = {}, set()
    pending = []
    for i in range(rng.randint(6, 14)):
        p = rng.choice(systems) + prompt(rng.randint(0, 999), rng.randint(1, 12))
        pending.append((rng.randint(0, 30), f"r{i}", p, rng.randint(1, 16)))
    pending.sort()
    step = 0
    while pending or e.scheduler.has_work() or not e._inbox.empty():
        while pending and pending[0][0] <= step:
            _, rid, p, n = pending.pop(0)
            d.submit(rid, p, n, session=f"s{rng.randint(0, 3)}")
            want[rid] = oracle(p, n)
        if step % 11 == 5 and want and rng.random() < 0.4:
            rid = rng.choice(sorted(want))
            if not d.chunks[rid] or d.chunks[rid][-1].finish_reason is None:
                e.abort(rid)
                aborted.add(rid)
        d.step()
        step += 1
        assert step < 5000
    for rid, toks in want.items():
        last = d.final(rid)
        if rid in aborted and last.finish_reason == "abort":
            assert d.tokens(rid) == toks[:len(d.tokens(rid))]      # a prefix of the real output
            continue
        assert last.error is None, (rid, last.error)
        assert d.tokens(rid) == toks and d.text(rid) == text_of(toks), rid
    idle(e)


def test_a_decode_waits_while_reservations_hold_the_pool_instead_of_aborting():
    """Found by the chaos run: a decoding request found no slot because reservations (KV being
    received, not retractable) held the rest of the pool, and was aborted as "can never fit".
    It must wait; once the reservation goes it decodes on, and its output is exact."""
    e = make(tokens=64, page_size=4, chunk=64, connector=DecodeConnector)
    d = Driver(e)
    d.submit("r", prompt(1, 10), 12)
    d.step()                                             # r is decoding (3 pages)
    fut = e.connector.expect("big")
    d.submit("big", prompt(2, 48), 4)
    d.step()
    assert fut.result() is not None                      # 12 of the 16 pages reserved
    for _ in range(8):
        d.step()
    assert d.chunks["r"][-1].finish_reason is None       # waiting, not aborted
    e.abort("big", "transfer failed")
    d.run()
    assert d.tokens("r") == oracle(prompt(1, 10), 12) and d.final("r").error is None
    idle(e)


# ---------------------------------------------------------------------------------- live migration
def _copy_pages(src: Engine, dst: Engine, src_pages, dst_pages) -> None:
    ps = src.kv_pool.page_size
    s = [r for pg in src_pages for r in range(pg * ps, pg * ps + ps)]
    d = [r for pg in dst_pages for r in range(pg * ps, pg * ps + ps)]
    dst.kv_pool.kv_data[:, :, d] = src.kv_pool.kv_data[:, :, s]


def _decode_a_while(page_size=4, warm_b=False, steps=5, overlap="off", **params):
    """Request "m" decodes on engine A for ``steps`` steps, then migrates to engine B: A ends its
    stream with "migrated" and holds the KV; B reserves what its own cache lacks, the pages are
    copied (what the NIXL WRITE does), A releases, B activates and finishes the request."""
    a = make(page_size=page_size, connector=DecodeConnector, overlap=overlap)
    b = make(page_size=page_size, connector=DecodeConnector, overlap=overlap)
    p, n = prompt(9, 22), 14
    da, db = Driver(a), Driver(b)
    if warm_b:   # B's cache already holds the prompt (another turn of the session ran there)
        db.submit("w", p, 1)
        db.run()
    da.submit("m", p, n, **params)
    for _ in range(steps):
        da.step()
    from tandem.engine.commands import Migrate
    cmd = Migrate("m")
    a.send(cmd)
    da.step()
    assert cmd.future.result() is True and da.final("m").finish_reason == "migrated"
    assert a.scheduler.detached["m"].req.status is ReqStatus.MIGRATED
    out = da.tokens("m")
    from tandem.core.messages import Resume
    resume = Resume(tuple(out), len(da.text("m")), da.final("m").cached_tokens)
    fut = b.connector.expect("m")
    b.submit(GenerateRequest("m", tuple(p), SamplingParams(max_tokens=n, ignore_eos=True, **params),
                             resume=resume), db.chunks["m"].append)
    db.step()
    res = fut.result()
    held = held_kv(a, "m", res.prefix_len)
    assert len(held.pages) == len(res.pages)
    _copy_pages(a, b, held.pages, res.pages)
    a.send(Release("m"))
    da.step()
    b.send(LandResumed("m"))
    db.run()
    return a, b, p, n, da, db, res


@pytest.mark.parametrize("warm_b", [False, True])
@OVERLAP
def test_a_migrated_request_continues_on_the_new_worker_exactly(warm_b, overlap):
    a, b, p, n, da, db, res = _decode_a_while(warm_b=warm_b, overlap=overlap)
    assert res.prefix_len == (20 if warm_b else 0)          # B's cache: the prompt's 5 whole pages
    toks = da.tokens("m") + db.tokens("m")
    assert toks == oracle(p, n) and da.text("m") + db.text("m") == text_of(toks)
    assert db.final("m").finish_reason == "length" and db.final("m").completion_tokens == n
    idle(a)
    idle(b)


def test_a_resumed_request_without_its_kv_is_recomputed_exactly():
    """Migration by recompute: the new worker gets only the tokens (no KV copy) and computes
    prompt + output itself; the stream goes on with no repeated or missing text."""
    a = make(connector=DecodeConnector)
    b = make()
    p, n = prompt(3, 17), 12
    da, db = Driver(a), Driver(b)
    da.submit("m", p, n)
    for _ in range(6):
        da.step()
    from tandem.core.messages import Resume
    from tandem.engine.commands import Migrate
    a.send(Migrate("m"))
    da.step()
    a.send(Release("m"))
    da.step()
    b.submit(GenerateRequest("m", tuple(p), SamplingParams(max_tokens=n, ignore_eos=True),
                             resume=Resume(tuple(da.tokens("m")), len(da.text("m")))), db.chunks["m"].append)
    db.run()
    toks = da.tokens("m") + db.tokens("m")
    assert toks == oracle(p, n) and da.text("m") + db.text("m") == text_of(toks)
    assert b.scheduler.stats["prompt_tokens"] == 0       # the prompt's usage was counted on A
    idle(a)
    idle(b)


def test_migrate_refuses_a_request_that_is_not_decoding_and_changes_nothing():
    from tandem.engine.commands import Migrate
    a = make(chunk=16, connector=DecodeConnector)
    d = Driver(a)
    d.submit("long", prompt(1, 40), 4)
    d.step()                                          # one 16-token chunk of 40: still prefilling
    for rid in ("long", "absent"):
        cmd = Migrate(rid)
        a.send(cmd)
        d.step()
        with pytest.raises(ValueError, match=f"Migrate for {rid}, which is not decoding here"):
            cmd.future.result()
    d.run()
    assert d.tokens("long") == oracle(prompt(1, 40), 4)
    idle(a)


@pytest.mark.parametrize("warm_b", [False, True])
def test_a_migration_aborted_before_its_kv_arrived_frees_exactly_the_reservation(warm_b):
    """The target reserved positions up to the last output token (which has no KV yet) and the
    copy failed (the source died, the client went away): the abort frees that reservation and
    nothing past it (freeing to seq_len once returned the pool's reserved page 0)."""
    a = make(page_size=4, connector=DecodeConnector)
    b = make(page_size=4, connector=DecodeConnector)
    p, n = prompt(5, 21), 12
    da, db = Driver(a), Driver(b)
    if warm_b:
        db.submit("w", p, 1)
        db.run()
    da.submit("m", p, n)
    for _ in range(5):
        da.step()
    from tandem.core.messages import Resume
    from tandem.engine.commands import Migrate
    a.send(Migrate("m"))
    da.step()
    fut = b.connector.expect("m")
    b.submit(GenerateRequest("m", tuple(p), SamplingParams(max_tokens=n, ignore_eos=True),
                             resume=Resume(tuple(da.tokens("m")), len(da.text("m")))), db.chunks["m"].append)
    db.step()
    assert fut.result() is not None
    b.connector.forget("m")
    b.abort("m", "the source died mid-copy")
    db.run()
    assert db.final("m").finish_reason == "abort"
    a.send(Release("m"))
    da.step()
    b.scheduler.check_invariants()
    idle(a)
    idle(b)
