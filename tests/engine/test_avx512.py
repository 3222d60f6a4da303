"""engine/quant/avx512.py + avx512_kernels.c: the GGUF blocks on AVX512 (BF16 dots for Q4_0/Q4_1,
VNNI int8 dots for Q8_0).

Oracles: given the activations the kernel multiplies (``activations``: the bf16 rows, or the int8
blocks and their scales), the output equals float64 ``x @ W^T`` over the exactly dequantized
weights to float32 accumulation error; every output row is bitwise independent of the batch and
the thread count; the fused pre-ops equal PreOp.apply (torch) up to one bf16 rounding; the
epilogue adds bias and residual; a machine without the kernels gets a reason, not a crash.
Skipped where the kernels cannot run (another CPU, no compiler): the reason is the skip message.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from tandem.engine.quant import native_lib
from tandem.engine.quant.avx512 import Avx512Linear, activations, avx512_reason
from tandem.engine.quant.blocks import from_gguf_blocks
from tandem.engine.quant.linear import make_linear
from tandem.engine.quant.preop import PreOp

gguf = pytest.importorskip("gguf")
KINDS = ["Q4_0", "Q4_1", "Q8_0"]
pytestmark = pytest.mark.skipif(native_lib.kernel_unavailable() is not None,
                                reason=f"needs the AVX512-BF16 kernels: {native_lib.kernel_unavailable()}")


def _weight(kind: str, n: int, k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.01).astype(np.float32)
    qt = getattr(gguf.GGMLQuantizationType, kind)
    raw = gguf.quants.quantize(x, qt)
    return from_gguf_blocks(kind, raw, n, k), torch.from_numpy(gguf.quants.dequantize(raw, qt).astype(np.float64))


@pytest.mark.parametrize("kind", KINDS)
def test_output_is_the_exact_weights_times_the_kernels_activations(kind):
    n, k, t = 96, 576, 9
    qw, w = _weight(kind, n, k)
    lin = Avx512Linear(qw, torch.bfloat16, out_dtype=torch.float32)
    x = torch.randn(t, k).bfloat16()
    xa, scale = activations(kind, x, k)
    if kind == "Q8_0":     # int8 blocks: |xq| <= 127, scale = max |x| / 127 per block
        assert xa.dtype == torch.int8 and xa.abs().max() <= 127
        blocks = x.float().view(t, k // 32, 32)
        torch.testing.assert_close(scale, blocks.abs().amax(-1) / 127)
        xr = (xa.double().view(t, k // 32, 32) * scale.double()[..., None]).view(t, k)
        assert (xr - x.double()).abs().max() <= scale.max() * 0.5 + 1e-6
    else:                  # bf16 rows: x itself; scale holds each block's sum
        assert torch.equal(xa, x)
        torch.testing.assert_close(scale.double(), x.double().view(t, k // 32, 32).sum(-1))
        xr = x.double()
    ref = xr @ w.t()
    got = lin(x).double()
    assert (got - ref).abs().max().item() < 2e-5 * ref.abs().max().item()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_each_output_row_is_independent_of_the_batch_and_threads(kind, threads):
    old = torch.get_num_threads()
    qw, _ = _weight(kind, 256, 576, seed=1)
    lin = Avx512Linear(qw, torch.bfloat16)
    x = torch.randn(70, 576).bfloat16()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([lin(x[i:i + 1]) for i in range(70)])
        torch.set_num_threads(threads)
        for m in (2, 3, 4, 5, 16, 33, 70):
            assert torch.equal(lin(x[:m]), alone[:m]), m
    finally:
        torch.set_num_threads(old)


def test_fused_pre_ops_equal_the_torch_definitions():
    qw, _ = _weight("Q4_1", 64, 576)
    lin = Avx512Linear(qw, torch.bfloat16, out_dtype=torch.float32)
    x = torch.randn(5, 576).bfloat16() * 3
    norm = PreOp.rmsnorm((torch.rand(576) + 0.5).bfloat16(), 1e-5)
    a, b = lin(x, pre=norm), lin(norm.apply(x.clone()))
    assert (a - b).abs().max() <= 0.02 * b.abs().max()     # one bf16 rounding of the normed input apart
    qw, _ = _weight("Q4_0", 64, 1536)
    lin = Avx512Linear(qw, torch.bfloat16, out_dtype=torch.float32)
    gu = torch.randn(5, 3072).bfloat16() * 4
    a, b = lin(gu, pre=PreOp.silu_mul()), lin(PreOp.silu_mul().apply(gu.clone()))
    assert (a - b).abs().max() <= 0.02 * b.abs().max()
    with pytest.raises(ValueError, match=r"wants \[T, 3072\]"):
        lin(gu[:, :1536], pre=PreOp.silu_mul())


def test_bias_and_residual_are_added_once_before_the_rounding():
    qw, _ = _weight("Q4_1", 64, 576)
    lin = Avx512Linear(qw, torch.bfloat16)
    x, bias, res = torch.randn(6, 576).bfloat16(), torch.randn(64).bfloat16(), torch.randn(6, 64).bfloat16()
    full = Avx512Linear(qw, torch.bfloat16, out_dtype=torch.float32)(x)
    torch.testing.assert_close(lin(x, bias, res), (full + bias.float() + res.float()).bfloat16(), atol=0, rtol=0)


def test_make_linear_picks_it_and_int4_forces_torchs_kernel():
    qw, _ = _weight("Q4_1", 96, 160)
    cpu = torch.device("cpu")
    assert isinstance(make_linear(qw, torch.bfloat16, cpu, native=True)[0], Avx512Linear)
    assert not isinstance(make_linear(qw, torch.bfloat16, cpu, native="int4")[0], Avx512Linear)
    assert "float32 activations" in avx512_reason(qw, torch.float32, cpu)
    odd, _ = _weight("Q4_0", 24, 160)
    assert "N % 16" in avx512_reason(odd, torch.bfloat16, cpu)


def test_it_pickles_and_computes_the_same_after():
    qw, _ = _weight("Q8_0", 96, 160)
    lin = Avx512Linear(qw, torch.bfloat16)
    x = torch.randn(3, 160).bfloat16()
    assert torch.equal(pickle.loads(pickle.dumps(lin))(x), lin(x))


@pytest.fixture
def fresh_load():
    """The library's load forgotten before the test and again after its monkeypatches are undone."""
    native_lib._load.cache_clear()
    yield
    native_lib._load.cache_clear()
    assert native_lib.kernel_ops() is not None


