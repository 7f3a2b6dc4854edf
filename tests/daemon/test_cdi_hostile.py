"""Hostile files in the CDI spec directories: nested past any parser's
depth, large, rewritten all the time. Each is refused with one log line or
parsed at a bounded rate; none stops a check, a start or the health probe."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from devplugin.node.discovery.cdi import BACKOFF_MIN, MAX_SPEC_BYTES, CdiReader
from devplugin.testing.cdi import nvidia_like_spec, write_spec
from devplugin.testing.node import hgx_node
from tests.conftest import GPU, HCA, Cluster
from tests.support import probe

Start = Callable[..., Cluster]

DEEP_JSON = "[" * 100_000
DEEP_YAML_FLOW = "a: " + "[" * 100_000
DEEP_YAML_BLOCK = "".join(f"{' ' * i}k{i}:\n" for i in range(60)) + " " * 60 + "v: 1\n"


def good_spec(kind: str = "example.com/dev") -> dict[str, object]:
    edits = {"deviceNodes": [{"path": "/dev/d0", "type": "c", "major": 1, "minor": 3}]}
    return {
        "cdiVersion": "0.3.0",
        "kind": kind,
        "devices": [{"name": "d0", "containerEdits": edits}],
    }


@pytest.mark.parametrize(
    ("name", "text"),
    [("deep.json", DEEP_JSON), ("deep.yaml", DEEP_YAML_FLOW), ("block.yaml", DEEP_YAML_BLOCK)],
)
def test_a_file_nested_too_deep_is_refused_with_one_line_and_the_rest_counts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str, text: str
) -> None:
    (tmp_path / name).write_text(text)
    write_spec(tmp_path, "good.json", good_spec())
    reader = CdiReader([str(tmp_path)])
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            catalog = reader.read()
    assert catalog.has("example.com/dev", "d0")
    assert "nested" in catalog.refused[str(tmp_path / name)]
    lines = [r for r in caplog.records if name in r.getMessage()]
    assert len(lines) == 1


def test_a_file_past_the_cap_is_refused_without_being_parsed(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text("a: " + "x" * (MAX_SPEC_BYTES + 10))
    reader = CdiReader([str(tmp_path)])
    catalog = reader.read()
    assert "larger than" in catalog.refused[str(path)]


def test_a_file_that_keeps_changing_is_parsed_at_a_bounded_rate(tmp_path: Path) -> None:
    now = [0.0]
    reader = CdiReader([str(tmp_path)], clock=lambda: now[0])
    path = tmp_path / "churn.json"
    for step in range(600):  # rewritten before every read, 10 reads a second, 60 s
        spec = good_spec()
        spec["devices"][0]["name"] = f"d{step}"  # type: ignore[index]
        write_spec(tmp_path, "churn.json", spec)
        os.utime(path, ns=(step * 10**9, step * 10**9 + 1))
        reader.read()
        now[0] += 0.1
    # Pauses of 1, 2, 4, 8, 16, 32 s: a handful of parses, not 600.
    assert reader.parses <= 8, reader.parses
    # Once it stops changing, its last content counts after the pause.
    now[0] += 300
    assert reader.read().has("example.com/dev", "d599")


@pytest.mark.slow
def test_a_megabyte_of_yaml_rewritten_every_few_tenths_costs_a_small_share_of_a_core(
    tmp_path: Path,
) -> None:
    # A spec just under the cap, valid, rewritten every 0.3 s for 8 s: the
    # reader (called every 0.1 s, as often as a check loop could) spends a
    # bounded share of the time parsing.
    devices = [
        {"name": f"d{i}", "containerEdits": {"env": [f"V{i}={'x' * 40}"] * 20}} for i in range(900)
    ]
    base = {"cdiVersion": "0.3.0", "kind": "example.com/dev", "devices": devices}
    text = json.dumps(base)  # JSON is YAML; the YAML loader parses it
    assert len(text) < MAX_SPEC_BYTES
    reader = CdiReader([str(tmp_path)])
    path = tmp_path / "churn.yaml"
    path.write_text(text)
    reader.read()  # the first parse: what one costs
    spent, started, last_write = 0.0, time.monotonic(), 0.0
    while time.monotonic() - started < 8:
        if time.monotonic() - last_write > 0.3:
            path.write_text(text + f"\n# {time.monotonic()}\n")
            last_write = time.monotonic()
        before = time.process_time()
        reader.read()
        spent += time.process_time() - before
        time.sleep(0.1)
    share = spent / (time.monotonic() - started)
    assert share < 0.5, share
    assert reader.parses <= 1 + 8 / BACKOFF_MIN


def test_a_daemon_with_a_hostile_spec_directory_starts_serves_and_stays_healthy(
    start_cluster: Start, tmp_path: Path
) -> None:
    static, dynamic = tmp_path / "etc-cdi", tmp_path / "run-cdi"
    static.mkdir()
    (static / "deep.json").write_text(DEEP_JSON)
    (static / "deep.yaml").write_text(DEEP_YAML_FLOW)
    cluster = start_cluster(
        hgx_node(),
        wait=False,
        **{
            "resources.gpu.device_list_strategy": ["cdi-cri"],
            "cdi.spec_dirs": [str(static), str(dynamic)],
        },
    )
    write_spec(static, "nvidia.yaml", nvidia_like_spec(cluster.node))
    kubelet, node = cluster.kubelet, cluster.node

    def healthy(resource: str) -> int:
        return sum(d.health == "Healthy" for d in kubelet.devices(resource).values())

    assert kubelet.wait_for(lambda: healthy(GPU) == len(node.gpus), 10)
    assert kubelet.wait_for(lambda: healthy(HCA) == len(node.hcas), 10)
    # The checks go on: a port going down is seen.
    hca = node.hcas[1]
    (hca.directory / "infiniband" / hca.name / "ports" / "1" / "state").write_text("1: DOWN\n")
    assert kubelet.wait_for(lambda: kubelet.devices(HCA)[hca.device_id].health == "Unhealthy", 5)
    assert probe(cluster, "/healthz")[0] == 200
