"""Disaggregated serving on Ray: start (or join) Ray, create the prefill and decode actors, wire
their NIXL agents. ``launch_disaggregated(cfg) -> RayClusterBackend`` (the router's ServingBackend):

1. ``ray.init`` (a fresh local instance, or ``cfg.ray_address``). On CPU the driver can load the
   weights once and hand them to every actor through the object store.
2. ``cfg.prefill`` PrefillActors and ``cfg.decode`` DecodeActors with ``cfg.engine_config``
   (decode's KV pool is ``cfg.decode_max_total_tokens`` when set), placed by
   cluster/workers.py ``placement``.
3. Bootstrap: every pair exchanges :class:`Handshake` bytes through Ray calls (NIXL metadata and
   the KV region's layout); each decode actor also gets the prefill actor's handle.

The :class:`Launcher` does steps 2 and 3 for one actor or pair at a time; the supervisor uses
the same one to relaunch a dead worker. Routing, admission and re-routing are the dispatcher's
(router/dispatch.py); the backend (cluster/backend.py) streams; the supervisor
(cluster/supervisor.py) watches health.
"""

from __future__ import annotations

import os

from tandem.cluster.backend import RayClusterBackend
from tandem.cluster.workers import DECODE, PREFILL, WorkerPool, WorkerRef, placement
from tandem.core.config import EngineConfig, ServeConfig
from tandem.core.types import TandemError

STARTUP_TIMEOUT_S = 600.0
PAIR_TIMEOUT_S = 60.0


def load_tokenizer(model: str):
    """The model's tokenizer without its weights (the driver tokenizes; workers hold weights)."""
    from tandem.core.tokenizer import Tokenizer
    from tandem.engine.loader import smollm2_path

    path = smollm2_path() if model == "smollm2" else os.path.expanduser(model)
    if os.path.isdir(path):
        return Tokenizer.from_hf_dir(path)
    return Tokenizer.from_gguf(path)


def decode_engine_config(cfg: ServeConfig) -> EngineConfig:
    """``cfg.engine_config`` with decode's own KV pool size, when ``decode_max_total_tokens`` is set."""
    ec = cfg.engine_config
    if cfg.decode_max_total_tokens is None:
        return ec
    d = ec.model_dump()
    d["cache"]["max_total_tokens"] = cfg.decode_max_total_tokens
    return EngineConfig.model_validate(d)


class Launcher:
    """Creates and wires actors for one cluster. ``weights``: an ObjectRef of a shared
    LoadedModel, or None (each actor loads the model itself)."""

    def __init__(self, cfg: ServeConfig, weights=None, kv_events: bool = False):
        self.cfg = cfg
        self.weights = weights
        self.kv_events = kv_events
        self.capacity = {PREFILL: cfg.engine_config.cache.max_total_tokens,
                         DECODE: decode_engine_config(cfg).cache.max_total_tokens}

    def spawn(self, role: str, slot: int, name: str) -> WorkerRef:
        """A new actor of ``role`` named ``name`` (its model loads in the background)."""
        from tandem.decode.actor import DecodeActor
        from tandem.prefill.actor import PrefillActor

        cfg = self.cfg
        opts = placement(cfg.prefill + cfg.decode, role)
        if role == PREFILL:
            h = PrefillActor.options(**opts).remote(
                name, cfg.engine_config.model_dump(), cfg.transfer_timeout_s, self.weights, self.kv_events)
        else:
            h = DecodeActor.options(**opts).remote(
                name, decode_engine_config(cfg).model_dump(), cfg.transfer_timeout_s,
                cfg.local_prefill_threshold, self.weights, cfg.kv_digest, cfg.debug_corrupt_kv)
        return WorkerRef(name, role, slot, h)

    def info(self, workers: list[WorkerRef]) -> list[dict]:
        """Each worker's ``info()``, waiting for its model to load; a worker that failed to
        start is a TandemError."""
        import ray

        try:
            return ray.get([w.handle.info.remote() for w in workers], timeout=STARTUP_TIMEOUT_S)
        except ray.exceptions.RayTaskError as e:
            raise TandemError(f"a worker failed to start: {e.cause if hasattr(e, 'cause') else e}") from None

    def pair(self, p: WorkerRef, d: WorkerRef) -> None:
        """Exchange handshakes: prefill learns where to WRITE, decode whom to expect (and ask)."""
        import ray

        hp, hd = ray.get([p.handle.handshake.remote(), d.handle.handshake.remote()], timeout=PAIR_TIMEOUT_S)
        ray.get([p.handle.add_peer.remote(hd), d.handle.add_prefill.remote(hp, p.handle)],
                timeout=PAIR_TIMEOUT_S)

    def bootstrap(self, pool: WorkerPool) -> list[dict]:
        """Spawn ``cfg.prefill`` + ``cfg.decode`` workers into ``pool``, wait for them, pair every
        prefill worker with every decode worker. Returns their ``info()`` in pool order."""
        for i in range(self.cfg.prefill):
            pool.add(self.spawn(PREFILL, i, f"prefill-{i}"))
        for i in range(self.cfg.decode):
            pool.add(self.spawn(DECODE, i, f"decode-{i}"))
        infos = self.info(pool.everyone())
        pages = {i["page_size"] for i in infos}
        if len(pages) != 1:
            raise TandemError(f"workers disagree on page_size: {sorted(pages)}")
        for p in pool.prefills:
            for d in pool.decodes:
                self.pair(p, d)
        return infos


def start_ray(cfg: ServeConfig) -> bool:
    """Join ``cfg.ray_address``, or start a local Ray here; True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    if cfg.ray_address:
        ray.init(address=cfg.ray_address, include_dashboard=False, log_to_driver=True)
        return False
    ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=True)
    return True


def launch_disaggregated(cfg: ServeConfig, *, restart: bool = True, loaded=None,
                         share_weights: bool | None = None) -> RayClusterBackend:
    """Start (or join) Ray, launch and bootstrap the workers; returns the serving backend.

    ``loaded``: a LoadedModel (CPU) to hand every worker through the object store instead of
    each loading the model itself. ``share_weights`` (default: when Ray runs here, without GPUs,
    with more than one worker) makes the driver load the model once for that purpose.
    ``restart``: the supervisor relaunches dead workers.
    """
    import ray

    started = start_ray(cfg)
    if loaded is None and share_weights is None:
        share_weights = (started and cfg.prefill + cfg.decode > 1 and cfg.engine_config.device != "cuda"
                         and not ray.cluster_resources().get("GPU", 0))
    if loaded is None and share_weights:
        from tandem.engine.loader import load_model

        ec = cfg.engine_config
        loaded = load_model(ec.model, device="cpu", dtype=ec.dtype, sliding_window=ec.sliding_window,
                            context_length=ec.context_length, weights=ec.weights)
    weights = ray.put(loaded) if loaded is not None else None
    del loaded
    kv_events = cfg.kv_events if cfg.kv_events is not None else cfg.policy == "kv_events"
    backend = RayClusterBackend(cfg, Launcher(cfg, weights, kv_events), load_tokenizer(cfg.engine_config.model),
                                started_ray=started, restart=restart)
    try:
        backend.start()
    except BaseException:
        backend.close()
        raise
    return backend
