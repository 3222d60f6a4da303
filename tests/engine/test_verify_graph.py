"""CUDA-graph verify steps (engine/verify_graph.py). On the CPU: the widths and sizes, the
graph-or-eager decision, the static buffers' exact contents after fill (each request padded to the
width after its real tokens, padding requests, stale columns), the stand-in runner (the same fill /
pad / slice path, eager) giving bitwise the logits of unpadded eager verify steps on the torch and
cpu_kernel backends (float32 and bf16) and, under TRITON_INTERPRET=1, on triton (also through the
capture path with a recorded graph), and the Engine's greedy tokens with speculation on and the
stand-in equal to speculation off. On a GPU (gpu-marked): real capture, replay bitwise equal to
the stand-in at the same padded shape, logits close to and tokens equal to eager."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tandem.cache.allocator import PagedAllocator
from tandem.cache.kv_pool import KVPool
from tandem.cache.req_to_token import ReqToTokenPool
from tandem.core.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.core.types import SamplingParams
from tandem.engine.batch_builder import PlanItem, build_forward_batch
from tandem.engine.model_runner import ModelRunner
from tandem.engine.models.hybrid import tiny_hybrid
from tandem.engine.verify_graph import (
    TOKEN_FIELDS, VerifyBuffers, VerifyGraphRunner, choose_verify, make_verify_graph, verify_sizes,
    verify_widths)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------- pure pieces

def test_widths_and_sizes():
    assert verify_widths(8) == [2, 3, 5, 9]
    assert verify_widths(1) == [2] and verify_widths(2) == [2, 3] and verify_widths(5) == [2, 3, 5, 6]
    assert verify_widths(32) == [2, 3, 5, 9, 17, 33]
    assert verify_sizes(4) == [1, 2, 4] and verify_sizes(256) == [1, 2, 4, 8, 16, 24, 32]
    with pytest.raises(ValueError, match="max_draft=0"):
        verify_widths(0)


def _pools(page_size=1):
    pool = KVPool(128, page_size, 1, 1, 4)
    r2t = ReqToTokenPool(8, 32)
    return pool, r2t, PagedAllocator(128 // page_size, page_size)


def _verify_batch(pool, r2t, alloc, lens, ext, rows_per_token=True):
    """A verify step of len(lens) requests: request i holds lens[i] tokens and adds ext[i] (its
    pending token and ext[i] - 1 drafts); ids 10 * i + j; every token a logit row."""
    items = []
    for i, (n, e) in enumerate(zip(lens, ext)):
        row = r2t.alloc()
        slots = alloc.alloc(n + e)
        if n:
            r2t.write(row, 0, slots[:n])
        items.append(PlanItem(row, n, [10 * i + j for j in range(e)], slots[n:]))
    fb = build_forward_batch(items, r2t, pool)
    fb.logit_rows = torch.arange(fb.num_tokens) if rows_per_token else torch.tensor([fb.num_tokens - 1])
    return fb


def test_choose_verify():
    pool, r2t, alloc = _pools()
    sizes, widths = [1, 2, 4], [2, 3, 5, 9]
    fb = _verify_batch(pool, r2t, alloc, [3, 5, 1], [3, 1, 4])
    c = choose_verify(fb, sizes, widths, 32)
    assert (c.size, c.width, c.reason) == (4, 5, "replay")
    assert choose_verify(fb, sizes, widths, 32, return_all_logits=True).reason == "all logits"
    assert choose_verify(fb, [1, 2], widths, 32).reason == "batch 3 > 2 captured"
    assert choose_verify(fb, sizes, [2, 3], 32).reason == "width 4 > 3 captured"
    assert choose_verify(fb, sizes, widths, 9).reason == "context end"      # 5 + 5 > 9
    assert choose_verify(fb, sizes, widths, 10).reason == "replay"
    chunk = _verify_batch(pool, r2t, alloc, [2], [4], rows_per_token=False)
    assert choose_verify(chunk, sizes, widths, 32).reason == "prefill chunk"
    fb.state_indices = torch.tensor([1, 2, 3])
    assert choose_verify(fb, sizes, widths, 32).reason == "recurrent state"
    fb.logit_rows = None
    assert choose_verify(fb, sizes, widths, 32).reason == "not a verify step"


def test_buffers_fill_pads_each_request_after_its_tokens():
    pool, r2t, alloc = _pools()
    bufs = VerifyBuffers(4, [2, 3, 5], "cpu")
    fb = _verify_batch(pool, r2t, alloc, [3, 5], [3, 1])
    fb.logit_rows = torch.tensor([3, 0, 2])                  # any rows, in any order
    bufs.fill(fb, 4, 3)
    tok = {f: bufs.tok[i, :12].tolist() for i, f in enumerate(TOKEN_FIELDS)}
    assert tok["input_ids"] == [0, 1, 2, 10, 0, 0] + [0] * 6
    assert tok["positions"] == [3, 4, 5, 5, 0, 0] + [0] * 6
    loc = fb.out_cache_loc.tolist()
    assert tok["out_cache_loc"] == loc[:3] + [loc[3], 0, 0] + [0] * 6        # padding -> PAD_SLOT 0
    assert bufs.req[:, :4].tolist() == [fb.req_pool_indices.tolist() + [0, 0], [6, 8, 3, 3], [3, 5, 0, 0]]
    assert bufs.rows[:12].tolist() == [3, 0, 2] + [0] * 9
    static = bufs.batch(4, 3, r2t.req_to_token, pool, [3, 5, 0, 0])
    assert static.extend_lens.tolist() == [3] * 4 and static.extend_starts.tolist() == [0, 3, 6, 9]
    assert static.input_ids.data_ptr() == bufs.tok.data_ptr()                # the same storage
    assert static.seq_lens_cpu == [6, 8, 3, 3] and static.extend_lens_cpu == [3] * 4
    assert static.logit_rows.shape == (12,) and not static.is_decode
    one = _verify_batch(pool, r2t, alloc, [2], [2])
    bufs.fill(one, 1, 2)                                     # stale columns of the first fill go
    assert bufs.tok[:, :2].tolist() == [[0, 1], [2, 3], one.out_cache_loc.tolist()]
    assert bufs.rows[:2].tolist() == [0, 1] and bufs.req[:, 0].tolist() == [one.req_pool_indices.item(), 4, 2]
    with pytest.raises(ValueError, match="does not fit captured shape 1 x 2"):
        bufs.fill(fb, 1, 2)
    with pytest.raises(ValueError, match="widths up to 3 does not fit captured shape 4 x 2"):
        bufs.fill(fb, 4, 2)


def test_make_verify_graph_follows_the_decode_graph():
    spec = SimpleNamespace(max_draft=8)
    assert make_verify_graph(object(), None, spec) == (None, None)             # no decode graph: its reason
    standin = SimpleNamespace(mode="standin", sizes=[1, 2], pool=None)
    assert make_verify_graph(object(), standin, spec) == (None, None)
    assert make_verify_graph(object(), SimpleNamespace(mode="cuda", sizes=[1], pool=None), None) == (None, None)


# ----------------------------------------------------------------------------- the stand-in

@pytest.fixture(scope="module")
def tiny():
    return tiny_hybrid(["full", "full"], seed=3)


def _runner(tiny, backend=None, page_size=1):
    from tandem.engine.attention.torch_backend import TorchAttentionBackend

    return ModelRunner.create(tiny, max_total_tokens=512, page_size=page_size, max_reqs=8,
                              max_context=96, backend=backend or TorchAttentionBackend())


PROMPTS = [[5, 9, 200, 17], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40] * 3, [88, 3], [250, 251, 7, 7, 7]]
# per step, each request's tokens (1: a decode without a draft; 1 + k: a pending token and k drafts)
STEPS = [[3, 1, 5, 2, 1], [9, 1, 1, 4, 2], [2, 2, 2, 2, 2], [1, 6, 1, 1, 1]]


def _verify_logits(runner, prompts, steps):
    """Prefill ``prompts``, then one verify step per ``steps`` row (every token a logit row, as
    ``logit_layout`` lays a verify step out; all of it kept); each step's logits [T, V], cloned."""
    seqs = [runner.new_seq() for _ in prompts]
    runner.extend(seqs, prompts)
    out = []
    for k, widths in enumerate(steps):
        plans = []
        for i, (s, n) in enumerate(zip(seqs, widths)):
            slots = runner.allocator.alloc_extend(s.last_slot, s.length, n)
            plans.append((s.row, s.length, [(31 * i + 7 * k + j) % 250 for j in range(n)], slots))
            s.length, s.last_slot = s.length + n, int(slots[-1])
        fb = runner.build_forward_batch(plans)
        fb.logit_rows = torch.arange(fb.num_tokens, device=fb.input_ids.device)
        out.append(runner.forward(fb).clone())
    for s in seqs:
        runner.release(s)
    return out


