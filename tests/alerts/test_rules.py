"""The chart's alert rules: promtool's unit tests pass, each rule has a case
that fires and a series beside it that must not, a runbook section, and
reads only documented metrics; the dashboard's queries read only
documented metrics too (tests/prometheus/ runs both against a real
Prometheus)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.monitoring_support import (
    ALERTS_FILE,
    DASHBOARD_FILE,
    DOCS,
    alert_rules,
    debian_tool,
    documented_metrics,
    panel_queries,
)

HERE = Path(__file__).resolve().parent
TESTS_FILE = HERE / "alerts_test.yaml"
RUNBOOKS = DOCS / "operators" / "alerts.md"


def run_promtool(tests: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [debian_tool("promtool"), "test", "rules", str(tests)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_every_rule_fires_and_stays_quiet_under_promtool() -> None:
    result = run_promtool(TESTS_FILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_that_never_fire_fail_every_case(tmp_path: Path) -> None:
    """The unit tests can fail: with every expression made false, each
    alert's firing case fails."""
    rules = yaml.safe_load(ALERTS_FILE.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["expr"] = "vector(0) > 1"
    (tmp_path / "alerts.yaml").write_text(yaml.safe_dump(rules))
    tests = yaml.safe_load(TESTS_FILE.read_text())
    tests["rule_files"] = ["alerts.yaml"]
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    result = run_promtool(tmp_path / "tests.yaml")
    assert result.returncode != 0
    failed = set(re.findall(r"alertname: (\w+),", result.stdout + result.stderr))
    assert failed == {rule["alert"] for rule in alert_rules()}


def _minutes(duration: str) -> int:
    assert duration.endswith("m"), duration
    return int(duration[:-1])


def _identity(labels: dict[str, str], keys: set[str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((key, labels.get(key, "")) for key in keys))


def _series_labels(series: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)="([^"]*)"', series))


def test_each_alert_has_a_firing_case_a_quiet_series_and_an_early_quiet_check() -> None:
    tests = yaml.safe_load(TESTS_FILE.read_text())["tests"]
    covered: set[str] = set()
    for case in tests:
        evals = case["alert_rule_test"]
        names = {e["alertname"] for e in evals}
        assert len(names) == 1, names
        (name,) = names
        firing = [e for e in evals if e["exp_alerts"]]
        quiet = [e for e in evals if not e["exp_alerts"]]
        assert firing, name
        assert quiet, name
        # The quiet check comes before the firing one (the rule's `for`).
        assert min(_minutes(e["eval_time"]) for e in quiet) < min(
            _minutes(e["eval_time"]) for e in firing
        )
        expected = [
            {k: v for k, v in a["exp_labels"].items() if k != "severity"}
            for e in firing
            for a in e["exp_alerts"]
        ]
        keys = set().union(*(set(labels) for labels in expected))
        fired = {_identity(labels, keys) for labels in expected}
        series = [_series_labels(s["series"]) for s in case["input_series"]]
        assert any(_identity(labels, keys) not in fired for labels in series), (
            f"{name}: no series beside the firing one"
        )
        covered.add(name)
    assert covered == {rule["alert"] for rule in alert_rules()}


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors for the headings of a page."""
    found = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


def test_every_alert_links_to_its_runbook_section() -> None:
    page = RUNBOOKS.read_text()
    anchors = _anchors(page)
    for rule in alert_rules():
        url = rule["annotations"]["runbook_url"]
        base, _, anchor = url.partition("#")
        assert base == "https://devplugin.io/docs/operators/alerts", url
        assert anchor == rule["alert"].lower(), url
        assert anchor in anchors, f"no runbook section for {rule['alert']}"
        assert f"| {rule['alert']} | {rule['labels']['severity']} |" in page
        assert rule["labels"]["severity"] in ("info", "warning", "critical")


def _metrics_in(query: str) -> set[str]:
    names = set(re.findall(r"\b(devplugin_[a-z_]+)", query))
    return {re.sub(r"_(bucket|sum|count)$", "", name) for name in names}


def test_alerts_and_panels_read_only_documented_metrics() -> None:
    documented = documented_metrics()
    for rule in alert_rules():
        missing = _metrics_in(rule["expr"]) - documented.keys()
        assert not missing, (rule["alert"], missing)
    for title, query in panel_queries():
        missing = _metrics_in(query) - documented.keys()
        assert not missing, (title, missing)


def test_the_dashboard_is_the_generated_one_with_unique_panel_ids() -> None:
    board: dict[str, Any] = json.loads(DASHBOARD_FILE.read_text())
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    assert board["uid"] == "devplugin"
    names = {v["name"] for v in board["templating"]["list"]}
    assert names == {"datasource", "namespace", "pod"}
    # Every metric the docs name for the daemon's devices and the extender's
    # calls has a panel (the rest are covered by the alerts or are internal).
    shown = set().union(*(_metrics_in(query) for _, query in panel_queries()))
    for name in (
        "devplugin_devices",
        "devplugin_custody_devices",
        "devplugin_hook_runs_total",
        "devplugin_allocations_total",
        "devplugin_containers_by_alignment",
        "devplugin_extender_requests_total",
        "devplugin_extender_seconds",
    ):
        assert name in shown
