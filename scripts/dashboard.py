"""The Grafana dashboard the chart ships (charts/devplugin/files/dashboard.json),
written from the panel table below by scripts/chart_schema.py.

Every query reads the daemon's and the extender's own metrics; `$namespace`
and `$pod` are the labels the Prometheus Operator's ServiceMonitor targets
carry, `$__rate_interval` Grafana's own. The tests run every query against
a real Prometheus scraping a real daemon and extender (tests/prometheus/).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

NODE = 'namespace=~"$namespace", pod=~"$pod"'
EXTENDER = 'namespace=~"$namespace"'
RATE = "[$__rate_interval]"
# Every query and variable reads the Prometheus the dashboard's first
# variable picks.
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@dataclass(frozen=True)
class Panel:
    title: str
    # (query, legend) pairs.
    targets: tuple[tuple[str, str], ...]
    unit: str = "short"
    description: str = ""
    kind: str = "timeseries"


def gauge(by: str, metric: str, *, how: str = "sum", where: str = NODE) -> str:
    return f"{how} by ({by}) ({metric}{{{where}}})"


def rate(by: str, metric: str, *, where: str = NODE) -> str:
    return f"sum by ({by}) (rate({metric}{{{where}}}{RATE}))"


def p99(by: str, metric: str, *, where: str = NODE) -> str:
    return f"histogram_quantile(0.99, sum by ({by}, le) (rate({metric}{{{where}}}{RATE})))"


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    ("Devices", (
        Panel("Devices by health",
              ((gauge("resource, health", "devplugin_devices"), "{{resource}} {{health}}"),),
              description="Devices each node serves, Healthy or not (a device kept out for a "
              "cleanup or a failed check counts as Unhealthy)."),
        Panel("Devices in custody, by phase",
              ((gauge("resource, phase", "devplugin_custody_devices"), "{{resource}} {{phase}}"),),
              description="Devices not free: being taken, held, owed or running a cleanup, "
              "quarantined after failed cleanups, or held by an unknown holder after a restart."),
        Panel("Longest wait for a cleanup",
              ((gauge("pod, resource", "devplugin_cleanup_oldest_seconds", how="max"),
                "{{pod}} {{resource}}"),),
              unit="s"),
        Panel("Hook runs",
              ((rate("resource, phase, result", "devplugin_hook_runs_total"),
                "{{resource}} {{phase}} {{result}}"),),
              unit="ops"),
    )),
    ("Allocations", (
        Panel("Allocate calls",
              ((rate("resource, result", "devplugin_allocations_total"),
                "{{resource}} {{result}}"),),
              unit="ops"),
        Panel("Allocate and preference p99",
              ((p99("resource", "devplugin_allocate_seconds_bucket"), "Allocate {{resource}}"),
               (p99("resource", "devplugin_preferred_allocation_seconds_bucket"),
                "GetPreferredAllocation {{resource}}")),
              unit="s"),
        Panel("Containers by worst GPU-HCA level",
              ((gauge("level", "devplugin_containers_by_alignment"), "{{level}}"),)),
        Panel("Containers below their required alignment",
              ((f"sum by (required) (increase(devplugin_alignment_below_required_total{{{NODE}}}"
                "[1h]))", "required {{required}}"),),
              description="Containers (in the last hour) whose worst level is past the level "
              "their pod requires."),
    )),
    ("Node state", (
        Panel("Check and holdings age",
              ((gauge("pod", "devplugin_check_age_seconds", how="max"), "last full check {{pod}}"),
               (gauge("pod", "devplugin_holdings_age_seconds", how="max"),
                "holdings confirmed {{pod}}")),
              unit="s"),
        Panel("Checkpoint written",
              ((gauge("pod", "devplugin_checkpoint_ok", how="min"), "{{pod}}"),),
              description="1 while the last lifecycle checkpoint write succeeded."),
        Panel("API caches and Lease",
              ((gauge("pod, cache", "devplugin_watch_age_seconds", how="max"),
                "{{pod}} {{cache}} watch"),
               (gauge("pod", "devplugin_lease_age_seconds", how="max"), "{{pod}} Lease")),
              unit="s"),
        Panel("Record and slice writes",
              ((rate("result", "devplugin_node_devices_writes_total"), "NodeDevices {{result}}"),
               (rate("result", "devplugin_resource_slice_writes_total"),
                "ResourceSlice {{result}}")),
              unit="ops"),
        Panel("DRA claims",
              ((rate("call, result", "devplugin_dra_claims_total"), "{{call}} {{result}}"),
               (gauge("pod", "devplugin_dra_prepared_claims"), "prepared now {{pod}}"))),
    )),
    ("Scheduler extender", (
        Panel("Extender calls",
              ((rate("verb, result", "devplugin_extender_requests_total", where=EXTENDER),
                "{{verb}} {{result}}"),),
              unit="ops"),
        Panel("Extender p99",
              ((p99("verb", "devplugin_extender_seconds_bucket", where=EXTENDER), "{{verb}}"),),
              unit="s"),
        Panel("Node records at the extender",
              ((gauge("state", "devplugin_extender_records", where=EXTENDER), "{{state}}"),)),
        Panel("Preemption answers",
              ((rate("outcome", "devplugin_extender_preempt_answers_total", where=EXTENDER),
                "{{outcome}}"),
               (rate("why", "devplugin_extender_preempt_unproven_total", where=EXTENDER),
                "unproven: {{why}}")),
              unit="ops"),
    )),
)  # fmt: skip


def _variable(name: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": name,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": name},
        "definition": query,
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {"text": "All", "value": "$__all"},
        "refresh": 2,
        "sort": 1,
    }


def _panel(panel: Panel, number: int, x: int, y: int) -> dict[str, Any]:
    return {
        "id": number,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {
                "refId": chr(ord("A") + index),
                "expr": query,
                "legendFormat": legend,
                "datasource": DATASOURCE,
            }
            for index, (query, legend) in enumerate(panel.targets)
        ],
    }


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    number, y = 1, 0
    for title, row in ROWS:
        panels.append(
            {
                "id": number,
                "type": "row",
                "title": title,
                "collapsed": False,
                "panels": [],
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
            }
        )
        number, y = number + 1, y + 1
        for index, panel in enumerate(row):
            panels.append(_panel(panel, number, 12 * (index % 2), y + 8 * (index // 2)))
            number += 1
        y += 8 * ((len(row) + 1) // 2)
    return {
        "uid": "devplugin",
        "title": "devplugin: GPUs, HCAs and their placement",
        "tags": ["devplugin", "gpu", "rdma"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                },
                _variable("namespace", "label_values(devplugin_devices, namespace)"),
                _variable("pod", 'label_values(devplugin_devices{namespace=~"$namespace"}, pod)'),
            ]
        },
        "panels": panels,
    }


def render_dashboard() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"
