"""Tenants and roles at the front door (issue 40), over the scripted backend and a real uvicorn:
the key file (key or key_sha256, role, rate_limit), 401 / 403 on every /admin and /debug route
(enumerated from the app, so a new route cannot escape), the tenant's cache salt on each
GenerateRequest (and a body ``cache_salt`` narrowing it), stored responses answered 404 to
other tenants (GET, DELETE, cancel, previous_response_id), 429 with Retry-After over a rate
limit, the per-tenant /metrics counters, and a SIGHUP-style reload."""

from __future__ import annotations

import hashlib
import re

import httpx
import pytest

from tandem.core.config import ServeConfig
from tandem.core.page_hash import cache_salt
from tandem.router.auth import KeyRing, load_keys

ALICE, BOB, ROOT, LIMITED = "sk-alice-0001", "sk-bob-000002", "sk-root-00003", "sk-slow-00004"
KEYS = f"""
- key: {ALICE}
  tenant: acme
  role: user
- key_sha256: {hashlib.sha256(BOB.encode()).hexdigest()}
  tenant: globex
  role: user
- key: {ROOT}
  tenant: ops
  role: admin
- key: {LIMITED}
  tenant: slowco
  role: user
  rate_limit: {{requests_per_s: 0.2}}
"""


def auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.fixture(scope="module")
def keyfile(tmp_path_factory):
    p = tmp_path_factory.mktemp("keys") / "keys.yaml"
    p.write_text(KEYS)
    return p


@pytest.fixture(scope="module")
def tenants(serve, keyfile, scripted_backend):
    return serve(scripted_backend(), ServeConfig(api_keys=str(keyfile), debug_endpoints=True))


def chat(srv, key, content="hi", **extra):
    return httpx.post(srv.url + "/v1/chat/completions", headers=auth(key), timeout=10,
                      json={"model": "scripted-model", "messages": [{"role": "user", "content": content}],
                            "max_tokens": 4, **extra})


PUBLIC = {"/health", "/metrics"}      # probes and Prometheus: no key
KEYED = ("/tokenize", "/detokenize")  # vLLM's paths outside /v1: a user key, as /v1/*


def routes(app, *prefixes: str) -> list[tuple[str, str]]:
    """(method, path) of every route of ``app`` under ``prefixes``, path parameters filled in."""
    return [(method, re.sub(r"\{[^}]+\}", "x", r.path)) for r in app.routes
            if r.path.startswith(prefixes) for method in sorted(r.methods - {"HEAD"})]


def test_every_route_is_public_v1_or_admin(tenants):
    """A new route must be one of the three kinds the tests below cover."""
    app = tenants.server.config.app
    odd = [r.path for r in app.routes if r.path not in PUBLIC and not r.path.startswith(("/v1/", "/admin/", "/debug/") + KEYED)]
    assert not odd, f"routes with no auth class: {odd}"


def test_every_v1_route_needs_a_key(tenants):
    app = tenants.server.config.app
    v1 = routes(app, "/v1/", *KEYED)
    assert len(v1) >= 11
    for method, path in v1:
        r = httpx.request(method, tenants.url + path, timeout=10, json={})
        assert r.status_code == 401, (method, path, r.status_code)
        r = httpx.request(method, tenants.url + path, headers=auth(ALICE), timeout=10, json={})
        assert r.status_code not in (401, 403), (method, path, r.status_code)


def test_every_admin_and_debug_route_needs_an_admin_key(tenants):
    app = tenants.server.config.app
    admin = routes(app, "/admin", "/debug")
    assert {p for _, p in admin} >= {"/debug/kv", "/debug/kill", "/admin/drain", "/admin/migrate"}
    assert httpx.get(tenants.url + "/admin/no-such-route", headers=auth(ALICE), timeout=10).status_code == 403
    for method, path in admin:
        url = tenants.url + path
        assert httpx.request(method, url, timeout=10).status_code == 401, (method, path)
        assert httpx.request(method, url, headers=auth("sk-unknown-key"), timeout=10).status_code == 401
        r = httpx.request(method, url, headers=auth(ALICE), timeout=10)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", (method, path)
        # an admin passes the gate (the scripted backend then has nothing to drain or inspect)
        assert httpx.request(method, url, headers=auth(ROOT), timeout=10).status_code not in (401, 403)


