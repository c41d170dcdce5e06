"""The observability profile's files checked against docker-compose.yml and the services' settings: Prometheus
scrapes every rein service (each replica of a scaled one) on the port it listens on, and Grafana is
provisioned with a dashboard that shows the staleness metrics, so a moved port or a renamed metric shows
here rather than as an empty panel."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

from tests.support.compose_file import REIN_SERVICES, REPLICATED, REPO, _load_yaml, _service, listen

PROMETHEUS = REPO / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = REPO / "deploy" / "grafana"


def test_prometheus_scrapes_every_service_on_its_port(compose: dict[str, Any], loaded: dict[str, Any]) -> None:
    config = _load_yaml(PROMETHEUS)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    for name in REIN_SERVICES:
        assert name in jobs, f"prometheus.yml does not scrape {name}"
        job = jobs[name]
        port = listen(name, loaded[name])[1]
        if name in REPLICATED:
            sd = job["dns_sd_configs"][0]  # every replica, found through compose's DNS
            assert sd["names"] == [name] and sd["port"] == port
        else:
            assert job["static_configs"][0]["targets"] == [f"{name}:{port}"]
    prom = _service(compose, "prometheus")
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]
    assert prom["profiles"] == ["observability"]


STALENESS_METRICS = (
    "rein_staleness_version_gap_min",
    "rein_staleness_version_gap_max",
    "rein_staleness_version_gap_mean",
    "rein_staleness_version_span_min",
    "rein_staleness_version_span_max",
    "rein_staleness_version_span_mean",
    "rein_staleness_dropped_groups",
    "rein_staleness_partial_rollout_rejected_groups",
    "rein_staleness_partial_rollout_rejected_samples",
    "rein_staleness_current_version_index",
    "rein_staleness_cutoff_version_index",
    "rein_trainer_reward_mean",
    "rein_trainer_train_rollout_logprob_abs_diff",
)


def test_grafana_dashboard_is_provisioned_and_shows_the_staleness_metrics(compose: dict[str, Any]) -> None:
    datasource = _load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")["datasources"][0]
    assert urlsplit(datasource["url"]).hostname == "prometheus"
    provider = _load_yaml(GRAFANA / "provisioning" / "dashboards" / "rein.yml")["providers"][0]
    grafana = _service(compose, "grafana")
    mounted = {spec.split(":")[1]: spec.split(":")[0] for spec in grafana["volumes"]}
    assert mounted[provider["options"]["path"]] == "./deploy/grafana/dashboards"
    assert mounted["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"

    dashboard = json.loads((GRAFANA / "dashboards" / "rein.json").read_text(encoding="utf-8"))
    exprs = " ".join(
        t["expr"] for p in dashboard["panels"] for t in p.get("targets", []) if isinstance(t.get("expr"), str)
    )
    missing = [m for m in STALENESS_METRICS if m not in exprs]
    assert not missing, f"dashboard lacks {missing}"
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {datasource["uid"]}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
