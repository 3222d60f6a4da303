"""A 1 prefill + 1 decode SmolLM2 worker set that several modules of tests/cluster share: its
workers are detached Ray actors in a namespace of their own, started once; each module that only
sends requests starts its own router over them (``launch_disaggregated`` adopts running workers,
cluster/launch.py ``bootstrap``) and closes it, which leaves the workers running.

Contract: a module that uses a set must not kill, drain or stop its workers, and must not assert
on the workers' absolute counters or cache contents (other modules ran requests before it):
deltas and the router's own metrics only. Worker-side settings (the engine config, the transfer
timeout, local prefill, KV events, digests, traces) are the set's: :meth:`WorkerSet.config`
rejects a router config that asks for other ones."""

from __future__ import annotations

from tandem.core.config import CacheConfig, EngineConfig, ServeConfig

F32_NAMESPACE = "tests-smollm2-f32"     # tests/cluster/shared/conftest.py ``smollm2_1p1d``
ENGINE = EngineConfig(device="cpu", num_threads=1,
                      cache=CacheConfig(page_size=16, max_total_tokens=8192, max_running_requests=16))
# ServeConfig fields a worker is spawned with (cluster/launch.py ``Launcher.spawn``): a router
# that adopts the set cannot change them
WORKER_FIELDS = ("engine", "engine_config", "prefill", "decode", "transfer_timeout_s", "local_prefill_threshold",
                 "kv_digest", "kv_store", "kv_events", "otlp_endpoint", "decode_max_total_tokens",
                 "debug_corrupt_kv", "debug_transfer_delay_ms", "debug_transfer_stall", "reply_push", "debug_push_fault")


def base_config(namespace: str, otlp_endpoint: str | None = None) -> ServeConfig:
    """The set's own config: 1P+1D of :data:`ENGINE`, detached workers in ``namespace``; with
    ``otlp_endpoint``, the workers export their spans there."""
    return ServeConfig(prefill=1, decode=1, transfer_timeout_s=60.0, engine_config=ENGINE,
                       worker_lifetime="cluster", ray_namespace=namespace, otlp_endpoint=otlp_endpoint)


class WorkerSet:
    """The workers of :func:`base_config` (``namespace``, ``receiver``'s URL as the OTLP endpoint
    when there is one), started from ``loaded`` (a LoadedModel shipped through the object store)
    when the namespace has none; :meth:`close` kills them (and closes ``receiver``)."""

    def __init__(self, namespace: str, loaded, receiver=None):
        from tandem.cluster.launch import launch_disaggregated

        self.namespace, self.receiver = namespace, receiver
        self.base = base_config(namespace, receiver.url if receiver is not None else None)
        launch_disaggregated(self.base, loaded=loaded).close()   # a router that leaves them running

    def config(self, **router_fields) -> ServeConfig:
        """A router config over this set: :func:`base_config` updated with ``router_fields``
        (validated); a worker-side field that differs from the set's is a ValueError."""
        fields = self.base.model_dump(exclude_unset=True) | router_fields
        cfg = ServeConfig.model_validate(fields)
        bad = [f for f in WORKER_FIELDS if getattr(cfg, f) != getattr(self.base, f)]
        if bad:
            raise ValueError(f"the shared workers of {self.namespace!r} are spawned with their own {bad}")
        return cfg

    def router(self, cfg: ServeConfig | None = None):
        """A new router (RayClusterBackend) over the running workers; close it when done."""
        from tandem.cluster.launch import launch_disaggregated

        return launch_disaggregated(cfg or self.base)

    def close(self) -> None:
        import ray

        if self.receiver is not None:
            self.receiver.close()
        for a in ray.util.list_named_actors(all_namespaces=True):
            if a["namespace"] == self.namespace:
                try:
                    ray.kill(ray.get_actor(a["name"], namespace=self.namespace))
                except ValueError:
                    pass
