"""The test renderer behaves like kustomize on the features k8s/ uses, and refuses the others."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from kustomize_lite import KustomizeError, json6902, json_merge, render, strategic_merge

DEPLOY = {
    "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
    "spec": {"template": {"spec": {"containers": [
        {"name": "a", "image": "a:1", "env": [{"name": "X", "value": "1"}], "args": ["x"]},
        {"name": "b", "image": "b:1"}]}}},
}


def _write(d, files: dict[str, object]) -> None:
    for name, body in files.items():
        p = d / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(body if isinstance(body, str) else yaml.safe_dump(body))


def test_strategic_merge_merges_lists_with_a_merge_key_and_replaces_others():
    patch = {"spec": {"template": {"spec": {"containers": [
        {"name": "a", "env": [{"name": "Y", "value": "2"}], "args": ["y"]}, {"name": "c", "image": "c:1"}]}}}}
    out = strategic_merge(DEPLOY, patch)
    a, b, c = out["spec"]["template"]["spec"]["containers"]
    assert a == {"name": "a", "image": "a:1", "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}],
                 "args": ["y"]}
    assert b == {"name": "b", "image": "b:1"} and c == {"name": "c", "image": "c:1"}
    assert DEPLOY["spec"]["template"]["spec"]["containers"][0]["args"] == ["x"], "input not mutated"
    with pytest.raises(KustomizeError):
        strategic_merge(DEPLOY, {"spec": {"$patch": "replace"}})


def test_json_merge_replaces_lists_and_deletes_nulls():
    out = json_merge({"a": [1, 2], "b": {"c": 1, "d": 2}}, {"a": [3], "b": {"c": None, "e": 5}})
    assert out == {"a": [3], "b": {"d": 2, "e": 5}}


def test_json6902_ops():
    doc = {"l": [{"n": "p"}, {"n": "d"}], "m": {"k": "v"}}
    out = json6902(doc, [
        {"op": "test", "path": "/l/1/n", "value": "d"},
        {"op": "add", "path": "/l/-", "value": {"n": "x"}},
        {"op": "add", "path": "/l/0", "value": {"n": "first"}},
        {"op": "replace", "path": "/m/k", "value": "w"},
        {"op": "add", "path": "/m/a~1b", "value": 1},
        {"op": "remove", "path": "/l/1"},
    ])
    assert out == {"l": [{"n": "first"}, {"n": "d"}, {"n": "x"}], "m": {"k": "w", "a/b": 1}}
    with pytest.raises(KustomizeError, match="test failed"):
        json6902(doc, [{"op": "test", "path": "/l/0/n", "value": "d"}])
    with pytest.raises(KustomizeError, match="does not exist"):
        json6902(doc, [{"op": "replace", "path": "/m/missing", "value": 1}])
    with pytest.raises(KustomizeError, match="not supported"):
        json6902(doc, [{"op": "move", "from": "/m", "path": "/n"}])


def test_overlay_generator_replace_and_patches(tmp_path):
    base, over = tmp_path / "base", tmp_path / "over"
    _write(base, {
        "kustomization.yaml": {"resources": ["d.yaml", "rc.yaml"], "generatorOptions": {"disableNameSuffixHash": True},
                               "configMapGenerator": [{"name": "cfg", "files": ["c.yaml"],
                                                       "options": {"labels": {"l": "1"}}}]},
        "d.yaml": DEPLOY,
        "rc.yaml": {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "r"},
                    "spec": {"workerGroupSpecs": [{"groupName": "p"}, {"groupName": "d"}]}},
        "c.yaml": "a: 1\n",
    })
    _write(over, {
        "kustomization.yaml": {
            "resources": ["../base"], "generatorOptions": {"disableNameSuffixHash": True},
            "configMapGenerator": [{"name": "cfg", "behavior": "replace", "files": ["serve.yaml=c2.yaml"]}],
            "patches": [
                {"path": "p.yaml"},
                {"path": "rc.yaml", "target": {"group": "ray.io", "version": "v1", "kind": "RayCluster", "name": "r"}},
                {"patch": textwrap.dedent("""\
                    apiVersion: ray.io/v1
                    kind: RayCluster
                    metadata: {name: r}
                    spec: {workerGroupSpecs: [{groupName: only}]}
                    """)},
            ]},
        "c2.yaml": "b: 2\n",
        "p.yaml": {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
                   "spec": {"replicas": 3}},
        "rc.yaml": [{"op": "replace", "path": "/spec/workerGroupSpecs/1/groupName", "value": "dd"}],
    })
    out = {r["kind"]: r for r in render(over)}
    assert out["ConfigMap"]["data"] == {"serve.yaml": "b: 2\n"}
    assert out["ConfigMap"]["metadata"]["labels"] == {"l": "1"}, "replace keeps the base's labels"
    assert out["Deployment"]["spec"]["replicas"] == 3
    assert out["Deployment"]["spec"]["template"] == DEPLOY["spec"]["template"]
    # the strategic-merge patch of a custom resource replaces its list, as kustomize does
    assert out["RayCluster"]["spec"]["workerGroupSpecs"] == [{"groupName": "only"}]


@pytest.mark.parametrize("kustomization, error", [
    ({"resources": [], "namePrefix": "x-"}, "unsupported kustomization keys"),
    ({"resources": [], "configMapGenerator": [{"name": "c", "literals": ["a=b"]}]}, "disableNameSuffixHash"),
    ({"resources": [], "generatorOptions": {"disableNameSuffixHash": True},
      "configMapGenerator": [{"name": "c", "files": ["../outside.yaml"]}]}, "load restrictor"),
    ({"resources": ["d.yaml"], "patches": [{"path": "two.yaml"}]}, "one document per patch"),
    ({"resources": ["d.yaml"], "patches": [{"patch": "[{op: add, path: /x, value: 1}]"}]}, "needs a target"),
    ({"resources": ["d.yaml"], "patches": [{"patch": "{apiVersion: v1, kind: Service, metadata: {name: d}}"}]},
     "matches nothing"),
    ({"resources": ["d.yaml", "d.yaml"]}, "duplicate resource"),
])
def test_unsupported_or_wrong_kustomizations_are_refused(tmp_path, kustomization, error):
    (tmp_path / "outside.yaml").write_text("x: 1\n")
    k = tmp_path / "k"
    _write(k, {"kustomization.yaml": kustomization, "d.yaml": DEPLOY,
               "two.yaml": "a: 1\n---\nb: 2\n"})
    with pytest.raises(KustomizeError, match=error):
        render(k)
