"""Shared fixtures: short socket directories, simulated nodes, a running daemon."""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from devplugin.config import Config, override
from devplugin.logs import CHATTY
from devplugin.node.lifecycle.checkpoint import Checkpoint, LifecycleState
from devplugin.runtime import Daemon, build
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.fake_nvml import FakeNvml
from devplugin.testing.kubelet import KubeletSimulator
from devplugin.testing.node import BuiltNode, NodeSpec, build_node

GPU = "nvidia.com/gpu"
HCA = "rdma/hca"


# How long a test's threads get to finish after its fixtures stopped them.
THREAD_GRACE = 5.0


def _project_code(thread: threading.Thread) -> str | None:
    """The module of the project's code a thread runs (devplugin, bench,
    tests), or None for a library's own thread."""
    target = getattr(thread, "_target", None)
    code = target if target is not None else type(thread).run
    module = getattr(code, "__module__", None) or ""
    if module.startswith(("devplugin", "bench", "tests")):
        return f"{module}.{getattr(code, '__qualname__', '?')}"
    return None


@pytest.fixture(autouse=True)
def no_thread_left_behind() -> Iterator[None]:
    """Fails a test that leaves a thread of the project's running: every
    loop a test starts is stopped and joined by the time it ends (a thread
    that outlives its test logs into the next one, or into nothing)."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + THREAD_GRACE
    left: list[str] = []
    for thread in threading.enumerate():
        if thread in before or thread is threading.current_thread():
            continue
        code = _project_code(thread)
        if code is None:
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            left.append(f"{thread.name} ({code})")
    if left:
        pytest.fail(f"threads left running after the test: {', '.join(sorted(left))}")


@pytest.fixture(autouse=True)
def root_logging_restored() -> Iterator[None]:
    """`devplugin` commands run in-process set the root logger up for a
    stream (pytest's capture of that moment) and quiet some loggers; both
    are undone after the test, so no later thread writes to a closed stream."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    chatty = {name: logging.getLogger(name).level for name in CHATTY}
    yield
    for handler in list(root.handlers):
        if handler not in before and type(handler) is logging.StreamHandler:
            root.removeHandler(handler)
    root.setLevel(level)
    for name, previous in chatty.items():
        logging.getLogger(name).setLevel(previous)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for unix sockets (sun_path holds 107 bytes; tmp_path is long)."""
    path = Path(tempfile.mkdtemp(prefix="dpt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def fast_config(node: BuiltNode, plugin_dir: Path, pod_resources: Path, **extra: Any) -> Config:
    """Defaults, pointed at a simulated node, with quick rescans for tests."""
    settings: dict[str, Any] = {
        "paths.sysfs_root": str(node.sysfs_root),
        "paths.dev_root": str(node.dev_root),
        "paths.nvidia_caps_root": str(node.caps_root),
        "paths.device_plugin_dir": str(plugin_dir),
        "paths.pod_resources_socket": str(pod_resources),
        "nvml.fixture": str(node.fixture),
        "discovery.rescan_interval_seconds": 0.5,
        "health.interval_seconds": 0.2,
        "pod_resources.poll_interval_seconds": 0.5,
        "pod_resources.bookkeeping_grace_seconds": 0.05,
        "lifecycle.checkpoint_file": str(node.sysfs_root.parent / "checkpoint.json"),
        "metrics.addresses": ["127.0.0.1:0"],
    }
    settings.update(extra)
    return override(Config(), **settings)


@dataclass
class Cluster:
    """A simulated node with its kubelet and a running daemon."""

    node: BuiltNode
    kubelet: KubeletSimulator
    daemon: Daemon
    nvml: FakeNvml
    plugin_dir: Path


@pytest.fixture
def start_cluster(tmp_path: Path, sock_dir: Path) -> Iterator[Callable[..., Cluster]]:
    started: list[tuple[Daemon, KubeletSimulator]] = []

    def start(
        spec: NodeSpec,
        *,
        nvml_init_error: int | None = None,
        hotplug_monitor: Any | None = None,
        start_kubelet: bool = True,
        wait: bool = True,
        api: ApiServerImitation | None = None,
        api_url: str | None = None,
        node_name: str = "node-1",
        on_built: Callable[[BuiltNode], None] | None = None,
        **config: Any,
    ) -> Cluster:
        # Several clusters may run in one test, each in its own directories.
        tag = str(len(started))
        node = build_node(spec, tmp_path / f"node{tag}")
        if on_built is not None:
            on_built(node)
        plugin_dir = sock_dir / f"dp{tag}"
        pod_resources = sock_dir / f"pr{tag}" / "kubelet.sock"
        kubelet = KubeletSimulator(plugin_dir, pod_resources, seed=1, api=api, node_name=node_name)
        if api is not None:
            # The daemon may reach the server another way (a proxy, `api_url`).
            kubeconfig = tmp_path / f"kubeconfig{tag}"
            kubeconfig.write_text(yaml.safe_dump(api.kubeconfig(api_url)))
            config = {
                "kubernetes.enabled": True, "kubernetes.kubeconfig": str(kubeconfig),
                "kubernetes.node_name": kubelet.node_name, **config,
            }  # fmt: skip
        if start_kubelet:
            kubelet.start()
        # A node whose lifecycle state is known (nothing in use, nothing owed);
        # without a checkpoint every idle device would be cleaned first.
        settings = fast_config(node, plugin_dir, pod_resources, **config)
        if "lifecycle.checkpoint_file" not in config:  # a test's own file is left as it is
            Checkpoint(Path(settings.lifecycle.checkpoint_file)).save(LifecycleState())
        lib = FakeNvml.from_file(node.fixture)
        lib.init_error = nvml_init_error
        daemon = build(
            settings,
            lib,
            hotplug_monitor=hotplug_monitor,
        )
        daemon.start()
        started.append((daemon, kubelet))
        cluster = Cluster(node, kubelet, daemon, lib, plugin_dir)
        if start_kubelet and wait:
            assert kubelet.wait_for_devices(GPU, len(node.gpus), timeout=10)
            assert kubelet.wait_for_devices(HCA, len(node.hcas), timeout=10)
        return cluster

    yield start
    for daemon, kubelet in started:
        daemon.stop()
        kubelet.stop()


@pytest.fixture
def api() -> Iterator[ApiServerImitation]:
    """The Kubernetes API server imitation, serving on a free local port."""
    server = ApiServerImitation()
    server.start()
    yield server
    server.stop()
