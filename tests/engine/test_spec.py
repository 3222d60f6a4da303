"""Speculative decoding (engine/sched/spec/): the same tokens as decoding without it, the KV of rejected
drafts given back, drafts kept within a tenant.

Oracles: the KV-echo model's pure-Python ``oracle`` (every slot a step reads is checked to hold its
own position, so a rolled-back slot read again, or reused while still read, raises), the engine
with ``speculative_algorithm="off"``, and for sampling the exact per-step distribution of the
KV-echo model's logits. A run repeated in the same tenant drafts from the pool the first run
filled, so its drafts are the exact continuation: the tests assert drafts were accepted, else
they would prove nothing about the accepted path."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from pydantic import ValidationError

from tandem.core.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.core.messages import GenerateRequest
from tandem.core.types import InvalidRequest, Req, SamplingParams
from tandem.engine.engine import Engine
from tandem.engine.models.hybrid import tiny_hybrid
from tandem.engine.sched.spec.ngram import NgramPool, RequestIndex
from tandem.engine.sched.spec.speculator import PRIOR_RATIO, DraftState, Speculator, StepCost

from fake_model import fake_loaded, next_token, oracle

PROMPT = [(7 + 13 * i) % 94 for i in range(24)]


def _stepped(spec: str = "ngram", loaded=None, page_size: int = 1, **cache) -> Engine:
    cfg = EngineConfig(device="cpu", dtype="float32", num_threads=1, speculative_algorithm=spec,
                       scheduler=SchedulerConfig(chunked_prefill_size=16),
                       cache=CacheConfig(**{"page_size": page_size, "max_total_tokens": 1024,
                                            "debug_invariants": True, **cache}))
    e = Engine(cfg, loaded=loaded or fake_loaded())
    e.shutdown()          # the test drives e.step()
    if e.scheduler.spec is not None:      # the KV-echo model's cost is all per token: fix the rule's
        e.scheduler.spec.cost = StepCost(fixed=PRIOR_RATIO)     # ratio, so drafting is deterministic
    return e


def collector(reqs) -> tuple[dict[str, list], object]:
    """``(out, cb)``: ``cb`` collects each request's chunks into ``out[rid]`` = [token ids, text,
    finish reason, logprobs]."""
    out: dict[str, list] = {g.rid: [[], "", None, []] for g in reqs}

    def cb(c):
        got = out[c.rid]
        got[0].extend(c.token_ids)
        got[1] += c.text
        got[3].extend(c.logprobs)
        if c.finish_reason is not None:
            got[2] = c.finish_reason
    return out, cb


def _drive(e: Engine, reqs: list[GenerateRequest]) -> dict[str, tuple]:
    """Submit ``reqs`` and step until all finish, checking the invariants after every step;
    rid -> (token ids, text, finish reason, logprobs)."""
    out, cb = collector(reqs)
    for g in reqs:
        e.submit(g, cb)
    while e.scheduler.has_work() or not e._inbox.empty():
        e.step()
        e.check_invariants()
    return {k: tuple(v) for k, v in out.items()}


def _spec(e: Engine) -> tuple[int, int]:
    st = e.scheduler.stats
    return st["spec_drafted_tokens"], st["spec_accepted_tokens"]


def test_a_repeated_prompt_drafts_from_the_pool_and_equals_the_oracle_with_pages_freed():
    for page_size in (1, 4):
        e = _stepped(page_size=page_size)
        free = e.allocator.available_size()
        p = SamplingParams(max_tokens=40, ignore_eos=True)
        first = _drive(e, [GenerateRequest("a", tuple(PROMPT), p)])
        again = _drive(e, [GenerateRequest("b", tuple(PROMPT), p)])
        assert list(first["a"][0]) == list(again["b"][0]) == oracle(PROMPT, 40)
        drafted, accepted = _spec(e)
        assert accepted >= 30, (drafted, accepted)          # the second run copies the first
        assert e.scheduler.stats["steps"] < 2 * 40
        snap = e.snapshot()
        assert snap.running == 0 and snap.request_tokens == 0 and snap.leaked_tokens == 0
        assert e.allocator.available_size() + snap.evictable_tokens == free


def test_stops_inside_an_accepted_run_cut_there_as_without_drafts():
    want = oracle(PROMPT, 40)
    cases = {"len": SamplingParams(max_tokens=13, ignore_eos=True),
             "tok": SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(want[17],)),
             "str": SamplingParams(max_tokens=40, ignore_eos=True,
                                   stop=(e_text := fake_loaded().tokenizer.decode(want[21:23]),)),
             "min": SamplingParams(max_tokens=40, min_tokens=20, ignore_eos=True, stop_token_ids=(want[17],)),
             "lps": SamplingParams(max_tokens=25, ignore_eos=True, logprobs=True, top_logprobs=2)}
    assert e_text
    got = {}
    for spec in ("off", "ngram"):
        e = _stepped(spec)
        _drive(e, [GenerateRequest("seed", tuple(PROMPT), SamplingParams(max_tokens=40, ignore_eos=True))])
        got[spec] = _drive(e, [GenerateRequest(k, tuple(PROMPT), p) for k, p in cases.items()])
        if spec == "ngram":
            assert _spec(e)[1] > 60, _spec(e)
        snap = e.snapshot()
        assert snap.running == 0 and snap.request_tokens == 0 and snap.leaked_tokens == 0
    assert got["ngram"] == got["off"]
    lens = {k: len(v[0]) for k, v in got["off"].items()}
    assert lens["len"] == 13 and lens["tok"] == want.index(want[17]) + 1 and lens["lps"] == 25
    assert got["off"]["str"][1].endswith(e_text) is False and lens["str"] <= 23
    assert lens["min"] >= 20
    assert all(got["off"][k][2] in ("stop", "length") for k in cases)
    assert len(got["ngram"]["lps"][3]) == 25


def test_seeded_sampling_equals_decoding_without_drafts():
    p = SamplingParams(max_tokens=30, temperature=1.0, seed=11, ignore_eos=True)
    runs = {}
    for spec in ("off", "ngram"):
        e = _stepped(spec)
        _drive(e, [GenerateRequest("seed", tuple(PROMPT), SamplingParams(max_tokens=30, ignore_eos=True))])
        runs[spec] = [_drive(e, [GenerateRequest(f"s{i}", tuple(PROMPT), p)])[f"s{i}"][0] for i in range(2)]
        if spec == "ngram":
            assert _spec(e)[1] > 5
    assert runs["ngram"][0] == runs["ngram"][1] == runs["off"][0]
    assert list(runs["off"][0]) != oracle(PROMPT, 30)     # it did sample


def test_unseeded_sampling_keeps_the_distribution():
    """Each KV-echo step puts p = e / (e + 1) on its hashed token and the rest on the next one: the
    pattern of "top or second" over 3 tokens is 3 independent Bernoulli(p) draws. Drafts come from
    a greedy run in the pool (the all-top pattern) and are accepted with probability p each."""
    n, p_top = 480, math.e / (math.e + 1)
    e = _stepped(max_total_tokens=4096, max_running_requests=4)
    _drive(e, [GenerateRequest("seed", tuple(PROMPT), SamplingParams(max_tokens=8, ignore_eos=True))])
    p = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    outs = _drive(e, [GenerateRequest(f"u{i}", tuple(PROMPT), p) for i in range(n)])
    drafted, accepted = _spec(e)
    assert accepted > n // 4, (drafted, accepted)
    counts: Counter = Counter()
    for toks, *_ in outs.values():
        seq, pattern = list(PROMPT), []
        for t in toks:
            pattern.append(t == next_token(seq))
            seq.append(t)
        counts[tuple(pattern)] += 1
    chi2 = 0.0
    for cell in [(a, b, c) for a in (0, 1) for b in (0, 1) for c in (0, 1)]:
        k = sum(cell)
        want = n * p_top ** k * (1 - p_top) ** (3 - k)
        chi2 += (counts[tuple(map(bool, cell))] - want) ** 2 / want
    assert chi2 < 24.3, (chi2, counts)       # chi-square, 7 degrees of freedom, p = 0.001


def test_the_pool_never_drafts_another_tenants_text():
    pool = NgramPool(n=3, span=4)
    pool.add((0, "a"), [1, 2, 3, 4, 5, 6])
    assert pool.propose((0, "a"), [9, 1, 2, 3], 4) == (4, 5, 6)
    assert pool.propose((0, "b"), [9, 1, 2, 3], 4) == () == pool.propose((7, "a"), [9, 1, 2, 3], 4)
    e = _stepped()
    _drive(e, [GenerateRequest("a", tuple(PROMPT), SamplingParams(max_tokens=30, ignore_eos=True),
                               tenant="acme", cache_salt=1)])
    before = _spec(e)
    other = _drive(e, [GenerateRequest("b", tuple(PROMPT), SamplingParams(max_tokens=30, ignore_eos=True),
                                       tenant="globex", cache_salt=2)])
    assert list(other["b"][0]) == oracle(PROMPT, 30)
    assert _spec(e)[1] - before[1] <= 2      # chance hits of its own n-grams only, never the pool's copy
    _drive(e, [GenerateRequest("c", tuple(PROMPT), SamplingParams(max_tokens=30, ignore_eos=True),
                               tenant="acme", cache_salt=1)])
    assert _spec(e)[1] - before[1] >= 20


def test_request_index_matches_the_longest_earlier_suffix():
    idx = RequestIndex(max_n=3)
    ids = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]
    assert idx.propose(ids, 3) == (4, 9, 2)                 # "1 2 3" before: then 4 9 2
    assert idx.propose(ids + [7], 2) == ()                  # 7 never seen
    assert RequestIndex().propose([5, 5], 4) == (5,)


def test_the_cost_rule_drafts_less_for_low_acceptance_and_big_batches():
    s = Speculator(8, 4096)
    good, bad = DraftState(hits=9.0, tries=10.0), DraftState(hits=1.0, tries=10.0)
    assert s.length(good, 1) == 8 and s.length(bad, 1) == 1
    assert s.length(good, 64) < s.length(good, 1) and s.length(bad, 64) == 0
    for _ in range(50):                  # a token costs as much as a step: drafting never pays
        s.cost.observe(1, 0.01)
        s.cost.observe(9, 0.09)
    assert s.length(good, 1) <= 1


def test_a_verify_steps_own_overhead_is_measured_and_paid_for():
    """The step half of the cost rule: plain steps cost 30 ms whatever their width, a verify step
    40 ms and the plain step after it 35 ms (the torch backend's measured shape); ``extra`` learns
    the 15 ms, and then drafts expected to add little (chat) no longer pay for the step, while
    well-accepted ones (copying) still do."""
    c = StepCost()
    for i in range(40):
        c.observe(4 + i % 2, 0.030)
    assert c.extra == 0 and c.pays(4, 1, 0.3)            # optimistic before any verify step
    for _ in range(20):
        c.observe(6, 0.040, verify=True)
        c.observe(4, 0.035)
    assert 0.012 < c.extra < 0.016, c.extra
    assert not c.pays(4, 2, 0.6) and c.pays(4, 2, 3.0)
    assert c.pays(16, 2, 8.0) and not c.pays(16, 2, 4.0)  # a bigger batch needs more accepted tokens
    noisy = StepCost()
    for i in range(40):
        noisy.observe(4 + i % 2, 0.030)
    for i in range(40):                                   # scatter around the fit, no overhead
        noisy.observe(6, noisy.predict(6) + (0.004 if i % 2 else -0.004), verify=True)
        noisy.observe(4, noisy.predict(4) + (-0.004 if i % 2 else 0.004))
    assert abs(noisy.extra) < 0.003, noisy.extra         # the scatter averages out, not up
    fixed = StepCost(fixed=PRIOR_RATIO)
    fixed.observe(6, 1.0, verify=True)
    assert fixed.extra == 0                               # fixed: timing never changes drafting


def test_config_and_request_fields():
    with pytest.raises(ValidationError, match="speculative_num_draft_tokens"):
        EngineConfig(speculative_num_draft_tokens=0)
    with pytest.raises(ValidationError, match="speculative_algorithm"):
        EngineConfig(speculative_algorithm="eagle")
    with pytest.raises(InvalidRequest, match="speculative"):
        SamplingParams(speculative="yes").validate()
    e = _stepped()
    _drive(e, [GenerateRequest("a", tuple(PROMPT), SamplingParams(max_tokens=30, ignore_eos=True))])
    before = _spec(e)
    out = _drive(e, [GenerateRequest("b", tuple(PROMPT), SamplingParams(max_tokens=30, ignore_eos=True,
                                                                         speculative=False))])
    assert list(out["b"][0]) == oracle(PROMPT, 30) and _spec(e) == before
    assert "speculative ngram (up to 8 draft tokens)" in e.startup_line
    assert "speculative off" in _stepped("off").startup_line


def test_swa_hybrid_equals_without_drafts_and_mamba_turns_it_off():
    swa = tiny_hybrid("full+swa", sliding_window=8)
    prompt = list(range(40, 70))
    got = {}
    for spec in ("off", "ngram"):
        for page_size in (1, 4):
            e = _stepped(spec, loaded=swa, page_size=page_size, max_total_tokens=512)
            p = SamplingParams(max_tokens=40, ignore_eos=True)
            a = _drive(e, [GenerateRequest("a", tuple(prompt), p)])["a"][0]
            b = _drive(e, [GenerateRequest("b", tuple(prompt), p), GenerateRequest("c", tuple(prompt[:20]), p)])
            got[spec, page_size] = (a, b["b"][0], b["c"][0])
            if spec == "ngram":
                assert _spec(e)[1] >= 20, _spec(e)
            assert e.hybrid.stats["swa_released"] > 0
    assert got["ngram", 1] == got["off", 1] == got["ngram", 4] == got["off", 4]
    mamba = _stepped(loaded=tiny_hybrid("full+mamba"))
    assert "speculative off: recurrent (mamba) layers" in mamba.startup_line
    assert mamba.scheduler.spec is None
