"""The Llama GPU path's fused kernels (engine/attention/triton_kernels/layer_ops.py, the
single-pass decode attention) against their unfused references, the whole path against the
composed layers, and how many device ops one decode step issues.

CPU runs use triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so shapes stay
tiny; bench/gpu_check.py runs this file compiled on a GPU too. The op count is what a GPU would launch: every aten op that is not a view or an
allocation, plus every triton kernel launch; a regression (a new cast, copy or unfused
elementwise op) changes it."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from tandem.engine.attention.triton_kernels import INTERPRETED  # noqa: E402
from tandem.engine.attention.triton_kernels.layer_ops import (  # noqa: E402
    add_rmsnorm, add_rmsnorm_reference, rope_store, rope_store_reference, silu_mul, silu_mul_reference)

if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("triton kernels are compiled and there is no GPU", allow_module_level=True)
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tol(dtype):
    return dict(atol=0, rtol=0) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_x", [True, False])
def test_add_rmsnorm_matches_add_then_norm(dtype, with_x):
    g = torch.Generator().manual_seed(0)
    res = torch.randn(5, 48, generator=g).to(DEVICE, dtype)
    x = torch.randn(5, 48, generator=g).to(DEVICE, dtype) if with_x else None
    w = (1 + 0.2 * torch.randn(48, generator=g)).to(DEVICE, dtype)
    ref_res = res.clone()
    want = add_rmsnorm_reference(x, ref_res, w, 1e-5)
    got = add_rmsnorm(x, res, w, 1e-5)
    torch.testing.assert_close(res, ref_res, **_tol(dtype))            # the residual, in place
    torch.testing.assert_close(got, want, **({"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32
                                              else _tol(dtype)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_silu_times_up(dtype):
    gu = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    torch.testing.assert_close(silu_mul(gu), silu_mul_reference(gu),
                               **({"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else _tol(dtype)))


@pytest.mark.parametrize("index_map", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_matches_rotary_then_store(index_map, dtype):
    from tandem.engine.layers import Rotary, rope_inv_freq

    T, nq, nkv, D = 4, 4, 2, 16
    g = torch.Generator().manual_seed(2)
    rot = Rotary(rope_inv_freq(D, 10000.0, None, None), 64, DEVICE, dtype)
    qkv = torch.randn(T, (nq + 2 * nkv) * D, generator=g).to(DEVICE, dtype)
    pos = torch.tensor([0, 7, 8, 31], device=DEVICE)
    loc = torch.tensor([5, 2, 9, 11], device=DEVICE)
    imap = torch.randperm(16, generator=g).to(DEVICE) if index_map else None
    bufs = [torch.full((16, nkv, D), float("nan"), dtype=dtype, device=DEVICE) for _ in range(4)]
    want_qkv = qkv.clone()
    views = [(t[:, : (nq + nkv) * D].view(T, nq + nkv, D), t[:, (nq + nkv) * D:].view(T, nkv, D))
             for t in (qkv, want_qkv)]
    rope_store(views[0][0], views[0][1], rot.cos, rot.sin, pos, nq, bufs[0], bufs[1], loc, imap)
    rope_store_reference(views[1][0], views[1][1], rot.cos, rot.sin, pos, nq, bufs[2], bufs[3], loc, imap)
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else _tol(dtype)
    torch.testing.assert_close(qkv, want_qkv, **tol)
    torch.testing.assert_close(bufs[0], bufs[2], equal_nan=True, **tol)
    torch.testing.assert_close(bufs[1], bufs[3], equal_nan=True, atol=0, rtol=0)


def test_single_pass_decode_equals_split_decode():
    from tandem.engine.attention.triton_kernels.decode import decode_attention

    g = torch.Generator().manual_seed(3)
    B, hq, hkv, D, rows = 3, 4, 2, 16, 64
    q = torch.randn(B, hq, D, generator=g).to(DEVICE)
    k, v = (torch.randn(rows, hkv, D, generator=g).to(DEVICE) for _ in range(2))
    r2t = torch.randperm(rows, generator=g).to(DEVICE, torch.int32).view(2, 32)
    r2t = torch.cat([r2t, r2t[:1]])
    idx, lens = torch.tensor([0, 1, 2], device=DEVICE), torch.tensor([5, 32, 17], device=DEVICE)
    outs = []
    for splits in (1, 3):
        o = torch.empty(B, hq, D, device=DEVICE)
        outs.append(decode_attention(q, k, v, o, r2t, idx, lens, D ** -0.5, splits))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- the whole path
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from test_model_tiny import make_hf, write_tokenizer

    path = tmp_path_factory.mktemp("tiny_llama_gpu_path")
    make_hf("qwen2_bias_swa").save_pretrained(path)          # biases, a sliding-window layer
    write_tokenizer(path)
    return str(path)


def _runner(path, dtype, backend):
    from tandem.engine.attention import make_attention_backend
    from tandem.engine.loader import load_model
    from tandem.engine.model_runner import ModelRunner

    loaded = load_model(path, device=DEVICE, dtype=dtype)
    return ModelRunner.create(loaded, max_total_tokens=256, page_size=4, max_reqs=4, max_context=64,
                              backend=make_attention_backend(backend, DEVICE))


PROMPTS = [[(7 * i + 3) % 256 for i in range(11)], [(5 * i + 1) % 256 for i in range(6)]]


def test_gpu_path_logits_match_the_composed_layers(tiny_dir):
    """Prefill (mixed lengths) then three decode steps: the fused path (triton backend) and the
    composed one (torch backend) agree in float32."""
    from tandem.engine.models import llama_gpu

    fused, plain = _runner(tiny_dir, "float32", "triton"), _runner(tiny_dir, "float32", "torch")
    assert llama_gpu.applies(fused.model, fused.backend)
    assert not llama_gpu.applies(plain.model, plain.backend)
    got = []
    for r in (fused, plain):
        seqs = [r.new_seq() for _ in PROMPTS]
        logits = [r.extend(seqs, PROMPTS)]
        for t in range(3):
            logits.append(r.decode(seqs, [40 + t, 50 + t]))
        got.append(torch.stack(logits))
    torch.testing.assert_close(got[0], got[1], atol=2e-4, rtol=1e-4)


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts aten ops that launch a kernel on a GPU (not views, not allocations; a 2-D
    ``matmul`` is one GEMM there)."""

    FREE = {"empty", "empty_like", "empty_strided", "lift_fresh", "detach"}

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        if view and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor):
            view = out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()  # .to: a copy?
        if not self.paused and not view and name not in self.FREE:
            self.ops.append(name)
        return out


