"""decode/local_prefill.py: the cost rule that decides where a prompt is prefilled, its measured
constants, and the estimate of what a prefill worker holds. Pure: no engine, no Ray."""

from __future__ import annotations

import pytest

from tandem.decode.local_prefill import PrefillCosts, SentPrefixes, choose_local


def test_costs_take_the_first_measurement_then_an_ewma():
    c = PrefillCosts()
    c.observe(100, 0.2, 0.25)                  # 2 ms a token, 50 ms beyond compute
    assert c.samples == 1
    assert c.per_token_s == pytest.approx(0.002) and c.overhead_s == pytest.approx(0.05)
    c.observe(100, 0.1, 0.1)                   # 1 ms a token, no overhead
    assert c.per_token_s == pytest.approx(0.002 + 0.2 * (0.001 - 0.002))
    assert c.overhead_s == pytest.approx(0.05 * 0.8)
    c.observe(0, 1.0, 2.0)                     # a full prefill-side hit measures nothing
    assert c.samples == 2


def test_rule_prefills_here_only_what_saves_more_than_it_costs():
    c = PrefillCosts(per_token_s=0.001, overhead_s=0.02)     # the overhead = 20 tokens
    # a later turn: decode holds the reply (256) the prefill worker lacks; 100 new tokens
    assert choose_local(1000, 896, 640, c, 16)
    # the new part longer than the reply plus the overhead's tokens: the prefill worker
    assert not choose_local(1200, 896, 640, c, 16)           # 304 new > 256 + 20
    assert choose_local(1170, 896, 640, c, 16)               # 274 new < 256 + 20
    # decode holds nothing the prefill worker lacks (a cold prompt, a shared system prompt)
    assert not choose_local(100, 0, 0, c, 16)
    assert not choose_local(600, 592, 592, c, 16)
    assert not choose_local(600, 592, 580, c, 16)            # less than a page more: not worth it


def test_sent_prefixes_match_whole_pages_per_peer_and_forget_the_oldest():
    s = SentPrefixes(page_size=4, capacity=3)
    ids = list(range(10))
    assert s.held("p0", ids) == 0
    s.add("p0", ids)                                  # pages [0:4), [4:8); the tail is not a page
    assert s.held("p0", ids + [99, 98]) == 8
    assert s.held("p0", [0, 1, 2, 3, 7, 7, 7, 7]) == 4   # diverges in the second page
    assert s.held("p1", ids) == 0                     # another prefill worker
    s.add("p0", [50, 51, 52, 53, 54, 55, 56, 57])     # two more pages: the oldest is forgotten
    assert s.held("p0", ids) == 0
    assert s.held("p0", [50, 51, 52, 53, 54, 55, 56, 57]) == 8
