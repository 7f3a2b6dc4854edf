"""The real-node tier: a kubelet and containerd built from the modules pinned
in upstream/, joined to a real control plane, with the daemon on simulated
hardware whose /dev nodes are real character devices. Skipped with one line
where the machine cannot run it; `DEVPLUGIN_REQUIRE_NODE=1` (.ci/run) makes
that a failure."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from devplugin.testing.controlplane import ControlPlane, Unavailable, binaries, env_flag
from devplugin.testing.realnode import NodeBinaries, missing, node_binaries

# The newest pin; the node's own behaviour under v1.35 is for a later step.
MINOR = "v1.37"


def unavailable(why: str) -> None:
    if env_flag("DEVPLUGIN_REQUIRE_NODE"):
        pytest.fail(f"real-node tier required here: {why}")
    pytest.skip(why)


@pytest.fixture(scope="session")
def node_bins() -> NodeBinaries:
    why = missing()
    if why is not None:
        unavailable(why)
    try:
        return node_binaries(MINOR)
    except Unavailable as exc:
        unavailable(f"real-node tier: {exc}")
        raise


@pytest.fixture(scope="session")
def plane(node_bins: NodeBinaries) -> Iterator[ControlPlane]:
    folder = Path(tempfile.mkdtemp(prefix="ntier-"))
    control = ControlPlane(binaries(MINOR), folder)
    try:
        control.start()
        yield control
    finally:
        control.stop()
        if not env_flag("DEVPLUGIN_KEEP_CLUSTER"):
            shutil.rmtree(folder, ignore_errors=True)
