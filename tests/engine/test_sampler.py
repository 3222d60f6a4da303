"""engine/sampler.py on synthetic logits (no model): the grammar bitmask touches only constrained
rows, an unconstrained batch never reaches the grammar engine, logprobs follow engine/logprobs.py's
definition (after the mask and min_tokens bans, before temperature), a row whose grammar allows
nothing is None, and min_tokens never bans a grammar's only way out."""

from __future__ import annotations

import pytest
import torch

from tandem.core.types import Req, SamplingParams
from tandem.engine.grammar import allocate_bitmask
from tandem.engine.sampler import Sampler

V = 100
EOS = 99


class FakeMatcher:
    """Test double of grammar.Matcher: allows exactly ``allowed``."""

    def __init__(self, allowed):
        self.allowed = list(allowed)


class FakeGrammar:
    """Test double of GrammarCompiler's two sampler-side methods."""

    def allocate_bitmask(self, b):
        return allocate_bitmask(b, V)

    def fill_bitmasks(self, pairs, bitmask):
        for m, row in pairs:
            bitmask[row] = 0
            for t in m.allowed:
                bitmask[row, t // 32] |= (1 << (t % 32)) if t % 32 != 31 else -(1 << 31)


class SR:
    def __init__(self, params, matcher=None, rid="r", out=()):
        self.req = Req([1, 2, 3], params, rid=rid)
        self.req.output_ids = list(out)
        self.matcher = matcher


def never():
    raise AssertionError("the grammar engine was reached for an unconstrained batch")


def test_unconstrained_batch_never_reaches_the_grammar_and_reports_no_logprobs():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    out = Sampler(0, grammar=never).sample(logits, [SR(SamplingParams()) for _ in range(3)], frozenset({EOS}))
    assert out.tokens == logits.argmax(-1).tolist() and out.logprobs is None


def test_mask_applies_to_constrained_rows_only_and_logprobs_follow_it():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=g)
    before = logits.clone()
    srs = [SR(SamplingParams(logprobs=True, top_logprobs=5), FakeMatcher([3, 7, 11])),
           SR(SamplingParams(logprobs=True, top_logprobs=2), rid="free"),
           SR(SamplingParams(temperature=1.0, seed=4, logprobs=True, top_logprobs=1), FakeMatcher([5]), rid="s")]
    out = Sampler(0, grammar=FakeGrammar).sample(logits, srs, frozenset({EOS}))
    assert torch.equal(logits, before)                      # the model's logits are never edited
    assert out.tokens[0] == [3, 7, 11][int(before[0, [3, 7, 11]].argmax())] and out.tokens[2] == 5
    assert out.tokens[1] == int(before[1].argmax())
    lp0 = out.logprobs[0]
    ref = torch.log_softmax(before[0, [3, 7, 11]], -1)
    assert abs(lp0.logprob - float(ref.max())) < 1e-6
    assert [t for t, _ in lp0.top] == [[3, 7, 11][i] for i in ref.argsort(descending=True).tolist()]
    assert len(lp0.top) == 3                                 # forbidden tokens are left out of top
    lp1 = out.logprobs[1]
    assert abs(lp1.logprob - float(torch.log_softmax(before[1], -1).max())) < 1e-6 and len(lp1.top) == 2
    assert out.logprobs[2].logprob == 0.0 and out.logprobs[2].top == ((5, 0.0),)   # before temperature


def test_a_row_whose_grammar_allows_nothing_is_none():
    out = Sampler(0, grammar=FakeGrammar).sample(torch.randn(2, V), [
        SR(SamplingParams(logprobs=True), FakeMatcher([])), SR(SamplingParams(), FakeMatcher([4]))], frozenset({EOS}))
    assert out.tokens == [None, 4] and out.logprobs is None   # nothing sampled for the row that asked


@pytest.mark.parametrize("allowed, want", [([EOS], EOS), ([EOS, 8], 8)])
def test_min_tokens_never_bans_the_grammars_only_way_out(allowed, want):
    logits = torch.zeros(1, V)
    logits[0, EOS] = 5.0
    sr = SR(SamplingParams(max_tokens=8, min_tokens=4), FakeMatcher(allowed))
    assert Sampler(0, grammar=FakeGrammar).sample(logits, [sr], frozenset({EOS})).tokens == [want]


def test_masks_prepared_during_the_forward_give_what_sample_computes_inline():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    srs = [SR(SamplingParams(logprobs=True, top_logprobs=3), FakeMatcher([1, 40, 70])), SR(SamplingParams()),
           SR(SamplingParams(logprobs=True), FakeMatcher([]))]
    s = Sampler(0, grammar=FakeGrammar)
    try:
        assert s.prepare([SR(SamplingParams())]) is None          # nothing constrained: no work
        masks = s.prepare(srs)
        a, b = s.sample(logits, srs, frozenset({EOS}), masks), s.sample(logits, srs, frozenset({EOS}))
        assert a == b and a.tokens[2] is None
        with pytest.raises(ValueError, match="prepared for rows"):
            s.sample(logits, srs[:2], frozenset({EOS}), s.prepare(srs))
    finally:
        s.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_logits_get_the_same_mask_and_logprobs():
    """The bias is rebuilt on the logits' device from the prepared CPU bitmask words."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    srs = [SR(SamplingParams(logprobs=True, top_logprobs=3), FakeMatcher([2, 33, 64, 95])), SR(SamplingParams()),
           SR(SamplingParams(logprobs=True, top_logprobs=2), FakeMatcher([31, 63]))]
    s = Sampler(0, grammar=FakeGrammar)
    try:
        cpu = s.sample(logits, srs, frozenset({EOS}), s.prepare(srs))
        gpu = s.sample(logits.cuda(), srs, frozenset({EOS}), s.prepare(srs))
    finally:
        s.close()
    assert gpu.tokens == cpu.tokens
    for a, b in zip(cpu.logprobs, gpu.logprobs):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-5
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_greedy_takes_torchs_argmax_rule_on_every_path():
    """engine/sampler.py ``greedy`` (numpy on CPU float32, torch otherwise): the first maximal
    index, a NaN counting as the maximum; rows of a strided view, bf16 rows through torch."""
    from tandem.engine.sampler import greedy

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1000, generator=g)
    x[1, 10] = x[1, 700] = 50.0             # a tie: the first one
    x[2, 30] = float("nan")                 # NaN wins, as in torch
    x[3, 40] = x[3, 41] = float("nan")
    x[4] = 0.0
    want = x.argmax(dim=-1).tolist()
    assert want[1:5] == [10, 30, 40, 0]
    assert greedy(x) == want
    assert greedy(x[::2]) == want[::2]      # a strided view
    assert greedy(x[:, 1:].t().contiguous().t()) == x[:, 1:].argmax(dim=-1).tolist()
    assert greedy(x.bfloat16()) == x.bfloat16().argmax(dim=-1).tolist()
