"""The shared L3 tier with real hybrid engines on the CPU (tiny Gemma 3: FULL + SWA; tiny
Granite-4.0-H: FULL + MAMBA) and a REAL Mooncake master on 127.0.0.1 (tests/worker/
test_l3_engines.py's fixture and helpers; SmolLM2 there).

Engine A computes the prompts and writes them through to the store (FULL pages, the SWA rows of
the windows it kept, the state checkpoints it took); engine B, fresh (nothing on its device, no
host tier), serves the same prompts from L3: its L3 hits are > 0, it reuses tokens, and its
greedy tokens and text equal an engine with the prefix cache off. An engine whose writes are all
damaged (``--debug-corrupt-l3``) makes every value a miss: the component values B reads first
fail their digest, B recomputes, and the output is the same. Every cache invariant (every pool's
ownership, spills written) is checked after each operation (debug_invariants) and at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("mooncake.store")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from tandem.cache.tiers.l3.connect import attach_store, l3_options  # noqa: E402
from tandem.core.types import SamplingParams  # noqa: E402
from tandem.engine.engine import Engine  # noqa: E402
from tandem.engine.hybrid import HybridConfig  # noqa: E402

from hf_hybrid_support import hybrid_engine_config, tiny_family  # noqa: E402
from test_l3_engines import flush, idle_and_exact, master  # noqa: E402,F401  (master: the fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAGE = 4
MAX_TOKENS = 10


def prompts(tag: str) -> list[list[int]]:
    """Byte prompts of 50-70 tokens (several 16-token prefill chunks, past the 8-token window)."""
    return [list(f"[{tag}] Request {i}: a prompt longer than the window, {'x' * (5 * i)} answer:".encode())
            for i in range(3)]


@pytest.fixture(scope="module", params=["gemma3", "granite"])
def family(request, tmp_path_factory):
    _, loaded = tiny_family(request.param, tmp_path_factory)
    plain = Engine(hybrid_engine_config(disable=True, max_total_tokens=1024), loaded=loaded)
    yield request.param, loaded, plain
    plain.shutdown()


def engine(loaded, master, *, corrupt: bool = False) -> Engine:
    e = Engine(hybrid_engine_config(page_size=PAGE, max_total_tokens=1024), loaded=loaded,
               hybrid=HybridConfig(state_slots=24))
    opts = l3_options(master.address.url(), timeout_s=2.0, corrupt=corrupt)
    opts["segment_bytes"] = 32 << 20
    tier = attach_store(e.kv.cache, e.kv_pool, e.model_name, aux_data=e.hybrid.component_data(), **opts)
    assert tier is not None and tier.write_through and e.kv.cache.tier("l3") is tier
    return e


def answer(e: Engine, ids_list):
    outs = e.generate_many([e.make_request(ids, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
                            for ids in ids_list], timeout=300)
    assert all(c.error is None for c in outs), [c.error for c in outs]
    return outs


def test_a_fresh_hybrid_engine_serves_what_another_computed_from_l3(family, master):
    name, loaded, plain = family
    ids = prompts(f"{name}-shared")
    a, b = engine(loaded, master), engine(loaded, master)
    try:
        first = answer(a, ids)
        flush(a)
        assert a.kv.cache.tier("l3").stats.written_pages > 0
        second = answer(b, ids)
        want = answer(plain, ids)
        for i, (x, y, w) in enumerate(zip(first, second, want)):
            assert x.token_ids == w.token_ids, f"{name} request {i}: the writer differs"
            assert (y.token_ids, y.text) == (w.token_ids, w.text), f"{name} request {i}: L3 changed it"
        st = b.kv.cache.tier("l3").stats
        assert st.hit_pages > 0 and st.aux_hits > 0 and st.aux_misses == 0, st
        assert all(y.cached_tokens > 0 for y in second), [y.cached_tokens for y in second]
        assert b.kv.cache.tier("l3").store.stats.corrupt == 0
        from prometheus_client import CollectorRegistry, generate_latest

        from tandem.engine.metrics import register_engine_metrics
        reg = CollectorRegistry()
        register_engine_metrics(b, "b", registry=reg)
        text = generate_latest(reg).decode()
        assert f'tandem_l3_component_hits_total{{role="colocated",worker="b"}} {st.aux_hits}.0' in text
        idle_and_exact(a)
        idle_and_exact(b)
    finally:
        a.shutdown()
        b.shutdown()


def test_corrupt_component_values_are_misses_with_the_same_output(family, master):
    name, loaded, plain = family
    ids = prompts(f"{name}-damaged")
    bad, b = engine(loaded, master, corrupt=True), engine(loaded, master)
    try:
        answer(bad, ids)
        flush(bad)
        got = answer(b, ids)
        want = answer(plain, ids)
        assert [(c.token_ids, c.text) for c in got] == [(c.token_ids, c.text) for c in want]
        st, ss = b.kv.cache.tier("l3").stats, b.kv.cache.tier("l3").store.stats
        # every end B could reach needs a component value: read first, damaged, a miss
        assert st.aux_misses > 0 and ss.corrupt >= st.aux_misses and st.hit_pages == 0, (st, ss)
        idle_and_exact(b)
    finally:
        bad.shutdown()
        b.shutdown()
