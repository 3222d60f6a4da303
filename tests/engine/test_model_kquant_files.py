"""SmolLM2 as Q4_K_M and Q6_K GGUF files (made in a fixture from the embedded Q4_1 one with
tests/engine/kquant_support.py: its weights dequantized and quantized again in llama.cpp's type
mix, including its fallback where a row is not whole 256-weight super-blocks -- K = 576 rows become
Q5_0 / Q8_0, so the files hold Q4_K, Q6_K, Q5_0 and Q8_0 tensors and fused q/k/v of two kinds).

Oracles, as test_model_smollm2.py and test_model_smollm2_bf16.py use them:
- the exact path (float32, dequantized) against Hugging Face transformers loading the same file:
  prefill logits within LOGIT_ATOL over every position, greedy tokens equal (teacher-forced);
- the default numerics (bf16 + the files' own blocks on the AVX512 kernels) against that exact
  path: max |logit diff| below 2.5 and mean below 0.3 (SmolLM2's bf16 bounds);
- the fused layer (one C call) bitwise the unfused one where it applies (single-kind layers).
Measured here (AVX512-BF16; Q4_K_M / Q6_K, 3 prompts): prefill max |diff| vs HF 1.3e-4 / 1.4e-4;
native vs exact max 1.30 / 1.88, per-prompt means 0.15-0.20 / 0.20-0.23 (with Q8_0 layer weights on
int8 activation blocks instead of bf16 ones, the Q6_K file's were 0.13-0.30).
"""

from __future__ import annotations

import os

import pytest
import torch

from kquant_support import q4_k_m, requantize_gguf
from smollm2_prompts import encode  # noqa: E402
from tandem.engine.attention import make_attention_backend
from tandem.engine.model_runner import ModelRunner
from tandem.engine.models.llama_cpu import FusedLlamaLayer
from tandem.engine.quant.cpu import native_bf16
from tandem.engine.quant.native_lib import kernel_unavailable

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

LOGIT_ATOL = 1e-3
NEW_TOKENS = 16
MIXES = {"Q4_K_M": lambda name: q4_k_m(name, 30), "Q6_K": lambda name: "Q6_K"}


@pytest.fixture(scope="module")
def blocks() -> dict:
    """The quantized tensors both files hold alike (the Q8_0 embedding, the Q6_K ffn_down of the
    layers given more bits), quantized once."""
    return {}


@pytest.fixture(scope="module", params=sorted(MIXES))
def kfile(request, smollm2_gguf, tmp_path_factory, hf_gguf_load, blocks):
    """(mix, path of the GGUF, {tensor: type})."""
    d = tmp_path_factory.mktemp(f"smollm2-{request.param.lower()}")
    path = str(d / f"smollm2-{request.param.lower()}.gguf")
    with hf_gguf_load():                     # tests/conftest.py: the source's parse is the session's
        types = requantize_gguf(smollm2_gguf, path, MIXES[request.param], blocks)
    return request.param, path, types


@pytest.fixture(scope="module")
def exact(kfile, hf_gguf_load):
    from tandem.engine.loader import load_model

    with hf_gguf_load():                     # one parse of the file for this module's loads
        return load_model(kfile[1], device="cpu", dtype="float32", weights="dequant")


@pytest.fixture(scope="module")
def native_model(kfile, hf_gguf_load):
    """The default numerics (bf16 + the file's blocks where this CPU has native bf16)."""
    from tandem.engine.loader import load_model

    with hf_gguf_load():
        return load_model(kfile[1], device="cpu")


@pytest.fixture(scope="module")
def hf(kfile, hf_gguf_load):
    path = kfile[1]
    with hf_gguf_load():                     # the parse the exact load made
        m = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="module")
def prompts(exact):
    return encode(exact.tokenizer)[:3]


def _all_logits(loaded, ids) -> torch.Tensor:
    r = ModelRunner.create(loaded, max_total_tokens=1024, page_size=4, max_reqs=2, max_context=512)
    s = r.new_seq()
    try:
        return r.extend([s], [ids], return_all_logits=True).float()
    finally:
        r.release(s)


