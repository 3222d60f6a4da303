"""core/types.py's request vocabulary and core/messages.py's wire encoding: new fields validate,
round-trip through msgpack, and old-shaped messages still decode."""

from __future__ import annotations

import json

import msgpack
import pytest

from tandem.core.messages import MAX_N, GenerateRequest, SampleGroup
from tandem.core.types import (MAX_TOP_LOGPROBS, Constraint, InvalidRequest, SamplingParams, StreamChunk,
                               TokenLogprob)

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


def wire_round_trip(greq: GenerateRequest) -> GenerateRequest:
    return GenerateRequest.from_wire(msgpack.unpackb(msgpack.packb(greq.to_wire()), raw=False))


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=("x", "yz"),
                   stop_token_ids=(2, 7), ignore_eos=True, min_tokens=2),
    SamplingParams(logprobs=True, top_logprobs=MAX_TOP_LOGPROBS),
    SamplingParams(constraint=Constraint("json_schema", SCHEMA, strict=False)),
    SamplingParams(constraint=Constraint("json_object")),
    SamplingParams(constraint=Constraint("regex", r"\d{3}"), logprobs=True),
    SamplingParams(constraint=Constraint("lark", 'start: "a" | "b"')),
])
@pytest.mark.parametrize("group", [None, SampleGroup("chatcmpl-1", 2, 3)])
def test_generate_request_round_trips(params, group):
    greq = GenerateRequest("r-1", (1, 2, 3), params.validate(), "sess", group)
    assert wire_round_trip(greq) == greq


def test_tenant_salt_and_trace_cross_the_wire_and_may_be_absent():
    greq = GenerateRequest("r", (5, 6), SamplingParams(), tenant="acme", cache_salt=12345,
                           trace="00-" + "a" * 32 + "-" + "b" * 16 + "-01")
    assert wire_round_trip(greq) == greq
    wire = greq.to_wire()
    for k in ("tenant", "cache_salt", "trace"):
        del wire[k]
    old = GenerateRequest.from_wire(wire)             # a sender that predates them
    assert (old.tenant, old.cache_salt, old.trace, old.cache_key) == ("", 0, "", (5, 6))
    assert greq.cache_key[1:] == (6,) and greq.cache_key[0] != 5


@pytest.mark.parametrize("field, value", [("cache_salt", -1), ("cache_salt", 1 << 31), ("cache_salt", True),
                                          ("tenant", 3), ("trace", "x" * 513)])
def test_bad_tenant_fields_are_refused(field, value):
    wire = {**GenerateRequest("r", (1,), SamplingParams()).to_wire(), field: value}
    with pytest.raises(InvalidRequest, match=field if field != "tenant" else "tenant and trace"):
        GenerateRequest.from_wire(wire)


def test_a_message_without_group_still_decodes():
    wire = GenerateRequest("r", (1,), SamplingParams()).to_wire()
    del wire["group"]
    assert GenerateRequest.from_wire(wire).group is None
    old_params = {k: v for k, v in wire["params"].items()
                  if k not in ("logprobs", "top_logprobs", "constraint")}
    assert GenerateRequest.from_wire({**wire, "params": old_params}).params == SamplingParams()


@pytest.mark.parametrize("params, message", [
    (SamplingParams(top_logprobs=MAX_TOP_LOGPROBS + 1, logprobs=True), r"top_logprobs must be an integer in \[0, 20\]"),
    (SamplingParams(top_logprobs=-1, logprobs=True), "top_logprobs"),
    (SamplingParams(top_logprobs=3), "top_logprobs needs logprobs"),
    (SamplingParams(logprobs=1), "logprobs must be a bool"),
    (SamplingParams(constraint=Constraint("yaml", "x")), "constraint kind must be one of"),
    (SamplingParams(constraint=Constraint("regex", "")), "needs a non-empty spec"),
    (SamplingParams(constraint="json"), "constraint must be a Constraint"),
])
def test_bad_params_are_refused(params, message):
    with pytest.raises(InvalidRequest, match=message):
        params.validate()


@pytest.mark.parametrize("mutate, message", [
    (lambda w: w["params"].update(constraint={"kind": "regex", "spec": "a", "extra": 1}), "constraint must be"),
    (lambda w: w["params"].update(constraint="regex"), "constraint must be"),
    (lambda w: w["params"].update(constraint={"kind": "regex", "spec": 5}), "spec must be a string"),
    (lambda w: w.update(group={"id": "g", "index": 3, "size": 3}), r"index must be in \[0, 3\)"),
    (lambda w: w.update(group={"id": "g", "index": 0, "size": MAX_N + 1}), "size must be in"),
    (lambda w: w.update(group={"id": "g"}), "group must be an object"),
    (lambda w: w.update(surprise=1), "fields mismatch"),
])
def test_bad_wire_messages_are_refused(mutate, message):
    wire = GenerateRequest("r", (1,), SamplingParams()).to_wire()
    mutate(wire)
    with pytest.raises(InvalidRequest, match=message):
        GenerateRequest.from_wire(wire)


def test_defaults_leave_existing_behaviour_alone():
    p = SamplingParams()
    assert (p.logprobs, p.top_logprobs, p.constraint) == (False, 0, None)
    c = StreamChunk("r", (5,), "x")
    assert c.logprobs == () and c.stop_str is None
    lp = TokenLogprob(5, -0.25, ((5, -0.25), (9, -2.0)))
    assert lp.top[0][0] == lp.token_id
    assert Constraint("json_schema", SCHEMA).key() == ("json_schema", SCHEMA, True)
    assert SampleGroup("g", 0, 2).leader and not SampleGroup("g", 1, 2).leader


def test_pins_cross_the_wire_and_may_be_absent():
    greq = GenerateRequest("r", (5, 6, 7), SamplingParams(), pins=((2, 300), (3, 3600)), pin_cap=64)
    assert wire_round_trip(greq) == greq
    wire = greq.to_wire()
    del wire["pins"], wire["pin_cap"]
    old = GenerateRequest.from_wire(wire)
    assert (old.pins, old.pin_cap) == ((), -1)


@pytest.mark.parametrize("field, value", [
    ("pins", [[1, 300]] * 5), ("pins", [[0, 300]]), ("pins", [[4, -1]]), ("pins", [[4, 300, 1]]),
    ("pins", [[4.0, 300]]), ("pins", [[True, 300]]), ("pins", "x"),
    ("pin_cap", -2), ("pin_cap", True), ("pin_cap", "8")])
def test_bad_pins_are_refused(field, value):
    wire = {**GenerateRequest("r", (1,), SamplingParams()).to_wire(), field: value}
    with pytest.raises(InvalidRequest, match=f"GenerateRequest.{field}"):
        GenerateRequest.from_wire(wire)
