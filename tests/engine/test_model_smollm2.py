"""SmolLM2-135M-Instruct (the embedded Q4_1 GGUF): Tandem against Hugging Face transformers
loading the same file (dequantized to float32).

Measured here (CPU, fp32): prefill logits max |diff| ~8e-5 over all positions of 5 prompts;
the bound asserted is 1e-3. Greedy tokens are identical.
"""

from __future__ import annotations

import pytest
import torch

from tandem.engine.model_runner import ModelRunner
from smollm2_prompts import encode  # noqa: E402

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LOGIT_ATOL = 1e-3
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model(hf_smollm2):
    return hf_smollm2      # the session's HF load (tests/conftest.py)


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    return encode(smollm2.tokenizer)


@pytest.fixture(scope="module")
def runner(smollm2):
    return ModelRunner.create(smollm2, max_total_tokens=2048, page_size=4, max_reqs=8, max_context=1024)


@pytest.fixture(scope="module")
def greedy(runner, prompt_ids, smollm2):
    """Tandem's greedy tokens for all prompts, generated as one batch."""
    return runner.generate_greedy(prompt_ids, NEW_TOKENS, stop_ids=smollm2.tokenizer.eos_token_ids)


def test_arch(smollm2):
    a = smollm2.arch
    assert (a.arch, a.num_layers, a.hidden_size, a.num_q_heads, a.num_kv_heads, a.head_dim) == \
        ("llama", 30, 576, 9, 3, 64)
    assert a.tie_word_embeddings and a.layer_types == ["full"] * 30 and a.rope_theta == 100000.0
    assert smollm2.name == "smollm2"


def test_prefill_logits_match_hf(runner, prompt_ids, hf_model):
    worst = 0.0
    for ids in prompt_ids:
        s = runner.new_seq()
        try:
            got = runner.extend([s], [ids], return_all_logits=True)     # [T, V]
        finally:
            runner.release(s)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0]
        worst = max(worst, (got - ref).abs().max().item())
    assert worst <= LOGIT_ATOL, f"max |logit diff| {worst:.2e} > {LOGIT_ATOL}"


def test_greedy_matches_hf_teacher_forced(greedy, prompt_ids, hf_model, smollm2):
    """HF's argmax after every prefix of (prompt + Tandem's tokens) is Tandem's next token."""
    eos = smollm2.tokenizer.eos_token_ids
    for ids, out in zip(prompt_ids, greedy):
        assert len(out) == NEW_TOKENS or out[-1] in eos
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids + out])).logits[0]
        want = logits[len(ids) - 1: len(ids) - 1 + len(out)].argmax(-1).tolist()
        assert out == want


def _hf_generate(hf_model, ids, eos):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=sorted(eos))
    return out[0, len(ids):].tolist()


def test_greedy_matches_hf_generate(greedy, prompt_ids, hf_model, smollm2):
    eos = smollm2.tokenizer.eos_token_ids
    assert greedy[1] == _hf_generate(hf_model, prompt_ids[1], eos)


@pytest.mark.slow
def test_greedy_matches_hf_generate_all(greedy, prompt_ids, hf_model, smollm2):
    """With test_greedy_matches_hf_generate (prompt 1), every prompt."""
    eos = smollm2.tokenizer.eos_token_ids
    for i, (ids, out) in enumerate(zip(prompt_ids, greedy)):
        if i != 1:
            assert out == _hf_generate(hf_model, ids, eos)


def test_chunked_prefill_matches_one_shot(runner, prompt_ids):
    ids = prompt_ids[4]
    s1, one = runner.prefill(ids)
    s2, chunked = runner.prefill(ids, chunk=7)
    runner.release(s1)
    runner.release(s2)
    torch.testing.assert_close(chunked, one, atol=1e-4, rtol=1e-4)


def test_greedy_text(greedy, smollm2):
    assert "Paris" in smollm2.tokenizer.decode(greedy[0])
