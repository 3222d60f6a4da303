"""k8s/: every overlay renders, validates against the Kubernetes and CRD schemas, and agrees with
Tandem's config model, its command line, Ray's command line and itself (replicas, sizing, probes).

Rendering uses tests/k8s/kustomize_lite.py; the real command is `kubectl kustomize k8s/overlays/gpu`.
"""

from __future__ import annotations

import json
import re
import shlex

import pytest
import yaml

from k8s_support import (DASHBOARD, OVERLAYS, SERVE_CONFIGMAP, SERVE_KEY, containers, crd_validator,
                         one, pod_templates, quantity, ray_start_argv, rendered, serve_yaml, shell_lines,
                         worker_group)

from tandem.core.config import ServeConfig

try:
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version
except ImportError:  # only the two schema tests need it; they skip, naming the package
    kubernetes_validate = None
    latest_version = lambda: "latest"  # noqa: E731

# The oldest Kubernetes minor we claim to support, and the newest whose schemas the package ships.
K8S_VERSIONS = ("1.30", latest_version())
CRD_SCHEMAS = {
    ("ray.io/v1", "RayCluster"): "ray.io_v1_raycluster.schema.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_v1_servicemonitor.schema.yaml",
}
EXPECTED_KINDS = sorted(["RayCluster", "Deployment", "Service", "Deployment", "Service",  # + the kv-store
                         "ConfigMap", "ConfigMap", "ServiceMonitor",
                         "PodDisruptionBudget", "PodDisruptionBudget", "PodDisruptionBudget",
                         "PodDisruptionBudget"])
ROLES = ("prefill", "decode")
RUN_AS_USER = 1000  # docker/Dockerfile.*: USER 1000:1000
# Memory a worker needs besides its KV: weights, torch, the CUDA context, raylet and the agent.
WORKER_OVERHEAD_BYTES = 2 * 2**30
# Models the overlays serve and their KV shape (layers, KV heads, head dim). SmolLM2-135M's GGUF:
# llama.block_count 30, attention.head_count_kv 3, embedding_length 576 / head_count 9 = 64.
KV_SHAPES = {"smollm2": (30, 3, 64)}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request):
    return request.param


@pytest.fixture
def resources(overlay):
    return rendered(overlay)


@pytest.fixture
def config(resources) -> ServeConfig:
    return ServeConfig.model_validate(yaml.safe_load(serve_yaml(resources)))


def _cluster(resources):
    return one(resources, "RayCluster", "tandem")


def _router(resources):
    return one(resources, "Deployment", "tandem-router")


def _router_container(resources):
    return one([{"kind": "c", "metadata": {"name": c["name"]}, **c} for c in
                _router(resources)["spec"]["template"]["spec"]["containers"]], "c", "router")


def _int_rayparam(params, key):
    return int(params[key])


# --- schemas -----------------------------------------------------------------------------------

def test_overlay_renders_the_expected_objects(resources):
    assert sorted(r["kind"] for r in resources) == EXPECTED_KINDS
    for r in resources:
        name = r["metadata"]["name"]
        assert DNS_SUBDOMAIN.match(name), f"{r['kind']}/{name} is not a DNS subdomain"
        assert "namespace" not in r["metadata"], "namespace comes from `kubectl apply -n`"


def _need_kubernetes_validate():
    if kubernetes_validate is None:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate)")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_kinds_validate_against_kubernetes_schemas(resources, version):
    _need_kubernetes_validate()
    for r in resources:
        if (r["apiVersion"], r["kind"]) in CRD_SCHEMAS:
            continue
        try:
            kubernetes_validate.validate(r, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{r['kind']}/{r['metadata']['name']} @ {version}: "
                        f"{'.'.join(map(str, e.path))}: {e.message}")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_ray_pod_templates_validate_as_core_v1(resources, version):
    """The CRD inlines core/v1 PodTemplateSpec: check each template as a PodTemplate object."""
    _need_kubernetes_validate()
    for where, tpl in pod_templates(_cluster(resources)):
        wrapper = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": tpl}
        try:
            kubernetes_validate.validate(wrapper, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"RayCluster {where} @ {version}: {'.'.join(map(str, e.path))}: {e.message}")


