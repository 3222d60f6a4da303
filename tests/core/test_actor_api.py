"""The actor Protocols (core/actors.py, prefill/api.py, decode/api.py) against every actor that
claims them: the Ray actors (the workers, the Responses store, the planner's lease) and the
simulated ones. A method the Protocol names must exist with
the Protocol's parameters, in order (extra parameters must have defaults). The driver's typed
clients (cluster/clients.py) have exactly the Protocols' methods, every method called on an actor
handle (``h.<verb>.remote(...)``) anywhere in the product is in a Protocol, and no module but its
client calls one or looks it up by name (worker/actor.py's ``RayKVSource`` is the workers' own)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Protocol

import pytest

from tandem.cluster.autoscaler import _lease_class
from tandem.cluster.clients import DecodeClient, PrefillClient, RoleClient
from tandem.cluster.responses import ResponseStoreActor
from tandem.core.actors import KVSource, PlannerLeaseAPI, ResponseStoreAPI, RoleAPI
from tandem.decode.actor import DecodeActor
from tandem.decode.api import DecodeAPI
from tandem.prefill.actor import PrefillActor
from tandem.prefill.api import PrefillAPI
from tandem.sim.actor import SimDecodeActor, SimPrefillActor, SimPrefillAPI


def _members(proto) -> dict[str, inspect.Signature]:
    out = {}
    for base in reversed(proto.__mro__):
        if base is Protocol or not getattr(base, "_is_protocol", False):
            continue
        out.update({n: inspect.signature(f) for n, f in vars(base).items()
                    if inspect.isfunction(f) and not n.startswith("_")})
    return out


def _unwrap(actor):
    return getattr(actor, "__ray_actor_class__", actor)   # the class @ray.remote wrapped, if it did


CLAIMS = [(PrefillActor, (PrefillAPI, KVSource)), (DecodeActor, (DecodeAPI, KVSource)),
          (SimPrefillActor, (PrefillAPI, SimPrefillAPI)), (SimDecodeActor, (DecodeAPI,)),
          (ResponseStoreActor, (ResponseStoreAPI,)), (_lease_class(), (PlannerLeaseAPI,))]


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
    assert "store_kv" in _members(PrefillAPI)
    assert set(_members(RoleAPI)) <= set(_members(PrefillAPI)) & set(_members(DecodeAPI))


CLIENTS = [(RoleClient, RoleAPI), (PrefillClient, PrefillAPI), (DecodeClient, DecodeAPI)]


@pytest.mark.parametrize("client,proto", CLIENTS, ids=lambda x: getattr(x, "__name__", ""))
def test_each_client_has_exactly_its_protocols_methods(client, proto):
    want = _members(proto)
    got = {n: inspect.signature(f) for n, f in inspect.getmembers(client, inspect.isfunction)
           if not n.startswith("_")}
    assert set(got) == set(want), f"{client.__name__}: extra {set(got) - set(want)}, missing {set(want) - set(got)}"
    bad = [n for n in want if list(got[n].parameters) != list(want[n].parameters)]
    assert not bad, f"{client.__name__}: parameters differ from {proto.__name__} in {bad}"


ROOT = Path(__file__).resolve().parents[2]
WORKER_VERBS = set().union(*(_members(p) for p in (PrefillAPI, DecodeAPI, KVSource)))
STORE_VERBS, LEASE_VERBS = set(_members(ResponseStoreAPI)), set(_members(PlannerLeaseAPI))
SIM_VERBS = set(_members(SimPrefillAPI))
VERBS = WORKER_VERBS | STORE_VERBS | LEASE_VERBS | SIM_VERBS
PACKAGES = ("cluster", "router", "prefill", "decode", "worker", "sim", "loadtest", "tandem")
# where an actor method may be named: the driver's clients, the workers' one KVSource adapter
# (KVSource's verbs and a prefill worker's store_kv), the clients of the cluster's two singleton
# actors (the store's, the planner's lease), and the simulated decode actor's simulated prefill
NAMED_IN = {"cluster/clients.py": WORKER_VERBS, "worker/actor.py": set(_members(KVSource)) | {"store_kv"},
            "cluster/responses.py": STORE_VERBS, "cluster/autoscaler.py": LEASE_VERBS,
            "sim/actor.py": SIM_VERBS}


def _remote_target(call: ast.Call) -> str | None:
    """The ``<verb>`` of any ``h.<verb>.remote(...)`` / ``h.<verb>.options(...).remote(...)``
    (``ray.remote(...)`` and ``Cls.remote(...)``, a construction, name no verb)."""
    f = call.func
    if not (isinstance(f, ast.Attribute) and f.attr == "remote"):
        return None
    target = f.value
    if isinstance(target, ast.Call) and isinstance(target.func, ast.Attribute) and target.func.attr == "options":
        target = target.func.value
    if isinstance(target, ast.Attribute):
        return target.attr
    return None


def _actor_verb(call: ast.Call) -> str | None:
    """``h.<verb>.remote(...)`` / ``h.<verb>.options(...).remote(...)`` / ``getattr(h, "<verb>")``."""
    f = call.func
    if isinstance(f, ast.Name) and f.id == "getattr" and len(call.args) >= 2:
        arg = call.args[1]
        # the simulated prefill's verb is left out here: ``prefill`` is also an argparse field's name
        return arg.value if isinstance(arg, ast.Constant) and arg.value in VERBS - SIM_VERBS else None
    if not (isinstance(f, ast.Attribute) and f.attr == "remote"):
        return None
    target = f.value
    if isinstance(target, ast.Call) and isinstance(target.func, ast.Attribute) and target.func.attr == "options":
        target = target.func.value
    return target.attr if isinstance(target, ast.Attribute) and target.attr in VERBS else None


def _product_calls():
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(f.relative_to(ROOT))
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Call):
                    yield rel, node


def test_every_remote_verb_is_in_a_protocol():
    """No cross-process verb is called by name alone: each has a Protocol its actors implement."""
    bad = [f"{rel}:{node.lineno} calls {verb!r}, in no Protocol" for rel, node in _product_calls()
           if (verb := _remote_target(node)) is not None and verb not in VERBS]
    assert not bad, "add the verb to its actor's Protocol (core/actors.py, prefill/api.py, decode/api.py):\n" + \
        "\n".join(bad)


def test_the_kv_adapter_lives_in_worker():
    """A prefill process unpickles the adapter a decode actor hands it: it must not import decode/."""
    from tandem.worker.actor import RayKVSource

    assert RayKVSource.__module__ == "tandem.worker.actor"
    assert {"prefill", "abort", "store"} <= set(vars(RayKVSource))


def test_actor_methods_are_named_only_by_their_clients():
    bad = []
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(f.relative_to(ROOT))
            for node in ast.walk(ast.parse(f.read_text())):
                verb = _actor_verb(node) if isinstance(node, ast.Call) else None
                if verb is not None and verb not in NAMED_IN.get(rel, set()):
                    bad.append(f"{rel}:{node.lineno} calls {verb!r} on an actor")
    assert not bad, "use cluster/clients.py's typed clients:\n" + "\n".join(bad)


def test_the_check_sees_a_string_call():
    tree = ast.parse("h.freeze.remote(rid); h.generate.options(num_returns=1).remote(w); getattr(h, 'stats')")
    assert [_actor_verb(n) for n in ast.walk(tree) if isinstance(n, ast.Call) and _actor_verb(n)] == \
        ["freeze", "generate", "stats"]
