"""Tenants and traces on a real 1 prefill + 1 decode Ray cluster of SmolLM2 (issue 40): a router of
its own over the shared workers of tests/cluster/shared/conftest.py.

- Isolation: tenant B's prompt, identical to one tenant A just ran, reports 0 cached tokens
  (the tenant salts the page-hash chain: the radix trees, events and the router's index never
  match across tenants), while each tenant's own repeat hits; a body ``cache_salt`` isolates
  further within a tenant.
- Traces: the OTLP/HTTP exporter of the router and of each worker sends to a receiver on 127.0.0.1
  (the shared workers' own) (it decodes ExportTraceServiceRequest protobufs); one request that arrives
  with a W3C ``traceparent`` yields, in that one trace, the router's HTTP and routing spans
  (service.name "router"), the prefill and KV-transfer spans of "prefill-0" and the decode span of
  "decode-0", with their token, byte and page counts.
"""

from __future__ import annotations

import secrets
import time

import pytest

from serve_support import Server

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

from tandem.core import tracing  # noqa: E402

pytestmark = pytest.mark.timeout(300)

KEYS = {"acme": "sk-acme-tenant-key", "globex": "sk-globex-tenant-key"}
PROMPT = ("You are a careful assistant. Here is a long shared document about the history of tea, "
          "its trade routes, and the ceremonies built around it in many countries. ") * 6


@pytest.fixture(scope="module")
def receiver(smollm2_1p1d):
    assert smollm2_1p1d.receiver is not None              # the module skips without OpenTelemetry
    return smollm2_1p1d.receiver


@pytest.fixture(scope="module")
def cluster(smollm2_1p1d, receiver, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text("".join(f"- key: {k}\n  tenant: {t}\n  role: user\n" for t, k in KEYS.items()))
    cfg = smollm2_1p1d.config(api_keys=str(keys))
    assert cfg.otlp_endpoint == receiver.url
    assert tracing.setup("router", cfg.otlp_endpoint)        # what run_serve does
    backend = smollm2_1p1d.router(cfg)
    server = Server(backend, cfg, "tenants")
    yield server
    server.stop()
    backend.close()
    tracing.shutdown()


def _ask(server, tenant: str, content: str = PROMPT, **kw):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=120)
    return c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": content}],
                                     max_tokens=4, temperature=0, **kw)


def _cached(r) -> int:
    return r.usage.prompt_tokens_details.cached_tokens


def test_tenants_never_hit_each_others_cache(cluster):
    a1 = _ask(cluster, "acme")
    assert a1.usage.prompt_tokens > 100 and _cached(a1) == 0
    a2 = _ask(cluster, "acme")
    assert _cached(a2) >= a1.usage.prompt_tokens - 32        # A's repeat: all but the last pages
    b1 = _ask(cluster, "globex")                             # the same prompt, another tenant
    assert b1.usage.prompt_tokens == a1.usage.prompt_tokens and _cached(b1) == 0
    assert _cached(_ask(cluster, "globex")) == _cached(a2)   # B's own repeat hits
    own = _ask(cluster, "acme", extra_body={"cache_salt": "project-x"})
    assert _cached(own) == 0                                 # a cache_salt narrows A's namespace
    assert a2.choices[0].message.content == b1.choices[0].message.content   # same output (greedy)
    # A pins a new prompt (issue 52); B, asking the same, reads only the chat template's opening,
    # which it computed itself earlier (b1), none of A's pinned pages; A's repeat reads them
    pinned = f"{secrets.token_hex(4)} is kept for a day. " + PROMPT
    a3 = _ask(cluster, "acme", pinned, extra_body={"prompt_cache_retention": "24h"})
    b3 = _ask(cluster, "globex", pinned)
    assert _cached(b3) <= _cached(a3) < a3.usage.prompt_tokens // 4, (_cached(a3), _cached(b3))
    assert _cached(_ask(cluster, "acme", pinned)) >= a3.usage.prompt_tokens - 32


