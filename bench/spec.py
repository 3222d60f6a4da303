"""Speculative decoding (engine/sched/spec/) on vs off: output tokens/s of a colocated engine, SmolLM2
(the embedded GGUF, float32), one torch thread, on (a) a copying workload and (b) plain chat.

Copying: a JSON document returned with one field changed, a function rewritten with one rename,
a tool result quoted back (the chat template, greedy). Chat: open questions. Each measurement is
a fresh engine (empty prefix cache and n-gram pool) running ``--batch`` requests at once, end to
end (prefill included): output tokens / wall seconds; the ratio on/off is the median over
``--repeats`` of each repeat's ratio; acceptance = accepted / drafted tokens; steps off/on = how
many fewer forwards the same tokens took (the load-independent half of the speedup: on a loaded
box the tok/s ratio is noisy). Greedy tokens are the same on and off (checked).

    python -m tandem.bench.spec                      # batches 1 and 4; bench/out/spec.json
    python -m tandem.bench.spec --batches 1,4,16 --repeats 3
    python -m tandem.bench.spec --attention-backend torch     # what a CPU without AVX512 runs
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from tandem.bench.common import bench_parser, write_report

DOC = {"id": 4172, "name": "Ada Lovelace", "born": "1815-12-10", "city": "London",
       "fields": ["mathematics", "computing"], "employer": None,
       "works": [{"title": "Notes on the Analytical Engine", "year": 1843}],
       "contact": {"email": "ada@example.org", "phone": "+44 20 7946 0000"}}

CODE = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, email, age = line.strip().split(",")
            users.append({"name": name, "email": email, "age": int(age)})
    return users


def oldest_user(users):
    best = None
    for user in users:
        if best is None or user["age"] > best["age"]:
            best = user
    return best'''

TOOL = ("ls -l /srv/app\n"
        "-rw-r--r-- 1 app app  1843 Mar  3 10:12 config.yaml\n"
        "-rw-r--r-- 1 app app 20480 Mar  3 10:15 data.db\n"
        "drwxr-xr-x 2 app app  4096 Mar  2 09:01 logs\n"
        "-rwxr-xr-x 1 app app   912 Mar  1 17:44 run.sh\n"
        "-rw-r--r-- 1 app app  3310 Mar  3 10:20 server.py")

COPYING = [
    f"Here is a JSON document:\n{json.dumps(DOC, indent=2)}\n\nReturn the same JSON document with "
    f"\"city\" changed to \"Paris\". Output only the JSON.",
    f"Rename the function load_users to read_users in this code and output the whole code:\n\n{CODE}",
    f"The tool returned:\n{TOOL}\n\nQuote the tool result back exactly, then say which file is largest.",
]

CHAT = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain why the sky is blue to a ten year old.",
        "What are three good habits for staying healthy? Explain each one.",
        "Describe a walk through a forest in autumn."]


def run_once(loaded, spec: str, prompts: list[str], max_tokens: int, backend: str = "auto") -> dict:
    from tandem.core.config import CacheConfig, EngineConfig
    from tandem.core.types import SamplingParams
    from tandem.engine.engine import Engine

    cfg = EngineConfig(device="cpu", dtype="float32", num_threads=1, speculative_algorithm=spec,
                       attention_backend=backend, cache=CacheConfig(max_total_tokens=16384))
    e = Engine(cfg, loaded=loaded)
    try:
        reqs = [e.make_request(p, SamplingParams(max_tokens=max_tokens), chat=True, rid=f"r{i}")
                for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        outs = e.generate_many(reqs, timeout=3600)
        wall = time.perf_counter() - t0
        st = e.stats()
    finally:
        e.shutdown()
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "steps": st["steps"],
            "drafted": st["spec_drafted_tokens"], "accepted": st["spec_accepted_tokens"],
            "verify_steps": st["spec_verify_steps"], "declined_steps": st["spec_steps_declined"],
            "ids": {o.rid: list(o.token_ids) for o in outs}}


def main(argv=None) -> int:
    ap = bench_parser(__doc__, "spec", repeats=3, threads=1)
    ap.add_argument("--batches", default="1,4", help="requests run at once, comma-separated")
    ap.add_argument("--copy-tokens", type=int, default=200, help="max_tokens of a copying request")
    ap.add_argument("--chat-tokens", type=int, default=128, help="max_tokens of a chat request")
    ap.add_argument("--workloads", default="copying,chat", help="which, comma-separated")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "cpu_kernel", "torch"],
                    help="the engine's attention backend (torch: what a CPU without AVX512 runs)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from tandem.engine.loader import load_model

    loaded = load_model("smollm2", device="cpu", dtype="float32")
    rows = []
    for workload, prompts, n_tok in (("copying", COPYING, args.copy_tokens), ("chat", CHAT, args.chat_tokens)):
        if workload not in args.workloads.split(","):
            continue
        for batch in [int(b) for b in args.batches.split(",")]:
            batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
            reps = []
            for rep in range(args.repeats):
                if batch == 1:          # batch 1: each prompt of the workload alone, one after another
                    batch_prompts = [prompts[rep % len(prompts)]]
                off = run_once(loaded, "off", batch_prompts, n_tok, args.attention_backend)
                on = run_once(loaded, "ngram", batch_prompts, n_tok, args.attention_backend)
                if on["ids"] != off["ids"]:
                    raise AssertionError(f"{workload} batch {batch}: greedy tokens differ with speculation")
                reps.append({"off_tok_s": off["tok_s"], "on_tok_s": on["tok_s"], "ratio": on["tok_s"] / off["tok_s"],
                             "tokens": on["tokens"], "steps_off": off["steps"], "steps_on": on["steps"],
                             "drafted": on["drafted"], "accepted": on["accepted"],
                             "verify_steps": on["verify_steps"], "declined_steps": on["declined_steps"]})
                print(f"  {workload} batch {batch} repeat {rep}: off {off['tok_s']:.2f} tok/s, "
                      f"on {on['tok_s']:.2f} tok/s ({reps[-1]['ratio']:.2f}x), accepted "
                      f"{on['accepted']}/{on['drafted']}, verify steps {on['verify_steps']} of {on['steps']} "
                      f"({on['declined_steps']} declined)", flush=True)
            drafted = sum(r["drafted"] for r in reps)
            rows.append({"workload": workload, "batch": batch, "repeats": len(reps),
                         "off_tok_s": statistics.median(r["off_tok_s"] for r in reps),
                         "on_tok_s": statistics.median(r["on_tok_s"] for r in reps),
                         "ratio": statistics.median(r["ratio"] for r in reps),
                         "acceptance": sum(r["accepted"] for r in reps) / drafted if drafted else 0.0,
                         "tokens_per_step_on": sum(r["tokens"] for r in reps) / sum(r["steps_on"] for r in reps),
                         "step_ratio": statistics.median(r["steps_off"] / r["steps_on"] for r in reps),
                         "runs": reps})
    print(f"\n{'workload':<9} {'batch':>5} {'off tok/s':>10} {'on tok/s':>9} {'on/off':>7} {'accept':>7} "
          f"{'tok/step':>8} {'steps off/on':>12}")
    for r in rows:
        print(f"{r['workload']:<9} {r['batch']:>5} {r['off_tok_s']:>10.2f} {r['on_tok_s']:>9.2f} "
              f"{r['ratio']:>6.2f}x {r['acceptance']:>7.2f} {r['tokens_per_step_on']:>8.2f} {r['step_ratio']:>11.2f}x")
    write_report(args.out, {"model": "smollm2 (embedded GGUF), float32", "threads": args.threads,
                            "attention_backend": args.attention_backend,
                            "copy_tokens": args.copy_tokens, "chat_tokens": args.chat_tokens, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
