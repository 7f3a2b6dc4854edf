"""The cluster tier's fixtures: one real control plane per pinned version,
shared by the tier's tests, and the chart installed into it with Helm.

Where the control plane cannot be had (no Go, a build that fails) every
test of the tier skips with one line saying why; with
DEVPLUGIN_REQUIRE_CLUSTER=1 (CI) that is a failure instead.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from devplugin.testing.controlplane import (
    REPO,
    ApiFailure,
    ControlPlane,
    Unavailable,
    binaries,
    env_flag,
)
from tests.real_cluster.nodes import remove_node

# One before 1.36 (the stable allocator, device taints off) and the newest.
VERSIONS = ("v1.35", "v1.37")
CHART = REPO / "charts" / "devplugin"
HELM_PYTHON = REPO / ".venv-helm" / "bin" / "python"
NAMESPACE = "devplugin-system"
RELEASE = "tier"


def unavailable(why: str) -> None:
    if env_flag("DEVPLUGIN_REQUIRE_CLUSTER"):
        pytest.fail(f"cluster tier required here: {why}")
    pytest.skip(f"cluster tier: {why}")


@pytest.fixture(scope="session", params=VERSIONS)
def control_plane(request: pytest.FixtureRequest) -> Iterator[ControlPlane]:
    try:
        bins = binaries(request.param)
    except Unavailable as exc:
        unavailable(str(exc))
    if shutil.which("openssl") is None:
        unavailable("openssl is not installed (the tier's certificates)")
    folder = Path(tempfile.mkdtemp(prefix=f"tier-{request.param}-"))
    plane = ControlPlane(bins, folder)
    try:
        plane.start()
    except RuntimeError as exc:
        plane.stop()
        pytest.fail(f"the {bins.version} control plane did not start: {exc}")
    try:
        yield plane
    finally:
        plane.stop()
        if not env_flag("DEVPLUGIN_KEEP_CLUSTER"):
            shutil.rmtree(folder, ignore_errors=True)


def _names(plane: ControlPlane, path: str) -> set[str]:
    return {item["metadata"]["name"] for item in plane.request("GET", path)["items"]}


@pytest.fixture(autouse=True)
def leaves_no_nodes(request: pytest.FixtureRequest) -> Iterator[None]:
    """The tier's tests share one control plane per version: what a test
    adds there (Nodes, and pods in `default`, which a later test's
    scheduler would otherwise place) goes when it ends, so no test's
    verdicts depend on the ones before it."""
    if "control_plane" not in request.fixturenames:
        yield
        return
    plane: ControlPlane = request.getfixturevalue("control_plane")
    nodes, pods = _names(plane, "/api/v1/nodes"), _names(plane, "/api/v1/namespaces/default/pods")
    yield
    for pod in _names(plane, "/api/v1/namespaces/default/pods") - pods:
        with contextlib.suppress(ApiFailure):
            plane.request("DELETE", f"/api/v1/namespaces/default/pods/{pod}?gracePeriodSeconds=0")
    for node in _names(plane, "/api/v1/nodes") - nodes:
        # The daemons' stand-in pods there too (the next test may reuse the name).
        remove_node(plane, node)


def helm_install(plane: ControlPlane, cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Install (and, unless a case says keep, uninstall) each case with the
    real Helm engine against the real API server."""
    if not (REPO / ".venv-helm" / ".installed").exists():
        why = REPO / ".venv-helm" / "UNAVAILABLE"
        unavailable(f"Helm: {why.read_text().strip() if why.exists() else '.venv-helm not made'}")
    request = {"kubeconfig": yaml.safe_dump(plane.admin), "cases": cases}
    done = subprocess.run(
        [str(HELM_PYTHON), str(REPO / "tests" / "helm" / "install_real.py"), str(CHART)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {entry["name"]: entry for entry in json.loads(done.stdout)}


# What the kept release installs: the daemon (both resources through the
# device-plugin API), its node policy, the extender and its second scheduler.
MAIN_VALUES: dict[str, Any] = {
    "extender": {"enabled": True, "scheduler": {"enabled": True}},
}


def keep_installed(
    plane: ControlPlane, release: str, namespace: str, values: dict[str, Any]
) -> ControlPlane:
    """The chart installed for good as `release` in `namespace`."""
    case = {"name": release, "namespace": namespace, "values": values, "keep": True}
    found = helm_install(plane, [case])[release]
    assert found["ok"], found.get("error")
    return plane


@pytest.fixture(scope="session")
def installed(control_plane: ControlPlane) -> ControlPlane:
    """The chart installed for good (release `tier` in devplugin-system)."""
    return keep_installed(control_plane, RELEASE, NAMESPACE, MAIN_VALUES)


DRA_NAMESPACE = "devplugin-dra"
DRA_RELEASE = "tierdra"
# The daemon serving both kinds through DRA, with the chart's claim
# templates in `default`, and the extender with its second scheduler (whose
# configuration then asks the extender about claim-only pods too).
DRA_VALUES: dict[str, Any] = {
    "config": {"resources": {"gpu": {"api": "dra"}, "hca": {"api": "dra"}}},
    "dra": {"claimTemplates": {"namespaces": ["default"]}},
    "extender": {"enabled": True, "scheduler": {"enabled": True}},
}


@pytest.fixture(scope="session")
def dra_installed(control_plane: ControlPlane) -> ControlPlane:
    """The chart installed for good with DRA (release `tierdra`)."""
    return keep_installed(control_plane, DRA_RELEASE, DRA_NAMESPACE, DRA_VALUES)
