"""The daemon's main job: scan, serve every resource, stay registered, rescan.

Scan, diff, serve: each rescan produces a whole `Inventory`; each resource
turns it into a `ResourceState`; a server pushes a new ListAndWatch list only
when its device list changed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

from devplugin.alignment import AlignmentMonitor
from devplugin.config import Config
from devplugin.coordination import Coordinator
from devplugin.discovery import Discoverer, NvmlGpuSource, Roots
from devplugin.kubelet import PodResourcesClient, Registrar
from devplugin.model import DeviceKind, Inventory
from devplugin.resources import (
    AllocationRefused,
    Capabilities,
    ContainerAllocation,
    GpuResource,
    HcaResource,
    Resource,
    ResourceState,
)
from devplugin.server import DevicePluginServicer, PluginServer, socket_name
from devplugin.topology import Topology

log = logging.getLogger(__name__)


def build_resources(config: Config) -> list[Resource]:
    caps = Capabilities(preferred_allocation=config.allocation.preferred)
    resources: list[Resource] = []
    if config.resources.gpu.enabled:
        resources.append(GpuResource(name=config.resources.gpu.name, capabilities=caps))
    if config.resources.hca.enabled:
        resources.append(
            HcaResource(
                name=config.resources.hca.name,
                env_var=config.resources.hca.env_var,
                capabilities=caps,
            )
        )
    return resources


def topology_key(inventory: Inventory) -> Hashable:
    """What the topology depends on (not health): rebuild only when it changes."""
    return (
        tuple(
            (g.uuid, g.pci.path if g.pci else None, g.numa_node, g.nvlink_peers, g.index)
            for g in inventory.gpus
        ),
        tuple((h.device_id, h.pci.path if h.pci else None, h.numa_node) for h in inventory.hcas),
    )


class Daemon:
    """Owns the servers, the registrar and the rescan loop for one node."""

    def __init__(self, config: Config, nvml_lib: Any | None) -> None:
        self.config = config
        paths = config.paths
        self.plugin_dir = Path(paths.device_plugin_dir)
        gpu_source = (
            NvmlGpuSource(nvml_lib)
            if nvml_lib is not None and config.resources.gpu.enabled
            else None
        )
        self.discoverer = Discoverer(
            Roots(Path(paths.sysfs_root), Path(paths.dev_root)), gpu_source
        )
        self.resources = build_resources(config)
        self.coordinator = Coordinator(pairing_window=config.allocation.pairing_window_seconds)
        # HCA device nodes for attach mode, whether or not rdma/hca is served.
        self._hca_view = HcaResource(
            name=config.resources.hca.name, env_var=config.resources.hca.env_var
        )
        self._hca_state: ResourceState | None = None
        self._topology_key: Hashable = None
        names = {resource.kind: resource.name for resource in self.resources}
        self.monitor = AlignmentMonitor(
            PodResourcesClient(Path(paths.pod_resources_socket)),
            self.coordinator,
            names,
            interval=config.pod_resources.poll_interval_seconds,
            min_interval=config.pod_resources.min_interval_seconds,
        )
        self.servers: list[PluginServer] = []
        self.registrar: Registrar | None = None
        self._inventory = Inventory()
        self._inventory_lock = threading.Lock()
        self._stop = threading.Event()
        self._rescan_now = threading.Event()
        self._rescan_thread: threading.Thread | None = None
        self._started = False

    @property
    def inventory(self) -> Inventory:
        with self._inventory_lock:
            return self._inventory

    def servicer(self, resource_name: str) -> DevicePluginServicer:
        for server in self.servers:
            if server.servicer.resource.name == resource_name:
                return server.servicer
        raise KeyError(resource_name)

    def start(self) -> None:
        """Serve first, then register: the kubelet dials back inside Register."""
        log.info(
            "devplugin starting: resources %s, plugin dir %s, sysfs %s, dev %s",
            ", ".join(resource.name for resource in self.resources),
            self.plugin_dir,
            self.config.paths.sysfs_root,
            self.config.paths.dev_root,
        )
        inventory = self.rescan()
        self._log_inventory(inventory)
        attach = self.config.allocation.attach_hcas
        for resource in self.resources:
            servicer = DevicePluginServicer(
                resource,
                resource.state(inventory),
                coordinator=self.coordinator,
                on_allocate=self._allocation_hook(resource.kind),
                attach=self._attach if attach and resource.kind is DeviceKind.GPU else None,
            )
            server = PluginServer(servicer, self.plugin_dir / socket_name(resource.name))
            self.servers.append(server)
        try:
            for server in self.servers:
                server.start()
        except Exception:
            self._stop_servers()
            raise
        kubelet = self.config.kubelet
        self.registrar = Registrar(
            self.servers,
            self.plugin_dir,
            interval=kubelet.watch_interval_seconds,
            register_timeout=kubelet.register_timeout_seconds,
            backoff_initial=kubelet.register_backoff_initial_seconds,
            backoff_max=kubelet.register_backoff_max_seconds,
        )
        self.registrar.start()
        self.monitor.start()
        self._rescan_thread = threading.Thread(target=self._rescan_loop, name="rescan", daemon=True)
        self._rescan_thread.start()
        self._started = True

    def rescan(self) -> Inventory:
        """Scan the node and push any change to the servers."""
        inventory = self.discoverer.scan()
        with self._inventory_lock:
            self._inventory = inventory
        key = topology_key(inventory)
        if key != self._topology_key:
            self.coordinator.set_topology(Topology.from_inventory(inventory))
            self._topology_key = key
        self._hca_state = self._hca_view.state(inventory)
        healthy = {DeviceKind.HCA: self._hca_state.healthy_ids()}
        for resource in self.resources:
            if resource.kind is DeviceKind.GPU:
                healthy[DeviceKind.GPU] = resource.state(inventory).healthy_ids()
        for kind, ids in healthy.items():
            self.coordinator.set_healthy(kind, ids)
        for server in self.servers:
            servicer = server.servicer
            if servicer.update(servicer.resource.state(inventory)):
                log.info("%s: device list changed", servicer.resource.name)
        return inventory

    def _allocation_hook(self, kind: DeviceKind) -> Callable[[Sequence[str]], None]:
        def allocated(ids: Sequence[str]) -> None:
            self.coordinator.allocated(kind, ids)
            self.monitor.poke()

        return allocated

    def _attach(self, gpu_ids: Sequence[str]) -> ContainerAllocation | None:
        """Attach mode: the nearest healthy HCAs' nodes and variable for these GPUs."""
        state = self._hca_state
        hcas = self.coordinator.nearest(gpu_ids)
        if state is None or not hcas:
            return None
        try:
            return self._hca_view.allocate(state, hcas)
        except AllocationRefused as exc:
            log.warning("attach: cannot add HCAs %s: %s", ",".join(hcas), exc.reason)
            return None

    def request_rescan(self) -> None:
        self._rescan_now.set()

    def _rescan_loop(self) -> None:
        interval = self.config.discovery.rescan_interval_seconds
        log.info("rescan loop started (every %.1fs)", interval)
        while not self._stop.is_set():
            self._rescan_now.wait(interval)
            self._rescan_now.clear()
            if self._stop.is_set():
                break
            try:
                self.rescan()
            except Exception:
                log.exception("rescan failed; keeping the previous device lists")
        log.info("rescan loop stopped")

    def _log_inventory(self, inventory: Inventory) -> None:
        if inventory.nvml.ok:
            log.info("NVML driver %s: %d GPUs", inventory.nvml.driver_version, len(inventory.gpus))
        for hca in inventory.hcas:
            log.info(
                "HCA %s at %s (NUMA %s), ports %s",
                hca.name,
                hca.pci_address,
                hca.numa_node if hca.numa_node is not None else "unknown",
                ", ".join(f"{port.number}:{port.state}" for port in hca.ports) or "none",
            )

    def stop(self) -> None:
        """Stop serving and remove our sockets. Safe to call more than once."""
        self._stop.set()
        self._rescan_now.set()
        if self.registrar is not None:
            self.registrar.stop()
        self.monitor.stop()
        if self._rescan_thread is not None:
            self._rescan_thread.join(timeout=10)
        self._stop_servers()
        self.discoverer.close()
        if self._started:
            log.info("devplugin stopped; sockets removed")
        self._started = False

    def _stop_servers(self) -> None:
        for server in self.servers:
            server.stop(grace=1.0)