def test_one_trace_spans_router_prefill_and_decode(cluster, receiver):
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    c = openai.OpenAI(base_url=cluster.url + "/v1", api_key=KEYS["acme"], max_retries=0, timeout=120,
                      default_headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    r = c.chat.completions.create(model="smollm2", temperature=0, max_tokens=5,
                                  messages=[{"role": "user", "content": "Name three colours. " * 8}])
    tracing.flush()
    want = {("router", "POST /v1/chat/completions"), ("router", "route"), ("prefill-0", "prefill"),
            ("prefill-0", "kv transfer"), ("decode-0", "decode")}
    end = time.monotonic() + 60                              # the workers export every 0.5 s
    while not want <= {(s["service"], s["name"]) for s in receiver.of_trace(trace_id)}:
        assert time.monotonic() < end, f"spans seen: {[(s['service'], s['name']) for s in receiver.of_trace(trace_id)]}"
        time.sleep(0.2)
    spans = {(s["service"], s["name"]): s for s in receiver.of_trace(trace_id)}
    http = spans[("router", "POST /v1/chat/completions")]
    assert http["parent"] == parent                          # the client's traceparent continued
    assert http["attrs"]["http.response.status_code"] == 200
    route, prefill = spans[("router", "route")], spans[("prefill-0", "prefill")]
    xfer, decode = spans[("prefill-0", "kv transfer")], spans[("decode-0", "decode")]
    assert route["parent"] == prefill["parent"] == decode["parent"] == http["id"]
    assert route["attrs"]["tandem.prefill"] == "prefill-0" and route["attrs"]["tandem.decode"] == "decode-0"
    p = prefill["attrs"]
    assert p["tandem.prompt_tokens"] == r.usage.prompt_tokens
    assert p["tandem.cached_tokens"] + p["tandem.computed_tokens"] == r.usage.prompt_tokens
    assert p["tandem.queue_s"] >= 0 and p["tandem.compute_s"] > 0      # the queue wait and the compute apart
    assert xfer["parent"] == prefill["id"]
    assert xfer["attrs"]["tandem.bytes"] > 0 and xfer["attrs"]["tandem.pages"] >= r.usage.prompt_tokens // 16
    assert decode["attrs"]["tandem.tokens"] == r.usage.completion_tokens
    assert decode["attrs"]["tandem.first_token_s"] >= 0


def _computed(server) -> float:
    """Prompt tokens the cluster's workers ran through the model (their /metrics, merged)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(x.value for f in text_string_to_metric_families(text) for x in f.samples
               if x.name == "tandem_worker_prompt_tokens_computed_total")


def test_prompt_cache_key_routes_together_and_cached_tokens_are_what_the_workers_reused(cluster):
    """Issue 52: two requests with one prompt_cache_key and different session ids land on the same
    decode worker, and the second's cached_tokens is exactly the prompt tokens the workers did not
    compute (their own counter)."""
    c = openai.OpenAI(base_url=cluster.url + "/v1", api_key=KEYS["acme"], max_retries=0, timeout=120)
    key = f"pck-{secrets.token_hex(4)}"
    content = f"{key}: {PROMPT}"
    outs = []
    for sid in ("agent-a", "agent-b"):
        before = _computed(cluster)
        raw = c.chat.completions.with_raw_response.create(
            model="smollm2", messages=[{"role": "user", "content": content}], max_tokens=4, temperature=0,
            prompt_cache_key=key, extra_body={"session_id": sid})
        out = raw.parse()
        outs.append((raw.headers.get("x-tandem-worker"), out.usage.prompt_tokens, _cached(out),
                     _computed(cluster) - before))
    (w1, p1, c1, n1), (w2, p2, c2, n2) = outs
    assert w1 is not None and w1 == w2, outs
    assert p1 == p2 > 100 and c1 < p1 // 2 and c1 == p1 - n1, outs    # the first: computed
    assert c2 > p2 // 2 and c2 == p2 - n2, outs                         # the second: reused
