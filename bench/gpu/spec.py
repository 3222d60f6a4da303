"""bench/gpu_check.py's speculative-decoding phase: n-gram speculation on vs off with CUDA graphs on
(decode and verify graphs; their stand-ins on the CPU), per batch size.

Each side is a fresh engine running the same ``batch`` random prompts twice, greedy, EOS ignored;
the second run is timed: its drafts come from the n-gram pool the first run filled (the copying
case, whatever the weights). Per batch: output tok/s on and off and their ratio, forwards
(scheduler steps) on and off, acceptance, the verify graph's replays and eager reasons, the
padded tokens it ran, and whether the tokens are equal (bf16: a verify step's extend kernel and
a decode step's kernel may round a near-tie differently, so this is reported, not required)."""

from __future__ import annotations

import time

import torch

from tandem.bench.gpu.correctness import make_engine
from tandem.core.types import SamplingParams


def _side(pair, plan, prompts: list[list[int]], steps: int, speculative: str) -> dict:
    B = len(prompts)
    eng = make_engine(pair, plan, graphs=True, speculative=speculative, max_running_requests=max(B, 8),
                      max_total_tokens=2 * B * (len(prompts[0]) + steps + 64) + 256)
    try:
        params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)

        def run(tag: str) -> list[list[int]]:
            outs = eng.generate_many([eng.make_request(p, params, rid=f"{tag}{i}") for i, p in enumerate(prompts)],
                                     timeout=600)
            bad = [c for c in outs if c.error]
            if bad:
                raise RuntimeError(f"request {bad[0].rid} failed: {bad[0].error}")
            return [list(c.token_ids) for c in outs]
        run("fill")
        st = eng.scheduler.stats
        steps0, drafted0, accepted0 = st["steps"], st["spec_drafted_tokens"], st["spec_accepted_tokens"]
        t = time.perf_counter()
        toks = run("timed")
        dt = time.perf_counter() - t
        res = {"tok_s": round(B * steps / dt, 1), "steps": st["steps"] - steps0, "tokens": toks}
        if speculative != "off":
            drafted = st["spec_drafted_tokens"] - drafted0
            res["acceptance"] = round((st["spec_accepted_tokens"] - accepted0) / max(drafted, 1), 3)
            vg = eng.runner.verify_graph
            res["verify_graph"] = {"mode": vg.mode, "stats": dict(vg.stats), "tokens": dict(vg.tokens)} \
                if vg is not None else None
        return res
    finally:
        eng.shutdown()


def spec_on_off(pair, plan) -> dict:
    """Speculation on vs off at each batch of ``plan.spec_batches`` (module docstring)."""
    V = pair.loaded.arch.vocab_size
    rows = []
    for B in plan.spec_batches:
        g = torch.Generator().manual_seed(1000 + B)
        prompts = [torch.randint(0, V, (plan.decode_prompt,), generator=g).tolist() for _ in range(B)]
        off = _side(pair, plan, prompts, plan.decode_steps, "off")
        on = _side(pair, plan, prompts, plan.decode_steps, "ngram")
        equal = on.pop("tokens") == off.pop("tokens")
        replays = (on.get("verify_graph") or {}).get("stats", {}).get("replay", 0)
        rows.append({"batch": B, "off": off, "on": on, "tokens_equal": equal,
                     "on_over_off": round(on["tok_s"] / off["tok_s"], 3), "verify_replays": replays})
        print(f"[gpu_check]   spec B={B}: off {off['tok_s']} tok/s ({off['steps']} steps), on {on['tok_s']} "
              f"({on['steps']} steps, acceptance {on['acceptance']}), verify graph {on['verify_graph']}, "
              f"tokens equal {equal}", flush=True)
    return {"rows": rows, "ok": all(r["verify_replays"] > 0 for r in rows)}
