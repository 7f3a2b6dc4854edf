"""The daemon's main job: scan, serve every resource, stay registered, rescan.

Scan, diff, serve: each rescan produces a whole `Inventory`; each resource
turns it into a `ResourceState`; a server pushes a new ListAndWatch list only
when its device list changed.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from devplugin.config import Config
from devplugin.discovery import Discoverer, NvmlGpuSource, Roots
from devplugin.kubelet import Registrar
from devplugin.model import Inventory
from devplugin.resources import GpuResource, HcaResource, Resource
from devplugin.server import DevicePluginServicer, PluginServer, socket_name

log = logging.getLogger(__name__)


def build_resources(config: Config) -> list[Resource]:
    resources: list[Resource] = []
    if config.resources.gpu.enabled:
        resources.append(GpuResource(name=config.resources.gpu.name))
    if config.resources.hca.enabled:
        resources.append(
            HcaResource(name=config.resources.hca.name, env_var=config.resources.hca.env_var)
        )
    return resources


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
        for resource in self.resources:
            servicer = DevicePluginServicer(resource, resource.state(inventory))
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
        self._rescan_thread = threading.Thread(target=self._rescan_loop, name="rescan", daemon=True)
        self._rescan_thread.start()
        self._started = True

    def rescan(self) -> Inventory:
        """Scan the node and push any change to the servers."""
        inventory = self.discoverer.scan()
        with self._inventory_lock:
            self._inventory = inventory
        for server in self.servers:
            servicer = server.servicer
            if servicer.update(servicer.resource.state(inventory)):
                log.info("%s: device list changed", servicer.resource.name)
        return inventory

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
