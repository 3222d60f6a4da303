"""``tandem serve``: start (or join) Ray, launch workers, serve the HTTP API, stop on Ctrl-C."""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--config", default=None,
                   help="YAML file with ServeConfig keys (see k8s/ for an example); flags override it")
    g.add_argument("--mode", choices=["disaggregated", "colocated"], default=None,
                   help="separate prefill and decode workers (default) or one worker doing both")
    g.add_argument("--engine", choices=["real", "sim"], default=None,
                   help="real model (default) or the simulated cost-model engine")
    g.add_argument("--prefill", type=int, default=None, help="prefill workers (default 1)")
    g.add_argument("--decode", type=int, default=None, help="decode workers (default 1)")
    g.add_argument("--host", default=None, help="HTTP bind address (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=None, help="HTTP port (default 8000)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    g.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting one")
    g.add_argument("--tool-parser", default=None, choices=["auto", "hermes", "llama3_json", "mistral"],
                   help="tool-call format the model writes (default auto: from its chat template; "
                        "Hermes <tool_call> when the template has no tool support)")
    g.add_argument("--policy", default=None,
                   choices=["round_robin", "random", "least_load", "cache_aware", "kv_events", "session"],
                   help="routing policy (default session)")
    g.add_argument("--transfer-timeout", type=float, default=None,
                   help="seconds before a KV transfer fails and its pages are freed (default 30)")
    g.add_argument("--local-prefill-threshold", type=int, default=None,
                   help="decode prefills an uncached suffix shorter than this itself (default 0)")
    g.add_argument("--decode-max-total-tokens", type=int, default=None,
                   help="device KV tokens per decode worker (default: --max-total-tokens; "
                        "--engine sim: the profile's KV room)")
    g.add_argument("--sim-profile", default=None,
                   help="--engine sim: cost profile, e.g. llama3-8b-h100 (default), llama3-70b-h100x8")
    g.add_argument("--sim-speedup", type=float, default=None,
                   help="--engine sim: simulated seconds per wall second (default 1)")


def run_serve(args) -> int:
    import uvicorn

    from tandem.cluster.config import serve_config_from_args

    cfg = serve_config_from_args(args)
    if cfg.engine == "sim":   # the real front door and router over cost-model workers: no Ray, no weights
        from tandem.cluster.sim_backend import SimServingBackend

        backend = SimServingBackend(cfg)
    elif cfg.mode == "colocated":
        from tandem.engine.engine import Engine
        from tandem.engine.metrics import register_engine_metrics
        from tandem.router.backend import LocalEngineBackend

        engine = Engine(cfg.engine_config)
        register_engine_metrics(engine, worker="colocated-0")
        backend = LocalEngineBackend(engine)
    else:
        from tandem.cluster.launch import launch_disaggregated

        backend = launch_disaggregated(cfg)
    from tandem.router.http import create_app

    app = create_app(backend, cfg)
    kind = f"sim {cfg.sim_profile} x{cfg.sim_speedup:g}" if cfg.engine == "sim" else cfg.mode
    print(f"tandem: serving {backend.model_name} ({kind}) on http://{cfg.host}:{cfg.port}", flush=True)
    # lifespan "off": the app has no startup/shutdown hooks, and uvicorn's lifespan task would
    # otherwise log a CancelledError traceback on Ctrl-C.
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning",
                                           lifespan="off"))
    try:
        server.run()
    except KeyboardInterrupt:
        pass   # uvicorn re-raises the signal after its graceful shutdown
    finally:
        print("tandem: shutting down", flush=True)
        close = getattr(backend, "close", None)
        if close is not None:
            close()
    return 0
