"""The phases of bench/gpu_cluster_check.py: the disaggregated cluster as Ray actors sharing one
GPU (or, ``--cpu-smoke``, the CPU with Ray's logical GPUs). Each phase returns a dict with ``ok``
(or figures) and its evidence; the driver records them.

- :func:`pd_vs_colocated`: 1P+1D greedy tokens against one colocated engine, prompt by prompt
  (equal in float32; in bf16 equal or parting at a near-tie, judged by
  bench/gpu/correctness.py ``compare_tokens``), and each worker's device and the NIXL memory
  type of its registered KV regions (from its handshake);
- :func:`handoff`: one fresh prompt per size through the cluster, the decode worker's timings:
  KV bytes moved, the NIXL write's seconds (GB/s) and its share of the TTFT; a device-to-device
  copy of the same bytes beside it;
- :func:`retraction_and_migration`: 1P+2D with the decode workers retracting every few steps to
  their (pinned, on a GPU) host pool and restoring, then a live migration of each request to the
  other decode worker: tokens against the colocated ones, each migration's downtime;
- :func:`serve_bench`: the ``tandem bench`` agent workload against ``tandem serve`` 1P+1D (joined
  to this Ray, the same GPU shares) and ``tandem serve --mode colocated``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import statistics
import time
import types
import uuid

import torch

from tandem.bench.gpu.correctness import compare_tokens


def engine_config(plan, path: str, dtype: str, **cache):
    """Every engine of the run: the plan's device, pool and context; no host pool unless asked
    (pinning decode's default, 4x the device pool, would cost seconds per launch)."""
    from tandem.core.config import CacheConfig, EngineConfig, SchedulerConfig

    retract = cache.pop("retract_every", 0)
    c = dict(page_size=16, max_total_tokens=plan.max_total_tokens, max_running_requests=16, host_pool_tokens=0)
    c.update(cache)
    return EngineConfig(model=path, device=plan.device, dtype=dtype, num_threads=plan.threads,
                        context_length=plan.context_length, cache=CacheConfig(**c),
                        scheduler=SchedulerConfig(debug_retract_every=retract))


def serve_config(plan, ec, *, decode: int, share: float, **kw):
    from tandem.core.config import MigrationConfig, ServeConfig

    return ServeConfig(prefill=1, decode=decode, prefill_num_gpus=share, decode_num_gpus=share,
                       transfer_timeout_s=120.0, engine_config=ec, migration=MigrationConfig(policy="off"), **kw)


def launch(cfg):
    """The cluster of ``cfg`` on the running Ray (each worker loads the model on its own device)."""
    from tandem.cluster.launch import launch_disaggregated

    return launch_disaggregated(cfg, restart=False, share_weights=False)


def _gpu_share(actor) -> float:
    import ray

    return ray.get_runtime_context().get_assigned_resources().get("GPU", 0.0)


def workers_seen(backend) -> dict:
    """Per worker: the GPU share Ray gave its actor, its engine's device and the NIXL memory type
    of each registered region."""
    import ray

    from tandem.core.kv_messages import Handshake

    out = {}
    for w in backend.pool.everyone():
        info, hs, gpu = ray.get([w.api.info(), w.api.handshake(),
                                 w.handle.__ray_call__.remote(_gpu_share)], timeout=60)
        out[w.name] = {"gpu": gpu, "device": info["device"],
                       "regions": {r.name: r.mem_type for r in Handshake.decode(hs).regions}}
    return out


async def _stream(backend, greq, move_after: int | None = None) -> dict:
    """Tokens, TTFT and (with ``move_after``) a live migration once that many tokens streamed. A
    move refused because the request is not decoding at that moment (the retraction lever had just
    retracted it) is asked again at a later token, up to 5 times."""
    t0, ids, first, task, tries = time.perf_counter(), [], None, None, 0
    async for c in backend.generate(greq):
        if c.error:
            raise RuntimeError(f"{greq.rid} failed: {c.error}")
        if c.token_ids and first is None:
            first = time.perf_counter() - t0
        ids += c.token_ids
        if task is not None and task.done() and tries < 5 and _not_decoding(task):
            task = None
        if move_after is not None and task is None and len(ids) >= move_after:
            task, tries = asyncio.ensure_future(backend.migrate(greq.rid)), tries + 1
    if task is not None:
        await task
    return {"ids": ids, "ttft_s": first}


def _not_decoding(task: asyncio.Future) -> bool:
    """Whether the finished move ``task`` was refused because its request was not decoding."""
    e = task.exception()
    return e is not None and "not decoding" in str(e)


def generate(backend, prompts, params, move_after: int | None = None) -> list[dict]:
    """Each prompt alone, in turn (the colocated reference runs them alone too)."""
    from tandem.core.messages import GenerateRequest

    return [asyncio.run(_stream(backend, GenerateRequest(f"g-{uuid.uuid4().hex[:10]}", tuple(p), params), move_after))
            for p in prompts]


def colocated_tokens(plan, path: str, dtype: str, prompts, params) -> list[list[int]]:
    from tandem.engine.engine import Engine

    eng = Engine(engine_config(plan, path, dtype))
    try:
        out = []
        for i, p in enumerate(prompts):
            c = eng.generate_many([eng.make_request(p, params, rid=f"c{i}")], timeout=600)[0]
            if c.error:
                raise RuntimeError(f"colocated request {i} failed: {c.error}")
            out.append(c.token_ids)
        return out
    finally:
        eng.shutdown()


def judge(dtype: str, hf, prompts, want, got) -> dict:
    """float32: every request equal; bf16: equal or parting at a bf16 near-tie (``compare_tokens``)."""
    if dtype == "float32" or hf is None:
        rows = [{"equal": a == b, "tie": False, "tokens": len(a)} for a, b in zip(want, got)]
    else:
        rows = [compare_tokens(hf, p, a, b) for p, a, b in zip(prompts, want, got)]
    ok = all(r["equal"] or r["tie"] for r in rows)
    return {"ok": ok, "exact": sum(r["equal"] for r in rows), "requests": len(rows),
            "diverged": [r for r in rows if not r["equal"]]}


def pd_vs_colocated(backend, dtype: str, hf, prompts, params, reference) -> dict:
    got = [r["ids"] for r in generate(backend, prompts, params)]
    res = judge(dtype, hf, prompts, reference, got)
    res["workers"] = workers_seen(backend)
    return res


def device_copy_GBps(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Best of ``repeats`` copies of ``nbytes`` between two buffers on ``device``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(7)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def handoff(backend, plan, vocab: int, seed: int = 0) -> dict:
    """Per prompt size, medians over ``plan.handoff_repeats`` fresh prompts (one warm-up dropped)."""
    from tandem.core.messages import GenerateRequest
    from tandem.core.types import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    rows = []
    for n in plan.handoff_tokens:
        runs = []
        for i in range(plan.handoff_repeats + 1):
            ids = tuple(rng.randrange(3, vocab - 3) for _ in range(n))
            r = asyncio.run(_stream(backend, GenerateRequest(f"h-{n}-{i}-{uuid.uuid4().hex[:6]}", ids, params)))
            stats = asyncio.run(backend.stats())
            t = next(s["last_timings"] for s in stats.values() if s["role"] == "decode" and s["last_timings"])
            if i:
                runs.append({"ttft_s": r["ttft_s"], "transfer_s": t["transfer_s"], "bytes": t["bytes"]})
        med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        dev = torch.device(plan.device if plan.device != "cuda" else "cuda:0")
        rows.append({"prompt_tokens": n, **med, "nixl_GBps": med["bytes"] / max(med["transfer_s"], 1e-9) / 1e9,
                     "device_copy_GBps": device_copy_GBps(dev, int(med["bytes"])),
                     "share_of_ttft": med["transfer_s"] / med["ttft_s"], "runs": runs})
    return {"ok": all(r["bytes"] > 0 for r in rows), "sizes": rows}


def metric_sum(backend, names: tuple[str, ...]) -> dict[str, float]:
    """The workers' counters named ``names``, summed over workers (their /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(names, 0.0)
    for f in text_string_to_metric_families(backend.metrics_text().decode()):
        for s in f.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


def router_downtime() -> tuple[float, float]:
    """The router's ``tandem_decode_migration_downtime_seconds`` (sum, count) in this process."""
    from prometheus_client import REGISTRY

    return (REGISTRY.get_sample_value("tandem_decode_migration_downtime_seconds_sum") or 0.0,
            REGISTRY.get_sample_value("tandem_decode_migration_downtime_seconds_count") or 0.0)


RETRACT = ("tandem_retractions_total", "tandem_retraction_restores_total", "tandem_retraction_recomputes_total")


def retraction_and_migration(backend, plan, dtype: str, hf, prompts, params, reference) -> dict:
    """Retraction (the cluster's decode workers retract every ``plan.retract_every`` steps), then
    the same prompts each moved once to the other decode worker after ``plan.move_after`` tokens."""
    r0 = metric_sum(backend, RETRACT)
    got = [r["ids"] for r in generate(backend, prompts, params)]
    r1 = metric_sum(backend, RETRACT)
    counts = {k.removeprefix("tandem_").removesuffix("_total"): r1[k] - r0[k] for k in RETRACT}
    retr = judge(dtype, hf, prompts, reference, got)
    retr.update(counts, ok=retr["ok"] and counts["retraction_restores"] > 0)
    downtimes, moved = [], []
    # One token a step while moved: a verify step can accept the rest of a short reply at once (the
    # tiny model repeats itself), ending it before the move; speculation under migration is the
    # suite's (tests/cluster/test_migration_cluster.py, SmolLM2's text).
    one = dataclasses.replace(params, speculative=False)
    for p in prompts:
        s0, c0 = router_downtime()
        got = generate(backend, [p], one, move_after=plan.move_after)[0]["ids"]
        s1, c1 = router_downtime()
        moved.append(got)
        if c1 - c0 == 1:
            downtimes.append(round(1e3 * (s1 - s0), 2))
    mig = judge(dtype, hf, prompts, reference, moved)
    mig.update(ok=mig["ok"] and len(downtimes) == len(prompts), migrations=len(downtimes), downtime_ms=downtimes)
    return {"ok": retr["ok"] and mig["ok"], "retraction": retr, "migration": mig, "workers": workers_seen(backend)}


def serve_bench(plan, path: str, dtype: str, ray_address: str, logdir: str) -> dict:
    """The agent workload against ``tandem serve`` 1P+1D (joined to ``ray_address``) and colocated."""
    import yaml

    from tandem.bench.agent_cache import Server, _run_workload
    from tandem.loadtest.loadgen.report import summarize
    from tandem.loadtest.loadgen.workloads import AgentConfig, Dist, agent_workload

    ec = engine_config(plan, path, dtype)
    base = serve_config(plan, ec, decode=1, share=plan.gpu_share)
    configs = {"pd": base.model_copy(update={"ray_address": ray_address, "worker_lifetime": "router"}),
               "colocated": base.model_copy(update={"mode": "colocated"})}
    workload = agent_workload(AgentConfig(num_sessions=plan.bench_sessions, turns=plan.bench_turns,
                                          system_prompt_tokens=plan.bench_system_tokens,
                                          think_time_s=Dist("const", 0.0), max_tokens=plan.bench_max_tokens))
    args = types.SimpleNamespace(max_total_tokens=plan.max_total_tokens, startup_timeout=plan.startup_timeout_s,
                                 timeout=300.0)
    out = {}
    for name, cfg in configs.items():
        cfg_path = os.path.join(logdir, f"serve_{name}.yaml")
        with open(cfg_path, "w") as f:
            yaml.safe_dump(cfg.model_dump(mode="json"), f)
        srv = Server([], args, _path(logdir, f"serve_{name}.log"))
        srv.cmd = [*srv.cmd[:srv.cmd.index("serve") + 1], "--config", cfg_path, "--host", "127.0.0.1",
                   "--port", str(srv.port)]
        with srv:
            records, _ = asyncio.run(_run_workload(srv.url, workload, args))
        s = summarize(records)
        out[name] = {"requests": s["requests"], "ok": s["ok"], "ttft_p50_s": s["ttft_s"]["p50"],
                     "ttft_p99_s": s["ttft_s"]["p99"], "itl_p50_s": s["itl_s"]["p50"],
                     "output_tok_per_s": s["output_tokens_per_s"], "startup_s": srv.startup_s,
                     "prompt_tokens": s["prompt_tokens"], "errors": s["errors_by_kind"],
                     "first_error": next((f"{r.error}: {r.error_detail}" for r in records if not r.ok), None)}
    ok = all(r["ok"] == r["requests"] > 0 for r in out.values())
    ratio = out["pd"]["ttft_p50_s"] / out["colocated"]["ttft_p50_s"] if ok else None
    return {"ok": ok, **out, "ttft_p50_ratio_pd_vs_colocated": ratio}


def _path(folder: str, name: str):
    from pathlib import Path

    return Path(folder) / name
