"""What this node's kubelet aligns, and the NUMA nodes it knows: the facts
the extender needs to predict the kubelet's Topology Manager, published in
the NodeDevices record (status.kubelet, status.numaNodes).

* The policies: the kubelet's configuration file (KubeletConfiguration's
  `topologyManagerPolicy`, `topologyManagerScope`, `cpuManagerPolicy`,
  YAML or JSON, read again when it changes), where the config names one;
  the daemon's own `kubelet.*` settings say what flags set instead.
* The NUMA nodes and their CPUs: sysfs (devices/system/node/node*/cpulist,
  what the kubelet's cadvisor reads).
* The CPUs a static CPU manager can still give exclusively: the kubelet's
  PodResources API (GetAllocatableResources' cpu_ids, less the cpu_ids its
  List shows containers holding).

Refreshed by the PodResources poll's loop (`refresh`), never on a reader's
path: `kubelet()` and `numa()` return the last result.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import yaml

from devplugin.config import KubeletConfig
from devplugin.node.podresources import PodResourcesClient
from devplugin.policy.topology_manager import CPU_POLICIES, POLICIES, SCOPES

log = logging.getLogger(__name__)

# A kubelet's configuration is a few KiB; past this the file is not read.
MAX_CONFIG_BYTES = 1 << 20
# How often the allocatable CPUs are asked for again (they change only when
# the kubelet restarts with other reserved CPUs).
ALLOCATABLE_EVERY = 60.0
# The record's key for each policy, and the daemon's setting that overrides it.
OVERRIDES = (
    ("topologyManagerPolicy", "topology_manager_policy"),
    ("topologyManagerScope", "topology_manager_scope"),
    ("cpuManagerPolicy", "cpu_manager_policy"),
)


def cpulist(text: str) -> frozenset[int]:
    """ "0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11}; ValueError for a bad list."""
    found: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        first, last = int(low), int(high or low)
        if last < first or last - first > 65536:
            raise ValueError(f"bad CPU range {part!r}")
        found.update(range(first, last + 1))
    return frozenset(found)


def numa_cpus(sysfs_root: Path) -> dict[int, frozenset[int]]:
    """NUMA node -> its CPUs, from sysfs (empty where sysfs has no nodes)."""
    found: dict[int, frozenset[int]] = {}
    base = sysfs_root / "devices" / "system" / "node"
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return found
    for name in entries:
        if not name.startswith("node") or not name[4:].isdigit():
            continue
        try:
            found[int(name[4:])] = cpulist((base / name / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return found


def read_policy(path: Path) -> dict[str, str]:
    """The policies a KubeletConfiguration file sets (the kubelet's defaults
    for those it leaves out); ValueError naming what is wrong."""
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        document = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not YAML or JSON") from exc
    if not isinstance(document, dict):
        raise ValueError(f"{path}: not a KubeletConfiguration")
    found = {
        "topologyManagerPolicy": document.get("topologyManagerPolicy") or "none",
        "topologyManagerScope": document.get("topologyManagerScope") or "container",
        "cpuManagerPolicy": document.get("cpuManagerPolicy") or "none",
    }
    allowed = {"topologyManagerPolicy": POLICIES, "topologyManagerScope": SCOPES,
               "cpuManagerPolicy": CPU_POLICIES}  # fmt: skip
    for key, value in found.items():
        if value not in allowed[key]:
            raise ValueError(f"{path}: {key} {str(value)[:40]!r} is not one this daemon knows")
    return found


class KubeletFacts:
    def __init__(
        self,
        config: KubeletConfig,
        sysfs_root: Path,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._sysfs = sysfs_root
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: tuple[float, int] | None = None  # the file's mtime and size
        self._policy: dict[str, str] = {}
        self._source = "not read"
        self._numa: dict[int, frozenset[int]] = {}
        self._allocatable: frozenset[int] | None = None
        self._assigned: frozenset[int] = frozenset()
        self._asked_at = -ALLOCATABLE_EVERY
        self._failing: str | None = None

    # -- what the record reads
    def kubelet(self) -> dict[str, Any]:
        with self._lock:
            found: dict[str, Any] = dict(self._policy)
            found["source"] = self._source
        for key, name in OVERRIDES:
            said = getattr(self._config, name)
            if said:
                found[key] = said
                found["source"] = "the daemon's kubelet settings"
        return found

    def numa(self) -> list[dict[str, int]]:
        """Each NUMA node with its CPUs, and those a static CPU manager can
        still give exclusively (its allocatable CPUs less those containers
        held at the last PodResources List)."""
        with self._lock:
            nodes, allocatable, assigned = dict(self._numa), self._allocatable, self._assigned
        static = self.kubelet().get("cpuManagerPolicy") == "static"
        found = []
        for node, cpus in sorted(nodes.items()):
            entry = {"id": node, "cpus": len(cpus)}
            if static and allocatable is not None:
                entry["freeCpus"] = len((cpus & allocatable) - assigned)
            found.append(entry)
        return found

    # -- the loop's work
    def refresh(self, client: PodResourcesClient | None) -> None:
        """Read what changed (the file by its mtime, sysfs once, the
        allocatable CPUs every ALLOCATABLE_EVERY with a static CPU manager)."""
        self._read_file()
        if not self._numa:
            nodes = numa_cpus(self._sysfs)
            with self._lock:
                self._numa = nodes
        if client is not None:
            with self._lock:
                self._assigned = client.assigned_cpus
        static = self.kubelet().get("cpuManagerPolicy") == "static"
        now = self._clock()
        # None or none at all (a kubelet still starting): asked at every poll.
        known = bool(self._allocatable)
        if client is None or not static or (known and now - self._asked_at < ALLOCATABLE_EVERY):
            return
        self._asked_at = now
        try:
            allocatable = client.allocatable_cpus()
        except grpc.RpcError as exc:
            self._fail(f"PodResources GetAllocatableResources failed: {exc.code()}")
            return
        with self._lock:
            self._allocatable = allocatable

    def _read_file(self) -> None:
        name = self._config.config_file
        if name is None:
            return
        path = Path(name)
        try:
            info = path.stat()
        except OSError as exc:
            self._set({}, f"{name}: unreadable ({exc.strerror})")
            return
        seen = (info.st_mtime, info.st_size)
        if seen == self._seen:
            return
        self._seen = seen
        try:
            policy = read_policy(path)
        except (OSError, ValueError) as exc:
            # Unsure of the policy: say nothing of it (no alignment predicted).
            self._set({}, str(exc)[:512])
            self._fail(str(exc))
            return
        self._set(policy, f"the kubelet's config file {name}"[:512])

    def _set(self, policy: dict[str, str], source: str) -> None:
        with self._lock:
            self._policy, self._source = policy, source

    def _fail(self, message: str) -> None:
        if message != self._failing:
            log.warning("kubelet facts: %s", message)
            self._failing = message
