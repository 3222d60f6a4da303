"""The correctness half of bench/gpu_check.py. Each check returns a dict with ``ok`` and its
evidence; the driver stops at the first that fails.

- :func:`run_pytest`: the GPU tests of the kernels, graphs and copier, compiled on the GPU;
- :func:`engine_vs_hf`: the engine's greedy tokens (bf16, graphs on) against transformers'
  ``generate`` on the same GPU, per prompt: equal, or the first divergence and whether it is a
  bf16 near-tie (the two tokens' logits, in transformers' forward, within two bf16 ulps);
- :func:`graphs_on_off`: graphs on vs ``disable_cuda_graph`` (tokens equal), and a captured
  graph's logits vs its eager stand-in at the same padded size (bitwise);
- :func:`retraction`: forced retraction with host backup/restore vs an uncontended run.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import torch

from tandem.core.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.core.types import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_TESTS = ["tests/engine/test_triton_attention.py", "tests/engine/test_gpu_path.py", "tests/engine/test_cuda_graph.py",
             "tests/engine/test_verify_graph.py",
             "tests/cache/test_copier.py", "tests/cache/test_host_tier.py", "tests/cache/test_host_components.py",
             "tests/cache/test_req_to_token.py"]


def captured(output: bytes | str | None) -> str:
    """A timed-out child's captured output as text: ``TimeoutExpired`` holds bytes even when the
    run asked for text (Python's documented quirk), and None when nothing was read."""
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def run_pytest(log_path: str, timeout_s: float) -> dict:
    """The GPU tests, compiled (TRITON_INTERPRET=0), in a child process; its log to ``log_path``."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow",
           "-o", "addopts=", *GPU_TESTS]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        out, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = f"{captured(e.stdout)}{captured(e.stderr)}\nTIMEOUT after {timeout_s:.0f} s", -1
    with open(log_path, "w") as f:
        f.write(out)
    tail = out.strip().splitlines()[-1] if out.strip() else ""
    return {"ok": rc == 0, "seconds": round(time.perf_counter() - t, 1), "summary": tail,
            "log": os.path.basename(log_path)}


def make_engine(pair, plan, *, graphs: bool, overlap: str = "auto", speculative: str = "ngram", **cache_kw):
    """An Engine over the pair's model. ``graphs``: captured on CUDA (decode, and verify where
    ``speculative`` is on); the eager stand-ins elsewhere (so the CPU smoke run takes the same
    path). ``overlap``: its overlap_schedule; ``speculative``: its speculative_algorithm."""
    from tandem.engine.cuda_graph import DecodeGraphRunner, capture_sizes
    from tandem.engine.engine import Engine
    from tandem.engine.verify_graph import VerifyGraphRunner, verify_sizes, verify_widths

    sched = cache_kw.pop("scheduler", SchedulerConfig())
    cache = dict(max_total_tokens=16384, max_running_requests=16, page_size=16)
    cache.update(cache_kw)
    cfg = EngineConfig(device=plan.device, disable_cuda_graph=not graphs, num_threads=plan.threads,
                       overlap_schedule=overlap, speculative_algorithm=speculative,
                       cache=CacheConfig(**cache), scheduler=sched)
    eng = Engine(cfg, loaded=pair.loaded)
    r, spec = eng.runner, eng.scheduler.spec
    if graphs and r.decode_graph is None:
        r.decode_graph = DecodeGraphRunner(r, capture_sizes(cache["max_running_requests"]), mode="standin")
    if graphs and r.verify_graph is None and spec is not None:
        r.verify_graph = VerifyGraphRunner(r, verify_sizes(cache["max_running_requests"]),
                                           verify_widths(spec.max_draft), mode="standin")
    return eng


def _generate(eng, prompts, params) -> list[list[int]]:
    reqs = [eng.make_request(p, params, rid=f"p{i}") for i, p in enumerate(prompts)]
    outs = eng.generate_many(reqs, timeout=600)
    bad = [c for c in outs if c.error]
    if bad:
        raise RuntimeError(f"engine request {bad[0].rid} failed: {bad[0].error}")
    return [c.token_ids for c in outs]


def bf16_tie(a: float, b: float) -> bool:
    """Two logits within two bf16 ulps of the larger (a tie bf16 rounding can flip)."""
    m = max(abs(a), abs(b), 1e-3)
    return abs(a - b) <= max(2 * 2.0 ** (math.floor(math.log2(m)) - 7), 0.02)


@torch.no_grad()
def _hf_last_logits(hf, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids], device=hf.device)
    return hf(x).logits[0, -1].float()


def compare_tokens(hf, prompt: list[int], want: list[int], got: list[int]) -> dict:
    """``want`` vs ``got`` after ``prompt``: equal, or where they part and whether the two
    tokens tie in transformers' logits there."""
    k = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    if k is None and len(want) == len(got):
        return {"equal": True, "tokens": len(want)}
    if k is None:                      # one stopped (EOS) where the other went on
        k = min(len(want), len(got))
    logits = _hf_last_logits(hf, prompt + want[:k])
    a = want[k] if k < len(want) else int(logits.argmax())
    b = got[k] if k < len(got) else int(logits.argmax())
    la, lb = float(logits[a]), float(logits[b])
    return {"equal": False, "tokens": len(want), "diverge_at": k, "want": a, "got": b,
            "logit_want": round(la, 4), "logit_got": round(lb, 4), "tie": bf16_tie(la, lb)}


