"""Hybrid models in the cluster: what a disaggregated request moves, and retraction with host backup.

Models: seeded random Gemma 3 text (12 layers, 5 sliding-window : 1 global, window W = 64, 1 KV
head of 64, hidden 256) and Granite-4.0-H (12 layers, 10 Mamba2 : 2 attention, 8 heads x 64,
d_state 64), each beside a *dense model of the same shape* (every layer full attention), written
as HF directories with transformers and loaded by Tandem (fp32, CPU).

1. **Bytes per disaggregated request** (PrefillWorker -> DecodeWorker in one process, real NIXL,
   page size 16): prompts of 4W and 16W tokens, nothing cached on either side. Bytes per region
   (``kv``: the full layers' pages; ``swa``: the SWA rows of the window decode keeps; ``state``:
   one state row) from the transfer's own count, the dense model's bytes for the same prompt,
   and the SWA layers' share: SWA bytes / what those layers would move at full length, next to
   its bound ``(W + 2 * page) / n``.
2. **Restore vs recompute of a retracted hybrid request** of N tokens (default 512, 1024, 2048):
   on the engine thread of an engine with a host tier (write_back: every repeat copies the FULL
   pages, the SWA window and the state checkpoint at retraction), a request is prefilled,
   retracted by the scheduler's own ``_retract`` and re-admitted (match -> ``cache.host.restore``
   -> claim copies the checkpoint), then one step samples the next token ("resume"). Baseline: a
   re-prefill of the same N + 1 tokens with the prefix cache off (recompute). Both must sample
   the same token. Medians of ``--repeats``.

Usage: python bench/hybrid.py [--threads 1] [--sizes 512,1024,2048] [--repeats 3]
           [--out bench/out/hybrid.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tandem.bench.retraction import retract_and_restore
from tandem.engine.models.hybrid import save_byte_tokenizer

WINDOW = 64
PAGE = 16


# ------------------------------------------------------------------------------------- models
def _randomize(model, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.linspace(1, 8, p.numel())))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * r - 1.0)
            elif name.endswith(".D"):
                p.copy_(1.0 + 0.2 * r)
            elif "norm" in name:
                p.copy_(0.2 * r + (0.0 if "gemma" in type(model).__name__.lower() else 1.0))
            else:
                p.copy_(0.05 * r)


def _save(model, path: Path) -> str:
    """``save_pretrained`` + the tiny models' byte-level tokenizer."""
    model.save_pretrained(path)
    save_byte_tokenizer(path)
    return str(path)