def test_a_cpu_without_the_instructions_gets_a_reason(fresh_load, monkeypatch):
    monkeypatch.setattr(native_lib, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    why = native_lib.kernel_unavailable()
    assert native_lib.kernel_ops() is None and "avx512_vnni" in why and "avx512_bf16" in why
    qw, _ = _weight("Q4_1", 96, 160)
    lin, why = make_linear(qw, torch.bfloat16, torch.device("cpu"), native=True)
    assert not isinstance(lin, Avx512Linear)          # torch's int4 kernel (or dequantized) instead


def test_a_failed_build_is_a_reason_not_a_crash(fresh_load, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert native_lib.kernel_ops() is None
    assert native_lib.kernel_unavailable().startswith("building the AVX512 kernels failed")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_is_bitwise_the_torch_rotary(dtype):
    from tandem.engine.layers import Rotary
    from tandem.engine.quant.avx512 import rope_

    for t in (1, 6):
        qkv = (torch.randn(t, 15 * 64) * 3).to(dtype)
        qk = qkv[:, :12 * 64].view(t, 12, 64)               # rows at the qkv stride, as the model has them
        cos, sin = torch.randn(t, 1, 32).to(dtype), torch.randn(t, 1, 32).to(dtype)
        ref = Rotary.apply(qk, cos, sin)
        rest = qkv[:, 12 * 64:].clone()
        assert rope_(qk, cos, sin)
        assert torch.equal(qk, ref) and torch.equal(qkv[:, 12 * 64:], rest)
    odd = torch.randn(2, 3, 8)                               # D / 2 = 4: not the kernel's
    assert not rope_(odd, torch.randn(2, 1, 4), torch.randn(2, 1, 4))
