"""A real Prometheus (Debian's package) on loopback for the monitoring tier:
it scrapes the targets a test names every second and evaluates the chart's
rules every second, with each rule's `for` shortened so pending and firing
happen within the test."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from devplugin.testing.controlplane import Process, free_port
from tests.monitoring_support import ALERTS_FILE, debian_tool

# Every rule's `for` in the tier: long enough to see `pending` between two
# polls, short enough for a test.
FOR = "3s"


@dataclass(frozen=True)
class Target:
    """One scrape target and the labels the Prometheus Operator would give it."""

    address: tuple[str, int]
    namespace: str
    pod: str


def shortened_rules() -> dict[str, Any]:
    rules: dict[str, Any] = yaml.safe_load(ALERTS_FILE.read_text())
    for group in rules["groups"]:
        group["interval"] = "1s"
        for rule in group["rules"]:
            rule["for"] = FOR
    return rules


class Prometheus:
    def __init__(self, base: Path, targets: Sequence[Target]) -> None:
        self.port = free_port()
        (base / "rules.yaml").write_text(yaml.safe_dump(shortened_rules()))
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(base / "rules.yaml")],
            "scrape_configs": [
                {
                    "job_name": "devplugin",
                    "scrape_interval": "1s",
                    "static_configs": [
                        {
                            "targets": [f"{t.address[0]}:{t.address[1]}"],
                            "labels": {"namespace": t.namespace, "pod": t.pod},
                        }
                        for t in targets
                    ],
                }
            ],
        }
        (base / "prometheus.yml").write_text(yaml.safe_dump(config))
        log = base / "prometheus.log"
        handle = log.open("ab")
        popen = subprocess.Popen(
            [
                debian_tool("prometheus"),
                f"--config.file={base / 'prometheus.yml'}",
                f"--storage.tsdb.path={base / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
        # Started, logged and stopped as the cluster tier's processes are.
        self.process = Process("prometheus", popen, log, handle)

    def url(self, path: str, **query: str | list[str]) -> str:
        return f"http://127.0.0.1:{self.port}{path}?" + urllib.parse.urlencode(query, doseq=True)

    def get(self, path: str, **query: str | list[str]) -> Any:
        """An API answer's `data`; AssertionError with Prometheus's error."""
        try:
            with urllib.request.urlopen(self.url(path, **query), timeout=10) as answer:
                body = json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read())
        assert body.get("status") == "success", body
        return body["data"]

    def ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.popen.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.url("/-/ready"), timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError("Prometheus did not start: " + self.logged())

    def logged(self) -> str:
        self.process.handle.flush()
        return self.process.tail()

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        result: list[dict[str, Any]] = data["result"]
        return result

    def alerts(self) -> dict[str, set[str]]:
        """Alert name -> the states its alerts are in now."""
        found: dict[str, set[str]] = {}
        for alert in self.get("/api/v1/alerts")["alerts"]:
            found.setdefault(alert["labels"]["alertname"], set()).add(alert["state"])
        return found

    def stop(self) -> None:
        self.process.stop()


@contextmanager
def running_prometheus(base: Path, targets: Sequence[Target]) -> Iterator[Prometheus]:
    base.mkdir(parents=True, exist_ok=True)
    server = Prometheus(base, targets)
    try:
        server.ready()
        yield server
    finally:
        server.stop()
