"""A request's logits do not depend on what it is batched with, how its prompt is chunked, or
whether its prefix came from the cache: bitwise, on the real SmolLM2, in the default numerics
(bf16 + native Q4_1 weights on a CPU with native bf16; 1 and 2 threads), in float32, and, where the
CPU has native bf16, in bf16 with dense (dequantized) weights: oneDNN's packed bf16 GEMM, the
kernel whose choice by row count on AMX broke this until the ISA was capped (core/onednn.py).

This is what the engine-level oracles (batched == alone, prefix cache on == off, disaggregated ==
colocated) rest on; for both CPU attention backends (engine/attention/torch_backend.py, "Exactness",
and engine/attention/cpu_backend.py say how each keeps it).
"""

from __future__ import annotations

import pytest
import torch

from tandem.engine.attention import make_attention_backend
from tandem.engine.model_runner import ModelRunner


def _numerics() -> list[tuple[str, int]]:
    from tandem.engine.quant.cpu import native_bf16
    return [("default", 1), ("default", 2), ("float32", 1)] + ([("bf16dense", 2)] if native_bf16() else [])


@pytest.fixture(scope="module")
def smollm2_bf16_dense(hf_gguf_load):
    from tandem.engine.loader import load_model

    with hf_gguf_load():
        return load_model("smollm2", device="cpu", dtype="bfloat16", weights="dequant")


def _backends() -> list[str]:
    from tandem.engine.attention.cpu_backend import cpu_kernel_unavailable
    return ["torch"] + (["cpu_kernel"] if cpu_kernel_unavailable() is None else [])


@pytest.fixture(params=[(m, n, b) for b in _backends() for m, n in _numerics()],
                ids=lambda p: f"{p[2]}-{p[0]}-{p[1]}")
def loaded(request, smollm2, smollm2_default):
    """(model, attention backend name), with this many torch threads."""
    old = torch.get_num_threads()
    torch.set_num_threads(request.param[1])
    model = {"default": smollm2_default, "float32": smollm2}.get(request.param[0])
    if model is None:
        model = request.getfixturevalue("smollm2_bf16_dense")
    yield model, request.param[2]
    torch.set_num_threads(old)


def _alone(r: ModelRunner, ids: list[int], steps: int) -> tuple[list[torch.Tensor], list[int]]:
    s, logits = r.prefill(ids)
    out, toks = [logits], [int(logits.argmax())]
    for _ in range(steps):
        logits = r.decode([s], [toks[-1]])[0]
        out.append(logits)
        toks.append(int(logits.argmax()))
    r.release(s)
    return out, toks


def test_logits_are_independent_of_batch_chunking_and_prefix(loaded):
    loaded, backend = loaded
    r = ModelRunner.create(loaded, max_total_tokens=8192, max_reqs=8, max_context=2048,
                           backend=make_attention_backend(backend, torch.device("cpu")))
    tok = loaded.tokenizer
    a = tok.encode("The largest planet in our solar system is")          # ~9 tokens
    long = tok.encode(" ".join(f"item{i}" for i in range(40)))           # ~120 tokens: crosses 64
    ref, toks = _alone(r, a, 6)

    # 1) a's prompt chunked (3 + rest), prefilled next to a long prompt and a decoding row
    sl, ll = r.prefill(long)
    sa = r.new_seq()
    r.extend([sa], [a[:3]])
    out = r.extend([sl, sa], [[int(ll.argmax())], a[3:]])
    assert torch.equal(out[1], ref[0])
    # 2) decode steps in a batch whose other row has a different key width (> 64 keys)
    tl = int(out[0].argmax())
    for i in range(6):
        out = r.decode([sl, sa], [tl, toks[i]])
        assert torch.equal(out[1], ref[i + 1]), f"decode step {i} differs in a batch"
        tl = int(out[0].argmax())
    r.release(sa)
    r.release(sl)

    # 3) a prefix-cache hit: the prompt's KV minus its last token reused, that token "decoded"
    sa = r.new_seq()
    r.extend([sa], [a[:-1]])
    assert torch.equal(r.extend([sa], [a[-1:]])[0], ref[0])
    r.release(sa)
