"""The device-plugin front-end, assembled: per served resource one record
(its hooks, servicer and gRPC server), and the registrar that keeps them
registered with the kubelet. It connects itself to the node core's
pipeline; the daemon starts and stops it as one loop."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from devplugin.config import Config
from devplugin.frontends.deviceplugin.kubelet import Registrar
from devplugin.frontends.deviceplugin.server import (
    DevicePluginServicer,
    PartnerOracle,
    PluginServer,
    socket_name,
)
from devplugin.model import DeviceKind
from devplugin.node.core import NodeCore, check_socket_field
from devplugin.node.node_hooks import Identify, ResourceHooks
from devplugin.node.resources import Resource, ResourceState

log = logging.getLogger(__name__)

# gRPC servers stop with this grace: a stop does not wait out a long call.
STOP_GRACE = 0.2


@dataclass
class ResourceRecord:
    """Everything that belongs to one served resource."""

    resource: Resource
    hooks: ResourceHooks
    servicer: DevicePluginServicer
    server: PluginServer


class DevicePluginFrontend:
    """The resources the kubelet learns of through the Device Plugin API."""

    def __init__(self, records: list[ResourceRecord], registrar: Registrar) -> None:
        self.records = records
        self.registrar = registrar

    @classmethod
    def build(
        cls,
        config: Config,
        core: NodeCore,
        *,
        partners: PartnerOracle | None = None,
        identify: Identify | None = None,
    ) -> DevicePluginFrontend:
        plugin_dir = Path(config.paths.device_plugin_dir)
        records: list[ResourceRecord] = []
        for resource in core.resources:
            if resource.kind in core.dra_kinds:
                continue
            attach = config.allocation.attach_hcas and resource.kind is DeviceKind.GPU
            hooks = ResourceHooks(
                resource,
                pipeline=core.pipeline,
                ledger=core.ledger,
                coordinator=core.coordinator,
                cleanup=core.cleanup,
                runner=core.runner,
                init=core.init_hook(resource.kind),
                attach=core.hca_view if attach else None,
                poke=core.monitor.poke,
                identify=identify,
            )
            servicer = DevicePluginServicer(
                resource,
                ResourceState(devices=(), allocations={}),
                coordinator=core.coordinator,
                hooks=hooks,
                partners=partners,
                metrics=core.metrics,
            )
            core.pipeline.connect(resource.kind, servicer.update)
            endpoint = plugin_dir / socket_name(resource.name)
            check_socket_field("paths.device_plugin_dir", endpoint)
            records.append(
                ResourceRecord(resource, hooks, servicer, PluginServer(servicer, endpoint))
            )
        kubelet = config.kubelet
        registrations = core.metrics.registrations
        registrar = Registrar(
            [record.server for record in records],
            plugin_dir,
            interval=kubelet.watch_interval_seconds,
            register_timeout=kubelet.register_timeout_seconds,
            backoff_initial=kubelet.register_backoff_initial_seconds,
            backoff_max=kubelet.register_backoff_max_seconds,
            on_register=lambda name: registrations.labels(name).inc(),
        )
        return cls(records, registrar)

    # -- views ----------------------------------------------------------------
    @property
    def servers(self) -> list[PluginServer]:
        return [record.server for record in self.records]

    def servicer(self, resource_name: str) -> DevicePluginServicer:
        for record in self.records:
            if record.resource.name == resource_name:
                return record.servicer
        raise KeyError(resource_name)

    def states(self) -> dict[DeviceKind, ResourceState]:
        """What each resource serves now (its last published state)."""
        return {record.resource.kind: record.servicer.state for record in self.records}

    def healthy(self) -> tuple[bool, str]:
        down = [r.resource.name for r in self.records if not r.server.running]
        if down:
            return False, f"gRPC server not running: {', '.join(down)}"
        thread = self.registrar.thread
        if thread is not None and not thread.is_alive():
            return False, f"{thread.name} loop has stopped"
        return True, ""

    def ready(self) -> tuple[bool, str]:
        missing = [name for name, ok in self.registrar.registered().items() if not ok]
        if missing:
            return False, f"not registered with the kubelet: {', '.join(missing)}"
        return True, ""

    # -- the Loop protocol ------------------------------------------------------
    @property
    def join_timeout(self) -> float:
        return self.registrar.join_timeout

    def start(self) -> None:
        """Serve, then register: the kubelet dials back inside Register."""
        started: list[PluginServer] = []
        try:
            for record in self.records:
                record.server.start()
                started.append(record.server)
        except Exception:
            for server in started:
                server.stop(grace=STOP_GRACE)
            raise
        self.registrar.start()

    def signal_stop(self) -> None:
        self.registrar.signal_stop()
        for record in self.records:
            record.servicer.close_streams()

    def join(self, timeout: float | None = None) -> None:
        for record in self.records:
            record.server.stop(grace=STOP_GRACE)
        self.registrar.join(timeout)