def test_custom_resources_validate_against_vendored_crd_schemas(resources):
    seen = set()
    for r in resources:
        key = (r["apiVersion"], r["kind"])
        if key in CRD_SCHEMAS:
            errors = sorted(crd_validator(CRD_SCHEMAS[key]).iter_errors(r), key=str)
            assert not errors, "\n".join(f"{r['kind']}: {'.'.join(map(str, e.path))}: {e.message}"
                                         for e in errors)
            seen.add(key)
    assert seen == set(CRD_SCHEMAS)


def test_crd_validator_rejects_what_the_api_server_would():
    v = crd_validator(CRD_SCHEMAS[("ray.io/v1", "RayCluster")])
    good = _cluster(rendered("cpu-dev"))
    assert not list(v.iter_errors(good))
    bad = json.loads(json.dumps(good))
    del bad["spec"]["workerGroupSpecs"][0]["minReplicas"]            # required
    bad["spec"]["workerGroupSpecs"][1]["replica"] = 2                 # unknown field (typo)
    bad["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0    # must be a string
    bad["spec"]["workerGroupSpecs"][1]["maxReplicas"] = 2**31         # int32
    bad["spec"]["authOptions"]["mode"] = "tokens"                     # KubeRay 1.5.1's enum
    bad["spec"]["autoscalerOptions"]["upscalingMode"] = "Fast"
    paths = {".".join(map(str, e.path)) for e in v.iter_errors(bad)}
    assert paths == {"spec.workerGroupSpecs.0", "spec.workerGroupSpecs.1",
                     "spec.headGroupSpec.rayStartParams.num-cpus", "spec.workerGroupSpecs.1.maxReplicas",
                     "spec.authOptions.mode", "spec.autoscalerOptions.upscalingMode"}


# --- the serve config --------------------------------------------------------------------------

def test_serve_config_loads_through_serveconfig(resources, config):
    """The ConfigMap's YAML is exactly ServeConfig (extra keys are forbidden by the model)."""
    assert config.mode == "disaggregated"
    assert config.ray_address == "auto", "the router pod runs `ray start`, then joins its local raylet"
    assert config.host == "0.0.0.0", "a Service reaches the pod IP, not loopback"


def test_serve_config_asks_for_one_actor_per_worker_pod(resources, config):
    """A fresh cluster starts one worker per pod of each group; the planner's bounds are the
    groups' autoscaling bounds (one worker per pod, so every worker it asks for has a pod)."""
    cluster = _cluster(resources)
    p = config.planner
    for role, wanted, lo, hi in (("prefill", config.prefill, p.min_prefill, p.max_prefill),
                                 ("decode", config.decode, p.min_decode, p.max_decode)):
        g = worker_group(cluster, role)
        assert g["replicas"] == wanted, f"{role}: serve.yaml starts {wanted} workers, the group {g['replicas']} pods"
        assert p.enabled and (g["minReplicas"], g["maxReplicas"]) == (lo, hi), (
            f"{role}: planner bounds {lo}..{hi} != group min/max {g['minReplicas']}..{g['maxReplicas']}")
        assert lo <= wanted <= hi
        assert g.get("numOfHosts", 1) == 1
    assert cluster["spec"]["enableInTreeAutoscaling"] is True, "the planner needs the Ray autoscaler"
    assert config.detached_workers, "workers must outlive the router replicas"


def test_ray_token_auth_is_on_and_the_router_carries_the_token(resources):
    cluster = _cluster(resources)
    assert cluster["spec"]["authOptions"] == {"mode": "token"}
    env = {e["name"]: e for e in _router_container(resources)["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    # KubeRay (>= 1.5.1) names the Secret after the RayCluster, with the key auth_token
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": cluster["metadata"]["name"],
                                                                  "key": "auth_token"}


def test_no_dashboard_or_client_port_on_any_service(resources):
    """KubeRay's head Service carries the head container's ports (plus metrics): keep the dashboard
    (8265) and the Ray Client (10001) off it, and off every Service we define."""
    head = _cluster(resources)["spec"]["headGroupSpec"]
    ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert set(ports) == {"gcs-server", "metrics"}, ports
    assert "headService" not in head
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    for svc in (r for r in resources if r["kind"] == "Service"):
        for p in svc["spec"]["ports"]:
            assert p["port"] not in (8265, 10001) and p.get("targetPort") not in (8265, 10001, "dashboard", "client")


def test_routers_are_replicas_rolled_one_at_a_time(resources):
    d = _router(resources)["spec"]
    assert d["replicas"] >= 2
    assert d["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    pdb = _pdb(resources, "tandem-router")["spec"]
    assert pdb["minAvailable"] == d["replicas"] - 1 >= 1, "a drain may take one router, never all"
    anti = d["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]["topologyKey"] == \
        "kubernetes.io/hostname"


def test_router_port_probes_service_and_config_agree(resources, config):
    c = _router_container(resources)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == config.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert (get["path"], get["port"]) == ("/health", "http"), probe
    svc = one(resources, "Service", "tandem-router")
    assert [(p["name"], p["targetPort"]) for p in svc["spec"]["ports"]] == [("http", "http")]
    labels = _router(resources)["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert _router(resources)["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_router_mounts_the_config_it_is_given(resources):
    spec = _router(resources)["spec"]["template"]["spec"]
    vol = one([{"kind": "v", "metadata": {"name": v["name"]}, **v} for v in spec["volumes"]], "v", "serve-config")
    assert vol["configMap"]["name"] == SERVE_CONFIGMAP
    mount = [m for m in _router_container(resources)["volumeMounts"] if m["name"] == "serve-config"]
    assert mount and mount[0]["mountPath"] == "/etc/tandem" and mount[0]["readOnly"]
    assert SERVE_KEY in one(resources, "ConfigMap", SERVE_CONFIGMAP)["data"]


def test_router_reads_its_api_keys_from_a_secret_it_mounts(resources, config):
    """serve.yaml's key file is the mounted Secret's (read-only, no subPath, so the kubelet can
    refresh it for a SIGHUP reload), and no key file, Secret or key ships in the manifests."""
    spec = _router(resources)["spec"]["template"]["spec"]
    vol = one([{"kind": "v", "metadata": {"name": v["name"]}, **v} for v in spec["volumes"]], "v", "api-keys")
    assert vol["secret"]["secretName"] == "tandem-api-keys" and "optional" not in vol["secret"]
    [item] = vol["secret"]["items"]
    [mount] = [m for m in _router_container(resources)["volumeMounts"] if m["name"] == "api-keys"]
    assert mount["readOnly"] and "subPath" not in mount
    assert config.api_keys == f"{mount['mountPath']}/{item['path']}"
    assert not any(r["kind"] == "Secret" for r in resources)
    assert "key:" not in serve_yaml(resources) and "sk-" not in json.dumps(resources)


# --- commands: Tandem's CLI and Ray's ----------------------------------------------------------

_SEPARATORS = {";", "&&", "||", "|", "&"}
_KEYWORDS = {"until", "while", "do", "done", "if", "then", "else", "fi"}
_REDIRECTS = {">", ">>", "<", ">&", "&>", "<&"}


def simple_commands(script: str) -> list[list[str]]:
    """The simple commands of a small bash script, redirections and loop keywords removed."""
    out: list[list[str]] = []
    for line in shell_lines(script):
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        tokens, cmd, skip = list(lex), [], False
        for i, tok in enumerate(tokens):
            if skip:
                skip = False
            elif tok in _SEPARATORS:
                out.append(cmd) if cmd else None
                cmd = []
            elif tok in _REDIRECTS:
                if cmd and cmd[-1].isdigit() and i > 0 and tokens[i - 1] == cmd[-1]:
                    cmd.pop()
                skip = True
            elif not cmd and tok in _KEYWORDS:
                continue
            else:
                cmd.append(tok)
        if cmd:
            out.append(cmd)
    return out


def _router_script(resources) -> str:
    c = _router_container(resources)
    assert c["command"] == ["/bin/bash", "-c"] and len(c["args"]) == 1
    return c["args"][0]


def _tandem_argv(resources) -> list[str]:
    cmds = [c[1:] if c[0] == "exec" else c for c in simple_commands(_router_script(resources))]
    tandem = [c for c in cmds if c[0] == "tandem"]
    assert len(tandem) == 1, f"expected one `tandem` command in the router script, got {tandem}"
    assert simple_commands(_router_script(resources))[-1][:2] == ["exec", "tandem"], \
        "the router must `exec tandem` last, so it gets SIGTERM as PID 1's replacement"
    return tandem[0][1:]


def test_router_command_exists_in_the_cli(resources):
    cli = pytest.importorskip("tandem.cluster.cli",
                              reason="the lead's CLI (tandem.cluster.cli.build_parser) is not in the repo yet")
    if not hasattr(cli, "build_parser"):
        pytest.skip("tandem.cluster.cli has no build_parser() yet")
    argv = _tandem_argv(resources)
    assert argv[0] == "serve"
    try:
        args = cli.build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"`tandem {' '.join(argv)}` is rejected by tandem.cluster.cli (exit {e.code})")
    assert getattr(args, "config", None) == "/etc/tandem/serve.yaml"


def test_router_script_ray_commands_parse_with_rays_cli(resources):
    from ray.scripts.scripts import cli as ray_cli

    ray_cmds = [c for c in simple_commands(_router_script(resources)) if c[0] == "ray"]
    assert [c[1] for c in ray_cmds] == ["health-check", "start"]
    for c in ray_cmds:
        ctx = ray_cli.commands[c[1]].make_context(c[1], c[2:])  # raises on an unknown or bad option
        if c[1] == "start":
            assert ctx.params["num_cpus"] == 0 and ctx.params["num_gpus"] == 0, \
                "nothing may be scheduled on the router's Ray node"
            assert not ctx.params["head"]


def test_ray_start_params_parse_with_rays_cli(resources):
    """Each rayStartParams key is a `ray start` option, and each value parses as its type."""
    from ray.scripts.scripts import cli as ray_cli

    start = ray_cli.commands["start"]
    cluster = _cluster(resources)
    head = cluster["spec"]["headGroupSpec"]["rayStartParams"]
    ctx = start.make_context("start", ["--head", *ray_start_argv(head)])
    assert ctx.params["num_cpus"] == 0, "no actors on the head"
    for role in ROLES:
        params = worker_group(cluster, role)["rayStartParams"]
        ctx = start.make_context("start", ["--address=tandem-head-svc:6379", *ray_start_argv(params)])
        assert json.loads(ctx.params["resources"]) == {role: 1}, \
            f"a {role} pod must offer exactly one {role!r} Ray resource"


# --- resources, sizing, images -----------------------------------------------------------------

def test_every_container_has_requests_and_limits(resources):
    for r in resources:
        for where, _spec, c in containers(r):
            req, lim = c["resources"]["requests"], c["resources"]["limits"]
            for k in ("cpu", "memory"):
                assert k in req and k in lim, f"{where}: {k} request and limit"
                assert quantity(req[k]) <= quantity(lim[k]), f"{where}: {k} request > limit"
            assert req["memory"] == lim["memory"], f"{where}: memory request != limit invites OOM kills"
            for k in set(req) | set(lim):
                if k.startswith("nvidia.com/"):
                    assert req.get(k) == lim.get(k), f"{where}: extended resources need request == limit"


def test_gpus_only_on_gpu_workers(overlay, resources, config):
    cluster = _cluster(resources)
    for r in resources:
        for where, _spec, c in containers(r):
            gpus = c["resources"]["limits"].get("nvidia.com/gpu", 0)
            is_worker = r["kind"] == "RayCluster" and "workerGroupSpecs" in where
            assert gpus == (1 if overlay == "gpu" and is_worker else 0), f"{where}: nvidia.com/gpu={gpus}"
    for role in ROLES:
        g = worker_group(cluster, role)
        p = g["rayStartParams"]
        c = g["template"]["spec"]["containers"][0]
        assert _int_rayparam(p, "num-cpus") == quantity(c["resources"]["limits"]["cpu"]), \
            f"{role}: Ray's num-cpus must equal the container's CPU limit"
        assert int(p.get("num-gpus", 0)) == c["resources"]["limits"].get("nvidia.com/gpu", 0)
        if overlay == "gpu":
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
                g["template"]["spec"]["tolerations"]
    assert config.engine_config.device == ("cuda" if overlay == "gpu" else "cpu")


def test_worker_actors_ask_for_their_pods_gpus(overlay, resources, config):
    """Each role's configured ``num_gpus`` (cluster/launch.py ``role_num_gpus``) is what its
    group's pod requests as ``nvidia.com/gpu`` and offers Ray as ``num-gpus``: the actor holds
    the pod's GPU (its pools go to that GPU) and no GPU sits unclaimed. The CPU overlay asks none."""
    from tandem.cluster.launch import role_num_gpus

    cluster = _cluster(resources)
    for role in ROLES:
        g = worker_group(cluster, role)
        per_pod = g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0)
        asked = role_num_gpus(config, role) or 0
        assert asked == per_pod == int(g["rayStartParams"].get("num-gpus", 0)), (
            f"{role}: actor asks num_gpus={asked}, the pod has nvidia.com/gpu={per_pod}")
        assert (per_pod >= 1) == (overlay == "gpu")


def test_cpu_workers_pin_torch_threads_to_their_cpu_limit(overlay, resources, config):
    if config.engine_config.device != "cpu":
        pytest.skip("GPU workers do not compute on CPU threads")
    for role in ROLES:
        c = worker_group(_cluster(resources), role)["template"]["spec"]["containers"][0]
        threads = config.engine_config.num_threads
        assert threads is not None and threads <= quantity(c["resources"]["limits"]["cpu"]), \
            f"{role}: num_threads={threads} oversubscribes the CPU limit"


def _kv_bytes_per_token(config: ServeConfig) -> int:
    layers, kv_heads, head_dim = KV_SHAPES[config.engine_config.model]
    dtype = config.engine_config.dtype
    assert dtype != "auto", "set engine_config.dtype in the overlays so the sizing is explicit"
    return layers * 2 * kv_heads * head_dim * DTYPE_BYTES[dtype]


def test_worker_memory_holds_kv_host_pool_and_object_store(resources, config):
    """README "Sizing": a worker's memory limit covers its host KV (and its device KV on CPU),
    Ray's object store (in /dev/shm, counted against the pod) and a fixed overhead."""
    bpt = _kv_bytes_per_token(config)
    cache = config.engine_config.cache
    for role in ROLES:
        g = worker_group(_cluster(resources), role)
        c = g["template"]["spec"]["containers"][0]
        device_tokens = (config.decode_max_total_tokens or cache.max_total_tokens) if role == "decode" \
            else cache.max_total_tokens
        host_bytes = cache.host_pool_tokens * bpt
        if config.engine_config.device == "cpu":
            host_bytes += device_tokens * bpt
        store = int(g["rayStartParams"]["object-store-memory"])
        need = host_bytes + store + WORKER_OVERHEAD_BYTES
        have = quantity(c["resources"]["limits"]["memory"])
        assert have >= need, f"{role}: memory limit {have / 2**30:.1f} GiB < needed {need / 2**30:.1f} GiB"


def test_shm_holds_the_object_store(resources):
    cluster = _cluster(resources)
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    for g in groups:
        spec = g["template"]["spec"]
        shm = [v for v in spec["volumes"] if v["name"] == "dshm"][0]["emptyDir"]
        assert shm["medium"] == "Memory"
        mounts = [m["mountPath"] for m in spec["containers"][0]["volumeMounts"]]
        assert "/dev/shm" in mounts
        assert quantity(shm["sizeLimit"]) >= int(g["rayStartParams"]["object-store-memory"]), \
            f"{g.get('groupName', 'head')}: /dev/shm smaller than the object store"


def test_one_pinned_image_for_the_whole_cluster(overlay, resources):
    """Ray needs the same Ray and Python version on every node, the router's included."""
    images = {c["image"] for r in resources for _w, _s, c in containers(r)}
    assert len(images) == 1, f"several images in one cluster: {images}"
    image = images.pop()
    name, _, tag = image.rpartition(":")
    assert name and tag and tag != "latest" and "/" not in tag, f"unpinned image {image!r}"
    assert tag.endswith("-gpu" if overlay == "gpu" else "-cpu")


def test_pods_run_as_the_images_non_root_user(resources):
    for r in resources:
        for where, tpl in pod_templates(r):
            sc = tpl["spec"]["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] == RUN_AS_USER, where
            for c in tpl["spec"]["containers"]:
                assert c["securityContext"]["allowPrivilegeEscalation"] is False, f"{where} {c['name']}"


def test_every_container_has_readiness_and_liveness_probes(resources):
    for r in resources:
        for where, _spec, c in containers(r):
            assert "readinessProbe" in c and "livenessProbe" in c, where


# --- KV transfer env, disruption budgets, monitoring -------------------------------------------

def test_gpu_workers_configure_ucx_for_nixl(overlay, resources):
    for role in ROLES:
        c = worker_group(_cluster(resources), role)["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        if overlay != "gpu":
            assert "UCX_TLS" not in env
            continue
        assert list(env) == ["RAY_USAGE_STATS_ENABLED", "UCX_TLS", "UCX_NET_DEVICES"], \
            "k8s/README.md's RDMA patch addresses UCX_NET_DEVICES as env/2"
        tls = env["UCX_TLS"].split(",")
        assert {"rc", "cuda_copy", "tcp"} <= set(tls), f"{role}: UCX_TLS={env['UCX_TLS']}"
        assert env["UCX_NET_DEVICES"]


def _pdb(resources, name):
    return one(resources, "PodDisruptionBudget", name)


def test_disruption_budgets_match_the_groups(resources):
    cluster = _cluster(resources)
    for role in ROLES:
        g = worker_group(cluster, role)
        pdb = _pdb(resources, f"tandem-{role}")["spec"]
        # Ray pods' owner (the RayCluster) has no /scale: only an integer minAvailable is allowed.
        assert "maxUnavailable" not in pdb and isinstance(pdb["minAvailable"], int)
        assert pdb["minAvailable"] == g["replicas"] - 1, f"{role}: minAvailable must be replicas - 1"
        # KubeRay's pod labels
        assert pdb["selector"]["matchLabels"] == {"ray.io/cluster": cluster["metadata"]["name"],
                                                  "ray.io/group": role}
    head = _pdb(resources, "tandem-head")["spec"]
    assert head == {"minAvailable": 1, "selector": {"matchLabels": {
        "ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}}}
    router = _pdb(resources, "tandem-router")["spec"]
    labels = _router(resources)["spec"]["template"]["metadata"]["labels"]
    assert router["minAvailable"] >= 1 and router["selector"]["matchLabels"].items() <= labels.items()


def test_servicemonitor_scrapes_the_router_metrics(resources):
    sm = one(resources, "ServiceMonitor", "tandem-router")["spec"]
    svc = one(resources, "Service", "tandem-router")
    assert sm["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    port_names = {p["name"] for p in svc["spec"]["ports"]}
    assert [(e["port"], e["path"]) for e in sm["endpoints"]] == [("http", "/metrics")]
    assert sm["endpoints"][0]["port"] in port_names


def test_dashboard_ships_as_a_grafana_configmap(resources):
    cm = one(resources, "ConfigMap", "tandem-grafana-dashboard")
    assert cm["metadata"]["labels"] == {"grafana_dashboard": "1"}
    assert cm["data"] == {DASHBOARD.name: DASHBOARD.read_text()}


def test_kv_store_storage_joins_its_master_with_tandems_flags(resources):
    """The storage container beside the Mooncake master runs cache/tiers/l3/mooncake.py's
    ``storage_args`` against the master container's ports, and its memory limit holds the
    segment it lends."""
    from tandem.cache.tiers.l3.mooncake import MasterAddress, storage_args

    pod = one(resources, "Deployment", "tandem-kv-store")["spec"]["template"]["spec"]
    by_name = {c["name"]: c for c in pod["containers"]}
    master, storage = by_name["master"], by_name["storage"]
    mflags = dict(a.lstrip("-").split("=", 1) for a in master["args"])
    sflags = dict(a.lstrip("-").split("=", 1) for a in storage["args"])
    segment = int(sflags["global_segment_size"])
    want = storage_args(MasterAddress("127.0.0.1", int(mflags["port"]), int(mflags["http_metadata_server_port"])),
                        segment, host="$(POD_IP)", port=int(sflags["port"]))
    assert storage["command"] == ["mooncake_client"] and storage["args"] == want
    assert segment <= quantity(storage["resources"]["limits"]["memory"]) - (256 << 20)
    assert any(e["name"] == "POD_IP" for e in storage["env"])
