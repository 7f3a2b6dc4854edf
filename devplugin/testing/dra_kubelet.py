"""The kubelet's DRA side, in-process, for the demo and the tests.

It does what the kubelet's plugin watcher and DRA manager do where a driver
can tell, over real gRPC on real unix sockets:

* watches the registry directory for `*.sock` files (a new or replaced
  socket is a new plugin), calls GetInfo, checks the answer (type
  DRAPlugin, an endpoint that exists, a DRAPlugin service it speaks) and
  says so with NotifyRegistrationStatus; a socket that disappears
  unregisters its plugin;
* calls NodePrepareResources / NodeUnprepareResources on the endpoint,
  preferring v1 over v1beta1 as the kubelet does, each with the kubelet's
  45 s deadline (`prepare`, `unprepare`);
* opens a DRAResourceHealth stream when the plugin advertises it and keeps
  the last device list (`health`);
* `restart` stops everything and starts again, optionally deleting every
  ResourceSlice of its node from the API imitation first, as a starting
  kubelet does, and optionally wiping the registry directory.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from devplugin.api import dra_health_v1alpha1_pb2 as health_pb
from devplugin.api import dra_health_v1alpha1_pb2_grpc as health_grpc
from devplugin.api import dra_v1_pb2 as v1
from devplugin.api import dra_v1_pb2_grpc as v1_grpc
from devplugin.api import dra_v1beta1_pb2 as v1beta1
from devplugin.api import dra_v1beta1_pb2_grpc as v1beta1_grpc
from devplugin.api import pluginregistration_v1_pb2 as reg_pb
from devplugin.api import pluginregistration_v1_pb2_grpc as reg_grpc
from devplugin.testing.apiserver import ApiServerImitation

log = logging.getLogger(__name__)

CALL_TIMEOUT = 45.0  # the kubelet's defaultClientCallTimeout
POLL = 0.02


def _inode(path: Path) -> tuple[int, int, int] | None:
    """A socket file's identity, standing in for the Create event the
    kubelet's plugin watcher reacts to (pluginwatcher/plugin_watcher.go: a
    Create re-registers the path, whatever it held before). Its inode alone
    is not enough: a file system reuses the number of an inode just freed, so
    a socket bound again after a crash can have the old one's. Its change
    time tells them apart: set when the socket is bound and when it is
    renamed into place. (A chmod sets it too, where the kubelet would see no
    Create; a daemon changes no socket in place.)"""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_ctime_ns


@dataclass
class DraPluginRecord:
    name: str
    endpoint: str
    versions: tuple[str, ...]
    socket: Path
    identity: tuple[int, int, int] | None
    channel: grpc.Channel
    health: dict[str, tuple[int, str]] = field(default_factory=dict)
    health_updates: int = 0
    stream: Any = None


@dataclass(frozen=True)
class ClaimCall:
    namespace: str
    uid: str
    name: str


class DraKubeletSimulator:
    def __init__(
        self,
        registry_dir: Path,
        *,
        node: str = "node-a",
        api: ApiServerImitation | None = None,
        prefer: str = "v1",
    ) -> None:
        self.registry_dir = registry_dir
        self.node = node
        self.api = api
        self.prefer = prefer
        self._lock = threading.Condition()
        self._plugins: dict[str, DraPluginRecord] = {}
        self._seen: dict[Path, tuple[int, int, int] | None] = {}
        # Sockets whose registration failed, so each failure is logged once.
        self._failed: dict[Path, tuple[int, int, int] | None] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.refused: list[str] = []
        self.prepare_calls = 0
        # The deadline of each prepare and unprepare (a test may shorten it).
        self.call_timeout = CALL_TIMEOUT

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        if self.api is not None:
            # A starting kubelet deletes every slice of its node.
            for item in self.api.items("resourceslices"):
                if item.get("spec", {}).get("nodeName") == self.node:
                    self.api.remove("resourceslices", item["metadata"]["name"])
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="dra-kubelet", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            for record in self._plugins.values():
                self._close(record)
            self._plugins.clear()
            self._seen.clear()
            self._failed.clear()

    def restart(self, *, wipe: bool = False) -> None:
        self.stop()
        if wipe:
            for path in self.registry_dir.glob("*.sock"):
                path.unlink(missing_ok=True)
        self.start()

    # -- the plugin watcher ----------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(POLL):
            try:
                # As the kubelet's watcher: names starting with a dot are not plugins.
                present = {
                    p: _inode(p)
                    for p in self.registry_dir.glob("*.sock")
                    if not p.name.startswith(".")
                }
            except OSError:
                continue
            for path, identity in present.items():
                if self._seen.get(path, "none") != identity and self._register(path, identity):
                    self._seen[path] = identity
            for path in [p for p in self._seen if p not in present]:
                del self._seen[path]
                with self._lock:
                    for name, record in list(self._plugins.items()):
                        if record.socket == path:
                            self._close(record)
                            del self._plugins[name]
                    self._lock.notify_all()

    def _register(self, path: Path, identity: tuple[int, int, int] | None) -> bool:
        """Whether the socket got its answer (registered or refused). As the
        kubelet's reconciler does, a socket whose calls failed is tried
        again on the next pass until it answers or goes away."""
        try:
            with grpc.insecure_channel(f"unix://{path}") as channel:
                stub = reg_grpc.RegistrationStub(channel)
                info = stub.GetInfo(reg_pb.InfoRequest(), timeout=5)
                problem = self._check(info)
                stub.NotifyRegistrationStatus(
                    reg_pb.RegistrationStatus(
                        plugin_registered=problem is None, error=problem or ""
                    ),
                    timeout=5,
                )
        except grpc.RpcError as exc:
            if self._failed.get(path) != identity:
                self._failed[path] = identity
                log.warning("registration via %s failed (trying again): %s", path, exc)
            return False
        self._failed.pop(path, None)
        if problem is not None:
            self.refused.append(problem)
            return True
        record = DraPluginRecord(
            info.name,
            info.endpoint,
            tuple(info.supported_versions),
            path,
            identity,
            grpc.insecure_channel(f"unix://{info.endpoint}"),
        )
        with self._lock:
            old = self._plugins.pop(info.name, None)
            if old is not None:
                self._close(old)
            self._plugins[info.name] = record
            self._lock.notify_all()
        if "v1alpha1.DRAResourceHealth" in record.versions:
            threading.Thread(
                target=self._health, args=(record,), name="dra-health", daemon=True
            ).start()
        return True

    def _check(self, info: reg_pb.PluginInfo) -> str | None:
        if info.type != "DRAPlugin":
            return f"plugin type {info.type!r} is not DRAPlugin"
        if not info.name:
            return "no driver name"
        if not Path(info.endpoint).is_absolute() or not Path(info.endpoint).exists():
            return f"endpoint {info.endpoint!r} does not exist"
        if not {"v1.DRAPlugin", "v1beta1.DRAPlugin"} & set(info.supported_versions):
            return f"no supported DRAPlugin version in {list(info.supported_versions)}"
        return None

    def _health(self, record: DraPluginRecord) -> None:
        stub = health_grpc.DRAResourceHealthStub(record.channel)
        try:
            stream = stub.NodeWatchResources(health_pb.NodeWatchResourcesRequest())
            record.stream = stream
            for answer in stream:
                seen = {
                    f"{d.device.pool_name}/{d.device.device_name}": (int(d.health), d.message)
                    for d in answer.devices
                }
                with self._lock:
                    record.health = seen
                    record.health_updates += 1
                    self._lock.notify_all()
        except grpc.RpcError:
            return

    @staticmethod
    def _close(record: DraPluginRecord) -> None:
        if record.stream is not None:
            record.stream.cancel()
        record.channel.close()

    # -- views -------------------------------------------------------------------------
    def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.05))
            return True

    def registered(self, driver: str) -> bool:
        return driver in self._plugins

    def plugin(self, driver: str) -> DraPluginRecord:
        with self._lock:
            return self._plugins[driver]

    def health(self, driver: str) -> dict[str, tuple[int, str]]:
        """pool/device -> (HealthStatus, message) from the last stream message."""
        with self._lock:
            record = self._plugins.get(driver)
            return dict(record.health) if record is not None else {}

    # -- the DRA manager's calls ---------------------------------------------------------
    def _stub(self, driver: str) -> tuple[Any, Any]:
        record = self.plugin(driver)
        if self.prefer == "v1" and "v1.DRAPlugin" in record.versions:
            return v1, v1_grpc.DRAPluginStub(record.channel)
        return v1beta1, v1beta1_grpc.DRAPluginStub(record.channel)

    def prepare(self, driver: str, claims: Sequence[ClaimCall]) -> Mapping[str, Any]:
        """claim uid -> {"devices": [...], "error": str}; raises grpc.RpcError."""
        pb, stub = self._stub(driver)
        request = pb.NodePrepareResourcesRequest(
            claims=[pb.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
        )
        self.prepare_calls += 1
        answer = stub.NodePrepareResources(request, timeout=self.call_timeout)
        return {
            uid: {
                "error": entry.error,
                "devices": [
                    {
                        "requests": list(d.request_names),
                        "pool": d.pool_name,
                        "device": d.device_name,
                        "cdi": list(d.cdi_device_ids),
                    }
                    for d in entry.devices
                ],
            }
            for uid, entry in answer.claims.items()
        }

    def unprepare(self, driver: str, claims: Sequence[ClaimCall]) -> Mapping[str, str]:
        pb, stub = self._stub(driver)
        request = pb.NodeUnprepareResourcesRequest(
            claims=[pb.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
        )
        answer = stub.NodeUnprepareResources(request, timeout=self.call_timeout)
        return {uid: entry.error for uid, entry in answer.claims.items()}


def container_cdi_ids(devices: Sequence[Mapping[str, Any]], request: str = "") -> list[str]:
    """The CDI ids the kubelet hands a container for one entry of its
    `resources.claims`, from a prepared claim's devices (as `prepare`
    returns them): for the whole claim (`request` empty) every device's;
    for a request, those of devices listing it or listing no request.
    Follows pkg/kubelet/cm/dra/claiminfo.go, ClaimInfo.cdiDevicesAsList."""
    found: list[str] = []
    for device in devices:
        requests = device["requests"]
        if not request or not requests or request in requests:
            found.extend(device["cdi"])
    return found
