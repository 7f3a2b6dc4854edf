"""What the alert and dashboard tests read: the chart's rules and dashboard,
and the metrics the docs name with their labels."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART_FILES = ROOT / "charts" / "devplugin" / "files"
ALERTS_FILE = CHART_FILES / "alerts.yaml"
DASHBOARD_FILE = CHART_FILES / "dashboard.json"
DOCS = ROOT / "docs"
METRICS_DOC = DOCS / "operators" / "metrics.md"

# Label names whose values come from closed sets (resource names, results,
# phases, levels, verbs...): the only ones a devplugin metric may carry.
BOUNDED_LABELS = frozenset(
    {
        "resource",
        "health",
        "result",
        "role",
        "phase",
        "level",
        "outcome",
        "cache",
        "call",
        "verb",
        "state",
        "why",
        "required",
        "le",
    }
)


def alert_rules() -> list[dict[str, Any]]:
    rules = yaml.safe_load(ALERTS_FILE.read_text())
    return [rule for group in rules["groups"] for rule in group["rules"]]


def documented_metrics() -> dict[str, frozenset[str]]:
    """Metric name -> its documented label names, from the tables of
    docs/operators/metrics.md (a histogram's name without _bucket)."""
    found: dict[str, frozenset[str]] = {}
    for name, labels in re.findall(
        r"^\| `(devplugin_[a-z_]+)` \| [a-z]+ \| *([a-z, ]*?) *\|", METRICS_DOC.read_text(), re.M
    ):
        found[name] = frozenset(label.strip() for label in labels.split(",") if label.strip())
    return found


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, query) for every query of the dashboard."""
    board = json.loads(DASHBOARD_FILE.read_text())
    return [
        (panel["title"], target["expr"])
        for panel in board["panels"]
        for target in panel.get("targets", ())
    ]


def debian_tool(name: str) -> str:
    """The path of a tool from Debian's prometheus package; the test skips
    without it, or fails where DEVPLUGIN_REQUIRE_PROMETHEUS says it must run."""
    found = shutil.which(name)
    if found is None:
        why = f"{name} not installed (Debian's prometheus package)"
        if os.environ.get("DEVPLUGIN_REQUIRE_PROMETHEUS"):
            pytest.fail(f"{why}; DEVPLUGIN_REQUIRE_PROMETHEUS is set")
        pytest.skip(why)
    return found