@torch.no_grad()
def engine_vs_hf(pair, plan) -> dict:
    eos = sorted(pair.loaded.tokenizer.eos_token_ids)
    eng = make_engine(pair, plan, graphs=True)
    try:
        ours = _generate(eng, pair.prompt_ids, SamplingParams(max_tokens=plan.new_tokens, temperature=0.0))
        graph_stats = dict(eng.runner.decode_graph.stats) if eng.runner.decode_graph else {}
    finally:
        eng.shutdown()
    rows = []
    for ids, got in zip(pair.prompt_ids, ours):
        x = torch.tensor([ids], device=pair.hf.device)
        ref = pair.hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=plan.new_tokens,
                               do_sample=False, eos_token_id=eos, pad_token_id=eos[0])[0, len(ids):].tolist()
        rows.append(compare_tokens(pair.hf, ids, ref, got))
    ok = all(r["equal"] or r["tie"] for r in rows)
    return {"ok": ok, "prompts": rows, "exact": sum(r["equal"] for r in rows), "graph": graph_stats}


def _eight(pair) -> list[list[int]]:
    """Eight prompts: the five, then three of them with a suffix (8 is a captured size)."""
    p = pair.prompt_ids
    return p + [ids + p[(i + 1) % len(p)][:4] for i, ids in enumerate(p[:3])]


def graphs_on_off(pair, plan) -> dict:
    """Tokens with graphs vs without, 8 requests decoding together (no padding, EOS ignored);
    and a runner's captured graph vs its stand-in over the same padded decode (bitwise)."""
    params = SamplingParams(max_tokens=plan.new_tokens, temperature=0.0, ignore_eos=True)
    toks = {}
    for graphs in (True, False):
        eng = make_engine(pair, plan, graphs=graphs)
        try:
            toks[graphs] = _generate(eng, _eight(pair), params)
        finally:
            eng.shutdown()
    same = [a == b for a, b in zip(toks[True], toks[False])]
    res = {"tokens_equal": all(same), "requests_equal": f"{sum(same)}/{len(same)}"}
    res.update(_replay_vs_standin(pair, plan))
    res["ok"] = res["tokens_equal"] and res["bitwise"] is not False
    return res


def overlap_on_off(pair, plan) -> dict:
    """Greedy tokens with overlap scheduling on vs off (graphs on), 8 requests of different
    lengths, so requests leave the batch while others decode on (engine/overlap.py)."""
    toks = {}
    for mode in ("on", "off"):
        eng = make_engine(pair, plan, graphs=True, overlap=mode)
        try:
            reqs = [eng.make_request(p, SamplingParams(max_tokens=plan.new_tokens // 2 + 3 * i,
                                                       temperature=0.0, ignore_eos=True), rid=f"o{i}")
                    for i, p in enumerate(_eight(pair))]
            toks[mode] = [c.token_ids for c in eng.generate_many(reqs, timeout=600)]
        finally:
            eng.shutdown()
    same = [a == b for a, b in zip(toks["on"], toks["off"])]
    return {"ok": all(same), "requests_equal": f"{sum(same)}/{len(same)}"}


@torch.no_grad()
def _replay_vs_standin(pair, plan, steps: int = 8) -> dict:
    """Five prompts decoded as one batch (padded to 8) through a captured graph and through the
    stand-in: every step's logits."""
    if plan.graph_mode != "cuda":
        return {"bitwise": None, "note": "no CUDA: the stand-in is the only graph path"}
    from tandem.engine.attention.triton_backend import TritonAttentionBackend
    from tandem.engine.cuda_graph import DecodeGraphRunner
    from tandem.engine.model_runner import ModelRunner

    out = {}
    for mode in ("standin", "cuda"):
        r = ModelRunner.create(pair.loaded, max_total_tokens=4096, page_size=16, max_reqs=8,
                               max_context=1024, backend=TritonAttentionBackend())
        r.decode_graph = DecodeGraphRunner(r, [8], mode=mode)
        seqs = [r.new_seq() for _ in pair.prompt_ids]
        logits = [r.extend(seqs, pair.prompt_ids)]
        for _ in range(steps):
            logits.append(r.decode(seqs, logits[-1].argmax(-1).tolist()).clone())
        out[mode] = torch.stack(logits)
    diff = float((out["cuda"] - out["standin"]).abs().max())
    return {"bitwise": diff == 0.0, "replay_vs_standin_max_diff": diff}


def retraction(pair, plan) -> dict:
    """Retract every few decode steps (host backup, then restore) vs the same requests alone."""
    params = SamplingParams(max_tokens=plan.new_tokens, temperature=0.0, ignore_eos=True)
    prompts = _eight(pair)
    eng = make_engine(pair, plan, graphs=True)
    try:
        alone = _generate(eng, prompts, params)
    finally:
        eng.shutdown()
    eng = make_engine(pair, plan, graphs=True, host_pool_tokens=16384, debug_invariants=True,
                      scheduler=SchedulerConfig(debug_retract_every=3))
    try:
        got = _generate(eng, prompts, params)
        st = dict(eng.scheduler.stats)
        eng.check_invariants()
    finally:
        eng.shutdown()
    rows = [compare_tokens(pair.hf, p, a, g) for p, a, g in zip(prompts, alone, got)]
    keys = ("retractions", "retraction_restores", "retraction_recomputes", "backup_tokens", "restore_tokens")
    stats = {k: st.get(k, 0) for k in keys}
    ok = stats["retraction_restores"] > 0 and all(r["equal"] or r["tie"] for r in rows)
    return {"ok": ok, "exact": sum(r["equal"] for r in rows), "requests": len(rows),
            "stats": stats, "diverged": [r for r in rows if not r["equal"]]}
