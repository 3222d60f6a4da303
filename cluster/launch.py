"""Disaggregated serving on Ray: ``launch_disaggregated(cfg) -> RayClusterBackend``, and the
:class:`Launcher` that spawns, discovers and pairs worker actors (cluster/README.md).
"""

from __future__ import annotations

import functools
import math
import os
import uuid
from typing import TYPE_CHECKING, Any, TypeVar, cast

from tandem.cluster.backend import RayClusterBackend
from tandem.cluster.weights import Shared, share
from tandem.cluster.workers import DECODE, PREFILL, WORKER_NAME, WorkerPool, WorkerRef, placement
from tandem.core import tracing
from tandem.core.config import EngineConfig, ServeConfig
from tandem.core.types import TandemError

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorClass, ActorHandle

    from tandem.core.tokenizer import Tokenizer
    from tandem.engine.loader import LoadedModel

STARTUP_TIMEOUT_S = 600.0
PAIR_TIMEOUT_S = 60.0
ADOPT_TIMEOUT_S = 5.0


T = TypeVar("T")


def start_actor(cls: type[T], options: dict[str, Any], *args: Any) -> ActorHandle[T]:
    """A new actor of ``cls``, an ``@ray.remote`` class, with Ray ``options``. Typed here once:
    mypy keeps a decorated class's own type (no ``.options``), and Ray types what ``.remote``
    makes "a handle or the class"."""
    handle = cast("ActorClass[T]", cls).options(**options).remote(*args)
    return cast("ActorHandle[T]", handle)


def load_tokenizer(model: str) -> Tokenizer:
    """The model's tokenizer without its weights; cached per model until its files change. Shared:
    callers only read it."""
    from tandem.engine.loader import smollm2_path

    path = smollm2_path() if model == "smollm2" else os.path.expanduser(model)
    files = [os.path.join(path, f) for f in _HF_TOKENIZER_FILES] if os.path.isdir(path) else [path]
    return _tokenizer_of(path, tuple(_stamp(f) for f in files))


# What Tokenizer.from_hf_dir reads from a model directory.
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                       "config.json", "chat_template.jinja")


def _stamp(path: str) -> tuple[int, int]:
    """(mtime_ns, size) of ``path``; (0, 0) when it is missing."""
    try:
        st = os.stat(path)
    except OSError:
        return 0, 0
    return st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=8)
def _tokenizer_of(path: str, stamps: tuple[tuple[int, int], ...]) -> Tokenizer:
    """``stamps`` only keys the cache: a changed file misses it."""
    from tandem.core.tokenizer import Tokenizer

    return Tokenizer.from_hf_dir(path) if os.path.isdir(path) else Tokenizer.from_gguf(path)


def decode_engine_config(cfg: ServeConfig) -> EngineConfig:
    """``cfg.engine_config`` with decode's own KV pool size, when ``decode_max_total_tokens`` is set."""
    ec = cfg.engine_config
    if cfg.decode_max_total_tokens is None:
        return ec
    d = ec.model_dump()
    d["cache"]["max_total_tokens"] = cfg.decode_max_total_tokens
    return EngineConfig.model_validate(d)


def role_num_gpus(cfg: ServeConfig, role: str, cluster_gpus: float = 0.0) -> float | None:
    """The GPUs one worker of ``role`` asks for: ``prefill_num_gpus`` / ``decode_num_gpus`` when set;
    else an even share (rounded down to 0.01) when there are fewer GPUs than workers and CUDA may be
    used; else None (``placement`` decides)."""
    asked = cfg.prefill_num_gpus if role == PREFILL else cfg.decode_num_gpus
    if asked is not None:
        return asked
    workers = cfg.prefill + cfg.decode
    if cfg.engine != "real" or cfg.engine_config.device == "cpu" or not 0 < cluster_gpus < workers:
        return None
    return math.floor(100 * cluster_gpus / workers) / 100


