"""K-quants (Q4_K, Q5_K, Q6_K) and Q5_0 / Q5_1 in engine/quant/blocks.py: the blocks unpack to
exactly what gguf-py dequantizes (the exact torch path the loader falls back to), row reorder and
stacking keep that, and the test quantizer (tests/engine/kquant_support.py) writes GGML's layout.
The AVX512 kernels on them: float64 over the exactly dequantized weights times the kernel's bf16
activations, each row bitwise independent of the batch and thread count, the fused pre-ops and
epilogue. Kernel tests skip, saying why, where the kernels cannot build (no AVX512-BF16).
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from kquant_support import quantize
from tandem.engine.quant import native_lib
from tandem.engine.quant.avx512 import Avx512Linear, activations
from tandem.engine.quant.blocks import BLOCK_BYTES, QuantParts, QuantWeight, from_gguf_blocks
from tandem.engine.quant.linear import make_linear
from tandem.engine.quant.preop import PreOp

gguf = pytest.importorskip("gguf")
NEW_KINDS = ["Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
N, K = 48, 768


def _x(n=N, k=K, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.01).astype(np.float32)


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_blocks_unpack_to_exactly_what_gguf_dequantizes(kind):
    x = _x()
    raw = quantize(x, kind)
    ref = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).astype(np.float32)
    qw = from_gguf_blocks(kind, raw, N, K)
    assert np.array_equal(qw.dequantize().numpy(), ref)       # bitwise
    assert qw.nbytes == raw.size
    assert qw.scale.shape == (N, K // qw.group)
    # the test quantizer is a real fit (what the fixtures rely on), not just a valid layout
    bound = {"Q5_0": 0.06, "Q5_1": 0.04, "Q4_K": 0.08, "Q5_K": 0.04, "Q6_K": 0.02}[kind]
    assert np.abs(ref - x).max() <= bound * np.abs(x).max()


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_rows_and_cat_keep_the_exact_values(kind):
    raw = quantize(_x(), kind)
    ref = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).astype(np.float32)
    qw = from_gguf_blocks(kind, raw, N, K)
    order = np.random.default_rng(1).permutation(N)
    both = QuantWeight.cat([qw, qw.rows(order)])
    assert np.array_equal(both.dequantize().numpy(), np.concatenate([ref, ref[order]]))


def test_k_quants_need_whole_super_blocks():
    with pytest.raises(ValueError, match="Q4_K matrix needs K divisible by 256"):
        from_gguf_blocks("Q4_K", np.zeros(BLOCK_BYTES["Q4_K"], np.uint8), 1, 576)


# -- the AVX512 kernels on these kinds (engine/quant/avx512_kernels.c, the "KQ" kinds) -----------
needs_kernels = pytest.mark.skipif(native_lib.kernel_unavailable() is not None,
                                   reason=f"needs the AVX512-BF16 kernels: {native_lib.kernel_unavailable()}")


def _qw(kind: str, n: int, k: int, seed: int = 0):
    raw = quantize(_x(n, k, seed), kind)
    return from_gguf_blocks(kind, raw, n, k), torch.from_numpy(
        gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).astype(np.float64))


@needs_kernels
@pytest.mark.parametrize("kind", NEW_KINDS)
def test_kernel_is_the_exact_weights_times_its_bf16_activations(kind):
    n, k, t = 96, 768, 9
    qw, w = _qw(kind, n, k)
    lin = Avx512Linear(qw, torch.bfloat16, out_dtype=torch.float32)
    x = torch.randn(t, k).bfloat16()
    xa, sums = activations(kind, x, k)
    g = 16 if kind == "Q6_K" else 32
    assert torch.equal(xa, x)
    # the kernel sums a block in float32: float32's tolerances against the float64 sum (float64's
    # failed 23 of 3,000 random activations, by a float32 rounding of 2.4e-7)
    assert sums.dtype == torch.float32
    torch.testing.assert_close(sums, x.double().view(t, k // g, g).sum(-1).float())
    ref = x.double() @ w.t()                           # float64 over the exactly dequantized weights
    got = lin(x).double()
    assert (got - ref).abs().max().item() < 2e-5 * ref.abs().max().item()


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["Q5_0", "Q4_K", "Q6_K"])
def test_kernel_rows_are_independent_of_the_batch_and_threads(kind, threads):
    old = torch.get_num_threads()
    qw, _ = _qw(kind, 256, 768, seed=1)
    lin = Avx512Linear(qw, torch.bfloat16)
    x = torch.randn(70, 768).bfloat16()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([lin(x[i:i + 1]) for i in range(70)])
        torch.set_num_threads(threads)
        for m in (2, 3, 4, 5, 16, 33, 70):
            assert torch.equal(lin(x[:m]), alone[:m]), m
    finally:
        torch.set_num_threads(old)


@needs_kernels
@pytest.mark.parametrize("kind", ["Q5_K", "Q6_K"])
def test_kernel_fused_pre_ops_bias_and_residual(kind):
    qw, _ = _qw(kind, 64, 512)
    lin = Avx512Linear(qw, torch.bfloat16, out_dtype=torch.float32)
    x = torch.randn(5, 512).bfloat16() * 3
    norm = PreOp.rmsnorm((torch.rand(512) + 0.5).bfloat16(), 1e-5)
    a, b = lin(x, pre=norm), lin(norm.apply(x.clone()))
    assert (a - b).abs().max() <= 0.02 * b.abs().max()     # one bf16 rounding of the normed input apart
    gu = torch.randn(5, 1024).bfloat16() * 4
    a, b = lin(gu, pre=PreOp.silu_mul()), lin(PreOp.silu_mul().apply(gu.clone()))
    assert (a - b).abs().max() <= 0.02 * b.abs().max()
    bf = Avx512Linear(qw, torch.bfloat16)
    bias, res = torch.randn(64).bfloat16(), torch.randn(5, 64).bfloat16()
    assert torch.equal(bf(x, bias, res), (lin(x) + bias.float() + res.float()).bfloat16())


@needs_kernels
def test_make_linear_runs_them_natively_and_pickles():
    qw, _ = _qw("Q4_K", 32, 256)
    lin, why = make_linear(qw, torch.bfloat16, torch.device("cpu"), native=True)
    assert isinstance(lin, Avx512Linear) and why is None
    x = torch.randn(3, 256).bfloat16()
    assert torch.equal(pickle.loads(pickle.dumps(lin))(x), lin(x))
    # torch's int4 kernel does not take them: the exact dequantized weight, with the reason
    lin, why = make_linear(qw, torch.bfloat16, torch.device("cpu"), native="int4")
    assert not isinstance(lin, Avx512Linear) and "not mapped to int4" in why


@needs_kernels
def test_kinds_side_by_side_run_part_by_part():
    """A fused qkv of Q5_0 q, k and a Q8_0 v (a *_M mix): one kernel, each part on its own blocks."""
    parts = [_qw("Q5_0", 64, 512, 0)[0], _qw("Q5_0", 32, 512, 1)[0], _qw("Q8_0", 32, 512, 2)[0]]
    stacked = QuantParts.stack(parts)
    assert isinstance(stacked, QuantParts) and stacked.kind == "Q5_0+Q8_0" and stacked.shape == (128, 512)
    lin, why = make_linear(stacked, torch.bfloat16, torch.device("cpu"), native=True)
    assert isinstance(lin, Avx512Linear) and why is None and lin.packed is None
    x, bias, res = torch.randn(6, 512).bfloat16(), torch.randn(128).bfloat16(), torch.randn(6, 128).bfloat16()
    alone = [Avx512Linear(p, torch.bfloat16) for p in (QuantParts.stack(parts[:2]), parts[2])]
    assert torch.equal(lin(x, bias, res),
                       torch.cat([alone[0](x, bias[:96], res[:, :96]), alone[1](x, bias[96:], res[:, 96:])], 1))
    assert torch.equal(pickle.loads(pickle.dumps(lin))(x), lin(x))
    lin, why = make_linear(stacked, torch.bfloat16, torch.device("cpu"), native="int4")
    assert not isinstance(lin, Avx512Linear) and "one kind" in why


@needs_kernels
def test_q8_0_layer_weights_with_bf16_activations():
    """``q8_bf16`` (what Llama layers ask for): Q8_0 codes exactly times the bf16 activations, not
    int8 activation blocks; rows independent of the batch."""
    qw, w = _qw("Q8_0", 96, 768)
    lin = Avx512Linear(qw, torch.bfloat16, out_dtype=torch.float32, q8_bf16=True)
    x = torch.randn(9, 768).bfloat16()
    ref = x.double() @ w.t()
    assert (lin(x).double() - ref).abs().max().item() < 2e-5 * ref.abs().max().item()
    int8 = Avx512Linear(qw, torch.bfloat16, out_dtype=torch.float32)      # the head's int8 way
    assert (int8(x).double() - ref).abs().max().item() > 1e-4 * ref.abs().max().item()
    alone = torch.cat([lin(x[i:i + 1]) for i in range(9)])
    assert torch.equal(lin(x), alone)


def test_without_the_kernels_they_run_dequantized_and_say_why(monkeypatch):
    """The fallback where the AVX512 kernels cannot build: the exact dequantized weight (in the
    compute dtype), the reason naming both kernels (the startup line's ``dequantized`` list)."""
    import tandem.engine.quant.avx512 as avx512

    monkeypatch.setattr(avx512, "kernel_unavailable", lambda: "the CPU lacks avx512_bf16 (test)")
    qw, w = _qw("Q6_K", 32, 256)
    lin, why = make_linear(qw, torch.bfloat16, torch.device("cpu"), native=True)
    assert not isinstance(lin, Avx512Linear)
    assert "the CPU lacks avx512_bf16 (test)" in why and "Q6_K is not mapped to int4" in why
    x = torch.randn(3, 256).bfloat16()
    torch.testing.assert_close(lin(x).float(), (x @ w.to(torch.bfloat16).t()).float(), atol=0.05, rtol=0.02)
