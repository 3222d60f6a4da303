"""Overlap scheduling (engine/overlap.py): the same tokens as the plain loop, at most one extra
forward past a stop (never streamed), and the host's work hidden behind the device's.

Oracles: the plain loop's own output (real SmolLM2, float32: greedy tokens, texts and finish
reasons across batch joins and finishes, stops, sampled / logprob rows that fall back to the
plain path, aborts and retraction), the KV-echo model's pure-Python oracle, and a stand-in model
whose forward watches the host apply steps while it runs (the speed: bench/overlap.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tandem.core.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.core.messages import GenerateRequest
from tandem.core.types import SamplingParams
from tandem.engine.engine import Engine
from tandem.engine.loader import LoadedModel
from tandem.engine.model_config import ModelArchConfig
from tandem.engine.models.hybrid import byte_tokenizer
from tandem.engine.overlap import resolve_overlap

from fake_model import fake_loaded, oracle

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at", "List three fruits:"]


def _engine(loaded, overlap: str, spec: str = "ngram", **cache) -> Engine:
    sched = cache.pop("scheduler", SchedulerConfig())
    cfg = EngineConfig(device="cpu", dtype="float32", overlap_schedule=overlap, scheduler=sched,
                       speculative_algorithm=spec,
                       cache=CacheConfig(**{"max_total_tokens": 4096, "debug_invariants": True, **cache}))
    return Engine(cfg, loaded=loaded)


def _mixed(e: Engine) -> dict[str, tuple]:
    """A workload whose requests join and leave a running batch: staggered arrivals, different
    lengths, EOS / stop-string / stop-token finishes, and rows that take the plain path (seeded
    sampling, logprobs). Returns rid -> (token ids, text, finish reason)."""
    out: dict[str, list] = {}
    done = threading.Event()
    params = [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    params[1] = SamplingParams(max_tokens=24, stop=("return",))
    params[2] = SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(3906,))
    params[3] = SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True)
    params[4] = SamplingParams(max_tokens=8, logprobs=True, top_logprobs=2, ignore_eos=True)
    reqs = [e.make_request(p, sp, rid=f"m{i}") for i, (p, sp) in enumerate(zip(PROMPTS, params))]
    reqs.append(e.make_request("What is 2+2?", SamplingParams(max_tokens=40), chat=True, rid="eos"))

    def cb(c):
        got = out.setdefault(c.rid, [[], "", None])
        got[0].extend(c.token_ids)
        got[1] += c.text
        if c.finish_reason is not None:
            got[2] = c.finish_reason
            if sum(v[2] is not None for v in out.values()) == len(reqs):
                done.set()

    for i, r in enumerate(reqs):
        e.submit(r, cb)
        time.sleep(0.03 * (i % 3))
    assert done.wait(300)
    return {k: tuple(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def plain(smollm2):
    e = _engine(smollm2, "off")
    yield _mixed(e)
    e.shutdown()


def test_overlap_defaults_to_cuda_only_and_the_flag_turns_it_off():
    cpu, cuda = __import__("torch").device("cpu"), __import__("torch").device("cuda")
    assert not resolve_overlap("auto", False, cpu, False) and resolve_overlap("auto", False, cuda, False)
    assert resolve_overlap("on", False, cpu, False)
    assert not resolve_overlap("on", True, cuda, False) and not resolve_overlap("on", False, cuda, True)


def test_greedy_tokens_equal_the_plain_loop_across_joins_stops_and_fallbacks(smollm2, plain):
    e = _engine(smollm2, "on")
    try:
        assert e.overlap and "overlap schedule on" in e.startup_line
        got = _mixed(e)
        e.check_invariants()
    finally:
        e.shutdown()
    assert got == plain
    assert {k: v[2] for k, v in plain.items()} == {"m0": "length", "m1": "stop", "m2": "stop", "m3": "length",
                                                  "m4": "length", "m5": "length", "eos": "stop"}


def test_retraction_and_abort_keep_outputs_exact_with_overlap(smollm2, plain):
    """A small pool with the retraction lever every 3 decode steps and a host tier: the
    greedy rows equal the plain loop's; an abort mid-stream gives back every slot."""
    e = _engine(smollm2, "on", max_total_tokens=512, page_size=4, host_pool_tokens=1024,
                scheduler=SchedulerConfig(debug_retract_every=3))
    try:
        greedy = {k: v for k, v in plain.items() if k in ("m0", "m1", "m2", "m5", "eos")}
        reqs = [e.make_request(PROMPTS[int(k[1])], p, rid=k) if k != "eos" else
                e.make_request("What is 2+2?", SamplingParams(max_tokens=40), chat=True, rid=k)
                for k, p in [("m0", SamplingParams(max_tokens=6, ignore_eos=True)),
                             ("m1", SamplingParams(max_tokens=24, stop=("return",))),
                             ("m2", SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(3906,))),
                             ("m5", SamplingParams(max_tokens=21, ignore_eos=True)), ("eos", None)]]
        done = e.generate_many(reqs, timeout=300)
        assert {c.rid: (tuple(c.token_ids), c.text, c.finish_reason) for c in done} == \
            {k: (tuple(v[0]), v[1], v[2]) for k, v in greedy.items()}
        assert e.stats()["retractions"] > 0
        free = e.snapshot().available_tokens + e.snapshot().evictable_tokens
        seen, final = threading.Event(), []
        req = e.make_request("Count from one to one hundred:", SamplingParams(max_tokens=300, ignore_eos=True))
        e.submit(req, lambda c: (seen.set() if c.token_ids else None,
                                 final.append(c) if c.finish_reason else None))
        assert seen.wait(60)
        e.abort(req.rid)
        deadline = time.time() + 30
        while not final and time.time() < deadline:
            time.sleep(0.02)
        assert final and final[0].finish_reason == "abort"
        snap = e.snapshot()
        assert snap.available_tokens + snap.evictable_tokens == free and snap.running == 0
        e.check_invariants()
    finally:
        e.shutdown()