def test_the_files_hold_the_k_quant_mix(kfile):
    mix, _, types = kfile
    kinds = set(types.values())
    assert {"Q6_K", "Q8_0"} <= kinds and (mix != "Q4_K_M" or {"Q4_K", "Q5_0"} <= kinds)
    assert types["blk.0.ffn_down.weight"] == "Q6_K"          # K = 1536: whole super-blocks
    assert types["blk.0.attn_q.weight"] == ("Q5_0" if mix == "Q4_K_M" else "Q8_0")   # K = 576: fallback


@pytest.mark.parametrize("kfile", ["Q4_K_M", pytest.param("Q6_K", marks=pytest.mark.slow)], indirect=True)
def test_exact_path_matches_hf_on_the_same_file(exact, hf, prompts):
    """(The Q6_K file's HF load, ~10 s, runs with the slow tests; its Q6_K tensors are the Q4_K_M
    file's kind too.)"""
    eos = exact.tokenizer.eos_token_ids
    worst = 0.0
    for ids in prompts:
        got = _all_logits(exact, ids)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        worst = max(worst, (got - ref).abs().max().item())
    print(f"{exact.name}: prefill max |logit diff| vs HF {worst:.2e}")
    assert worst <= LOGIT_ATOL, f"max |logit diff| {worst:.2e} > {LOGIT_ATOL}"
    r = ModelRunner.create(exact, max_total_tokens=2048, page_size=4, max_reqs=4, max_context=512)
    greedy = r.generate_greedy(prompts, NEW_TOKENS, stop_ids=eos)
    for ids, out in zip(prompts, greedy):
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out])).logits[0]
        assert out == logits[len(ids) - 1: len(ids) - 1 + len(out)].argmax(-1).tolist()


@pytest.mark.skipif(native_bf16() is None, reason="no native bf16 on this CPU")
def test_default_numerics_within_the_bf16_bounds(kfile, exact, native_model, prompts):
    native = native_model
    if kernel_unavailable() is None:
        assert "avx512 (Q6_K)" in native.precision and "dequantized" not in native.precision, native.precision
    worst, means = 0.0, []
    for ids in prompts:
        diff = (_all_logits(native, ids) - _all_logits(exact, ids)).abs()
        worst, means = max(worst, diff.max().item()), means + [diff.mean().item()]
    print(f"{kfile[0]}: native vs exact max {worst:.2f}, means {[round(m, 3) for m in means]}")
    assert worst < 2.5 and max(means) < 0.3, (worst, means)


def _trace(loaded) -> list[torch.Tensor]:
    r = ModelRunner.create(loaded, max_total_tokens=1024, max_reqs=4, max_context=512,
                           backend=make_attention_backend("cpu_kernel", torch.device("cpu")))
    tok = loaded.tokenizer
    a, b = tok.encode("The capital of France is"), tok.encode(" ".join(f"w{i}" for i in range(20)))
    sa, sb = r.new_seq(), r.new_seq()
    out = [r.extend([sa], [a[:2]]), r.extend([sa, sb], [a[2:], b])]
    for _ in range(3):
        out.append(r.decode([sa, sb], out[-1].argmax(-1).tolist()))
    r.release(sa)
    r.release(sb)
    return out


@pytest.mark.skipif(kernel_unavailable() is not None or native_bf16() is None,
                    reason=f"AVX512 kernels: {kernel_unavailable() or 'no native bf16'}")
def test_fused_layers_are_bitwise_the_unfused_ones(native_model):
    native = native_model
    layers = native.model.layers
    built = [FusedLlamaLayer.build(layer) for layer in layers]
    assert sum(b is not None for b in built) >= 16             # every single-kind layer fuses
    for layer, b in zip(layers, built):
        layer.fused, layer.fused_built = b, True
    fused = _trace(native)
    for layer in layers:
        layer.fused, layer.fused_built = None, True
    plain = _trace(native)
    for layer, b in zip(layers, built):               # the module's model as it was
        layer.fused, layer.fused_built = b, True
    for i, (f, p) in enumerate(zip(fused, plain)):
        assert torch.equal(f, p), f"step {i} differs"
