"""A tenant's traced request moved between decode workers (issue 40): 1 prefill + 2 decode Ray
workers of SmolLM2, tracing to an OTLP/HTTP receiver this test runs. The user's key cannot move
it (403); the admin's POST /admin/migrate does. The request's one trace then holds a "migration"
span (from, to, outcome ok; each attempt refused while it was still prefilling, a 409, adds one with
outcome refused) and decode spans from both decode workers, the second one resumed;
the stream is the same text as the request unmoved; and the move kept the tenant's cache salt:
the target found the pages its pre-copy took (under the request's salt) in its own cache
(tandem_decode_migration_reused_tokens_total > 0; with the salt lost on the way, it finds none).
"""

from __future__ import annotations

import secrets
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

from otlp_support import Receiver  # noqa: E402

from tandem.core import tracing  # noqa: E402
from tandem.core.config import CacheConfig, EngineConfig, MigrationConfig, ServeConfig  # noqa: E402

pytestmark = pytest.mark.timeout(300)

USER, ADMIN = "sk-acme-user-key", "sk-ops-admin-key"
MESSAGES = [{"role": "user", "content": "Write a long paragraph about rivers."}]


@pytest.fixture(scope="module")
def cluster(smollm2, ray_local, tmp_path_factory):
    from tandem.cluster.launch import launch_disaggregated

    from serve_support import Server

    receiver = Receiver()
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(f"- key: {USER}\n  tenant: acme\n  role: user\n- key: {ADMIN}\n  tenant: ops\n  role: admin\n")
    engine = EngineConfig(device="cpu", num_threads=1,
                          cache=CacheConfig(page_size=16, max_total_tokens=4096, max_running_requests=8))
    cfg = ServeConfig(prefill=1, decode=2, transfer_timeout_s=20.0, engine_config=engine,
                      ray_namespace="tenants-migration", api_keys=str(keys), otlp_endpoint=receiver.url,
                      migration=MigrationConfig(policy="off", precopy_min_tokens=0))
    assert tracing.setup("router", cfg.otlp_endpoint)
    backend = launch_disaggregated(cfg, loaded=smollm2)
    server = Server(backend, cfg, "tenants-migration")
    yield server, backend, receiver
    server.stop()
    backend.close()
    tracing.shutdown()
    receiver.close()


def _stream(server, out: dict, headers: dict) -> None:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=USER, max_retries=0, timeout=120,
                      default_headers=headers)
    s = c.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=64, temperature=0,
                                  stream=True, extra_body={"ignore_eos": True})
    out["text"] = "".join(ev.choices[0].delta.content or "" for ev in s if ev.choices)


def test_a_moved_request_keeps_its_trace_and_its_salt(cluster):
    server, backend, receiver = cluster
    trace_id = secrets.token_hex(16)
    out: dict = {}
    th = threading.Thread(target=_stream, args=(server, out, {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}))
    th.start()
    end = time.monotonic() + 60
    while not backend.inflight:
        assert time.monotonic() < end, "the request never reached a decode worker"
        time.sleep(0.02)
    rid, src = next(iter(backend.inflight.items()))
    url = server.url + "/admin/migrate"
    assert httpx.post(url, params={"rid": rid}, headers={"Authorization": f"Bearer {USER}"},
                      timeout=30).status_code == 403
    refused = 0
    for _ in range(200):              # 409 while it is still prefilling
        r = httpx.post(url, params={"rid": rid}, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
        if r.status_code != 409:
            break
        refused += 1
        time.sleep(0.05)
    assert r.status_code == 200, r.text
    to = r.json()["to"]
    th.join(120)
    assert not th.is_alive() and out.get("text")

    tracing.flush()
    names = {src.name: "source", to: "target"}
    end = time.monotonic() + 60
    while True:
        spans = receiver.of_trace(trace_id)
        migration = [s for s in spans if s["name"] == "migration"]
        moved = [s for s in migration if s["attrs"]["tandem.outcome"] == "ok"]
        decodes = {s["service"]: s for s in spans if s["name"] == "decode" and s["attrs"]["tandem.rid"] == rid}
        if moved and set(names) <= set(decodes):
            break
        assert time.monotonic() < end, [(s["service"], s["name"], s["attrs"]) for s in spans]
        time.sleep(0.2)
    # an attempt the router refused (the 409s above, while the request was still prefilling) is
    # in the trace too, as a "migration" span with outcome "refused"
    assert len(moved) == 1, [s["attrs"] for s in migration]
    [m] = moved
    others = [s["attrs"]["tandem.outcome"] for s in migration if s is not m]
    assert set(others) <= {"refused"} and len(others) <= refused, (others, refused)
    assert m["service"] == "router" and m["attrs"]["tandem.outcome"] == "ok"
    assert (m["attrs"]["tandem.from"], m["attrs"]["tandem.to"]) == (src.name, to)
    assert decodes[to]["attrs"]["tandem.resumed"] and not decodes[src.name]["attrs"]["tandem.resumed"]
    assert decodes[src.name]["attrs"]["tandem.tokens"] + decodes[to]["attrs"]["tandem.tokens"] >= 64

    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    reused = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                 if line.startswith("tandem_decode_migration_reused_tokens_total"))
    assert reused >= 16                                   # at least a page of the salted prompt

    # unmoved, the same request gives the same text (greedy)
    again: dict = {}
    _stream(server, again, {})
    assert again["text"] == out["text"]
