"""The Grafana dashboard (k8s/base/dashboards/tandem.json) plots only series a live `tandem serve`
exports. The live comparison against a running server's /metrics reuses k8s_dashboard_metric_names."""

from __future__ import annotations

import json

from k8s_support import (DASHBOARD, TANDEM_COUNTERS, TANDEM_HISTOGRAMS, k8s_dashboard_metric_names,
                         tandem_series_names)


def test_dashboard_uses_only_exported_series():
    names = k8s_dashboard_metric_names(DASHBOARD)
    assert names, "no tandem_* series found in the dashboard's queries"
    unknown = names - tandem_series_names()
    assert not unknown, f"the dashboard queries series tandem serve does not export: {sorted(unknown)}"


def test_dashboard_covers_every_family():
    names = k8s_dashboard_metric_names(DASHBOARD)
    missing = {c for c in TANDEM_COUNTERS if c not in names} | {
        h for h in TANDEM_HISTOGRAMS if f"{h}_bucket" not in names}
    assert not missing, f"no panel for {sorted(missing)}"


def test_dashboard_structure():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert set(p["gridPos"]) == {"h", "w", "x", "y"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert 'namespace=~"$namespace"' in t["expr"], f"{p['title']}: {t['expr']}"


def test_metric_name_extraction(tmp_path):
    """Names come from PromQL only (targets, template queries), never from titles or legends."""
    dash = {
        "title": "tandem_not_a_metric",
        "templating": {"list": [{"name": "ns", "definition": "label_values(tandem_a_total, namespace)",
                                 "query": {"query": "label_values(tandem_b_total, namespace)"}}]},
        "panels": [
            {"title": "x", "targets": [
                {"expr": 'histogram_quantile(0.9, sum by (le) (rate(tandem_h_seconds_bucket{job="x"}[5m])))',
                 "legendFormat": "tandem_legend"},
                {"expr": "sum(rate(tandem_c_total[1m])) / sum(rate(nottandem_d_total[1m]))"}]},
            {"title": "row", "panels": [{"targets": [{"expr": "tandem_nested_total"}]}]},
        ],
    }
    path = tmp_path / "d.json"
    path.write_text(json.dumps(dash))
    assert k8s_dashboard_metric_names(path) == {"tandem_a_total", "tandem_b_total", "tandem_h_seconds_bucket",
                                                "tandem_c_total", "tandem_nested_total"}
