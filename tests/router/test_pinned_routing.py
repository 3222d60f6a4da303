"""Pins in the router's exact index (issue 52): a worker's KV events say which prefixes it pinned
and for how long; routing prefers the workers that pinned a request's prefix, even after the pages
left the device for a lower tier, and forgets a pin when it ends or is deleted."""

from __future__ import annotations

from tandem.cache.radix.events import BlockPinned, BlockUnpinned, encode
from tandem.router.kv_wire import decode_payload
from tandem.router.policies import PolicyConfig, PrefillEstimator, RouterState, choose
from tandem.router.prefix_index import GlobalBlockIndex, KVEvent, block_hashes
from tandem.router.view import DECODE, PREFILL, ClusterView, RouteRequest, WorkerView

HS = block_hashes(list(range(160)), 16)        # 10 blocks of 16 tokens
LINEAR = PrefillEstimator(overhead_s=0.0, per_token_s=1e-3, per_pair_s=0.0)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_pin_events_cross_the_wire():
    payload = encode(1.0, [BlockPinned([HS[0], 2**64 - 1], 300.0), BlockUnpinned([HS[0]])])
    p, u = decode_payload(4, payload)
    assert (p.worker_id, p.kind, p.block_hashes, p.ttl_s) == (4, "pinned", (HS[0], 2**64 - 1), 300.0)
    assert (u.kind, u.block_hashes) == ("unpinned", (HS[0],))


def test_pinned_prefix_is_the_leading_pinned_run_until_the_pin_ends():
    clock = Clock()
    ix = GlobalBlockIndex(clock=clock)
    assert ix.pinned_prefix(HS) == {} and not ix.has_pins()
    ix.apply(KVEvent(0, "pinned", tuple(HS[:6]), ttl_s=300.0))
    ix.apply(KVEvent(1, "pinned", tuple(HS[:3]), ttl_s=60.0))
    ix.apply(KVEvent(2, "pinned", tuple(HS[1:4]), ttl_s=300.0))     # not a prefix of this request
    assert ix.pinned_prefix(HS) == {0: 6, 1: 3}
    assert ix.pinned_blocks(0) == 6
    clock.t += 61                                                     # worker 1's pin ended
    assert ix.pinned_prefix(HS) == {0: 6}
    ix.apply(KVEvent(0, "pinned", tuple(HS[:2]), ttl_s=10.0))       # a shorter pin never shortens one
    clock.t += 200
    assert ix.pinned_prefix(HS) == {0: 6}
    ix.apply(KVEvent(0, "unpinned", tuple(HS[3:6])))                  # DELETE /admin/cache/pins
    assert ix.pinned_prefix(HS) == {0: 3}
    ix.apply(KVEvent(0, "cleared"))                                   # a restarted publisher
    assert ix.pinned_prefix(HS) == {}


def test_session_routes_a_new_session_to_the_worker_that_pinned_its_prefix():
    # both prefill workers idle; worker 1 pinned the prompt's first 8 blocks, whose pages have since
    # left its device (no stored blocks anywhere): the pin alone makes it the better choice
    v = ClusterView.of([WorkerView(0, PREFILL), WorkerView(1, PREFILL),
                        WorkerView(10, DECODE), WorkerView(11, DECODE)], 0.0)
    req = RouteRequest("r", list(range(160)), 160, 1, session_id="s1")
    s = RouterState(PolicyConfig(kv_block_size=16, estimator=LINEAR, duplicate_penalty=0.0))
    assert choose(v, req, s, "session").prefill_worker == 0            # no pin: the lower id
    s = RouterState(PolicyConfig(kv_block_size=16, estimator=LINEAR, duplicate_penalty=0.0))
    s.kv.apply(KVEvent(1, "pinned", tuple(HS[:8]), ttl_s=300.0))
    s.kv.apply(KVEvent(11, "pinned", tuple(HS[:8]), ttl_s=300.0))
    d = choose(v, req, s, "session")
    assert (d.prefill_worker, d.decode_worker, d.matched_tokens) == (1, 11, 128)


def test_kv_events_counts_a_pinned_block_as_a_lower_tier_hit():
    v = ClusterView.of([WorkerView(0, PREFILL), WorkerView(1, PREFILL), WorkerView(10, DECODE)], 0.0)
    req = RouteRequest("r", list(range(160)), 160, 1)
    s = RouterState(PolicyConfig(kv_block_size=16))
    s.kv.apply(KVEvent(0, "stored", tuple(HS[:2]), 32))             # worker 0: 2 device blocks
    s.kv.apply(KVEvent(1, "pinned", tuple(HS[:8]), ttl_s=300.0))    # worker 1: 8 pinned, demoted
    assert choose(v, req, s, "kv_events").prefill_worker == 1


def test_one_prompt_cache_key_one_route_whatever_the_session_ids():
    """OpenAI's prompt_cache_key is the routing key ahead of session ids (router/sessions.py): two
    agents with their own session ids and one key land on the same prefill and decode workers,
    even when the first pair has become the busier one."""
    from tandem.router.sessions import session_key

    k1 = session_key({"x-session-id": "agent-a"}, {"prompt_cache_key": "pck", "session_id": "x"})
    k2 = session_key({}, {"prompt_cache_key": "pck", "session_id": "agent-b", "user": "u"})
    assert k1 == k2 == "pck"
    assert session_key({"x-session-id": "agent-a"}, {"session_id": "x"}) == "agent-a"
    s = RouterState(PolicyConfig(kv_block_size=16))
    v = ClusterView.of([WorkerView(0, PREFILL), WorkerView(1, PREFILL),
                        WorkerView(10, DECODE), WorkerView(11, DECODE)], 0.0)
    first = choose(v, RouteRequest("a", list(range(64)), 64, 1, session_id=k1), s, "session")
    busy = {first.prefill_worker: 3, first.decode_worker: 4096}
    v = ClusterView.of([WorkerView(w, PREFILL, in_flight=busy.get(w, 0)) for w in (0, 1)]
                       + [WorkerView(w, DECODE, running_tokens=busy.get(w, 0)) for w in (10, 11)], 1.0)
    second = choose(v, RouteRequest("b", list(range(64)) + [7] * 16, 80, 1, session_id=k2), s, "session")
    assert (second.prefill_worker, second.decode_worker) == (first.prefill_worker, first.decode_worker)
    assert second.reason == "sticky"
    other = choose(v, RouteRequest("c", list(range(64)), 64, 1, session_id="agent-b"), s, "session")
    assert other.decode_worker != first.decode_worker          # without the key: its own route