def test_v1_needs_a_key_and_takes_user_and_admin(tenants):
    assert chat(tenants, None).status_code == 401
    assert chat(tenants, "sk-nope-nope").status_code == 401
    for key in (ALICE, BOB, ROOT):
        assert chat(tenants, key).status_code == 200
    assert httpx.get(tenants.url + "/v1/models", headers=auth(BOB), timeout=10).status_code == 200


def test_requests_carry_the_tenant_and_its_cache_salt(tenants):
    backend = tenants.backend
    for key, tenant in ((ALICE, "acme"), (BOB, "globex")):
        assert chat(tenants, key, content=f"salt {tenant}").status_code == 200
        g = backend.requests[-1]
        assert g.tenant == tenant and g.cache_salt == cache_salt(tenant) != 0
    assert chat(tenants, ALICE, content="own salt", cache_salt="project-x").status_code == 200
    g = backend.requests[-1]
    assert g.cache_salt == cache_salt("acme", "project-x") not in (0, cache_salt("acme"))
    assert chat(tenants, ALICE, cache_salt=7).status_code == 400
    # the salt keys the caches, never the model's input
    assert g.cache_key[0] != g.prompt_ids[0]
    assert g.cache_key[1:] == g.prompt_ids[1:]


def test_stored_responses_belong_to_their_tenant(tenants):
    body = {"model": "scripted-model", "input": "remember me", "max_output_tokens": 4}
    r = httpx.post(tenants.url + "/v1/responses", headers=auth(ALICE), json=body, timeout=10)
    assert r.status_code == 200
    rid = r.json()["id"]
    url = f"{tenants.url}/v1/responses/{rid}"
    assert httpx.get(url, headers=auth(ALICE), timeout=10).status_code == 200
    for key in (BOB, ROOT):     # another tenant, even an admin's, sees nothing
        assert httpx.get(url, headers=auth(key), timeout=10).status_code == 404
        assert httpx.delete(url, headers=auth(key), timeout=10).status_code == 404
        assert httpx.post(url + "/cancel", headers=auth(key), timeout=10).status_code == 404
        r = httpx.post(tenants.url + "/v1/responses", headers=auth(key), timeout=10,
                       json={**body, "previous_response_id": rid})
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    r = httpx.post(tenants.url + "/v1/responses", headers=auth(ALICE), timeout=10,
                   json={**body, "previous_response_id": rid})
    assert r.status_code == 200
    assert httpx.delete(url, headers=auth(ALICE), timeout=10).status_code == 200
    assert httpx.get(url, headers=auth(ALICE), timeout=10).status_code == 404


def test_rate_limit_is_a_429_with_retry_after(tenants):
    assert chat(tenants, LIMITED).status_code == 200        # the bucket holds one request
    r = chat(tenants, LIMITED)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(r.headers["Retry-After"]) <= 5
    assert chat(tenants, ALICE).status_code == 200          # other tenants are not held back


