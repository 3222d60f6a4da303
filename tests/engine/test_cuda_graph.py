"""CUDA-graph decode (engine/cuda_graph.py). On the CPU: the capture sizes, the graph-or-eager
decision, the static buffers' exact contents after fill (padding, stale columns), and the
stand-in runner (the same fill / pad / slice path, eager) giving the outputs of plain eager
steps, through the runner and through the Engine. On a GPU (gpu-marked): real capture, replay
bitwise equal to the stand-in at the same padded size, tokens equal to eager."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tandem.cache.allocator import PagedAllocator
from tandem.cache.kv_pool import KVPool
from tandem.cache.req_to_token import ReqToTokenPool
from tandem.core.config import CacheConfig, EngineConfig
from tandem.core.types import SamplingParams
from tandem.engine.batch_builder import PlanItem, build_forward_batch
from tandem.engine.cuda_graph import (
    FIELDS, DecodeBuffers, DecodeGraphRunner, capture_sizes, choose, make_decode_graph, padded_size)
from tandem.engine.model_runner import ModelRunner
from tandem.engine.models.hybrid import tiny_hybrid

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------- pure pieces

def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(130)[-4:] == [112, 120, 128, 130]
    big = capture_sizes(300)
    assert big[big.index(128):] == [128, 144, 160, 176, 192, 208, 224, 240, 256, 288, 300]
    with pytest.raises(ValueError, match="max_bs=0"):
        capture_sizes(0)


def test_padded_size():
    sizes = [1, 2, 4, 8, 16, 24]
    assert [padded_size(b, sizes) for b in (1, 2, 3, 5, 8, 9, 17, 24, 25)] == [1, 2, 4, 8, 8, 16, 24, 24, None]


def _pools(page_size=1):
    pool = KVPool(64, page_size, 1, 1, 4)
    r2t = ReqToTokenPool(8, 32)
    return pool, r2t, PagedAllocator(64 // page_size, page_size)


def _batch(pool, r2t, alloc, lens, ext):
    """A batch of len(lens) rows: row i holds lens[i] tokens and adds ext[i]."""
    items = []
    for n, e in zip(lens, ext):
        row = r2t.alloc()
        slots = alloc.alloc(n + e)
        if n:
            r2t.write(row, 0, slots[:n])
        items.append(PlanItem(row, n, list(range(7, 7 + e)), slots[n:]))
    return build_forward_batch(items, r2t, pool)


def test_choose():
    pool, r2t, alloc = _pools()
    sizes = [1, 2, 4]
    dec = _batch(pool, r2t, alloc, [3, 5, 1], [1, 1, 1])
    assert choose(dec, sizes) == choose(dec, sizes, False)
    assert (choose(dec, sizes).size, choose(dec, sizes).reason) == (4, "replay")
    assert choose(dec, sizes, return_all_logits=True).reason == "all logits"
    assert choose(dec, [1, 2]).reason == "batch 3 > 2 captured"
    mixed = _batch(pool, r2t, alloc, [2, 0], [1, 4])
    assert (choose(mixed, sizes).size, choose(mixed, sizes).reason) == (None, "prefill or mixed step")
    dec.state_indices = torch.tensor([1, 2, 3])
    assert choose(dec, sizes).reason == "recurrent state"


def test_buffers_fill_pads_and_overwrites_stale_columns():
    pool, r2t, alloc = _pools()
    bufs = DecodeBuffers(8, "cpu")
    fb3 = _batch(pool, r2t, alloc, [3, 5, 1], [1, 1, 1])
    bufs.fill(fb3, 4)
    col = {f: bufs.data[i].tolist() for i, f in enumerate(FIELDS)}
    assert col["input_ids"][:4] == [7, 7, 7, 0]
    assert col["positions"][:4] == [3, 5, 1, 0]
    assert col["out_cache_loc"][:4] == fb3.out_cache_loc.tolist() + [0]
    assert col["req_pool_indices"][:4] == fb3.req_pool_indices.tolist() + [0]
    assert col["seq_lens"][:4] == [4, 6, 2, 1]
    assert col["prefix_lens"][:4] == [3, 5, 1, 0]
    assert col["extend_lens"] == [1] * 8 and col["extend_starts"] == list(range(8))
    fb1 = _batch(pool, r2t, alloc, [2], [1])
    bufs.fill(fb1, 2)                                 # column 1 held fb3's second row
    assert bufs.data[:, 1].tolist() == [0, 0, 0, 0, 1, 0, 1, 1]
    static = bufs.batch(2, r2t.req_to_token, pool, fb1.seq_lens_cpu + [1])
    assert static.input_ids.data_ptr() == bufs.data.data_ptr()          # the same storage
    assert static.is_decode and static.seq_lens_cpu == [3, 1] and static.prefix_lens_cpu == [2, 0]
    with pytest.raises(ValueError, match="batch 3 does not fit captured size 2"):
        bufs.fill(fb3, 2)


def test_make_decode_graph_reasons():
    cfg = EngineConfig()
    cpu = SimpleNamespace(device=torch.device("cpu"), backend=SimpleNamespace(capturable=True))
    assert make_decode_graph(cpu, cfg, hybrid=False) == (None, None)
    gpu = SimpleNamespace(device=torch.device("cuda"), backend=SimpleNamespace(capturable=True))
    assert make_decode_graph(gpu, EngineConfig(disable_cuda_graph=True), hybrid=False) == \
        (None, "cuda graph: off (--disable-cuda-graph)")
    assert make_decode_graph(gpu, cfg, hybrid=True) == (None, "cuda graph: off (hybrid model (SWA / recurrent pools))")
    assert make_decode_graph(gpu, cfg, hybrid=False, role="prefill") == \
        (None, "cuda graph: off (prefill engines do not decode)")
    torch_backend = SimpleNamespace(device=torch.device("cuda"), backend=object())
    assert make_decode_graph(torch_backend, cfg, hybrid=False) == (None, "cuda graph: off (object is not capturable)")


def test_config_and_flags():
    from tandem.cluster.cli import build_parser
    from tandem.cluster.flags import engine_config_from_args

    assert not EngineConfig().disable_cuda_graph and EngineConfig().cuda_graph_max_bs is None
    args = build_parser().parse_args(["generate", "--prompt", "x", "--disable-cuda-graph",
                                      "--cuda-graph-max-bs", "16"])
    cfg = engine_config_from_args(args)
    assert cfg.disable_cuda_graph and cfg.cuda_graph_max_bs == 16
    assert not engine_config_from_args(build_parser().parse_args(["generate", "--prompt", "x"])).disable_cuda_graph
    with pytest.raises(ValueError):
        EngineConfig(cuda_graph_max_bs=0)


# ----------------------------------------------------------------------------- the stand-in

@pytest.fixture(scope="module")
def tiny():
    return tiny_hybrid(["full", "full"], seed=3)


def _runner(tiny, backend=None, page_size=1):
    return ModelRunner.create(tiny, max_total_tokens=512, page_size=page_size, max_reqs=8,
                              max_context=96, backend=backend)


PROMPTS = [[5, 9, 200, 17], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40] * 3, [88, 3], [250, 251, 7, 7, 7]]


def _decode_logits(runner, prompts, steps):
    """Greedy decode of ``prompts`` as one batch; every step's logits [B, V] (cloned: a graph's
    output is overwritten by its next replay)."""
    seqs = [runner.new_seq() for _ in prompts]
    out = [runner.extend(seqs, prompts)]
    for _ in range(steps):
        out.append(runner.decode(seqs, out[-1].argmax(-1).tolist()).clone())
    for s in seqs:
        runner.release(s)
    return torch.stack(out)                          # [steps + 1, B, V]


@pytest.mark.parametrize("n", [3, 5])
def test_standin_equals_eager_torch_backend(tiny, n):
    eager = _decode_logits(_runner(tiny), PROMPTS[:n], 6)
    r = _runner(tiny)
    r.decode_graph = DecodeGraphRunner(r, [1, 2, 4, 8], mode="standin")
    got = _decode_logits(r, PROMPTS[:n], 6)
    assert torch.equal(got.argmax(-1), eager.argmax(-1))
    torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-5)
    assert r.decode_graph.stats == {"replay": 6, "eager: prefill or mixed step": 1}


def test_standin_equals_eager_triton_backend(tiny):
    pytest.importorskip("triton")
    from tandem.engine.attention.triton_backend import TritonAttentionBackend
    from tandem.engine.attention.triton_kernels import INTERPRETED

    if not INTERPRETED:
        pytest.skip("compiled triton kernels need CUDA tensors: the gpu tests below cover this")

    eager = _decode_logits(_runner(tiny, TritonAttentionBackend(), page_size=4), PROMPTS[:3], 3)
    r = _runner(tiny, TritonAttentionBackend(), page_size=4)
    r.decode_graph = DecodeGraphRunner(r, [4], mode="standin")
    got = _decode_logits(r, PROMPTS[:3], 3)
    assert torch.equal(got.argmax(-1), eager.argmax(-1))
    torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-5)


def test_standin_keeps_the_pool_but_padding_page(tiny):
    """Padding rows write only slot 0 (the reserved page): every other slot holds what eager
    steps write."""
    a, b = _runner(tiny), _runner(tiny)
    b.decode_graph = DecodeGraphRunner(b, [8], mode="standin")
    _decode_logits(a, PROMPTS[:3], 4)
    _decode_logits(b, PROMPTS[:3], 4)
    torch.testing.assert_close(b.kv_pool.kv_data[:, :, 1:], a.kv_pool.kv_data[:, :, 1:], atol=1e-6, rtol=0)


def test_engine_with_standin_matches_engine_without(tiny):
    from tandem.engine.engine import Engine

    cfg = EngineConfig(device="cpu", num_threads=1, speculative_algorithm="off",   # counts pure decodes
                       cache=CacheConfig(max_total_tokens=1024, max_running_requests=8, page_size=2))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    texts = {}
    stats = None
    for standin in (False, True):
        eng = Engine(cfg, loaded=tiny)
        assert eng.runner.decode_graph is None                       # CPU: no capture
        if standin:
            eng.runner.decode_graph = DecodeGraphRunner(eng.runner, capture_sizes(8), mode="standin")
        try:
            reqs = [eng.make_request(p, params, rid=f"r{i}") for i, p in enumerate(PROMPTS)]
            texts[standin] = [c.token_ids for c in eng.generate_many(reqs, timeout=120)]
            eng.check_invariants()
            if standin:
                stats = dict(eng.runner.decode_graph.stats)
        finally:
            eng.shutdown()
    assert texts[True] == texts[False] and all(len(t) == 12 for t in texts[True])
    assert stats["replay"] >= 8 and any(k.startswith("eager") for k in stats)


# ----------------------------------------------------------------------------- on a GPU

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graph_replay_bitwise_equals_standin(dtype):
    from tandem.engine.attention.triton_backend import TritonAttentionBackend

    loaded = tiny_hybrid(["full", "full"], seed=3, device="cuda", dtype=dtype)
    out = {}
    for mode in ("standin", "cuda"):
        r = _runner(loaded, TritonAttentionBackend(), page_size=4)
        r.decode_graph = DecodeGraphRunner(r, [1, 2, 4, 8], mode=mode)
        out[mode] = _decode_logits(r, PROMPTS, 8)
        assert r.decode_graph.stats["replay"] == 8
        if mode == "cuda":
            assert r.decode_graph.capture_seconds > 0 and "captured decode batch sizes 1,2,4,8" in \
                r.decode_graph.summary()
    assert torch.equal(out["cuda"], out["standin"])
    plain = _decode_logits(_runner(loaded, TritonAttentionBackend(), page_size=4), PROMPTS, 8)
    assert torch.equal(plain.argmax(-1), out["cuda"].argmax(-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_engine_graph_on_off_same_tokens():
    from tandem.engine.engine import Engine

    loaded = tiny_hybrid(["full", "full"], seed=3, device="cuda", dtype=torch.bfloat16)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    toks = {}
    for off in (False, True):
        cfg = EngineConfig(device="cuda", disable_cuda_graph=off,
                           cache=CacheConfig(max_total_tokens=2048, max_running_requests=8, page_size=16))
        eng = Engine(cfg, loaded=loaded)
        assert (eng.runner.decode_graph is None) == off
        assert ("cuda graph: off (--disable-cuda-graph)" if off else "cuda graph: captured decode batch sizes "
                "1,2,4,8 in ") in eng.startup_line
        try:
            # 8 requests decoding together: a captured size, so both runs multiply the same shapes
            eight = PROMPTS + [p[::-1] for p in PROMPTS[:3]]
            reqs = [eng.make_request(p, params, rid=f"r{i}") for i, p in enumerate(eight)]
            toks[off] = [c.token_ids for c in eng.generate_many(reqs, timeout=120)]
            if not off:
                assert eng.runner.decode_graph.stats["replay"] >= 14
        finally:
            eng.shutdown()
    assert toks[False] == toks[True]


class _RecordedGraph:
    """What a CUDA graph does, without CUDA: replay re-runs the captured call, which reads the
    static buffers as they are at replay time, into the output tensor the capture returned."""

    def __init__(self, forward, out):
        self.forward, self.out, self.replays = forward, out, 0

    def replay(self):
        self.out.copy_(self.forward())
        self.replays += 1

    def pool(self):
        return "pool"


def test_capture_path_with_a_recorded_graph(tiny, monkeypatch):
    """mode="cuda"'s control flow on the CPU: every size captured (largest first, one pool), the
    backend's capture-time metadata reused by every replay (so a capturable backend: triton),
    replays reading the refilled buffers, outputs sliced to the batch; equal to eager."""
    pytest.importorskip("triton")
    from tandem.engine.attention.triton_backend import TritonAttentionBackend
    from tandem.engine.attention.triton_kernels import INTERPRETED

    if not INTERPRETED:
        pytest.skip("compiled triton kernels need CUDA tensors: the gpu tests cover this")
    pools = []

    def capture_one(self, forward, pool):
        pools.append(pool)
        g = _RecordedGraph(forward, forward().clone())
        return g, g.out

    monkeypatch.setattr(DecodeGraphRunner, "_sync", lambda self: None)
    monkeypatch.setattr(DecodeGraphRunner, "_capture_one", capture_one)
    eager = _decode_logits(_runner(tiny, TritonAttentionBackend(), page_size=4), PROMPTS, 5)
    r = _runner(tiny, TritonAttentionBackend(), page_size=4)
    r.decode_graph = DecodeGraphRunner(r, [2, 8], mode="cuda")
    assert sorted(r.decode_graph._graphs) == [2, 8] and pools == [None, "pool"]
    assert r.decode_graph.summary().startswith("cuda graph: captured decode batch sizes 2,8 in ")
    got = _decode_logits(r, PROMPTS, 5)
    torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-5)
    assert r.decode_graph._graphs[8][0].replays == 5 and r.decode_graph._graphs[2][0].replays == 0
    assert r.kv_pool.kv_data.isfinite().all()
