"""K-quants (Q4_K, Q5_K, Q6_K) and Q5_0 / Q5_1 in engine/quant/blocks.py: the blocks unpack to
exactly what gguf-py dequantizes (the exact torch path the loader falls back to), row reorder and
stacking keep that, and the test quantizer (tests/engine/kquant_support.py) writes GGML's layout.
"""

from __future__ import annotations

import numpy as np
import pytest

from kquant_support import quantize
from tandem.engine.quant.blocks import BLOCK_BYTES, QuantWeight, from_gguf_blocks

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
