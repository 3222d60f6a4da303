"""A small, strict kustomize renderer for the tests (the real command is ``kubectl kustomize DIR``).

It supports exactly the subset of kustomization.yaml that k8s/ uses, and refuses anything else,
so a manifest can never rely on a feature this renderer silently ignores:

- ``resources``: YAML files (multi-document allowed) and directories holding a kustomization.yaml;
- ``configMapGenerator``: ``name``, ``files`` (``key=path`` or ``path``), ``literals``, ``behavior``
  (create / replace / merge), ``options.labels`` / ``options.annotations``;
- ``generatorOptions``: only ``disableNameSuffixHash: true`` (we never rely on hash suffixes, because
  kustomize would not rewrite references to a hashed name inside the RayCluster's pod templates);
- ``patches``: each with ``path`` or inline ``patch`` and an optional ``target`` (kind, name, group,
  version). A patch whose document is a list is a JSON 6902 patch (ops ``add``, ``remove``,
  ``replace``, ``test``); otherwise it is a strategic-merge patch.

Strategic merge follows kustomize: built-in kinds merge the lists that Kubernetes declares with a
``patchMergeKey`` (containers by name, env by name, ...); kinds kustomize has no schema for (our
RayCluster, the ServiceMonitor) get JSON merge-patch semantics (RFC 7386: lists are replaced whole),
which is why the overlays patch the RayCluster with JSON 6902 ops instead.

Files referenced by a kustomization must lie inside its directory (kustomize's load restrictor).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "configMapGenerator", "generatorOptions", "patches"}
GENERATOR_KEYS = {"name", "files", "literals", "behavior", "options"}
GENERATOR_OPTION_KEYS = {"labels", "annotations", "disableNameSuffixHash"}
PATCH_KEYS = {"path", "patch", "target"}
TARGET_KEYS = {"kind", "name", "group", "version"}

# patchMergeKey of the list fields we patch in built-in kinds (from k8s.io/api's struct tags).
# A list field not named here is replaced whole, as Kubernetes does for lists without a merge key.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
}
BUILTIN_GROUPS = {"", "apps", "policy", "batch", "networking.k8s.io", "autoscaling", "rbac.authorization.k8s.io"}


class KustomizeError(ValueError):
    """The kustomization uses something this renderer does not support, or is wrong."""


def render(directory: str | Path) -> list[dict[str, Any]]:
    """Render a kustomization directory into a list of resource dicts (base first, then overlays)."""
    return _render(Path(directory).resolve())


def _load_kustomization(directory: Path) -> dict[str, Any]:
    path = directory / "kustomization.yaml"
    if not path.is_file():
        raise KustomizeError(f"no kustomization.yaml in {directory}")
    k = yaml.safe_load(path.read_text()) or {}
    unknown = set(k) - KUSTOMIZATION_KEYS
    if unknown:
        raise KustomizeError(f"{path}: unsupported kustomization keys {sorted(unknown)} "
                             f"(supported: {sorted(KUSTOMIZATION_KEYS)})")
    if k.get("kind", "Kustomization") != "Kustomization":
        raise KustomizeError(f"{path}: kind must be Kustomization")
    return k


def _inside(directory: Path, rel: str) -> Path:
    p = (directory / rel).resolve()
    if p != directory and directory not in p.parents:
        raise KustomizeError(f"{rel!r} is outside {directory} (kustomize's load restrictor forbids it)")
    return p


def _inside_or_dir(directory: Path, rel: str) -> Path:
    """Resources may name another kustomization directory anywhere (e.g. ../../base); files must be inside."""
    p = (directory / rel).resolve()
    return p if p.is_dir() else _inside(directory, rel)


def _render(directory: Path) -> list[dict[str, Any]]:
    k = _load_kustomization(directory)
    out: list[dict[str, Any]] = []
    for rel in k.get("resources", []):
        p = _inside_or_dir(directory, rel)
        if p.is_dir():
            out.extend(_render(p))
        else:
            out.extend(d for d in yaml.safe_load_all(p.read_text()) if d)
    _check_unique(out, directory)

    gen_opts = k.get("generatorOptions", {})
    if set(gen_opts) - {"disableNameSuffixHash"} or (k.get("configMapGenerator") and
                                                     gen_opts.get("disableNameSuffixHash") is not True):
        raise KustomizeError(f"{directory}: configMapGenerator needs generatorOptions.disableNameSuffixHash: "
                             "true (hash suffixes are not supported)")
    for gen in k.get("configMapGenerator", []):
        _apply_generator(out, gen, directory)

    for patch in k.get("patches", []):
        _apply_patch(out, patch, directory)
    _check_unique(out, directory)
    return out


def _key(res: dict[str, Any]) -> tuple[str, str, str]:
    return (res.get("apiVersion", ""), res.get("kind", ""), res.get("metadata", {}).get("name", ""))


def _check_unique(resources: list[dict[str, Any]], directory: Path) -> None:
    seen: set[tuple[str, str, str]] = set()
    for r in resources:
        if _key(r) in seen:
            raise KustomizeError(f"{directory}: duplicate resource {_key(r)}")
        seen.add(_key(r))


# --- configMapGenerator ------------------------------------------------------------------------

def _apply_generator(resources: list[dict[str, Any]], gen: dict[str, Any], directory: Path) -> None:
    unknown = set(gen) - GENERATOR_KEYS
    if unknown:
        raise KustomizeError(f"{directory}: unsupported configMapGenerator keys {sorted(unknown)}")
    opts = gen.get("options", {})
    if set(opts) - GENERATOR_OPTION_KEYS:
        raise KustomizeError(f"{directory}: unsupported generator options {sorted(set(opts) - GENERATOR_OPTION_KEYS)}")
    data: dict[str, str] = {}
    for spec in gen.get("files", []):
        key, _, rel = spec.rpartition("=") if "=" in spec else ("", "", spec)
        path = _inside(directory, rel)
        data[key or path.name] = path.read_text()
    for lit in gen.get("literals", []):
        key, sep, value = lit.partition("=")
        if not sep:
            raise KustomizeError(f"{directory}: literal {lit!r} is not key=value")
        data[key] = value
    meta: dict[str, Any] = {"name": gen["name"]}
    if opts.get("labels"):
        meta["labels"] = dict(opts["labels"])
    if opts.get("annotations"):
        meta["annotations"] = dict(opts["annotations"])
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}

    behavior = gen.get("behavior", "create")
    idx = next((i for i, r in enumerate(resources) if _key(r) == _key(cm)), None)
    if behavior == "create":
        if idx is not None:
            raise KustomizeError(f"{directory}: ConfigMap {gen['name']} already exists (use behavior: replace)")
        resources.append(cm)
    elif behavior in ("replace", "merge"):
        if idx is None:
            raise KustomizeError(f"{directory}: behavior {behavior} but no ConfigMap {gen['name']} in the bases")
        old = resources[idx]
        if behavior == "merge":
            cm["data"] = {**old.get("data", {}), **data}
        # kustomize keeps the base's labels/annotations and adds the overlay's
        for field in ("labels", "annotations"):
            merged = {**old["metadata"].get(field, {}), **meta.get(field, {})}
            if merged:
                cm["metadata"][field] = merged
        resources[idx] = cm
    else:
        raise KustomizeError(f"{directory}: unknown generator behavior {behavior!r}")


# --- patches -----------------------------------------------------------------------------------

def _matches(res: dict[str, Any], target: dict[str, Any]) -> bool:
    group, _, version = res.get("apiVersion", "").rpartition("/")
    return (target.get("kind", res.get("kind")) == res.get("kind")
            and target.get("name", res["metadata"]["name"]) == res["metadata"]["name"]
            and target.get("group", group) == group
            and target.get("version", version) == version)


def _apply_patch(resources: list[dict[str, Any]], patch: dict[str, Any], directory: Path) -> None:
    unknown = set(patch) - PATCH_KEYS
    if unknown or ("path" in patch) == ("patch" in patch):
        raise KustomizeError(f"{directory}: a patch needs exactly one of path/patch (and optional target): {patch}")
    text = _inside(directory, patch["path"]).read_text() if "path" in patch else patch["patch"]
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    if len(docs) != 1:
        raise KustomizeError(f"{directory}: one document per patch, got {len(docs)} in {patch}")
    body = docs[0]
    target = patch.get("target")
    if target is not None and set(target) - TARGET_KEYS:
        raise KustomizeError(f"{directory}: unsupported target keys {sorted(set(target) - TARGET_KEYS)}")

    if isinstance(body, list):  # JSON 6902
        if target is None:
            raise KustomizeError(f"{directory}: a JSON 6902 patch needs a target")
        hits = [i for i, r in enumerate(resources) if _matches(r, target)]
        if not hits:
            raise KustomizeError(f"{directory}: patch target {target} matches nothing")
        for i in hits:
            resources[i] = json6902(resources[i], body)
        return

    if not isinstance(body, dict):
        raise KustomizeError(f"{directory}: a strategic-merge patch must be a mapping")
    if target is None:
        target = {"kind": body.get("kind"), "name": body.get("metadata", {}).get("name")}
        group, _, version = body.get("apiVersion", "").rpartition("/")
        target.update(group=group, version=version)
    hits = [i for i, r in enumerate(resources) if _matches(r, target)]
    if not hits:
        raise KustomizeError(f"{directory}: patch target {target} matches nothing")
    for i in hits:
        res = resources[i]
        group = res["apiVersion"].rpartition("/")[0]
        builtin = group in BUILTIN_GROUPS
        patched = strategic_merge(res, body) if builtin else json_merge(res, body)
        resources[i] = patched


def json_merge(base: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: mappings merge recursively, null deletes, anything else replaces."""
    if not isinstance(patch, dict) or not isinstance(base, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = json_merge(out.get(k), v)
    return out


def strategic_merge(base: Any, patch: Any, field: str | None = None) -> Any:
    """Kubernetes strategic merge for the lists named in MERGE_KEYS; other lists are replaced."""
    if isinstance(patch, dict):
        if any(k.startswith("$") for k in patch):
            raise KustomizeError(f"strategic-merge directives are not supported: {sorted(patch)}")
        if not isinstance(base, dict):
            return copy.deepcopy(patch)
        out = copy.deepcopy(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = strategic_merge(out.get(k), v, k)
        return out
    if isinstance(patch, list) and field in MERGE_KEYS and isinstance(base, list):
        key = MERGE_KEYS[field]
        out = copy.deepcopy(base)
        for item in patch:
            if not isinstance(item, dict) or key not in item:
                raise KustomizeError(f"items of {field} must carry their merge key {key!r}: {item}")
            j = next((i for i, b in enumerate(out) if b.get(key) == item[key]), None)
            if j is None:
                out.append(copy.deepcopy(item))
            else:
                out[j] = strategic_merge(out[j], item)
        return out
    return copy.deepcopy(patch)


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise KustomizeError(f"JSON pointer must start with '/': {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str], path: str) -> Any:
    for p in parts:
        try:
            doc = doc[int(p)] if isinstance(doc, list) else doc[p]
        except (KeyError, IndexError, ValueError, TypeError):
            raise KustomizeError(f"JSON 6902 path {path!r} does not exist (at {p!r})") from None
    return doc


def json6902(resource: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """Apply RFC 6902 ops add/remove/replace/test (kustomize's JSON 6902 patches)."""
    doc = copy.deepcopy(resource)
    for op in ops:
        kind, path = op.get("op"), op.get("path", "")
        parts = _pointer(path)
        parent = _walk(doc, parts[:-1], path)
        last = parts[-1]
        if kind == "test":
            if _walk(doc, parts, path) != op["value"]:
                raise KustomizeError(f"JSON 6902 test failed at {path}")
        elif kind == "add":
            if isinstance(parent, list):
                idx = len(parent) if last == "-" else int(last)
                if not 0 <= idx <= len(parent):
                    raise KustomizeError(f"JSON 6902 add index out of range at {path}")
                parent.insert(idx, copy.deepcopy(op["value"]))
            elif isinstance(parent, dict):
                parent[last] = copy.deepcopy(op["value"])
            else:
                raise KustomizeError(f"JSON 6902 add: parent of {path} is not a container")
        elif kind in ("replace", "remove"):
            _walk(doc, parts, path)  # must exist
            if kind == "replace":
                if isinstance(parent, list):
                    parent[int(last)] = copy.deepcopy(op["value"])
                else:
                    parent[last] = copy.deepcopy(op["value"])
            elif isinstance(parent, list):
                del parent[int(last)]
            else:
                del parent[last]
        else:
            raise KustomizeError(f"JSON 6902 op {kind!r} is not supported (add, remove, replace, test)")
    return doc
