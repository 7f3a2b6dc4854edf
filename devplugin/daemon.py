"""The daemon's main job: scan, judge health, serve, stay registered.

Scan, diff, serve: every check produces a whole `Inventory`; each resource
turns it into the list it would serve on the hardware alone (live health);
the health tracker (latched faults, recovery) and the cleanup manager (in
use, cleaning, quarantined) then decide each device's final health; a
server pushes a ListAndWatch update only when its list changed.

One loop owns the checks: a light check (ports, device nodes, NVML handles)
every `health.interval_seconds`, a full rescan of the PCI tree every
`discovery.rescan_interval_seconds` or at once on a hotplug event, and a
re-judgement (no scan) whenever an XID arrives or a cleanup changes state.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

from devplugin.alignment import AlignmentMonitor
from devplugin.config import Config, HooksConfig
from devplugin.coordination import Coordinator
from devplugin.discovery import Discoverer, NvmlGpuSource, Roots
from devplugin.discovery.udev import HotplugWatcher, udev_monitor
from devplugin.kubelet import PodResourcesClient, Registrar
from devplugin.lifecycle.checkpoint import Checkpoint
from devplugin.lifecycle.cleanup import CleanupManager
from devplugin.lifecycle.health import HealthTracker, Recovery
from devplugin.lifecycle.hooks import HookDevice, HookSpec, run_hook
from devplugin.lifecycle.xid import XidWatcher
from devplugin.metrics import Metrics
from devplugin.model import DeviceKind, Health, Inventory, PluginDevice, Refused
from devplugin.resources import (
    Capabilities,
    ContainerAllocation,
    GpuResource,
    HcaResource,
    Resource,
    ResourceState,
)
from devplugin.server import DevicePluginServicer, PluginServer, socket_name
from devplugin.sharing import SharedResource
from devplugin.status import StatusServer
from devplugin.topology import Topology

log = logging.getLogger(__name__)

SWITCH_INTERVAL = 0.0005


def _hooks_config(config: Config, kind: DeviceKind) -> HooksConfig:
    return config.resources.gpu.hooks if kind is DeviceKind.GPU else config.resources.hca.hooks


def build_resources(config: Config) -> list[Resource]:
    def caps(hooks: HooksConfig) -> Capabilities:
        return Capabilities(
            preferred_allocation=config.allocation.preferred,
            pre_start=bool(hooks.init) and hooks.init_phase == "pre_start",
        )

    resources: list[Resource] = []
    gpu, hca = config.resources.gpu, config.resources.hca
    sharing = config.sharing
    if gpu.enabled:
        gpu_resource: Resource = GpuResource(name=gpu.name, capabilities=caps(gpu.hooks))
        if sharing.gpu.replicas > 1:
            gpu_resource = SharedResource(
                gpu_resource,
                sharing.gpu.replicas,
                policy=sharing.gpu.policy,
                refuse_multiple=sharing.gpu.refuse_multiple_per_gpu,
                renamed=sharing.gpu.resource_name,
            )
        resources.append(gpu_resource)
    if hca.enabled:
        hca_resource: Resource = HcaResource(
            name=hca.name, env_var=hca.env_var, capabilities=caps(hca.hooks)
        )
        if sharing.hca.units > 1:
            hca_resource = SharedResource(
                hca_resource, sharing.hca.units, policy=sharing.hca.policy
            )
        resources.append(hca_resource)
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
    """Owns the servers, the registrar, the checks and the lifecycle for one node."""

    def __init__(
        self, config: Config, nvml_lib: Any | None, *, hotplug_monitor: Any | None = None
    ) -> None:
        self.config = config
        paths = config.paths
        self.plugin_dir = Path(paths.device_plugin_dir)
        gpu_lib = nvml_lib if config.resources.gpu.enabled else None
        gpu_source = NvmlGpuSource(gpu_lib) if gpu_lib is not None else None
        self.discoverer = Discoverer(
            Roots(Path(paths.sysfs_root), Path(paths.dev_root)), gpu_source
        )
        self.resources = build_resources(config)
        grace = config.pod_resources.bookkeeping_grace_seconds
        self.coordinator = Coordinator(
            pairing_window=config.allocation.pairing_window_seconds, bookkeeping_grace=grace
        )
        # HCA device nodes for attach mode when rdma/hca itself is not served.
        self._hca_view = HcaResource(
            name=config.resources.hca.name, env_var=config.resources.hca.env_var
        )
        self._names = {resource.kind: resource.name for resource in self.resources}
        self.metrics = Metrics()
        self._run_hook = self.metrics.timed_hooks(run_hook)
        self.health = HealthTracker(Recovery(config.health.recovery), config.health.good_checks)
        self._init_hooks: dict[DeviceKind, HookSpec] = {}
        cleanup_hooks: dict[DeviceKind, HookSpec] = {}
        for resource in self.resources:
            hooks = _hooks_config(config, resource.kind)
            if hooks.init:
                self._init_hooks[resource.kind] = HookSpec(hooks.init, hooks.timeout_seconds)
            if hooks.cleanup:
                cleanup_hooks[resource.kind] = HookSpec(hooks.cleanup, hooks.timeout_seconds)
        lifecycle = config.lifecycle
        self.cleanup = CleanupManager(
            hooks=cleanup_hooks,
            resource_names=self._names,
            describe=self.describe,
            checkpoint=Checkpoint(Path(lifecycle.checkpoint_file)),
            confirmations=lifecycle.release_confirmations,
            retry_initial=lifecycle.cleanup_retry_initial_seconds,
            retry_max=lifecycle.cleanup_retry_max_seconds,
            bookkeeping_grace=grace,
            on_change=self.request_judge,
            on_cleaned=self._cleaned,
            runner=self._run_hook,
        )
        self.monitor = AlignmentMonitor(
            PodResourcesClient(Path(paths.pod_resources_socket)),
            self.coordinator,
            self._names,
            interval=config.pod_resources.poll_interval_seconds,
            min_interval=config.pod_resources.min_interval_seconds,
            listeners=[self.cleanup.observe],
            metrics=self.metrics,
        )
        self.status: StatusServer | None = None
        self.xid = (
            XidWatcher(gpu_lib, ignore=config.health.xid_ignore, on_fault=self._gpu_fault)
            if gpu_lib is not None
            else None
        )
        self._hotplug_monitor = hotplug_monitor
        self.hotplug: HotplugWatcher | None = None
        self.servers: list[PluginServer] = []
        self.registrar: Registrar | None = None
        self._inventory = Inventory()
        self._live: dict[DeviceKind, ResourceState] = {}
        self._served: dict[DeviceKind, ResourceState] = {}
        # The HCAs' judged state (or, unserved, their live one) for attach mode.
        self._hca_state: ResourceState | None = None
        self._topology_key: Hashable = None
        self._refresh_lock = threading.RLock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._want_full = False
        self._want_judge = False
        self._loop_thread: threading.Thread | None = None
        self._started = False
        self.checks = 0  # completed scans, for observers

    # -- state ---------------------------------------------------------------
    @property
    def inventory(self) -> Inventory:
        with self._refresh_lock:
            return self._inventory

    def servicer(self, resource_name: str) -> DevicePluginServicer:
        for server in self.servers:
            if server.servicer.resource.name == resource_name:
                return server.servicer
        raise KeyError(resource_name)

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        """Serve first, then register: the kubelet dials back inside Register."""
        log.info(
            "devplugin starting: resources %s, plugin dir %s, sysfs %s, dev %s",
            ", ".join(resource.name for resource in self.resources),
            self.plugin_dir, self.config.paths.sysfs_root, self.config.paths.dev_root,
        )  # fmt: skip
        # RPC handlers share the interpreter with the check loop; a short GIL
        # switch interval keeps a scan from delaying a kubelet call by more
        # than half a millisecond (the default slice is 5 ms).
        sys.setswitchinterval(SWITCH_INTERVAL)
        self.cleanup.start()
        self.refresh(full=True)
        self._log_inventory(self._inventory)
        for resource in self.resources:
            kind = resource.kind
            init = self._init_hooks.get(kind)
            pre_start = resource.capabilities.pre_start
            servicer = DevicePluginServicer(
                resource,
                resource.serve(self._served[kind]),
                coordinator=self.coordinator,
                on_allocate=self._allocation_hook(kind),
                attach=self._attach
                if self.config.allocation.attach_hcas and kind is DeviceKind.GPU
                else None,
                prepare=self._prepare_hook(kind),
                init=self._init_hook(kind) if init is not None and not pre_start else None,
                pre_start=self._init_hook(kind) if init is not None and pre_start else None,
                metrics=self.metrics,
            )
            self.servers.append(
                PluginServer(servicer, self.plugin_dir / socket_name(resource.name))
            )
        try:
            for server in self.servers:
                server.start()
        except Exception:
            self._stop_servers()
            self.cleanup.stop()
            raise
        kubelet = self.config.kubelet
        self.registrar = Registrar(
            self.servers,
            self.plugin_dir,
            interval=kubelet.watch_interval_seconds,
            register_timeout=kubelet.register_timeout_seconds,
            backoff_initial=kubelet.register_backoff_initial_seconds,
            backoff_max=kubelet.register_backoff_max_seconds,
            on_register=lambda name: self.metrics.registrations.labels(name).inc(),
        )
        self.registrar.start()
        if self.config.metrics.enabled:
            self.status = StatusServer(
                list(self.config.metrics.addresses),
                self.metrics.registry,
                healthy=self.healthy,
                ready=self.ready,
            )
            self.status.start()
        self.monitor.start()
        if self.xid is not None:
            self.xid.start()
        monitor = self._hotplug_monitor
        if monitor is None and self.config.hotplug.udev:
            monitor = udev_monitor()
        if monitor is not None:
            self.hotplug = HotplugWatcher(monitor, lambda what: self.request_rescan())
            self.hotplug.start()
        self._loop_thread = threading.Thread(target=self._loop, name="checks", daemon=True)
        self._loop_thread.start()
        self._started = True

    def healthy(self) -> tuple[bool, str]:
        """/healthz: the process, its gRPC servers and its loops are alive."""
        down = [s.servicer.resource.name for s in self.servers if not s.running]
        if down:
            return False, f"gRPC server not running: {', '.join(down)}"
        threads = [self._loop_thread]
        if self.registrar is not None:
            threads.append(self.registrar.thread)
        for thread in threads:
            if thread is not None and not thread.is_alive():
                return False, f"{thread.name} loop has stopped"
        return True, ""

    def ready(self) -> tuple[bool, str]:
        """/readyz: every resource is registered with the current kubelet."""
        if self.registrar is None:
            return False, "not started"
        missing = [name for name, ok in self.registrar.registered().items() if not ok]
        if missing:
            return False, f"not registered with the kubelet: {', '.join(missing)}"
        return True, ""

    def stop(self) -> None:
        """Stop serving and remove our sockets. Safe to call more than once."""
        self._stop.set()
        self._wake.set()
        if self.status is not None:
            self.status.stop()
        if self.registrar is not None:
            self.registrar.stop()
        self.monitor.stop()
        if self.hotplug is not None:
            self.hotplug.stop()
        if self.xid is not None:
            self.xid.stop()
        if self._loop_thread is not None:
            self._loop_thread.join(timeout=10)
        self._stop_servers()
        self.cleanup.stop()
        self.discoverer.close()
        if self._started:
            log.info("devplugin stopped; sockets removed")
        self._started = False

    def _stop_servers(self) -> None:
        for server in self.servers:
            server.stop(grace=1.0)

    # -- the check loop --------------------------------------------------------
    def request_rescan(self) -> None:
        """A full rescan soon (hotplug)."""
        self._want_full = True
        self._wake.set()

    def request_judge(self) -> None:
        """Re-decide health without scanning (an XID, a cleanup state change)."""
        self._want_judge = True
        self._wake.set()

    def _loop(self) -> None:
        interval = self.config.health.interval_seconds
        rescan = self.config.discovery.rescan_interval_seconds
        log.info(
            "check loop started (health every %.1fs, full rescan every %.1fs)", interval, rescan
        )
        next_check = time.monotonic() + interval
        next_full = time.monotonic() + rescan
        while not self._stop.is_set():
            self._wake.wait(max(0.0, min(next_check, next_full) - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                break
            full, self._want_full = self._want_full, False
            judge, self._want_judge = self._want_judge, False
            now = time.monotonic()
            try:
                if full or now >= next_full:
                    self.refresh(full=True)
                    next_full = now + rescan
                    next_check = now + interval
                elif now >= next_check:
                    self.refresh(full=False)
                    next_check = now + interval
                elif judge:
                    self.judge()
            except Exception:
                log.exception("health check failed; keeping the previous device lists")
        log.info("check loop stopped")

    def refresh(self, *, full: bool = True) -> Inventory:
        """Scan (everything, or just health inputs), record the checks, judge."""
        with self._refresh_lock:
            inventory = self.discoverer.scan(full=full)
            self._inventory = inventory
            key = topology_key(inventory)
            if key != self._topology_key:
                if self._topology_key is not None:
                    log.info("device set changed; topology rebuilt")
                self.coordinator.set_topology(Topology.from_inventory(inventory))
                self._topology_key = key
            live = {resource.kind: resource.state(inventory) for resource in self.resources}
            # Attach mode needs HCA device nodes even when rdma/hca is not served.
            if DeviceKind.HCA not in live:
                self._hca_state = self._hca_view.state(inventory)
            present: list[str] = []
            for state in live.values():
                for device in state.devices:
                    present.append(device.id)
                    self.health.observe(device.id, device.health is Health.HEALTHY, device.reason)
            self.health.forget(present)
            self._live = live
            self.judge()
            self.checks += 1
            return inventory

    def rescan(self) -> Inventory:
        return self.refresh(full=True)

    def judge(self) -> None:
        """Final health per device: cleanup state first, then latched faults."""
        with self._refresh_lock:
            after_cleanup = self.config.health.recovery == "after_cleanup"
            for kind, live in self._live.items():
                devices: list[PluginDevice] = []
                previous = self._served.get(kind)
                for device in live.devices:
                    verdict = self.cleanup.verdict(kind, device.id) or self.health.verdict(
                        device.id
                    )
                    judged = dataclasses.replace(
                        device, health=verdict.health, reason=verdict.reason
                    )
                    devices.append(judged)
                    before = previous.device(device.id) if previous is not None else None
                    self._log_transition(kind, before, judged)
                    if (
                        after_cleanup
                        and verdict.health is Health.UNHEALTHY
                        and device.health is Health.HEALTHY
                        and device.id not in self.cleanup.in_use(kind)
                    ):
                        self.cleanup.request_cleanup(kind, device.id)
                judged_state = dataclasses.replace(live, devices=tuple(devices))
                self._served[kind] = judged_state
                self.coordinator.set_healthy(kind, judged_state.healthy_ids())
                resource = next(r for r in self.resources if r.kind is kind)
                served = resource.serve(judged_state)
                self.metrics.set_devices(resource.name, (d.health for d in served.devices))
                for server in self.servers:
                    if server.servicer.resource is resource and server.servicer.update(served):
                        log.info("%s: device list changed", resource.name)
            if DeviceKind.HCA in self._served:
                self._hca_state = self._served[DeviceKind.HCA]
            elif self._hca_state is not None:
                self.coordinator.set_healthy(DeviceKind.HCA, self._hca_state.healthy_ids())

    def _log_transition(
        self, kind: DeviceKind, before: PluginDevice | None, after: PluginDevice
    ) -> None:
        name = self._names[kind]
        if before is None:
            if after.health is Health.UNHEALTHY:
                log.warning("%s: %s is Unhealthy: %s", name, after.id, after.reason)
            return
        if before.health is after.health and before.reason == after.reason:
            return
        if after.health is Health.HEALTHY:
            log.info("%s: %s is Healthy again", name, after.id)
        else:
            log.warning("%s: %s is Unhealthy: %s", name, after.id, after.reason)

    # -- events ----------------------------------------------------------------
    def _gpu_fault(self, uuid: str, reason: str) -> None:
        self.health.fault(uuid, reason, self.config.health.xid_good_checks)
        self.request_judge()

    def _cleaned(self, kind: DeviceKind, device: str) -> None:
        self.health.cleaned(device)
        self.request_judge()

    # -- per-RPC hooks -----------------------------------------------------------
    def describe(self, kind: DeviceKind, ids: Sequence[str]) -> list[HookDevice] | None:
        """What hooks are told about each device; None if one is unknown."""
        inventory = self.inventory
        found: list[HookDevice] = []
        if kind is DeviceKind.GPU:
            gpus = {gpu.uuid: gpu for gpu in inventory.gpus}
            for device_id in ids:
                gpu = gpus.get(device_id)
                if gpu is None:
                    return None
                found.append(
                    HookDevice(device_id, str(gpu.pci_address), (f"/dev/nvidia{gpu.minor_number}",),
                               gpu.numa_node, gpu_uuid=gpu.uuid)
                )  # fmt: skip
        else:
            hcas = {hca.device_id: hca for hca in inventory.hcas}
            for device_id in ids:
                hca = hcas.get(device_id)
                if hca is None:
                    return None
                nodes = tuple(node.path for node in hca.char_devices)
                found.append(
                    HookDevice(device_id, str(hca.pci_address), nodes, hca.numa_node,
                               hca_name=hca.name)
                )  # fmt: skip
        return found

    def _allocation_hook(self, kind: DeviceKind) -> Callable[[Sequence[str]], None]:
        def allocated(ids: Sequence[str]) -> None:
            self.coordinator.allocated(kind, ids)
            self.cleanup.allocated(kind, ids)
            self.monitor.poke()

        return allocated

    def _prepare_hook(self, kind: DeviceKind) -> Callable[[Sequence[str]], str | None]:
        shared = any(isinstance(r, SharedResource) for r in self.resources if r.kind is kind)

        def prepare(ids: Sequence[str]) -> str | None:
            error = self.cleanup.prepare(kind, ids, reuse_proves_release=not shared)
            self.judge()
            return error

        return prepare

    def _init_hook(self, kind: DeviceKind) -> Callable[[Sequence[str]], str | None]:
        spec = self._init_hooks[kind]
        name = self._names[kind]

        def init(ids: Sequence[str]) -> str | None:
            devices = self.describe(kind, ids)
            if devices is None:
                return "unknown device ids"
            result = self._run_hook(spec, "init", name, devices)
            if result.ok:
                log.info("%s: init hook for %s took %.2fs", name, ",".join(ids), result.duration)
                return None
            message = result.describe("init", spec.timeout)
            log.warning("%s: %s for %s", name, message, ",".join(ids))
            return message

        return init

    def _attach(self, gpu_ids: Sequence[str]) -> ContainerAllocation | None:
        """Attach mode: the nearest healthy HCAs' nodes and variable for these GPUs."""
        state = self._hca_state
        hcas = self.coordinator.nearest(gpu_ids)
        if state is None or not hcas:
            return None
        try:
            return self._hca_view.allocate(state, hcas)
        except Refused as exc:
            log.warning("attach: cannot add HCAs %s: %s", ",".join(hcas), exc.reason)
            return None

    def _log_inventory(self, inventory: Inventory) -> None:
        if inventory.nvml.ok:
            log.info("NVML driver %s: %d GPUs", inventory.nvml.driver_version, len(inventory.gpus))
        for hca in inventory.hcas:
            log.info(
                "HCA %s at %s (NUMA %s), ports %s",
                hca.name, hca.pci_address,
                hca.numa_node if hca.numa_node is not None else "unknown",
                ", ".join(f"{port.number}:{port.state}" for port in hca.ports) or "none",
            )  # fmt: skip
