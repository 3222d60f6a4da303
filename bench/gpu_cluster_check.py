"""The disaggregated cluster on one GPU, checked and measured in one command (issue 36): under
8 minutes on one H200.

    python bench/gpu_cluster_check.py [--out DIR] [--budget-s 450] [--skip-serve]
    python bench/gpu_cluster_check.py --cpu-smoke --out /tmp/x     (tiny sizes, CPU: the same phases)

On the device machine use bench/gpu_cluster_check.sh (keeps the carried part, reassembles and
installs the staged wheels offline, then runs this); bench/gpu_stage.sh prepares the parts.
Writes ``OUT/gpu_cluster_check.json`` (every number), ``OUT/gpu_cluster_check.md`` (the table,
also printed last) and the servers' logs; ``OUT`` is ``--out``, else ``$OUT``, else
bench/out/gpu_cluster_check.

A Ray head on this machine with its GPU (``--cpu-smoke``: one logical GPU, no real one); random
weights with SmolLM2-135M's geometry (``--cpu-smoke``: 2 layers of 64), saved once as a HF
directory every worker loads. In order (bench/gpu/cluster.py):

1. for each dtype (float32, then bfloat16; the smoke: float32), 1 prefill + 1 decode worker at
   ``num_gpus=0.5`` each, KV pools on the device, registered with NIXL (VRAM; the smoke: DRAM),
   moved over UCX (cuda_ipc / cuda_copy): the five prompts' greedy tokens against a colocated
   engine on the same device (float32 identical; bf16 identical or parting at a near-tie);
2. on the last dtype's cluster: the KV handoff of 1k, 8k and 32k-token prompts, NIXL GB/s
   against a device-to-device copy of the same bytes, and the write's share of TTFT;
3. 1 prefill + 2 decode workers at ``num_gpus=0.33``, decode retracting every 3 steps to its
   pinned host pool and restoring: tokens against the colocated ones; then each prompt moved live
   to the other decode worker: tokens again, and each migration's downtime;
4. ``tandem serve`` 1P+1D (joined to this Ray, ``num_gpus`` 0.5 per worker from its config) and
   ``tandem serve --mode colocated``, the ``tandem bench`` agent workload against each: TTFT
   p50/p99, ITL, output tok/s.

A failed phase is recorded and the next one still runs; the exit status is 1 when any check
failed. A phase that would start past ``--budget-s`` is skipped (and says so).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Plan:
    device: str = "cuda"
    dtypes: tuple = ("float32", "bfloat16")
    model: str = "random-smollm2"
    new_tokens: int = 32
    handoff_tokens: tuple = (1024, 8192, 32768)
    handoff_repeats: int = 3
    max_total_tokens: int = 40960
    context_length: int | None = 40960
    host_pool_tokens: int = 65536
    retract_every: int = 3
    move_after: int = 8
    gpu_share: float = 0.5
    migration_share: float = 0.33
    bench_sessions: int = 8
    bench_turns: int = 3
    bench_system_tokens: int = 200
    bench_max_tokens: int = 32
    startup_timeout_s: float = 180.0
    threads: int | None = None
    serve: bool = True
    budget_s: float = 450.0


SMOKE = Plan(device="cpu", dtypes=("float32",), model="tiny", new_tokens=8, handoff_tokens=(64, 256),
             handoff_repeats=1, max_total_tokens=8192, context_length=8192, host_pool_tokens=8192, move_after=3,
             bench_sessions=1, bench_turns=2, bench_system_tokens=8, bench_max_tokens=4, threads=1,
             budget_s=300.0)

HEADLINE = ("pd_equals_colocated", "nixl_vram_GBps", "device_copy_GBps", "migration_ok", "migration_downtime_ms",
            "ttft_p50_ratio_pd_vs_colocated")


def _phase(report: dict, name: str, fn, plan: Plan, t_start: float):
    """bench/gpu_check.py's phase (a raise is recorded as a failure, the run goes on), unless the
    budget is spent: then the phase is skipped and says so."""
    from tandem.bench.gpu_check import _phase as recorded

    if time.perf_counter() - t_start > plan.budget_s:
        report[name] = {"skipped": f"budget of {plan.budget_s:.0f} s spent"}
        return report[name]
    return recorded(report, name, fn, required=False)


def run(plan: Plan, out: str) -> dict:
    import ray
    import torch

    from tandem.bench.gpu import cluster as c
    from tandem.bench.gpu.models import SMOLLM2_GEOMETRY, TINY_GEOMETRY, _prompt_ids, random_hf_dir
    from tandem.cluster.launch import load_tokenizer
    from tandem.core.types import SamplingParams

    t_start = time.perf_counter()
    report: dict = {"plan": asdict(plan), "device_name": _device_name(plan)}
    ray.init(address="local", num_cpus=os.cpu_count() or 2, num_gpus=1, include_dashboard=False,
             log_to_driver=False)
    path, hf32 = random_hf_dir(SMOLLM2_GEOMETRY if plan.model == "random-smollm2" else TINY_GEOMETRY,
                               path=tempfile.mkdtemp(prefix="tandem-cluster-model-"))
    prompts, vocab = _prompt_ids(load_tokenizer(path)), hf32.config.vocab_size
    params = SamplingParams(max_tokens=plan.new_tokens, temperature=0.0, ignore_eos=True)
    report["model"] = {"geometry": plan.model, "path": path, "vocab": vocab, "prompts": len(prompts)}
    refs: dict[str, Any] = {}
    hfs: dict[str, Any] = {}
    live: dict[str, Any] = {}          # per dtype: colocated tokens, the judge's model; the open cluster
    dtype = plan.dtypes[-1]

    def close():
        if live:
            live.pop("backend").close()

    def pd(dt: str) -> dict:
        close()
        refs[dt] = c.colocated_tokens(plan, path, dt, prompts, params)
        hfs[dt] = None if dt == "float32" else hf32.to(device=plan.device, dtype=getattr(torch, dt))
        live["backend"] = c.launch(c.serve_config(plan, c.engine_config(plan, path, dt), decode=1,
                                                  share=plan.gpu_share))
        return c.pd_vs_colocated(live["backend"], dt, hfs[dt], prompts, params, refs[dt])

    def migration() -> dict:
        ec = c.engine_config(plan, path, dtype, host_pool_tokens=plan.host_pool_tokens,
                             retract_every=plan.retract_every)
        b = c.launch(c.serve_config(plan, ec, decode=2, share=plan.migration_share))
        try:
            return c.retraction_and_migration(b, plan, dtype, hfs[dtype], prompts, params, refs[dtype])
        finally:
            b.close()

    try:
        for dt in plan.dtypes:
            _phase(report, f"pd_vs_colocated_{dt}", lambda: pd(dt), plan, t_start)
        _phase(report, "handoff", lambda: c.handoff(live["backend"], plan, vocab), plan, t_start)
        close()
        _phase(report, "retraction_migration", migration, plan, t_start)
        if plan.serve:
            address = ray.get_runtime_context().gcs_address
            _phase(report, "serve_bench", lambda: c.serve_bench(plan, path, dtype, address, out), plan, t_start)
    finally:
        close()
        ray.shutdown()
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    report.update(headline(report, plan))
    return report


def headline(report: dict, plan: Plan) -> dict:
    """The keys readers of the report use (None where the phase did not run)."""
    pd = [report.get(f"pd_vs_colocated_{d}", {}) for d in plan.dtypes]
    sizes = report.get("handoff", {}).get("sizes") or [{}]
    mig = report.get("retraction_migration", {})
    serve = report.get("serve_bench", {})
    return {"pd_equals_colocated": all(p.get("ok", False) for p in pd),
            "nixl_vram_GBps": _round(sizes[-1].get("nixl_GBps")),
            "device_copy_GBps": _round(sizes[-1].get("device_copy_GBps")),
            "handoff_share_of_ttft": {s["prompt_tokens"]: round(s["share_of_ttft"], 4) for s in sizes if s},
            "retraction_ok": mig.get("retraction", {}).get("ok", False),
            "migration_ok": mig.get("migration", {}).get("ok", False),
            "migration_downtime_ms": mig.get("migration", {}).get("downtime_ms"),
            "ttft_p50_ratio_pd_vs_colocated": _round(serve.get("ttft_p50_ratio_pd_vs_colocated"))}


def _round(x, nd: int = 3):
    return None if x is None else round(x, nd)


def _device_name(plan: Plan) -> str:
    import torch

    return torch.cuda.get_device_name(0) if plan.device == "cuda" else "cpu (smoke: DRAM descriptors)"


def failed(report: dict, plan: Plan) -> list[str]:
    """The checks that failed (a skipped measurement is not a failure)."""
    bad = [k for k, v in report.items() if isinstance(v, dict) and v.get("ok") is False]
    return bad + ([] if report["pd_equals_colocated"] else ["pd_equals_colocated"])


def table(report: dict) -> str:
    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    lines = [f"| disaggregated on {report['device_name']} | value |", "|---|---|"]
    for k in HEADLINE:
        v = report.get(k)
        lines.append(f"| {k} | {v if isinstance(v, (bool, list)) or v is None else f(v)} |")
    for s in report.get("handoff", {}).get("sizes", []):
        lines.append(f"| handoff {s['prompt_tokens']} tokens: {s['bytes'] / 1e6:.3f} MB | NIXL {f(s['nixl_GBps'])} GB/s, "
                     f"copy {f(s['device_copy_GBps'])} GB/s, {f(100 * s['share_of_ttft'], '{:.1f}')}% of TTFT "
                     f"{f(1e3 * s['ttft_s'], '{:.1f}')} ms |")
    mig = report.get("retraction_migration", {})
    if "retraction" in mig:
        r = mig["retraction"]
        lines.append(f"| retraction to host | {r['exact']}/{r['requests']} equal, {r['retractions']:.0f} retractions, "
                     f"{r['retraction_restores']:.0f} restores |")
    for name in ("pd", "colocated"):
        s = report.get("serve_bench", {}).get(name)
        if s:
            lines.append(f"| tandem bench agent, {name} | TTFT p50 {f(1e3 * s['ttft_p50_s'], '{:.1f}')} ms, "
                         f"p99 {f(1e3 * s['ttft_p99_s'], '{:.1f}')} ms, ITL p50 {f(1e3 * (s['itl_p50_s'] or 0), '{:.1f}')} "
                         f"ms, {f(s['output_tok_per_s'], '{:.1f}')} tok/s ({s['ok']}/{s['requests']} ok) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="report folder (default $OUT, else bench/out/gpu_cluster_check)")
    ap.add_argument("--cpu-smoke", action="store_true", help="the same phases on the CPU at tiny sizes")
    ap.add_argument("--budget-s", type=float, default=None, help="skip phases that would start after this")
    ap.add_argument("--skip-serve", action="store_true", help="leave out the tandem serve / tandem bench phase")
    args = ap.parse_args(argv)
    plan = SMOKE if args.cpu_smoke else Plan()
    if args.budget_s is not None:
        plan = replace(plan, budget_s=args.budget_s)
    if args.skip_serve:
        plan = replace(plan, serve=False)
    out = args.out or os.environ.get("OUT") or os.path.join(ROOT, "bench", "out", "gpu_cluster_check")
    os.makedirs(out, exist_ok=True)
    report = run(plan, out)
    bad = failed(report, plan)
    report["failed"] = bad
    with open(os.path.join(out, "gpu_cluster_check.json"), "w") as fh:
        json.dump(report, fh, indent=1, default=str)
    md = table(report)
    with open(os.path.join(out, "gpu_cluster_check.md"), "w") as fh:
        fh.write(md + "\n")
    print(md)
    print(f"[gpu_cluster_check] {'FAILED: ' + ', '.join(bad) if bad else 'all checks passed'} "
          f"in {report['seconds']:.0f} s; wrote {out}/gpu_cluster_check.json", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    raise SystemExit(main())
