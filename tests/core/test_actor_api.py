"""The actor Protocols (core/actors.py, prefill/api.py, decode/api.py) against every actor that
claims them: the Ray actors and the simulated ones. A method the Protocol names must exist with
the Protocol's parameters, in order (extra parameters must have defaults)."""

from __future__ import annotations

import inspect
from typing import Protocol

import pytest

from tandem.core.actors import KVSource, RoleAPI
from tandem.decode.actor import DecodeActor
from tandem.decode.api import DecodeAPI
from tandem.prefill.actor import PrefillActor
from tandem.prefill.api import PrefillAPI
from tandem.sim.actor import SimDecodeActor, SimPrefillActor


def _members(proto) -> dict[str, inspect.Signature]:
    out = {}
    for base in reversed(proto.__mro__):
        if base is Protocol or not getattr(base, "_is_protocol", False):
            continue
        out.update({n: inspect.signature(f) for n, f in vars(base).items()
                    if inspect.isfunction(f) and not n.startswith("_")})
    return out


def _unwrap(actor):
    return actor.__ray_actor_class__   # the class @ray.remote wrapped


CLAIMS = [(PrefillActor, (PrefillAPI, KVSource)), (DecodeActor, (DecodeAPI, KVSource)),
          (SimPrefillActor, (PrefillAPI,)), (SimDecodeActor, (DecodeAPI,))]


@pytest.mark.parametrize("actor,protos", CLAIMS, ids=lambda x: getattr(x, "__name__", "")[:40])
def test_each_actor_implements_its_protocols(actor, protos):
    cls, bad = _unwrap(actor), []
    for proto in protos:
        for name, want in _members(proto).items():
            fn = getattr(cls, name, None)
            if fn is None:
                bad.append(f"{proto.__name__}.{name}: missing")
                continue
            got = list(inspect.signature(fn).parameters.values())
            names = [p.name for p in want.parameters.values()]
            if [p.name for p in got[:len(names)]] != names:
                bad.append(f"{proto.__name__}.{name}: {[p.name for p in got]} is not {names}")
            elif any(p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD
                     for p in got[len(names):]):
                bad.append(f"{proto.__name__}.{name}: extra parameters without defaults")
    assert not bad, f"{cls.__name__}: " + "; ".join(bad)


def test_the_protocols_name_what_cluster_calls():
    assert {"freeze", "release_frozen", "generate", "add_decode"} <= set(_members(DecodeAPI))
    assert {"write_kv", "drop_kv"} == set(_members(KVSource))
    assert set(_members(RoleAPI)) <= set(_members(PrefillAPI)) & set(_members(DecodeAPI))
