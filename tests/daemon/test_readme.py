"""Every example in the README and the docs works as written; every link
between them leads somewhere; the configuration reference is the schema's."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from devplugin.config import parse_config
from devplugin.testing.fake_nvml import FakeNvml, parse_fixture
from devplugin.testing.kubelet import ContainerRequest
from devplugin.testing.node import hgx_node
from tests.conftest import GPU, HCA, Cluster
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
README_LINES = 300


def blocks(language: str) -> list[str]:
    found = []
    for page in PAGES:
        for indent, lang, body in FENCE.findall(page.read_text()):
            if lang == language:
                found.append("\n".join(line[len(indent) :] for line in body.splitlines()))
    return found


def yaml_documents() -> list[Any]:
    return [yaml.safe_load(block) for block in blocks("yaml")]


def test_the_readme_has_the_examples_this_file_checks() -> None:
    kinds = [doc.get("kind") if isinstance(doc, dict) else None for doc in yaml_documents()]
    assert "Pod" in kinds
    assert len(blocks("json")) == 1
    assert any(isinstance(d, dict) and d.get("version") == "v1" for d in yaml_documents())


def test_every_config_example_loads() -> None:
    configs = [d for d in yaml_documents() if isinstance(d, dict) and "kind" not in d]
    assert configs
    for document in configs:
        # Fragments (a `resources:` section alone) are completed with the version.
        parse_config({"version": "v1", **document})


def test_the_nvml_fixture_example_is_accepted() -> None:
    (example,) = blocks("json")
    fixture = parse_fixture(json.loads(example), "README")
    lib = FakeNvml(fixture)
    lib.nvmlInit()
    assert lib.nvmlDeviceGetCount() == len(fixture.gpus) >= 2


def test_the_pod_examples_ask_for_both_resources() -> None:
    pods = [d for d in yaml_documents() if isinstance(d, dict) and d.get("kind") == "Pod"]
    assert pods
    for pod in pods:
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert limits[GPU] == limits[HCA] == 4


def test_the_readme_is_short_and_every_link_leads_somewhere() -> None:
    assert len(README.read_text().splitlines()) <= README_LINES
    broken = []
    linked: set[Path] = set()
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            linked.add(path)
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
    # Every page of the docs is reached from somewhere.
    unreached = [p.relative_to(ROOT) for p in PAGES[1:] if p.resolve() not in linked]
    assert not unreached, unreached


def test_the_configuration_reference_is_the_schemas() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import config_reference
    finally:
        sys.path.pop(0)
    assert config_reference.OUT.read_text() == config_reference.render()
    documented = set(re.findall(r"^\| `([a-z_.]+)` \|", config_reference.OUT.read_text(), re.M))
    # Every leaf of the schema, e.g. health.port_interval_seconds.
    assert "health.port_interval_seconds" in documented
    assert "kubelet.watch_interval_seconds" in documented
    assert len(documented) >= 80


@pytest.mark.parametrize("hook", ["devplugin.hooks.hca_check"])
def test_the_example_hca_hook_checks_the_daemons_sysfs_root(
    start_cluster: Any, tmp_path: Path, hook: str
) -> None:
    # The hook waits for a gate, so the kubelet is sure to see the device
    # Unhealthy while it is being cleaned (ListAndWatch sends the latest
    # state; a hook quicker than the stream would leave no trace of it).
    gate = tmp_path / "gate"
    waits = f"while [ ! -e {gate} ]; do sleep 0.01; done; exec {sys.executable} -m {hook}"
    cluster: Cluster = start_cluster(
        hgx_node(), **{"resources.hca.hooks.cleanup": ["/bin/sh", "-c", waits]}
    )
    kubelet = cluster.kubelet
    pod = kubelet.admit("p", [ContainerRequest("c", {HCA: 1})])
    (hca,) = pod.container("c").devices[HCA]
    kubelet.remove("p")
    assert kubelet.wait_for(lambda: kubelet.devices(HCA)[hca].health == "Unhealthy", 15)
    gate.touch()
    # The hook reads the simulated node's ports (all ACTIVE) through
    # DEVPLUGIN_SYSFS_ROOT; with /sys it would find no such HCA and fail.
    assert wait_until(lambda: cluster.daemon.core.lifecycle.queue.runs >= 1, timeout=15)
    assert kubelet.wait_for(lambda: kubelet.devices(HCA)[hca].health == "Healthy", 15)
    assert cluster.daemon.core.lifecycle.book.pending() == {}
