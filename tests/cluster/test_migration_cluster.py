"""Live migration through the whole cluster: 1 prefill + 2 decode Ray actors behind the HTTP front
door. Streams keep going while the router moves them between decode workers (POST
/admin/migrate) or drains a worker (POST /admin/drain): every client gets exactly the text the
same request gets without migration (greedy), no error, and both decode workers' pools return to
their baseline.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tandem.core.config import CacheConfig, EngineConfig, MigrationConfig, ServeConfig
from tandem.core.types import SamplingParams

OUT = 96
TOPICS = ("rivers", "bridges", "volcanoes")


def _streamed(backend, wire_rid: str) -> int:
    """Tokens the client of the request running as ``wire_rid`` has (its RequestStream's ``sent``)."""
    return next((s.sent for s in list(backend.streams.values()) if s.wire_rid == wire_rid), 0)


def _cfg() -> ServeConfig:
    engine = EngineConfig(device="cpu", num_threads=1,
                          cache=CacheConfig(page_size=16, max_total_tokens=4096, max_running_requests=16))
    # policy off: these tests move requests by hand (the policy's own test runs one round itself)
    return ServeConfig(prefill=1, decode=2, transfer_timeout_s=20.0, engine_config=engine, debug_endpoints=True,
                       migration=MigrationConfig(policy="off", precopy_min_tokens=0))


def _messages(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Write a long paragraph about {topic}."}]


@pytest.fixture(scope="module")
def cluster(ray_local, smollm2_default):
    from tandem.cluster.launch import launch_disaggregated
    from tandem.engine.engine import Engine

    from serve_support import Server

    cfg = _cfg()
    backend = launch_disaggregated(cfg, loaded=smollm2_default)
    server = Server(backend, cfg)
    e = Engine(cfg.engine_config, loaded=smollm2_default)
    # the oracle: the same requests on a colocated engine, no migration (one batch: greedy decode
    # is batch invariant, as the cluster's concurrent streams already assume)
    params = SamplingParams(max_tokens=OUT, ignore_eos=True)
    done = e.generate_many([e.make_request(e.tokenizer.apply_chat_template(_messages(t)), params) for t in TOPICS])
    want = {t: c.text for t, c in zip(TOPICS, done)}
    e.shutdown()
    yield backend, server, want
    server.stop()
    backend.close()


def _stream(server, topic: str, out: dict, session: str | None = None, key: str | None = None,
            max_tokens: int = OUT, seen: list | None = None, speculative: bool = False, **sampling) -> None:
    """A streamed chat (greedy unless ``sampling`` says otherwise), its text and finish reason
    into ``out[key or topic]``; each chunk's text is appended to ``seen`` as it arrives. Without
    drafts unless ``speculative``: the module repeats its prompts, so the tenant's n-gram pool
    would draft whole replies and a stream would end before a move or drain reached it (a
    fresh-clone run: a drain found nothing to move, a chaos run no migration at all)."""
    text, finish, err = [], None, None
    try:
        s = server.client.chat.completions.create(
            model="smollm2", messages=_messages(topic), max_tokens=max_tokens, stream=True,
            **{"temperature": 0, **sampling},
            extra_body={"ignore_eos": True, "speculative": speculative},
            extra_headers={"X-Session-Id": session or f"m-{topic}"})
        for ev in s:
            if ev.choices:
                text.append(ev.choices[0].delta.content or "")
                if seen is not None:
                    seen.append(text[-1])
                finish = ev.choices[0].finish_reason or finish
    except Exception as e:  # noqa: BLE001 - reported, and the test fails on it
        err = repr(e)
    out[key or topic] = ("".join(text), finish, err)


def _running_on(backend) -> dict[str, str]:
    return {rid: w.name for rid, w in list(backend.inflight.items())}


def _wait_decoding(backend, n: int, timeout: float = 60.0) -> dict[str, str]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        on = _running_on(backend)
        if len(on) >= n:
            return on
        time.sleep(0.05)
    raise AssertionError(f"only {len(_running_on(backend))} of {n} requests in flight")


def _idle(server, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while True:
        kv = httpx.get(server.url + "/debug/kv", timeout=30).json()
        ws = kv["workers"]
        if kv["migrations"] == [] and all(w["leaked_tokens"] == 0 and w["request_tokens"] == 0
                                          and w["locked_tokens"] == 0 and w["invariants"] == "ok" for w in ws):
            return
        if time.monotonic() > end:
            raise AssertionError(ws)
        time.sleep(0.2)


def _check(out: dict, want: dict) -> None:
    for t in TOPICS:
        text, finish, err = out[t]
        assert err is None and finish == "length", (t, out[t])
        assert text == want[t], f"{t}: migrated text differs from the unmigrated one"


def test_the_balance_policy_spreads_a_session_that_piled_onto_one_worker(cluster):
    """One session's three streams all land on one decode worker (session affinity); one policy
    round moves one of them to the empty worker, and every text is still the unmigrated one."""
    import asyncio

    from tandem.core.config import MigrationConfig

    backend, server, want = cluster
    out: dict = {}
    threads = [threading.Thread(target=_stream, args=(server, t, out, "one-session")) for t in TOPICS]
    for th in threads:
        th.start()
    on = _wait_decoding(backend, len(TOPICS))
    assert len(set(on.values())) == 1, on
    cfg = MigrationConfig(policy="balance", high=0.99, low=0.98, spread=0.001)
    moved = []
    for _ in range(100):   # until one of them decodes (not still prefilling)
        moved = asyncio.run(backend.migrator.rebalance_once(cfg))
        if moved:
            break
        time.sleep(0.05)
    assert len(moved) == 1 and backend.migrator.counts["rebalance"] >= 1
    for th in threads:
        th.join(120)
    _check(out, want)
    _idle(server)


def test_streams_move_between_decode_workers_and_a_drained_worker_empties(cluster):
    backend, server, want = cluster
    out: dict = {}
    threads = [threading.Thread(target=_stream, args=(server, t, out)) for t in TOPICS]
    for th in threads:
        th.start()
    on = _wait_decoding(backend, len(TOPICS))
    # one request, by hand, to the other decode worker (retried while it is still prefilling)
    rid, src = next(iter(on.items()))
    for _ in range(100):
        r = httpx.post(server.url + "/admin/migrate", params={"rid": rid}, timeout=30)
        if r.status_code != 409:
            break
        time.sleep(0.05)
    assert r.status_code == 200, r.text
    assert r.json()["to"] != src
    # then everything off the busiest decode worker
    busiest = max({w for w in _running_on(backend).values()},
                  key=lambda n: sum(1 for w in _running_on(backend).values() if w == n))
    d = httpx.post(server.url + "/admin/drain", params={"worker": busiest}, timeout=120).json()
    assert d["moved"] and d["remaining"] == [] and all(m["to"] != busiest for m in d["moved"]), d
    for th in threads:
        th.join(120)
    _check(out, want)
    assert backend.migrator.counts["migrations"] >= 2
    _idle(server)


def _metric(server, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for f in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=30).text):
        for s in f.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def _move(server, rid: str, to: str) -> None:
    for _ in range(200):   # 409 while it is still prefilling
        r = httpx.post(server.url + "/admin/migrate", params={"rid": rid, "to": to}, timeout=30)
        if r.status_code != 409:
            break
        time.sleep(0.05)
    assert r.status_code == 200, r.text


def test_a_rolling_restart_of_every_decode_worker_under_load_drops_no_request(cluster):
    """Each decode worker in turn takes every stream (moved there by hand) and is then drained with
    ``stop``: the streams move to the other, it is stopped and relaunched; the clients see only
    their unmigrated texts, and the next worker goes only once its replacement is serving."""
    backend, server, want = cluster
    moved0 = _metric(server, "tandem_decode_migrations_total", outcome="ok")
    names = sorted(w.name for w in backend.decodes if w.alive)
    drains = []
    for name in names:
        out: dict = {}
        threads = [threading.Thread(target=_stream, args=(server, t, out, f"r-{name}-{t}")) for t in TOPICS]
        for th in threads:
            th.start()
        for rid, on in _wait_decoding(backend, len(TOPICS)).items():
            if on != name:
                _move(server, rid, name)
        d = httpx.post(server.url + "/admin/drain", params={"worker": name, "stop": "true"}, timeout=120).json()
        assert d["stopped"] and d["remaining"] == [], d
        drains.append(d)
        for th in threads:
            th.join(120)
        _check(out, want)
        end = time.monotonic() + 120     # its replacement joins before the next one goes
        while sum(1 for w in backend.decodes if w.alive) < len(names):
            assert time.monotonic() < end, "the drained worker was not replaced"
            time.sleep(0.2)
    assert any(d["moved"] for d in drains), drains   # (a stream may end before its drain)
    assert _metric(server, "tandem_decode_migrations_total", outcome="ok") > moved0
    assert _metric(server, "tandem_decode_migrations_total", reason="drain", outcome="ok") > 0
    assert _metric(server, "tandem_decode_migration_downtime_seconds_count") > 0
    _idle(server)


LONG, GENERATED = 128, 48   # the generated pre-copy's requests: moved once they generated GENERATED+


def test_the_pre_copy_takes_the_generated_pages_so_the_stop_copies_only_the_tail(cluster):
    """A greedy and a seeded (temperature 0.9) request, each moved to the other decode worker once
    it generated 48+ tokens: the pre-copy takes the prompt and the generated tokens (whole pages),
    so at the stop the target finds them in its own cache (reused, not copied), and each text
    equals the same request's unmigrated one (run after: it caches nothing the move could use)."""
    backend, server, _ = cluster
    page = backend.cfg.engine_config.cache.page_size
    kinds = {"greedy": ("lighthouses", {}), "seeded": ("tide pools", {"temperature": 0.9, "seed": 7})}
    reused0 = _metric(server, "tandem_decode_migration_reused_tokens_total")
    c0 = dict(backend.migrator.counts)
    out: dict = {}
    threads = [threading.Thread(target=_stream, args=(server, topic, out, f"pg-{k}", k),
                                kwargs={"max_tokens": LONG, **kw}) for k, (topic, kw) in kinds.items()]
    for th in threads:
        th.start()
    floor, end = 0, time.monotonic() + 120   # floor: what each pre-copy takes at least (whole pages)
    moved: set[str] = set()
    while len(moved) < len(kinds):
        assert time.monotonic() < end, f"only {moved} moved"
        for rid, (req, _) in list(backend.migrator.live.items()):
            k = (req.session_id or "").removeprefix("pg-")
            if k in kinds and k not in moved and _streamed(backend, rid) >= GENERATED:
                src = backend.inflight[rid].name
                _move(server, rid, next(w.name for w in backend.decodes if w.alive and w.name != src))
                floor += (len(req.prompt_ids) + GENERATED) // page * page
                moved.add(k)
        time.sleep(0.02)
    for th in threads:
        th.join(120)
    precopied = backend.migrator.counts["precopied_tokens"] - c0["precopied_tokens"]
    assert backend.migrator.counts["precopies"] - c0["precopies"] == len(kinds)
    assert precopied >= floor, (precopied, floor)
    reused = _metric(server, "tandem_decode_migration_reused_tokens_total") - reused0
    assert reused >= precopied, (reused, precopied)   # every pre-copied page was found, not copied
    for k, (topic, kw) in kinds.items():   # the oracle: the same requests, unmigrated
        _stream(server, topic, out, f"pg-{k}-plain", f"{k}-plain", max_tokens=LONG, **kw)
        text, finish, err = out[k]
        assert err is None and finish == "length", (k, out[k])
        assert text == out[f"{k}-plain"][0] and out[f"{k}-plain"][1] == "length", f"{k}: the migrated text differs"
    _idle(server)


def test_a_pre_copy_that_times_out_only_leaves_more_for_the_stop(cluster):
    """Every pre-copy round gives up at once (``precopy_timeout_s`` tiny): the move still happens,
    the stop copies everything, the text is the unmigrated one and nothing is left anywhere."""
    backend, server, want = cluster
    old, backend.migrator.cfg = backend.migrator.cfg, MigrationConfig(policy="off", precopy_min_tokens=0,
                                                                      precopy_timeout_s=1e-4)
    c0 = dict(backend.migrator.counts)
    out: dict = {}
    try:
        th = threading.Thread(target=_stream, args=(server, TOPICS[1], out, "pg-timeout"))
        th.start()
        end = time.monotonic() + 60
        while True:
            on = [(rid, backend.inflight[rid].name) for rid, (req, _) in list(backend.migrator.live.items())
                  if req.session_id == "pg-timeout" and _streamed(backend, rid) >= 16
                  and rid in backend.inflight]
            if on:
                break
            assert time.monotonic() < end, "the request never generated enough"
            time.sleep(0.02)
        rid, src = on[0]
        _move(server, rid, next(w.name for w in backend.decodes if w.alive and w.name != src))
        th.join(120)
    finally:
        backend.migrator.cfg = old
    text, finish, err = out[TOPICS[1]]
    assert err is None and finish == "length" and text == want[TOPICS[1]], out
    assert backend.migrator.counts["migrations"] == c0["migrations"] + 1
    assert backend.migrator.counts["precopy_rounds"] == c0["precopy_rounds"]   # none landed
    _idle(server)


def test_a_pre_copy_takes_whole_pages_of_the_prompt_and_the_generated_tokens():
    from tandem.cluster.migration import Migrator

    m = Migrator(None, None, {}, cfg=MigrationConfig(policy="off"), page_size=4)
    prompt = (1, 2, 3, 4, 5)
    assert m.warm_ids(prompt, [6, 7]) == prompt                      # no whole page past the prompt
    assert m.warm_ids(prompt, [6, 7, 8, 9, 10]) == (1, 2, 3, 4, 5, 6, 7, 8)
    assert m.warm_ids(prompt, list(range(6, 14))) == tuple(range(1, 13))
    m.cfg = MigrationConfig(policy="off", precopy_generated=False)
    assert m.warm_ids(prompt, list(range(6, 14))) == prompt          # the prompt only, as it is


@pytest.fixture
def forced(cluster):
    """The chaos lever on the shared cluster: every running request moves each 12 tokens."""
    backend = cluster[0]
    old = backend.migrator.cfg
    backend.migrator.cfg = MigrationConfig(policy="off", debug_migrate_every=12, precopy_min_tokens=0)
    yield backend.migrator.cfg
    backend.migrator.cfg = old


def _chat(server, **kw):
    return server.client.chat.completions.create(model="smollm2", messages=_messages("glaciers"),
                                                 max_tokens=40, **kw)


def test_forced_migrations_every_few_tokens_change_no_text(cluster, forced):
    """Greedy streams, a seeded n = 2 request and a JSON-schema-constrained one, each moved between
    the decode workers every 12 tokens (pre-copy on): the same texts as without migration."""
    backend, server, want = cluster
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "height_m": {"type": "integer"}},
              "required": ["name", "height_m"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "peak", "schema": schema, "strict": True}}
    forced_cfg, backend.migrator.cfg = backend.migrator.cfg, MigrationConfig(policy="off")
    plain_n = _chat(server, n=2, temperature=0.9, seed=5)
    plain_json = _chat(server, temperature=0.7, seed=2, response_format=fmt)
    backend.migrator.cfg = forced_cfg
    ok0 = _metric(server, "tandem_decode_migrations_total", reason="forced", outcome="ok")
    out: dict = {}
    threads = [threading.Thread(target=_stream, args=(server, t, out, f"f-{t}"), kwargs={"speculative": True})
               for t in TOPICS]
    for th in threads:
        th.start()
    got_n = _chat(server, n=2, temperature=0.9, seed=5)
    got_json = _chat(server, temperature=0.7, seed=2, response_format=fmt)
    for th in threads:
        th.join(120)
    _check(out, want)
    assert [c.message.content for c in got_n.choices] == [c.message.content for c in plain_n.choices]
    assert got_json.choices[0].message.content == plain_json.choices[0].message.content
    assert __import__("json").loads(got_json.choices[0].message.content).keys() == {"name", "height_m"}
    moved = _metric(server, "tandem_decode_migrations_total", reason="forced", outcome="ok") - ok0
    # each leg streams 12+ tokens; with drafts (on here: migration with speculation must equal
    # none) a step streams several, and the module's repeated prompts draft from the pool, so how
    # often a stream moves follows its acceptance: 8 moves in a loaded fresh-clone run, 9+ quiet
    assert moved >= len(TOPICS), moved
    assert _metric(server, "tandem_decode_migration_bytes_total") > 0
    assert _metric(server, "tandem_decode_migration_reused_tokens_total") > 0   # the pre-copied prompts
    _idle(server)