def _count_decode_ops(r, monkeypatch) -> tuple[list[str], int]:
    """(aten ops, triton launches) of one decode step of two sequences."""
    from triton.runtime.interpreter import InterpretedFunction

    seqs = [r.new_seq() for _ in PROMPTS]
    r.extend(seqs, PROMPTS)
    fb = r.build_forward_batch([(s.row, s.length, [60], r.allocator.alloc_extend(
        s.last_slot, s.length, 1)) for s in seqs])
    counter, launches = _OpCounter(), [0]
    real = InterpretedFunction.run

    def run(self, *a, **kw):
        launches[0] += 1
        counter.paused = True          # the interpreter's own tensor handling is not a launch
        try:
            return real(self, *a, **kw)
        finally:
            counter.paused = False

    monkeypatch.setattr(InterpretedFunction, "run", run)
    with counter:
        r.forward(fb)
    return counter.ops, launches[0]


@pytest.mark.skipif(not INTERPRETED, reason="counts launches through triton's interpreter")
def test_one_decode_step_issues_a_pinned_number_of_device_ops(tiny_dir, monkeypatch):
    """float16 weights on the CPU are plain tensors, as on a GPU (DenseLinear), so the step
    is the GPU path's: per layer add_rmsnorm, qkv GEMM (+ bias: addmm), rope_store, one decode
    attention (single pass: split-K needs a GPU's SM count to pay), o GEMM, add_rmsnorm,
    gate_up GEMM, silu_mul, down GEMM; per step the embedding, the final norm, the head GEMM
    and its float32 cast."""
    r = _runner(tiny_dir, "float16", "triton")
    ops, launches = _count_decode_ops(r, monkeypatch)
    layers = r.model.arch.num_layers
    per_layer = 9
    assert sorted(ops) == sorted(["embedding"] + ["addmm", "matmul", "matmul", "matmul"] * layers
                                 + ["matmul", "to"]), ops
    assert launches == 5 * layers + 1
    assert len(ops) + launches == per_layer * layers + 4


# ---------------------------------------------------------------------------- device sampling
def test_sample_kernel_greedy_rows_are_argmax_and_draws_follow_the_cut_distribution():
    from tandem.engine.attention.triton_kernels.layer_ops import sample, sample_reference_probs

    g = torch.Generator().manual_seed(4)
    V, n = 12, 200                         # the interpreter runs a program a row; the seeds are fixed
    row = torch.randn(V, generator=g) * 2
    logits = row.repeat(n, 1).to(DEVICE)
    f32 = dict(dtype=torch.float32, device=DEVICE)
    seeds = torch.arange(n, device=DEVICE, dtype=torch.int64) * 7919 + 1
    for temp, top_p, top_k in [(0.7, 0.8, 0), (1.3, 1.0, 4)]:
        got = sample(logits, torch.full((n,), temp, **f32), torch.full((n,), top_p, **f32),
                     torch.full((n,), top_k, dtype=torch.int32, device=DEVICE), seeds, iters=10)
        want = sample_reference_probs(row, temp, top_p, top_k)
        freq = torch.bincount(got.cpu(), minlength=V).float() / n
        assert (freq[want == 0] == 0).all(), (temp, top_p, top_k, freq, want)      # the cuts hold
        assert (freq - want).abs().max() < 0.1, (temp, top_p, top_k, freq, want)   # ~4 sigma
        again = sample(logits[:20], torch.full((20,), temp, **f32), torch.full((20,), top_p, **f32),
                       torch.full((20,), top_k, dtype=torch.int32, device=DEVICE), seeds[:20], iters=10)
        assert torch.equal(again, got[:20])                     # a row's draw: its seed and itself
    mixed = torch.randn(5, 300, generator=g).to(DEVICE)
    mixed[2, 7] = mixed[2, 9] = mixed[2].max() + 1             # a tie: the first index wins
    got = sample(mixed, torch.zeros(5, **f32), torch.ones(5, **f32),
                 torch.zeros(5, dtype=torch.int32, device=DEVICE), seeds[:5])
    assert torch.equal(got, mixed.argmax(-1)) and int(got[2]) == 7