def _stepped(overlap: str) -> Engine:
    cfg = EngineConfig(device="cpu", dtype="float32", num_threads=1, overlap_schedule=overlap,
                       cache=CacheConfig(page_size=4, max_total_tokens=256, debug_invariants=True))
    e = Engine(cfg, loaded=fake_loaded())
    e.shutdown()          # the test drives e.step()
    return e


def _run(e: Engine, params: SamplingParams, prompt: list[int]) -> list:
    chunks: list = []
    e.submit(GenerateRequest("r", tuple(prompt), params), chunks.append)
    while e.scheduler.has_work() or not e._inbox.empty():
        e.step()
    return chunks


@pytest.mark.parametrize("stop", ["token", "length"])
def test_a_stop_costs_at_most_one_extra_forward_and_is_never_streamed(stop):
    prompt = [(5 + 11 * i) % 94 for i in range(9)]
    want = oracle(prompt, 12)
    params = (SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(want[6],))
              if stop == "token" else SamplingParams(max_tokens=7, ignore_eos=True))
    runs = {}
    for mode in ("off", "on"):
        e = _stepped(mode)
        chunks = _run(e, params, prompt)
        runs[mode] = ([t for c in chunks for t in c.token_ids], chunks[-1].finish_reason,
                      e.loaded.model.forwards)
        snap = e.snapshot()
        assert snap.running == 0 and snap.request_tokens == 0 and snap.leaked_tokens == 0
    toks, reason, fwd = runs["on"]
    n = want.index(want[6]) + 1 if stop == "token" else 7
    assert (toks, reason) == (want[:n], "stop" if stop == "token" else "length") == runs["off"][:2]
    # a stop token is only known once read back: one step past it; a length stop is known ahead
    assert fwd == runs["off"][2] + (1 if stop == "token" else 0)


_VOCAB = 258     # the byte tokenizer's