def write_models(root: Path) -> dict[str, str]:
    """HF directories: gemma3 / gemma3-dense / granite / granite-dense."""
    import transformers

    L = 12
    out = {}
    common: dict[str, Any] = dict(vocab_size=300, hidden_size=256, num_hidden_layers=L, num_attention_heads=4,
                  num_key_value_heads=1, max_position_embeddings=8192, bos_token_id=256,
                  eos_token_id=257)
    swa = ["sliding_attention"] * 5 + ["full_attention"]
    for name, kinds in (("gemma3", swa * (L // 6)), ("gemma3-dense", ["full_attention"] * L)):
        cfg = transformers.Gemma3TextConfig(**common, intermediate_size=512, head_dim=64,
                                            sliding_window=WINDOW, layer_types=kinds,
                                            query_pre_attn_scalar=64, pad_token_id=0)
        m = transformers.Gemma3ForCausalLM(cfg).eval()
        _randomize(m)
        out[name] = _save(m, root / name)
    hyb = (["mamba"] * 5 + ["attention"]) * (L // 6)
    for name, kinds in (("granite", hyb), ("granite-dense", ["attention"] * L)):
        gcfg = transformers.GraniteMoeHybridConfig(
            **common, intermediate_size=128, shared_intermediate_size=512, layer_types=kinds,
            mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=64, mamba_d_head=64, mamba_d_conv=4,
            mamba_chunk_size=64, num_local_experts=0, position_embedding_type="rope")
        m = transformers.GraniteMoeHybridForCausalLM(gcfg).eval()
        _randomize(m)
        out[name] = _save(m, root / name)
    return out


def _config(threads: int, *, tokens: int, host: int = 0, disable: bool = False, page: int = PAGE):
    from tandem.core.config import CacheConfig, EngineConfig, SchedulerConfig

    return EngineConfig(device="cpu", num_threads=threads, seed=0,
                        cache=CacheConfig(page_size=page, max_total_tokens=tokens, max_running_requests=4,
                                          host_pool_tokens=host, host_write_policy="write_back",
                                          disable_prefix_cache=disable),
                        scheduler=SchedulerConfig(chunked_prefill_size=512))


def _prompt(n: int, salt: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(1000 + n + salt)
    return torch.randint(0, 256, (n,), generator=g).tolist()


# ----------------------------------------------------------------------------------- part 1
def bytes_per_request(paths: dict[str, str], threads: int) -> list[dict]:
    from tandem.core.messages import GenerateRequest
    from tandem.core.types import SamplingParams
    from tandem.decode.worker import DecodeWorker
    from tandem.worker.kv_regions import transfer_bytes
    from tandem.engine.loader import load_model
    from tandem.prefill.worker import PrefillWorker

    class Client:
        def __init__(self, w):
            self.w, self.name = w, w.name

        async def prefill(self, req_wire, xfer, dst_prefix_len):
            return await self.w.prefill(req_wire, xfer, dst_prefix_len)

        async def abort(self, rid, reason):
            await self.w.abort(rid, reason)

    rows = []
    loop = asyncio.new_event_loop()
    for fam in ("gemma3", "granite"):
        per = {}
        for variant in (fam, f"{fam}-dense"):
            loaded = load_model(paths[variant], device="cpu", dtype="float32")
            cfg = _config(threads, tokens=16 * WINDOW + 4 * PAGE)

            async def make():
                p = PrefillWorker(f"{variant}-p", cfg, loaded=loaded, transfer_timeout_s=120)
                d = DecodeWorker(f"{variant}-d", cfg, loaded=loaded, transfer_timeout_s=120)
                p.add_peer(d.handshake())
                d.add_peer(p.handshake())
                return p, d

            p, d = loop.run_until_complete(make())
            try:
                for mult in (4, 16):
                    n = mult * WINDOW
                    greq = GenerateRequest(f"{variant}-{n}", tuple(_prompt(n)),
                                           SamplingParams(max_tokens=1))

                    async def go():
                        async for _ in d.generate(greq, Client(p)):
                            pass
                        return dict(d.last_timings)

                    t = loop.run_until_complete(go())
                    h = d.engine.hybrid
                    regions = {"kv": -(-n // PAGE)}
                    if h.active and h.window is not None:
                        regions["swa"] = n - h.keep_from(n)
                    if h.active and h.state_pool is not None:
                        regions["state"] = 1
                    by_region = {r: transfer_bytes(d.engine, {r: k}) for r, k in regions.items()}
                    assert sum(by_region.values()) == t["bytes"], (by_region, t["bytes"])
                    per[(variant, n)] = {"bytes": t["bytes"], "regions": by_region, "units": regions,
                                         "transfer_s": t["transfer_s"]}
            finally:
                p.close()
                d.close()
                loop.run_until_complete(asyncio.sleep(0.01))   # let the cancelled pump finish
        for mult in (4, 16):
            n = mult * WINDOW
            hy, de = per[(fam, n)], per[(f"{fam}-dense", n)]
            row = {"family": fam, "prompt_tokens": n, "window_multiple": mult, "bytes": hy["bytes"],
                   "dense_bytes": de["bytes"], "ratio": hy["bytes"] / de["bytes"],
                   "regions": hy["regions"], "units": hy["units"],
                   "transfer_ms": hy["transfer_s"] * 1e3, "dense_transfer_ms": de["transfer_s"] * 1e3}
            # what the hybrid's non-full layers would move at full length (dense per-layer bytes)
            n_layers = 12
            full_layers = 2
            per_layer_dense = de["bytes"] / n_layers
            row["aux_share"] = (hy["bytes"] - hy["regions"]["kv"]) / (per_layer_dense * (n_layers - full_layers))
            row["aux_bound"] = (WINDOW + 2 * PAGE) / n if fam == "gemma3" else None
            rows.append(row)
    loop.close()
    return rows


# ----------------------------------------------------------------------------------- part 2
def _cycle(e, ids: list[int], rid: str) -> dict:
    """Engine thread: prefill, retract (host backup), restore (re-admission), resume one step."""
    from tandem.core.types import Req, SamplingParams

    s = e.scheduler
    req = Req(list(ids), SamplingParams(max_tokens=4, ignore_eos=True), rid=rid)
    sr = s.add(req)
    while not req.output_ids:
        e.step()
    cyc = retract_and_restore(e, sr)
    backup_s, restore_s, resume_s = cyc["backup_s"], cyc["restore_s"], cyc["resume_s"]
    usage = e.cache.host.usage()
    restored = cyc["restored_tokens"]
    while rid in s.running:
        e.step()
    e.cache.evict(10**9, "host")
    e.cache.evict(10**9)
    e.cache.evict(10**9, "host")
    return {"backup_s": backup_s, "restore_s": restore_s, "resume_s": resume_s,
            "restored_tokens": restored, "host_usage": usage, "tokens": req.output_ids[:2]}


def _recompute(e, ids: list[int], first: int) -> tuple[float, int]:
    from tandem.core.types import SamplingParams

    t = time.perf_counter()
    c = e.generate(list(ids) + [first], SamplingParams(max_tokens=1))
    return time.perf_counter() - t, c.token_ids[0]


def restore_vs_recompute(paths: dict[str, str], threads: int, sizes: list[int], repeats: int) -> list[dict]:
    from tandem.engine.engine import Engine
    from tandem.engine.loader import load_model

    rows = []
    for fam in ("gemma3", "granite"):
        loaded = load_model(paths[fam], device="cpu", dtype="float32")
        top = max(sizes) + 8 * PAGE
        host_e = Engine(_config(threads, tokens=2 * top, host=2 * top), loaded=loaded)
        host_e.shutdown()   # driven step by step on this thread
        plain = Engine(_config(threads, tokens=2 * top, disable=True), loaded=loaded)
        try:
            for n in sizes:
                ids = _prompt(n, 7)
                cyc, rec = [], []
                for r in range(repeats):
                    cyc.append(_cycle(host_e, ids, f"{fam}-{n}-{r}"))
                    dt, tok = _recompute(plain, ids, cyc[-1]["tokens"][0])
                    if tok != cyc[-1]["tokens"][1]:
                        raise AssertionError(f"{fam} N={n}: restored next token {cyc[-1]['tokens'][1]} "
                                             f"!= recomputed {tok}")
                    rec.append(dt)
                med = {k: statistics.median(c[k] for c in cyc) for k in ("backup_s", "restore_s", "resume_s")}
                recompute_s = statistics.median(rec)
                rows.append({"family": fam, "tokens": n, **{k[:-2] + "_ms": v * 1e3 for k, v in med.items()},
                             "recompute_s": recompute_s, "restored_tokens": cyc[-1]["restored_tokens"],
                             "host_usage": cyc[-1]["host_usage"],
                             "speedup_restore": recompute_s / med["restore_s"],
                             "speedup_restore_resume": recompute_s / (med["restore_s"] + med["resume_s"])})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            host_e.shutdown()
            plain.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sizes", default="512,1024,2048")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/out/hybrid.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_models(Path(tmp))
        part1 = bytes_per_request(paths, args.threads)
        for r in part1:
            print(json.dumps(r), flush=True)
        part2 = restore_vs_recompute(paths, args.threads, [int(x) for x in args.sizes.split(",")],
                                     args.repeats)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"window": WINDOW, "page_size": PAGE, "bytes_per_request": part1,
                               "restore_vs_recompute": part2}, indent=1))
    print("| family | prompt | kv bytes | swa bytes | state bytes | total | dense | ratio | aux share | bound |")
    for r in part1:
        g = r["regions"]
        print(f"| {r['family']} | {r['prompt_tokens']} ({r['window_multiple']}W) | {g.get('kv', 0)} | "
              f"{g.get('swa', 0)} | {g.get('state', 0)} | {r['bytes']} | {r['dense_bytes']} | "
              f"{r['ratio']:.3f} | {r['aux_share']:.4f} | {r['aux_bound'] or '-'} |")
    print("| family | N | backup ms | restore ms | resume ms | recompute s | speedup restore | +resume |")
    for r in part2:
        print(f"| {r['family']} | {r['tokens']} | {r['backup_ms']:.2f} | {r['restore_ms']:.2f} | "
              f"{r['resume_ms']:.1f} | {r['recompute_s']:.3f} | {r['speedup_restore']:.0f} | "
              f"{r['speedup_restore_resume']:.1f} |")


if __name__ == "__main__":
    main()