class Launcher:
    """Creates and wires actors for one cluster. ``weights``: an ObjectRef of a shared
    LoadedModel, or None (each actor loads the model itself)."""

    def __init__(self, cfg: ServeConfig, weights: ObjectRef[Shared] | None = None, kv_events: bool = False,
                 tokenizer: Tokenizer | None = None) -> None:
        self.cfg = cfg
        self.weights = weights
        self.kv_events = kv_events
        self.tokenizer = tokenizer
        self.detached = cfg.detached_workers
        self.namespace = cfg.ray_namespace if self.detached else f"tandem-{uuid.uuid4().hex[:12]}"
        self.capacity = {PREFILL: cfg.engine_config.cache.max_total_tokens,
                         DECODE: decode_engine_config(cfg).cache.max_total_tokens}

    def _options(self, role: str, name: str) -> dict[str, Any]:
        """Ray ``.options()`` of one actor: cluster/workers.py ``placement``, then the role's
        configured ``num_gpus`` (:func:`role_num_gpus`) when there is one."""
        opts = placement(self.cfg.prefill + self.cfg.decode, role, sim=self.cfg.engine == "sim",
                         role_resource=self.cfg.planner.enabled)
        import ray

        gpus = role_num_gpus(self.cfg, role, ray.cluster_resources().get("GPU", 0.0))
        if gpus is not None:
            opts["num_gpus"] = gpus
        opts.update(name=name, namespace=self.namespace, max_restarts=0)
        traces = self.cfg.otlp_endpoint or tracing.endpoint_from_env()
        if traces:
            opts["runtime_env"] = {"env_vars": {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": tracing.traces_url(traces)}}
        if self.detached:
            opts.update(lifetime="detached", get_if_exists=True)
        return opts

    def spawn(self, role: str, slot: int, name: str) -> WorkerRef:
        """The actor of ``role`` named ``name``: a new one (its model loads in the background),
        or, for detached workers, the running one of that name (``get_if_exists``)."""
        cfg = self.cfg
        opts = self._options(role, name)
        if cfg.engine == "sim":
            from tandem.sim.actor import SimDecodeActor, SimPrefillActor

            sim_cls: type[SimPrefillActor | SimDecodeActor] = SimPrefillActor if role == PREFILL else SimDecodeActor
            h: ActorHandle[Any] = start_actor(sim_cls, opts, name, cfg.model_dump(), self.kv_events,
                                              self.tokenizer if role == DECODE else None)
            return WorkerRef(name, role, slot, h)
        from tandem.decode.actor import DecodeActor
        from tandem.prefill.actor import PrefillActor

        from tandem.cache.tiers.l3.connect import l3_options

        l3 = l3_options(cfg.kv_store, cfg.l3_timeout_s, cfg.debug_corrupt_l3, cfg.l3_worker_segment_bytes)
        options = cfg.worker_options(l3=l3, kv_events=self.kv_events)
        if role == PREFILL:
            h = start_actor(PrefillActor, opts, name, cfg.engine_config.model_dump(), options, self.weights)
        else:
            h = start_actor(DecodeActor, opts, name, decode_engine_config(cfg).model_dump(), options, self.weights)
        return WorkerRef(name, role, slot, h)

    def discover(self) -> list[WorkerRef]:
        """The running workers of this launcher's namespace (named actors called like workers),
        by role and slot; handles only: their ``info()`` may still be loading."""
        import ray

        found = []
        for a in ray.util.list_named_actors(all_namespaces=True):
            if a.get("namespace") != self.namespace:
                continue
            m = WORKER_NAME.match(a.get("name", ""))
            if m is None:
                continue
            try:
                h = ray.get_actor(a["name"], namespace=self.namespace)
            except ValueError:
                continue
            found.append(WorkerRef(a["name"], m[1], int(m[2]), h))
        return sorted(found, key=lambda w: (w.role != PREFILL, w.slot, w.name))

    def info(self, workers: list[WorkerRef], timeout: float = STARTUP_TIMEOUT_S) -> list[dict[str, Any]]:
        """Each worker's ``info()``, waiting for its model to load; a worker that failed to
        start is a TandemError."""
        import ray

        try:
            infos = ray.get([w.api.info() for w in workers], timeout=timeout)
        except ray.exceptions.RayTaskError as e:
            raise TandemError(f"a worker failed to start: {e.cause if hasattr(e, 'cause') else e}") from None
        for w, i in zip(workers, infos):
            w.node_id = i.get("node_id", "")
        return infos

    def answering(self, workers: list[WorkerRef],
                  timeout: float = ADOPT_TIMEOUT_S) -> list[tuple[WorkerRef, dict[str, Any]]]:
        """The ``(worker, info)`` of those of ``workers`` that answer within ``timeout`` (the
        others are still loading, or dead)."""
        import ray

        refs = {w.api.info(): w for w in workers}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        out = []
        for r in ready:
            try:
                info = ray.get(r)
            except Exception:  # noqa: BLE001
                continue
            refs[r].node_id = info.get("node_id", "")
            out.append((refs[r], info))
        return out

    def pair(self, p: WorkerRef, d: WorkerRef) -> None:
        """Exchange handshakes: prefill learns where to WRITE, decode whom to expect (and ask).
        Idempotent: a worker keeps a peer it already knows."""
        import ray

        hp, hd = ray.get([p.api.handshake(), d.api.handshake()], timeout=PAIR_TIMEOUT_S)
        ray.get([p.prefill_api.add_peer(hd), d.decode_api.add_prefill(hp, p.handle)],
                timeout=PAIR_TIMEOUT_S)

    def pair_decodes(self, a: WorkerRef, b: WorkerRef) -> None:
        """Two decode workers learn each other: a migrated request's KV moves between them."""
        import ray

        ha, hb = ray.get([a.api.handshake(), b.api.handshake()], timeout=PAIR_TIMEOUT_S)
        ray.get([a.decode_api.add_decode(hb, b.handle), b.decode_api.add_decode(ha, a.handle)],
                timeout=PAIR_TIMEOUT_S)

    def pair_missing(self, prefills: list[tuple[WorkerRef, dict[str, Any]]],
                     decodes: list[tuple[WorkerRef, dict[str, Any]]]) -> int:
        """Pair every unpaired prefill-decode and decode-decode couple; returns how many were paired."""
        n = 0
        for p, pi in prefills:
            for d, di in decodes:
                if p.name not in di.get("peers", ()) or d.name not in pi.get("peers", ()):
                    self.pair(p, d)
                    n += 1
        for i, (a, ai) in enumerate(decodes):
            for b, bi in decodes[i + 1:]:
                if a.name not in bi.get("peers", ()) or b.name not in ai.get("peers", ()):
                    self.pair_decodes(a, b)
                    n += 1
        return n

    def bootstrap(self, pool: WorkerPool) -> list[dict[str, Any]]:
        """Fill ``pool`` with the namespace's running workers, else new ones; pair them. Returns their
        ``info()`` in pool order."""
        found = self.discover() if self.detached else []
        if not found:
            found = [self.spawn(PREFILL, i, f"prefill-{i}") for i in range(self.cfg.prefill)]
            found += [self.spawn(DECODE, i, f"decode-{i}") for i in range(self.cfg.decode)]
            infos = self.info(found)
        else:
            got = dict((w.name, (w, i)) for w, i in self.answering(found, STARTUP_TIMEOUT_S))
            found = [w for w in found if w.name in got]
            infos = [got[w.name][1] for w in found]
            if not any(w.role == DECODE for w in found):
                raise TandemError(f"namespace {self.namespace!r} has workers but no live decode worker")
        by_name = {w.name: i for w, i in zip(found, infos)}
        for w in found:
            pool.add(w)
        infos = [by_name[w.name] for w in pool.everyone()]
        pages = {i["page_size"] for i in infos}
        if len(pages) != 1:
            raise TandemError(f"workers disagree on page_size: {sorted(pages)}")
        pairs = list(zip(pool.everyone(), infos))
        self.pair_missing([x for x in pairs if x[0].role == PREFILL], [x for x in pairs if x[0].role == DECODE])
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


def launch_disaggregated(cfg: ServeConfig, *, restart: bool = True, loaded: LoadedModel | None = None,
                         share_weights: bool | None = None) -> RayClusterBackend:
    """Start (or join) Ray, launch and bootstrap the workers; returns the serving backend.
    ``loaded``: weights to hand every worker; ``restart``: relaunch dead workers."""
    import ray

    started = start_ray(cfg)
    if loaded is None and share_weights is None:
        share_weights = (started and cfg.engine != "sim" and cfg.prefill + cfg.decode > 1 and cfg.engine_config.device != "cuda"
                         and not ray.cluster_resources().get("GPU", 0))
    if loaded is None and share_weights and cfg.engine != "sim":
        from tandem.engine.loader import load_model

        ec = cfg.engine_config
        loaded = load_model(ec.model, device="cpu", dtype=ec.dtype, sliding_window=ec.sliding_window,
                            context_length=ec.context_length, weights=ec.weights)
    weights = share(loaded) if loaded is not None else None
    del loaded
    kv_events = cfg.kv_events if cfg.kv_events is not None else cfg.policy in ("kv_events", "session")
    tokenizer = load_tokenizer(cfg.engine_config.model)
    launcher = Launcher(cfg, weights, kv_events, tokenizer if cfg.engine == "sim" else None)
    backend = RayClusterBackend(cfg, launcher, tokenizer, started_ray=started, restart=restart)
    try:
        backend.start()
    except BaseException:
        backend.close()
        raise
    return backend
