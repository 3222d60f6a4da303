"""engine/hybrid.py's HybridHooks protocol: both implementations define every hook themselves
(none falls back to the protocol's empty body) with the protocol's parameters."""

from __future__ import annotations

import inspect

import pytest

from tandem.engine.hybrid import NO_HYBRID, HybridHooks, HybridResources, NoHybrid

HOOKS = [n for n, v in vars(HybridHooks).items() if inspect.isfunction(v) and not n.startswith("_")]


def test_the_protocol_names_the_hooks_request_kv_calls():
    assert {"attach", "claim", "alloc", "state_batch", "advanced", "handover", "drop_range",
            "release", "transfer_rows", "owned", "host_stores", "describe"} <= set(HOOKS)


@pytest.mark.parametrize("impl", [NoHybrid, HybridResources])
def test_implementations_define_every_hook_with_its_parameters(impl):
    assert HybridHooks in impl.__mro__                 # declared, not only shaped alike
    for name in HOOKS:
        assert name in vars(impl), f"{impl.__name__} inherits {name} from the protocol"
        want = inspect.signature(getattr(HybridHooks, name)).parameters
        got = inspect.signature(getattr(impl, name)).parameters
        assert [(p.name, p.default) for p in got.values()] == [(p.name, p.default) for p in want.values()]
    for attr in ("active", "components", "stats"):
        assert hasattr(impl, attr) or attr in impl.__init__.__code__.co_names


def test_no_hybrid_hooks_do_nothing():
    assert not NO_HYBRID.active and NO_HYBRID.claim(None, {}, 0)
    assert NO_HYBRID.alloc(None, 4, lambda: "slots") == "slots"
    assert NO_HYBRID.state_batch([]) == (None, None) and NO_HYBRID.transfer_rows(None, 0) == {}