def _live_workers(backend, n: int, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while sum(1 for w in backend.decodes if w.alive) < n:
        assert time.monotonic() < end, "a killed decode worker was not replaced"
        time.sleep(0.2)


def test_a_target_killed_mid_migration_leaves_the_stream_on_its_source(cluster):
    """The target decode worker is killed while a request moves to it (during the pre-copy or
    the copy, whichever the race hits): the request decodes on (or resumes) on its source, the
    text is the unmigrated one, nothing leaks; the supervisor replaces the dead worker."""
    import ray

    backend, server, want = cluster
    out: dict = {}
    seen: list = []
    th = threading.Thread(target=_stream, args=(server, TOPICS[0], out, "kill-target"), kwargs={"seen": seen})
    th.start()
    rid, src = next(iter(_wait_decoding(backend, 1).items()))
    target = next(w for w in backend.decodes if w.alive and w.name != src)
    end = time.monotonic() + 60   # a few tokens in: decoding, not prefilling
    while len(seen) < 3:
        assert time.monotonic() < end and th.is_alive(), f"the stream sent {len(seen)} chunks"
        time.sleep(0.01)
    mover = threading.Thread(target=lambda: httpx.post(server.url + "/admin/migrate",
                                                       params={"rid": rid, "to": target.name}, timeout=60))
    failed0 = _metric(server, "tandem_decode_migrations_total", reason="admin", outcome="failed")
    mover.start()
    end = time.monotonic() + 30   # the move is under way (a kill before it arrives is no mid-move kill)
    while rid not in backend.migrator.moves:
        assert time.monotonic() < end and mover.is_alive(), "the move never started"
        time.sleep(0.001)
    ray.kill(target.handle, no_restart=True)
    mover.join(60)
    th.join(120)
    text, finish, err = out[TOPICS[0]]
    assert err is None and finish == "length", out
    assert text == want[TOPICS[0]]
    assert _metric(server, "tandem_decode_migrations_total", reason="admin", outcome="failed") == failed0 + 1
    _live_workers(backend, 2)
    _idle(server)


def test_a_chaos_run_with_forced_migrations_and_a_target_killed_mid_move_loses_nothing(cluster, forced,
                                                                                       smollm2_default):
    """``tandem chaos`` against the cluster, every request moved each 4 tokens, client aborts, and
    the target of a live migration killed: every completed text equals its unmigrated one, every
    failure states why, and once idle no page is leaked or held anywhere."""
    import asyncio

    from tandem.loadtest.chaos.cli import format_table, options, run_chaos, verdict
    from tandem.loadtest.chaos.oracle import Oracle

    backend, server, _ = cluster
    backend.migrator.cfg = MigrationConfig(policy="off", debug_migrate_every=4, precopy_min_tokens=0)
    oracle = Oracle("smollm2", "auto", threads=1, loaded=smollm2_default)
    try:
        rep = asyncio.run(run_chaos(options(server.url, seed=3, sessions=3, turns=2, max_tokens=16,
                                            kill=["target@1"], settle_s=30.0), oracle=oracle))
    finally:
        oracle.close()
    assert not verdict(rep), verdict(rep)
    assert "live migrations ok / failed / aborted" in format_table(rep)
    assert rep["mismatches"] == [] and rep["leaked_tokens"] == 0 and rep["completed"] > 0
    assert rep["killed"] and not rep["killed"][0].startswith("("), rep["killed"]   # a real target died
    # the killed target's own streams now fail over to the other worker (issue 48) instead of
    # ending: the run can be over before the replacement joins, with no live target for a move
    # after the kill, so a completed move is not guaranteed; a carried-out one is
    assert sum(rep["migrations"].values()) > 0, rep["migrations"]
    assert rep["failovers"]["failed"] == 0, rep["failovers"]
    _live_workers(backend, 2)
    _idle(server)


def test_a_drain_of_eight_live_streams_takes_seconds_not_their_decode_time(cluster):
    """Eight streams on one decode worker; the drain moves them all and returns while they are
    still decoding (elsewhere); every one ends with the unmigrated text."""
    backend, server, want = cluster
    out: dict = {}
    keys = [(f"d{i}", TOPICS[i % len(TOPICS)]) for i in range(8)]
    threads = [threading.Thread(target=_stream, args=(server, t, out, "drain-eight", k)) for k, t in keys]
    for th in threads:
        th.start()
    on = _wait_decoding(backend, 8)
    name = max(set(on.values()), key=list(on.values()).count)
    for rid, w in on.items():
        if w != name:
            _move(server, rid, name)
    t0 = time.monotonic()
    d = httpx.post(server.url + "/admin/drain", params={"worker": name}, timeout=120).json()
    took = time.monotonic() - t0
    still = sum(1 for k, _ in keys if k not in out)
    assert d["remaining"] == [] and len(d["moved"]) >= 1, d
    assert still >= 1, f"every stream ended before the drain returned ({took:.1f}s): nothing shown"
    for th in threads:
        th.join(120)
    for k, t in keys:
        text, finish, err = out[k]
        assert err is None and finish == "length" and text == want[t], (k, out[k])
    httpx.post(server.url + "/admin/undrain", params={"worker": name}, timeout=30)
    _idle(server)
