"""Live migration of hybrid models through the whole cluster: tiny Gemma 3 (sliding window) and
Granite-4.0-H (Mamba) on 1 prefill + 2 decode Ray actors, the forced-migration lever moving every
running request to the other decode worker every few tokens. Greedy texts over HTTP equal the
in-process engine's (no migration), the moves are counted ok, and both decode pools end idle
with every invariant holding (SWA rows of the kept window and recurrent state moved with them)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from tandem.core.config import MigrationConfig, ServeConfig  # noqa: E402
from tandem.core.types import SamplingParams  # noqa: E402
from tandem.engine.engine import Engine  # noqa: E402

from hf_hybrid_support import hybrid_engine_config, tiny_family  # noqa: E402

OUT = 128          # long enough that a tiny model on a fast CPU is still decoding when a move lands
EVERY = 4
PROMPTS = [list(b"A user asks the hybrid model a question that is longer than its window: ") + [i + 1]
           for i in range(3)]


@pytest.fixture(scope="module", params=["gemma3", "granite"])
def hybrid(request, tmp_path_factory, ray_local):
    from tandem.cluster.launch import launch_disaggregated

    from serve_support import Server

    path, loaded = tiny_family(request.param, tmp_path_factory, "mig_")
    engine = hybrid_engine_config(page_size=4, max_total_tokens=2048).model_copy(
        update={"model": str(path), "dtype": "float32"})
    e = Engine(engine, loaded=loaded)
    try:
        want = [e.generate(p, SamplingParams(max_tokens=OUT, ignore_eos=True)).text for p in PROMPTS]
    finally:
        e.shutdown()
    cfg = ServeConfig(prefill=1, decode=2, transfer_timeout_s=30.0, engine_config=engine,
                      migration=MigrationConfig(policy="off", debug_migrate_every=EVERY, precopy_min_tokens=0))
    backend = launch_disaggregated(cfg, loaded=loaded)
    server = Server(backend, cfg)
    yield backend, server, want, backend.model_name
    server.stop()
    backend.close()


def _complete(server, model: str, ids: list[int], out: list, i: int) -> None:
    text, finish = [], None
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": ids, "max_tokens": OUT, "temperature": 0, "ignore_eos": True,
            "stream": True,
            # one token a step: a tiny random model's repetitive text is drafted and accepted many
            # tokens a step, so a request could end before the forced move its 4th token asked for
            # arrives ("moved >= 2" then fails); speculation under migration is test_migration_cluster's
            "speculative": False}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            import json

            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            text.append(ev["choices"][0]["text"])
            finish = ev["choices"][0].get("finish_reason") or finish
    out[i] = ("".join(text), finish)


def test_forced_migrations_of_hybrid_requests_keep_their_greedy_text(hybrid):
    backend, server, want, model = hybrid
    out: list = [None] * len(PROMPTS)
    ths = [threading.Thread(target=_complete, args=(server, model, p, out, i)) for i, p in enumerate(PROMPTS)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(180)
    assert [o[0] for o in out] == want, out
    assert all(o[1] == "length" for o in out), out
    from prometheus_client.parser import text_string_to_metric_families

    moved = sum(s.value for f in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=30).text)
                for s in f.samples if s.name == "tandem_decode_migrations_total"
                and s.labels.get("reason") == "forced" and s.labels.get("outcome") == "ok")
    assert moved >= 2, [line for line in httpx.get(server.url + "/metrics", timeout=30).text.splitlines()
                        if "migration" in line and not line.startswith("#")]
    end = time.monotonic() + 60
    while True:
        kv = httpx.get(server.url + "/debug/kv", timeout=30).json()
        ws = kv["workers"]
        if kv["migrations"] == [] and all(w["leaked_tokens"] == 0 and w["request_tokens"] == 0
                                          and w["locked_tokens"] == 0 and w["invariants"] == "ok" for w in ws):
            break
        assert time.monotonic() < end, [_not_idle(w) for w in ws]
        time.sleep(0.2)


def _not_idle(w: dict) -> dict:
    """What keeps worker ``w`` from idle (its name and each counter that is not zero, the
    invariant check's verdict in full): the failure message names the leak."""
    return {"worker": w["worker"], **{k: w[k] for k in ("leaked_tokens", "request_tokens", "locked_tokens")
                                      if w[k]}, "invariants": w["invariants"]}