class _WatchingModel:
    """The stand-in that watches the host while it computes: forward ``k`` waits (up to
    ``wait_s``) for the host to launch step ``k + 1`` (``launched`` reaches ``k + 1``; the engine
    counts its ``Scheduler.advance`` calls there) and counts the forwards that saw it; ``lane``
    counts the forwards run off the engine's thread. Only a host that plans while the device runs
    can launch a step during a forward, and with overlap it always does (planning step ``k + 1``
    waits for nothing forward ``k`` computes) except past the last step; the plain loop never can."""

    device, dtype = torch.device("cpu"), torch.float32

    def __init__(self, wait_s: float):
        self.wait_s, self.calls, self.lane, self.saw_host, self.launched = wait_s, 0, 0, 0, 0
        self.engine: Engine | None = None

    def forward(self, fb, backend, return_all_logits: bool = False):
        self.calls += 1
        self.lane += threading.current_thread() is not self.engine._thread
        end = time.monotonic() + self.wait_s
        while self.launched <= self.calls and time.monotonic() < end:
            time.sleep(0.001)
        self.saw_host += self.launched > self.calls
        last = fb.logit_indices           # all mass on a printable byte (never EOS) of the input
        logits = torch.zeros(len(last), _VOCAB)
        logits[torch.arange(len(last)), (fb.input_ids[last] * 31 + fb.positions[last] * 7 + 1) % 94] = 1.0
        return logits


def _watching(wait_s: float) -> LoadedModel:
    """A LoadedModel of :class:`_WatchingModel` over the byte tokenizer."""
    arch = ModelArchConfig(arch="llama", vocab_size=_VOCAB, hidden_size=2, num_layers=1, num_q_heads=1,
                           num_kv_heads=1, head_dim=2, intermediate_size=2, max_position=4096,
                           layer_types=["full"], bos_token_id=256, eos_token_ids=(257,))
    return LoadedModel(_WatchingModel(wait_s), arch, byte_tokenizer(), "watching-stand-in")


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_the_host_launches_step_n_plus_1_while_the_device_runs_step_n(overlap):
    """The overlap itself, structurally (the speed it buys is bench/overlap.py's): with overlap on
    every step runs off the engine's thread and the host launches the next one while it runs (all
    but the last); with it off every forward runs on the engine's thread and none sees a launch.
    Tokens equal either way."""
    loaded = _watching(wait_s=2.0 if overlap == "on" else 0.02)
    model = loaded.model
    e = model.engine = _engine(loaded, overlap, spec="off")   # a step with drafts runs plainly
    advance = e.scheduler.advance

    def counted(plan):
        advance(plan)
        model.launched += 1

    e.scheduler.advance = counted
    try:
        reqs = [e.make_request(p, SamplingParams(max_tokens=8, ignore_eos=True), rid=f"w{i}")
                for i, p in enumerate(["abc", "hello", "xyz"])]
        outs = e.generate_many(reqs, timeout=120)
    finally:
        e.shutdown()
    assert all(len(o.token_ids) == 8 for o in outs)
    if overlap == "on":
        assert model.lane == model.calls >= 8 and model.saw_host == model.calls - 1, \
            (model.saw_host, model.lane, model.calls)
    else:
        assert model.lane == 0 and model.calls >= 8 and model.saw_host == 0, (model.saw_host, model.calls)


def test_which_rows_the_device_samples_alone():
    """Greedy rows anywhere; unseeded temperature / top-p rows on CUDA only (the one-launch
    sample kernel); seeded, logprob, constrained and min_tokens-banned rows never."""
    import torch

    from tandem.engine.overlap import device_sampleable
    from tandem.engine.sched.sched_types import SchedReq, StepPlan
    from tandem.core.types import Req

    def plan(**params):
        sr = SchedReq(Req([1, 2, 3], SamplingParams(**params)), tracker=None)
        p = StepPlan()
        p.add(sr, 3, torch.arange(3))
        sr.ahead = 1
        return p

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert device_sampleable(plan(), cpu) and device_sampleable(plan(), cuda)
    assert not device_sampleable(plan(temperature=0.8, top_p=0.9), cpu)
    assert device_sampleable(plan(temperature=0.8, top_p=0.9), cuda)
    for bad in (dict(temperature=0.8, seed=3), dict(logprobs=True), dict(min_tokens=4)):
        assert not device_sampleable(plan(**bad), cuda), bad
