"""engine/quant/: GGUF blocks unpacked exactly, int4 kernels against the dequantized weights, each
output row independent of its batch, the kernel choice and its fallbacks, the dtype choice.

Measured here (AVX512-BF16 CPU): Int4Linear's max |error| against fp32 x @ dequantized W^T is
within 1.6x of a bf16-dense GEMM's on the same bf16 inputs (the only extra rounding is the
per-block scale and zero in bf16); asserted: within 2x plus 1e-2.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from tandem.engine.quant.blocks import QuantWeight, from_gguf_blocks
from tandem.engine.quant.linear import (DenseLinear, Int4Linear, PackedLinear, int4_reason,
                                        make_linear, onednn_packable)

gguf = pytest.importorskip("gguf")
KINDS = ["Q4_0", "Q4_1", "Q8_0"]
N, K = 96, 160


def _quantized(kind: str, n: int = N, k: int = K, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(raw GGUF blocks [n, k/32 * bytes], their dequantized float32 [n, k])."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.01).astype(np.float32)
    qt = getattr(gguf.GGMLQuantizationType, kind)
    raw = gguf.quants.quantize(x, qt)
    return raw, gguf.quants.dequantize(raw, qt).astype(np.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_unpack_to_exactly_what_gguf_dequantizes(kind):
    raw, ref = _quantized(kind)
    qw = from_gguf_blocks(kind, raw, N, K)
    assert qw.shape == (N, K) and qw.scale.shape == (N, K // 32)
    assert np.array_equal(qw.dequantize().numpy(), ref)
    assert qw.nbytes == raw.size


def test_rows_and_cat_move_whole_rows():
    raw, ref = _quantized("Q4_1")
    qw = from_gguf_blocks("Q4_1", raw, N, K)
    order = np.random.default_rng(1).permutation(N)
    assert np.array_equal(qw.rows(order).dequantize().numpy(), ref[order])
    both = QuantWeight.cat([qw, qw.rows(order)])
    assert np.array_equal(both.dequantize().numpy(), np.concatenate([ref, ref[order]]))
    with pytest.raises(ValueError, match="one kind"):
        QuantWeight.cat([qw, from_gguf_blocks("Q8_0", *_quantized("Q8_0")[:1], N, K)])


def test_unsupported_block_type_is_a_clear_error():
    with pytest.raises(ValueError, match="Q2_K.*supported: Q4_0, Q4_1, Q8_0, Q5_0"):
        from_gguf_blocks("Q2_K", np.zeros(10, np.uint8), 1, 256)


needs_int4 = pytest.mark.skipif(
    int4_reason(from_gguf_blocks("Q4_0", _quantized("Q4_0")[0], N, K), torch.bfloat16,
                torch.device("cpu")) is not None, reason="no int4 CPU kernel in this torch")


@needs_int4
@pytest.mark.parametrize("kind", KINDS)
def test_int4_kernel_matches_the_dequantized_weight(kind):
    raw, ref = _quantized(kind)
    lin, why = make_linear(from_gguf_blocks(kind, raw, N, K), torch.bfloat16, torch.device("cpu"), native="int4")
    assert isinstance(lin, Int4Linear) and why is None
    x = torch.randn(7, K).bfloat16()
    w = torch.from_numpy(ref)
    exact = x.float() @ w.t()
    dense = (x @ w.bfloat16().t()).float()            # what bf16-dequantized weights would give
    got = lin(x).float()
    err, err_dense = (got - exact).abs().max().item(), (dense - exact).abs().max().item()
    assert err <= 2 * err_dense + 1e-2, (err, err_dense)
    bias, res = torch.randn(N).bfloat16(), torch.randn(7, N).bfloat16()
    torch.testing.assert_close(lin(x, bias, res).float(), (lin(x) + bias + res).float(), atol=0.05, rtol=0.02)


# Each kernel's rows independent of the batch: tests/engine/test_onednn_isa.py, at every ISA level.


def test_kernel_choice_and_fallback_reasons():
    qw = from_gguf_blocks("Q4_1", _quantized("Q4_1")[0], N, K)
    cpu = torch.device("cpu")
    lin, why = make_linear(qw, torch.float32, cpu, native=True)
    assert not isinstance(lin, Int4Linear) and "float32 activations" in why
    lin, why = make_linear(qw, torch.float32, cpu, native=False)
    assert why == "dequant" and isinstance(lin, PackedLinear if onednn_packable(torch.float32, cpu) else DenseLinear)
    assert "cuda" in int4_reason(qw, torch.bfloat16, torch.device("cuda"))
    odd = from_gguf_blocks("Q4_0", _quantized("Q4_0", 24, K)[0], 24, K)
    assert "N % 16" in int4_reason(odd, torch.bfloat16, cpu)
    lin, why = make_linear(torch.randn(8, 16), torch.float32, cpu, native=True)   # dense: no reason
    assert why is None


@needs_int4
def test_kernels_pickle_and_compute_the_same_after():
    qw = from_gguf_blocks("Q8_0", _quantized("Q8_0")[0], N, K)
    x = torch.randn(5, K).bfloat16()
    for native in ("int4", True, False):
        lin, _ = make_linear(qw, torch.bfloat16, torch.device("cpu"), native=native)
        again = pickle.loads(pickle.dumps(lin))
        assert torch.equal(again(x), lin(x))


def test_auto_dtype_and_weights_follow_the_cpu(monkeypatch):
    from tandem.engine import loader
    from tandem.engine.model_config import ModelLoadError

    cpu = torch.device("cpu")
    monkeypatch.setattr(loader, "native_bf16", lambda: "avx512_bf16")
    assert loader.resolve_dtype("auto", cpu) == torch.bfloat16
    assert "avx512_bf16" in loader.describe_dtype("auto", cpu)
    assert loader.resolve_weights("auto", torch.bfloat16, cpu) is True
    monkeypatch.setattr(loader, "native_bf16", lambda: None)
    assert loader.resolve_dtype("auto", cpu) == torch.float32
    assert loader.resolve_weights("auto", torch.float32, cpu) is False
    assert loader.resolve_dtype("float32", cpu) == torch.float32
    for mode in ("native", "int4"):
        with pytest.raises(ModelLoadError, match=f"weights '{mode}' runs on the CPU with dtype bfloat16"):
            loader.resolve_weights(mode, torch.float32, cpu)
    assert loader.resolve_weights("int4", torch.bfloat16, cpu) == "int4"
    with pytest.raises(ModelLoadError, match="supported: auto, native, int4, dequant"):
        loader.resolve_weights("int8", torch.bfloat16, cpu)
