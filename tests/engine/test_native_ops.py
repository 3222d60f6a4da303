"""engine/quant/native_ops.cpp: the AVX512 kernels as typed torch operators (torch.ops.tandem.*).

Oracle: a wrong dtype, rank, shape, layout or index range raises ValueError naming the op and the
argument, before the kernel runs -- the output, the KV pools and every other tensor are bitwise
what they were (nothing was written through a bad pointer). A right call computes what the
Python classes compute (the bitwise oracles themselves: test_avx512.py, test_kquants.py,
test_llama_cpu.py). Skipped, with the reason, where the kernels cannot run (no AVX512-BF16).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.engine.quant import native_lib
from tandem.engine.quant.avx512 import Avx512Linear
from tandem.engine.quant.blocks import from_gguf_blocks

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(native_lib.kernel_unavailable() is not None,
                                reason=f"needs the AVX512-BF16 kernels: {native_lib.kernel_unavailable()}")
BF = torch.bfloat16


def _linear(kind: str, n: int, k: int, seed: int = 0) -> Avx512Linear:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    raw = gguf.quants.quantize(x, getattr(gguf.GGMLQuantizationType, kind))
    return Avx512Linear(from_gguf_blocks(kind, raw, n, k), BF)


def _raises(match: str, fn, *args, **kw):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kw)


@pytest.fixture(scope="module")
def ops():
    return native_lib.kernel_ops()


def test_the_operators_are_registered_with_their_schemas(ops):
    schema = str(ops.linear_.default._schema)
    assert schema.startswith("tandem::linear_(int kind, Tensor wpack, Tensor x, Tensor(a!) out")
    assert "Tensor(a!) kpool" in str(ops.attention.default._schema)
    assert native_lib.describe().startswith("native AVX512-BF16 kernels: on (torch.ops.tandem")


def test_linear_rejects_bad_arguments_and_leaves_out_untouched(ops):
    lin = _linear("Q4_0", 64, 96)
    op = ops.linear_.default
    x = torch.randn(3, 96, dtype=BF)
    out = torch.full((3, 64), 7.0, dtype=BF)
    good = (lin.kind_id, lin.packed, x, out, 0, None, 0.0, None, None)

    def call(**kw):
        names = ("kind", "wpack", "x", "out", "pre", "nw", "eps", "residual", "bias")
        args = dict(zip(names, good)) | kw
        op(*(args[n] for n in names))

    _raises("wpack must be a contiguous .* uint8", call, wpack=lin.packed.view(torch.int8))
    _raises("wpack records must be 544 bytes for kind 2", call, kind=2)          # Q4_0 blocks read as Q8_0
    _raises("unknown kernel kind 9", call, kind=9)
    _raises(r"x must be \[3, 96\]", call, x=torch.randn(3, 64, dtype=BF))
    _raises("x must be float32 or bfloat16, got Half", call, x=x.half())
    _raises("x must have unit stride", call, x=torch.randn(96, 3, dtype=BF).t())
    _raises(r"out must be \[3, 64\]", call, out=torch.empty(2, 64, dtype=BF))
    _raises(r"residual must be \[3, 64\]", call, residual=torch.zeros(3, 32, dtype=BF))
    _raises("bias must have 64 entries", call, bias=torch.zeros(48, dtype=BF))
    _raises("norm weight is given exactly with pre-op rmsnorm", call, pre=1)
    _raises(r"x must be \[3, 192\]", call, pre=2)                                 # silu_mul wants [T, 2K]
    _raises("the norm weight must have x's dtype", call, pre=1, nw=torch.ones(96))
    assert torch.equal(out, torch.full((3, 64), 7.0, dtype=BF))                   # nothing was written
    call()
    assert torch.equal(out, lin(x))


def test_a_linear_called_with_the_wrong_input_width_says_so():
    lin = _linear("Q8_0", 32, 64)
    with pytest.raises(ValueError, match=r"wants \[T, 64\]"):
        lin(torch.randn(2, 32, dtype=BF))


def test_activations_and_rope_check_their_shapes(ops):
    _raises("K must be a positive multiple of 32", ops.activations, 0, torch.randn(2, 48), 48, 0, None, 0.0)
    _raises(r"x must be \[2, 64\]", ops.activations, 0, torch.randn(2, 32), 64, 0, None, 0.0)
    x = torch.randn(2, 3, 64, dtype=BF)
    before = x.clone()
    cos, sin = torch.randn(2, 1, 32, dtype=BF), torch.randn(2, 1, 32, dtype=BF)
    _raises(r"cos and sin must be \[2, 32\]", ops.rope_, x, cos[:, :, :16], sin[:, :, :16])
    _raises("cos and sin must be CPU BFloat16", ops.rope_, x, cos.float(), sin.float())
    _raises("head dim must be a multiple of 32", ops.rope_, x[:, :, :48], cos, sin)
    _raises("x must have 3 dims", ops.rope_, x[0], cos, sin)
    assert torch.equal(x, before)


def _attention_args(t: int = 2, hq: int = 2, hkv: int = 1, d: int = 16, rows: int = 8):
    """A one-sequence step: t new tokens at positions 0..t-1 of req_to_token row 0 (slot = position)."""
    q = torch.randn(t, hq, d, dtype=BF)
    kpool, vpool = torch.zeros(rows, hkv, d, dtype=BF), torch.zeros(rows, hkv, d, dtype=BF)
    k, v = torch.randn(t, hkv, d, dtype=BF), torch.randn(t, hkv, d, dtype=BF)
    r2t = torch.arange(rows, dtype=torch.int32)[None]                      # [1, rows]
    i64 = dict(dtype=torch.int64)
    return dict(q=q, kpool=kpool, vpool=vpool, k=k, v=v, wrow=torch.arange(t, **i64), r2t=r2t,
                rows=torch.zeros(t, **i64), lo=torch.zeros(t, **i64), hi=torch.arange(1, t + 1, **i64),
                imap=None, scale=d ** -0.5)


def test_attention_checks_pools_dtypes_and_index_ranges_before_writing(ops):
    base = _attention_args()

    def call(**kw):
        a = base | kw
        return ops.attention(*a.values())

    _raises("write rows must lie in", call, wrow=torch.tensor([0, 8]))          # the pool has 8 rows
    _raises("wrow must be a contiguous 1-dim CPU Long", call, wrow=torch.tensor([0, 1], dtype=torch.int32))
    _raises(r"query 1's key range \[0, 9\)", call, hi=torch.tensor([1, 9]))     # past req_to_token's width
    _raises("rows must lie in", call, rows=torch.tensor([0, 1]))
    _raises("req_to_token must be a 2-dim int32", call, r2t=base["r2t"].long())
    _raises("kpool and vpool must be contiguous 3-dim CPU BFloat16", call, kpool=base["kpool"].float())
    _raises(r"kpool and vpool must be \[rows, 1, 16\]", call, vpool=torch.zeros(8, 2, 16, dtype=BF))
    _raises("k and v must have q's dtype", call, k=base["k"].float())
    _raises(r"q heads \(2\) must be a multiple of kv heads \(3\)", call,
            **{n: torch.randn(2, 3, 16, dtype=BF) for n in ("k", "v")})
    _raises("head dim must be a multiple of 16", call, q=torch.randn(2, 2, 24, dtype=BF))
    assert not base["kpool"].any() and not base["vpool"].any()                  # no K/V was written
    out = call()
    assert out.shape == (2, 2, 16) and torch.equal(base["kpool"][:2], base["k"])


def test_llama_layer_checks_that_the_projections_chain(ops):
    n_q, n_kv, d, h, inter = 2, 1, 32, 64, 96
    qkv, o = _linear("Q8_0", (n_q + 2 * n_kv) * d, h), _linear("Q4_0", h, n_q * d, 1)
    gu, down = _linear("Q4_1", 2 * inter, h, 2), _linear("Q8_0", h, inter, 3)
    ws = [qkv, o, gu, down]
    a = _attention_args(t=3, hq=n_q, hkv=n_kv, d=d)
    x = torch.randn(3, h, dtype=BF)
    cos, sin = torch.randn(3, 1, d // 2, dtype=BF), torch.randn(3, 1, d // 2, dtype=BF)
    norm = torch.ones(h, dtype=BF)

    def call(order=(0, 1, 2, 3), x=x, norm=norm):
        return ops.llama_layer([ws[i].packed for i in order], [ws[i].kind_id for i in order] + [n_q, n_kv, d],
                               norm, norm, 1e-5, d ** -0.5, x, cos, sin, a["kpool"], a["vpool"], a["wrow"],
                               a["r2t"], a["rows"], a["lo"], a["hi"], None)

    _raises("the projections' shapes do not chain", call, (2, 1, 0, 3))
    _raises("x must be a contiguous 2-dim bfloat16", call, x=x.float())
    _raises(r"the norm weights must be contiguous \[64\] bfloat16", call, norm=norm.float())
    assert not a["kpool"].any()
    out = call()
    assert out.shape == (3, h) and out.dtype == BF and a["kpool"][:3].any()


def test_a_size_one_dim_s_stride_is_not_checked(ops):
    """A decode step's one token: k and v views of different tensors (row strides differ, as in
    the exact path's qkv split) are taken; the stride of a dim of one element is never used."""
    a = _attention_args(t=1)
    k = torch.randn(1, 1, 48, dtype=BF)[:, :, :16]                         # row stride 48, v's is 16
    out = ops.attention(a["q"], a["kpool"], a["vpool"], k, a["v"], a["wrow"], a["r2t"], a["rows"], a["lo"],
                        a["hi"], None, a["scale"])
    assert out.shape == (1, 2, 16) and torch.equal(a["kpool"][0], k[0]) and torch.equal(a["vpool"][0], a["v"][0])