def _counter(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{"):
            got = ",".join(sorted(line[len(name) + 1:line.index("}")].split(",")))
            if got == want:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_per_tenant_metrics(tenants):
    before = httpx.get(tenants.url + "/metrics", timeout=10).text
    assert chat(tenants, BOB, content="count me").status_code == 200
    chat(tenants, LIMITED)
    chat(tenants, LIMITED)
    after = httpx.get(tenants.url + "/metrics", timeout=10).text

    def delta(name, **labels):
        return _counter(after, name, **labels) - _counter(before, name, **labels)

    assert delta("tandem_tenant_requests_total", tenant="globex") == 1
    assert delta("tandem_tenant_tokens_total", tenant="globex", kind="output") == 4
    prompt = delta("tandem_tenant_tokens_total", tenant="globex", kind="prompt")
    assert prompt > 4 and delta("tandem_tenant_tokens_total", tenant="globex", kind="cached") == 4
    assert delta("tandem_tenant_rate_limited_total", tenant="slowco") >= 1


def test_reload_swaps_the_keys_and_keeps_them_on_a_bad_file(tmp_path):
    p = tmp_path / "keys.yaml"
    p.write_text(KEYS)
    ring = KeyRing(path=str(p))
    assert ring.who(ALICE).tenant == "acme" and ring.who(BOB).tenant == "globex"
    p.write_text(f"- key: {ALICE}\n  tenant: acme2\n  role: admin\n")
    assert ring.reload()
    assert ring.who(ALICE).tenant == "acme2" and ring.who(ALICE).admin and ring.who(BOB) is None
    p.write_text("- tenant: nokey\n")
    assert not ring.reload()                     # refused: the previous set stays
    assert ring.who(ALICE).tenant == "acme2"


def test_key_file_errors_name_the_entry_not_the_key(tmp_path):
    p = tmp_path / "keys.yaml"
    p.write_text("- key: sk-secret-value-1\n  tenant: a\n  role: root\n")
    with pytest.raises(ValueError) as e:
        load_keys(str(p))
    assert "entry 0" in str(e.value) and "sk-secret-value-1" not in str(e.value)


def test_single_api_key_is_an_admin_of_the_default_tenant():
    ring = KeyRing(api_key="sk-only-admin")
    who = ring.who("sk-only-admin")
    assert who.admin and who.tenant == "" and ring.who("sk-other") is None and ring.who("") is None
    assert cache_salt(who.tenant) == 0          # the shared cache namespace, as before tenants


def test_tandem_serve_reads_the_key_file_again_on_sighup(tmp_path):
    """The real command (``tandem serve --engine sim --api-keys FILE``): a key added to the file
    works only after SIGHUP; a broken file on the next SIGHUP keeps the keys in force. Its
    simulated workers' caches are salted too: the new tenant's copy of a prompt the first tenant
    repeated (a hit) is a miss."""
    import signal
    import subprocess
    import sys
    import time

    from tandem.core.ports import free_port

    port = free_port()
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"- key: {ALICE}\n  tenant: acme\n  role: user\n")
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "tandem.cluster.cli", "serve", "--engine", "sim", "--host", "127.0.0.1",
           "--port", str(port), "--api-keys", str(keys)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1/models"

    def status(key: str) -> int:
        return httpx.get(url, headers=auth(key), timeout=5).status_code

    def until(key: str, code: int) -> None:
        end = time.monotonic() + 60
        while True:
            try:
                if status(key) == code:
                    return
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < end, f"{key} never got {code}:\n{log.read_text()[-2000:]}"
            time.sleep(0.2)

    try:
        until(ALICE, 200)
        assert status(BOB) == 401
        keys.write_text(f"- key: {ALICE}\n  tenant: acme\n  role: user\n- key: {BOB}\n  tenant: globex\n  role: user\n")
        assert status(BOB) == 401                   # not before the signal
        proc.send_signal(signal.SIGHUP)
        until(BOB, 200)

        def cached(key: str) -> int:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", headers=auth(key), timeout=60,
                           json={"model": "smollm2", "prompt": list(range(1000, 1400)), "max_tokens": 2})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached(ALICE) == 0 and cached(ALICE) > 300 and cached(BOB) == 0 and cached(BOB) > 300
        keys.write_text("not: [a, key, list\n")
        proc.send_signal(signal.SIGHUP)
        until_log = time.monotonic() + 30
        while "kept the previous key set" not in log.read_text():
            assert time.monotonic() < until_log, log.read_text()[-2000:]
            time.sleep(0.2)
        assert status(BOB) == 200 and status(ALICE) == 200
        assert ALICE not in log.read_text() and BOB not in log.read_text()   # keys never logged
    finally:
        proc.kill()         # the sim engine runs in the process: nothing outlives it
        proc.wait()
