"""How long a 1 prefill + 1 decode cluster takes to launch from weights the driver holds.

The driver loads SmolLM2 once (``--dtype``: float32, or auto, the default numerics), starts a local
Ray instance (2 CPUs), then launches and closes a 1P+1D cluster ``--repeats`` times from that one
LoadedModel (``launch_disaggregated(cfg, loaded=...)``: what the test suite's cluster modules do),
timing each launch to the point where the backend serves; prints the times and their median.

    .venv/bin/python -m tandem.bench.launch [--dtype float32] [--repeats 5]
"""

from __future__ import annotations

import statistics
import time

from tandem.bench.common import bench_parser, write_report


def main(argv=None) -> int:
    import ray

    ap = bench_parser(__doc__, "launch", repeats=5)
    ap.add_argument("--dtype", default="float32", choices=("float32", "auto"))
    args = ap.parse_args(argv)
    from tandem.cluster.launch import launch_disaggregated
    from tandem.core.config import CacheConfig, EngineConfig, ServeConfig
    from tandem.engine.loader import load_model

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    loaded = load_model("smollm2", device="cpu", dtype=args.dtype)
    cfg = ServeConfig(prefill=1, decode=1, engine_config=EngineConfig(
        device="cpu", num_threads=1, cache=CacheConfig(page_size=16, max_total_tokens=4096)))
    times = []
    try:
        for _ in range(args.repeats):
            t = time.perf_counter()
            backend = launch_disaggregated(cfg, loaded=loaded)
            times.append(time.perf_counter() - t)
            backend.close()
    finally:
        ray.shutdown()
    print("launch s:", " ".join(f"{t:.2f}" for t in times), f"median {statistics.median(times):.2f}")
    write_report(args.out, {"dtype": args.dtype, "launch_s": times, "median_s": statistics.median(times)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
