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

OUT = 96
TOPICS = ("rivers", "bridges", "volcanoes")


def _cfg() -> ServeConfig:
    engine = EngineConfig(device="cpu", num_threads=1,
                          cache=CacheConfig(page_size=16, max_total_tokens=4096, max_running_requests=16))
    # policy off: these tests move requests by hand (the policy's own test runs one round itself)
    return ServeConfig(prefill=1, decode=2, transfer_timeout_s=20.0, engine_config=engine,
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
    want = {}
    for t in TOPICS:   # the oracle: the same request on a colocated engine, no migration
        c = e.generate(e.tokenizer.apply_chat_template(_messages(t)),
                       __import__("tandem.core.types", fromlist=["SamplingParams"]).SamplingParams(
                           max_tokens=OUT, ignore_eos=True))
        want[t] = c.text
    e.shutdown()
    yield backend, server, want
    server.stop()
    backend.close()


def _stream(server, topic: str, out: dict, session: str | None = None) -> None:
    """A streamed chat, its text and finish reason into ``out[topic]``."""
    text, finish, err = [], None, None
    try:
        s = server.client.chat.completions.create(
            model="smollm2", messages=_messages(topic), max_tokens=OUT, temperature=0, stream=True,
            extra_body={"ignore_eos": True}, extra_headers={"X-Session-Id": session or f"m-{topic}"})
        for ev in s:
            if ev.choices:
                text.append(ev.choices[0].delta.content or "")
                finish = ev.choices[0].finish_reason or finish
    except Exception as e:  # noqa: BLE001 - reported, and the test fails on it
        err = repr(e)
    out[topic] = ("".join(text), finish, err)


def _running_on(backend) -> dict[str, str]:
    return {rid: w.name for rid, w in list(backend._inflight.items())}


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
        ws = httpx.get(server.url + "/debug/kv", timeout=30).json()["workers"]
        if all(w["leaked_tokens"] == 0 and w["request_tokens"] == 0 and w["locked_tokens"] == 0
               and w["invariants"] == "ok" for w in ws):
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
