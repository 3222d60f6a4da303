"""``tandem serve``: build the backend a validated ServeConfig asks for and serve the HTTP API."""

from __future__ import annotations

import logging
import signal

from tandem.core import tracing
from tandem.core.config import ServeConfig
from tandem.router.backend import ServingBackend

log = logging.getLogger(__name__)


def build_backend(cfg: ServeConfig) -> ServingBackend:
    """The router's ServingBackend for ``cfg``: simulated, colocated or disaggregated."""
    if cfg.engine == "sim" and (cfg.ray_address or cfg.planner.enabled):
        from tandem.cluster.launch import launch_disaggregated

        return launch_disaggregated(cfg)
    if cfg.engine == "sim":
        from tandem.cluster.launch import load_tokenizer
        from tandem.sim.backend import SimServingBackend

        return SimServingBackend(cfg, load_tokenizer(cfg.engine_config.model))
    if cfg.mode == "colocated":
        from tandem.engine.engine import Engine
        from tandem.engine.metrics import register_engine_metrics
        from tandem.router.backend import LocalEngineBackend

        engine = Engine(cfg.engine_config, name="colocated-0")
        print(f"tandem: {engine.startup_line}", flush=True)
        register_engine_metrics(engine, worker="colocated-0")
        from tandem.engine.gie_metrics import register_gie_metrics

        register_gie_metrics(engine, worker="colocated-0")
        return LocalEngineBackend(engine)
    from tandem.cluster.launch import launch_disaggregated

    return launch_disaggregated(cfg)


def run_serve(cfg: ServeConfig) -> int:
    """Serve until Ctrl-C, then close the backend. Returns the exit status."""
    import uvicorn

    from tandem.cluster.kv_store import start_kv_store
    from tandem.router.http import create_app

    if tracing.setup("router", cfg.otlp_endpoint):
        print("tandem: tracing on (OTLP/HTTP)", flush=True)
    cfg, stop_kv_store = start_kv_store(cfg)
    try:
        backend = build_backend(cfg)
    except BaseException:
        stop_kv_store()
        raise
    app = create_app(backend, cfg)
    if cfg.api_keys:
        signal.signal(signal.SIGHUP, lambda *_: app.state.keys.reload())
    kind = f"sim {cfg.sim_profile} x{cfg.sim_speedup:g}" if cfg.engine == "sim" else cfg.mode
    print(f"tandem: serving {backend.model_name} ({kind}) on http://{cfg.host}:{cfg.port}", flush=True)
    # lifespan "off": the app has no startup/shutdown hooks, and uvicorn's lifespan task would
    # otherwise log a CancelledError traceback on Ctrl-C.
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning",
                                           lifespan="off"))
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        print("tandem: shutting down", flush=True)
        close = getattr(backend, "close", None)
        if close is not None:
            close()
        stop_kv_store()
        tracing.shutdown()
    return 0