def _assert_bitwise(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w), (g - w).abs().max()


@pytest.mark.parametrize("backend", ["torch", "cpu_kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_standin_equals_eager_cpu_backends(tiny, backend, dtype):
    from tandem.engine.attention import make_attention_backend
    from tandem.engine.attention.cpu_backend import cpu_kernel_unavailable

    if backend == "cpu_kernel" and (why := cpu_kernel_unavailable()) is not None:
        pytest.skip(why)
    model = tiny if dtype == torch.float32 else tiny_hybrid(["full", "full"], seed=3, dtype=dtype)
    eager = _verify_logits(_runner(model, make_attention_backend(backend, "cpu")), PROMPTS, STEPS)
    r = _runner(model, make_attention_backend(backend, "cpu"))
    r.verify_graph = VerifyGraphRunner(r, [1, 2, 4, 8], [2, 3, 5, 9], mode="standin")
    _assert_bitwise(_verify_logits(r, PROMPTS, STEPS), eager)
    assert r.verify_graph.stats == {"replay": 4}
    assert r.verify_graph.tokens == {"real": 12 + 17 + 10 + 10, "run": 8 * (5 + 9 + 2 + 9)}


def test_standin_keeps_the_pool_but_the_padding_slot(tiny):
    """Padding tokens write only slot 0 (the reserved page): every other slot holds what eager
    verify steps write."""
    a, b = _runner(tiny), _runner(tiny)
    b.verify_graph = VerifyGraphRunner(b, [8], [9], mode="standin")
    _verify_logits(a, PROMPTS[:3], STEPS)
    _verify_logits(b, PROMPTS[:3], STEPS)
    assert torch.equal(b.kv_pool.kv_data[:, :, 1:], a.kv_pool.kv_data[:, :, 1:])


def test_standin_equals_eager_triton_backend(tiny):
    """The triton extend kernel in the interpreter: padded rows (a different grid, more keys per
    block, padding queries) leave every real row bitwise the unpadded one."""
    pytest.importorskip("triton")
    from tandem.engine.attention.triton_backend import TritonAttentionBackend
    from tandem.engine.attention.triton_kernels import INTERPRETED

    if not INTERPRETED:
        pytest.skip("compiled triton kernels need CUDA tensors: the gpu tests below cover this")
    steps = STEPS[:2]
    eager = _verify_logits(_runner(tiny, TritonAttentionBackend(), page_size=4), PROMPTS[:3], [s[:3] for s in steps])
    r = _runner(tiny, TritonAttentionBackend(), page_size=4)
    r.verify_graph = VerifyGraphRunner(r, [4], [5, 9], mode="standin")
    got = _verify_logits(r, PROMPTS[:3], [s[:3] for s in steps])
    _assert_bitwise(got, eager)
    assert r.verify_graph.stats == {"replay": 2}


def _engine(loaded, spec: str, **kw):
    from tandem.engine.engine import Engine
    from tandem.engine.sched.spec.speculator import PRIOR_RATIO, StepCost

    cfg = EngineConfig(device="cpu", dtype="float32", num_threads=1, speculative_algorithm=spec,
                       scheduler=SchedulerConfig(chunked_prefill_size=16),
                       cache=CacheConfig(max_total_tokens=1024, max_running_requests=8, page_size=2,
                                         debug_invariants=True), **kw)
    eng = Engine(cfg, loaded=loaded)
    eng.shutdown()                                           # the test drives eng.step()
    if eng.scheduler.spec is not None:                       # drafting must not depend on timing
        eng.scheduler.spec.cost = StepCost(fixed=PRIOR_RATIO)
    return eng


@pytest.mark.parametrize("attention", ["torch", "auto"])
def test_engine_spec_with_standin_equals_spec_off(tiny, attention):
    """Greedy tokens with speculation and the verify stand-in equal speculation off, for batches
    whose requests draft different lengths (a prefill chunk in some steps: those stay eager); run
    twice, so the second run copies the first through the n-gram pool."""
    from tandem.core.messages import GenerateRequest
    from tandem.engine.cuda_graph import DecodeGraphRunner, capture_sizes

    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [list(range(40, 60)), [7, 8, 9] * 6, PROMPTS[1], PROMPTS[4] * 3]
    toks, stats, tokens, accepted = {}, {}, None, 0
    for spec in ("off", "ngram"):
        eng = _engine(tiny, spec, attention_backend=attention)
        assert eng.runner.verify_graph is None                       # CPU: no capture
        eng.runner.decode_graph = DecodeGraphRunner(eng.runner, capture_sizes(8), mode="standin")
        if spec == "ngram":
            eng.runner.verify_graph = VerifyGraphRunner(eng.runner, verify_sizes(8), verify_widths(8),
                                                        mode="standin")
        out: dict[str, list[int]] = {}
        for run in "ab":                  # the second run drafts from the pool the first one filled
            for i, p in enumerate(prompts):
                out[f"{run}{i}"] = []
                eng.submit(GenerateRequest(f"{run}{i}", tuple(p), params),
                           lambda c: out[c.rid].extend(c.token_ids))
            while eng.scheduler.has_work() or not eng._inbox.empty():
                eng.step()
                eng.check_invariants()
        toks[spec] = out
        if spec == "ngram":
            stats, tokens = dict(eng.runner.verify_graph.stats), eng.runner.verify_graph.tokens
            accepted = eng.scheduler.stats["spec_accepted_tokens"]
    assert toks["ngram"] == toks["off"] and all(len(t) == 40 for t in toks["off"].values())
    assert accepted >= 20 and stats["replay"] >= 5, (accepted, stats)
    assert tokens["run"] > tokens["real"] > 0                        # some requests were padded
    assert set(stats) <= {"replay", "eager: prefill chunk"}, stats


class _RecordedGraph:
    """What a CUDA graph does, without CUDA: replay re-runs the captured call, which reads the
    static buffers as they are at replay time (and the capture's backend metadata), into the
    output tensor the capture returned."""

    def __init__(self, forward, out):
        self.forward, self.out, self.replays = forward, out, 0

    def replay(self):
        self.out.copy_(self.forward())
        self.replays += 1

    def pool(self):
        return "pool"


def test_capture_path_with_a_recorded_graph(tiny, monkeypatch):
    """mode="cuda"'s control flow on the CPU, triton in the interpreter: every shape captured
    (widest and largest first, into the decode graph's pool), the capture-time metadata (prefix
    lengths 0) reused by replays over real prefixes, outputs sliced to the step's rows; bitwise the
    unpadded eager steps."""
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

    monkeypatch.setattr(VerifyGraphRunner, "_sync", lambda self: None)
    monkeypatch.setattr(VerifyGraphRunner, "_capture_one", capture_one)
    steps = [s[:3] for s in STEPS[:2]]                         # widths 5 and 9 over 3 requests
    eager = _verify_logits(_runner(tiny, TritonAttentionBackend(), page_size=4), PROMPTS[:3], steps)
    r = _runner(tiny, TritonAttentionBackend(), page_size=4)
    decode = SimpleNamespace(mode="cuda", sizes=[1, 2, 4], pool="decode pool")
    r.verify_graph, line = make_verify_graph(r, decode, SimpleNamespace(max_draft=8))
    g = r.verify_graph
    assert list(g._graphs) == [(s, w) for w in (9, 5, 3, 2) for s in (4, 2, 1)]
    assert pools == ["decode pool"] + ["pool"] * 11 and g.pool == "pool"
    assert line.startswith("cuda graph: captured verify widths 2,3,5,9 x batch sizes 1,2,4 in ")
    got = _verify_logits(r, PROMPTS[:3], steps)
    _assert_bitwise(got, eager)
    assert g._graphs[(4, 5)][0].replays == 1 and g._graphs[(4, 9)][0].replays == 1
    assert g.stats == {"replay": 2} and r.kv_pool.kv_data.isfinite().all()


# ----------------------------------------------------------------------------- on a GPU

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_verify_replay_bitwise_equals_standin(dtype):
    from tandem.engine.attention.triton_backend import TritonAttentionBackend

    loaded = tiny_hybrid(["full", "full"], seed=3, device="cuda", dtype=dtype)
    out = {}
    for mode in ("standin", "cuda"):
        r = _runner(loaded, TritonAttentionBackend(), page_size=4)
        r.verify_graph = VerifyGraphRunner(r, [1, 2, 4, 8], [2, 3, 5, 9], mode=mode)
        out[mode] = _verify_logits(r, PROMPTS, STEPS)
        assert r.verify_graph.stats == {"replay": len(STEPS)}
        if mode == "cuda":
            assert r.verify_graph.capture_seconds > 0 and "captured verify widths 2,3,5,9 x batch sizes " \
                "1,2,4,8 in " in r.verify_graph.summary()
    _assert_bitwise(out["cuda"], out["standin"])
    plain = _verify_logits(_runner(loaded, TritonAttentionBackend(), page_size=4), PROMPTS, STEPS)
    for p, c in zip(plain, out["cuda"]):
        torch.testing.assert_close(c, p, atol=1e-4 if dtype == torch.float32 else 0.1, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_engine_spec_with_verify_graphs_same_tokens_as_spec_off():
    from tandem.engine.engine import Engine
    from tandem.engine.sched.spec.speculator import PRIOR_RATIO, StepCost

    loaded = tiny_hybrid(["full", "full"], seed=3, device="cuda", dtype=torch.float32)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [list(range(40, 60)), [7, 8, 9] * 6, PROMPTS[1], PROMPTS[4] * 3]
    toks = {}
    for spec in ("off", "ngram"):
        cfg = EngineConfig(device="cuda", dtype="float32", speculative_algorithm=spec,
                           cache=CacheConfig(max_total_tokens=2048, max_running_requests=8, page_size=16))
        eng = Engine(cfg, loaded=loaded)
        try:
            if eng.scheduler.spec is not None:       # idle engine: drafting must not depend on timing
                eng.scheduler.spec.cost = StepCost(fixed=PRIOR_RATIO)
            assert (eng.runner.verify_graph is None) == (spec == "off")
            if spec == "ngram":
                assert "cuda graph: captured verify widths 2,3,5,9 x batch sizes 1,2,4,8 in " in eng.startup_line
            toks[spec] = []
            for run in "ab":              # the second run drafts from the pool the first one filled
                reqs = [eng.make_request(p, params, rid=f"{run}{i}") for i, p in enumerate(prompts)]
                toks[spec] += [c.token_ids for c in eng.generate_many(reqs, timeout=120)]
            if spec == "ngram":
                assert eng.stats()["spec_accepted_tokens"] >= 20
                assert eng.runner.verify_graph.stats["replay"] >= 1, eng.runner.verify_graph.stats
        finally:
            eng.shutdown()
    assert toks["ngram"] == toks["off"]
