"""The device-plugin front-end, assembled: per served resource one record
(its hooks, servicer and gRPC server), and the registrar that keeps them
registered with the kubelet. It connects itself to the node core's
pipeline; the daemon starts and stops it as one loop."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from devplugin.config import Config
from devplugin.frontends.deviceplugin.dirwatch import DirWatch
from devplugin.frontends.deviceplugin.kubelet import Registrar
from devplugin.frontends.deviceplugin.server import (
    DevicePluginServicer,
    PartnerOracle,
    PluginServer,
    socket_name,
)
from devplugin.kinds.registry import is_anchor, wing
from devplugin.model import DeviceKind
from devplugin.node.core import NodeCore, check_socket_field
from devplugin.node.node_hooks import Identify, ResourceHooks
from devplugin.node.resources import Resource, ResourceState
from devplugin.policy.mig import profile_resource

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

    def __init__(
        self, records: list[ResourceRecord], registrar: Registrar, plugin_dir: Path | None = None
    ) -> None:
        self.records = records
        self.registrar = registrar
        # The kubelet's directory changing (a restart) pokes the registrar at once.
        self.dirwatch = DirWatch(plugin_dir, registrar.poke) if plugin_dir is not None else None
        if self.dirwatch is not None:
            watch = self.dirwatch
            registrar.heard_through(lambda: watch.watching)

    @classmethod
    def build(
        cls,
        config: Config,
        core: NodeCore,
        *,
        partners: PartnerOracle | None = None,
        identify: Identify | None = None,
        profiles: Sequence[str] = (),
    ) -> DevicePluginFrontend:
        """`profiles`: the MIG profiles found at start, each served as its
        own resource under the mixed strategy."""
        plugin_dir = Path(config.paths.device_plugin_dir)
        records: list[ResourceRecord] = []
        mixed = config.resources.gpu.mig.strategy == "mixed"
        served: list[tuple[Resource, str | None]] = []
        for resource in core.resources:
            if resource.kind in core.dra_kinds:
                continue
            served.append((resource, None))
            if mixed and wing(resource.kind).cut:
                # One resource per MIG profile found at start, beside whole GPUs.
                served += [
                    (replace(resource, name=profile_resource(resource.name, p)), p)  # type: ignore[type-var]
                    for p in profiles
                ]
        # Under mixed, the GPU kind's judged state is split among its resources.
        fan = _FanOut(core) if mixed else None
        by_name: dict[str, DevicePluginServicer] = {}

        def served_ids(name: str) -> frozenset[str] | None:
            found = by_name.get(name)
            return found.ids if found is not None else None

        for resource, profile in served:
            attach = config.allocation.attach_hcas and is_anchor(resource.kind)
            hooks = ResourceHooks(
                resource,
                pipeline=core.pipeline,
                ledger=core.ledger,
                coordinator=core.coordinator,
                takes=core.lifecycle.takes,
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
                partner_ids=served_ids,
                metrics=core.metrics,
            )
            by_name[resource.name] = servicer
            if profile is not None and partners is not None:
                partners.add_resource(resource.kind, resource.name)
            if fan is not None and wing(resource.kind).cut:
                fan.add(servicer, profile)
                core.pipeline.connect(resource.kind, fan)
            else:
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
        return cls(records, registrar, plugin_dir)

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
        """What each kind serves now (its last published state; a kind served
        as several resources, mixed MIG, put back together)."""
        found: dict[DeviceKind, ResourceState] = {}
        for record in self.records:
            state, kind = record.servicer.state, record.resource.kind
            before = found.get(kind)
            if before is not None:
                state = replace(
                    before,
                    devices=before.devices + state.devices,
                    allocations={**before.allocations, **state.allocations},
                    names={**before.names, **state.names},
                )
            found[kind] = state
        return found

    def served_as(self) -> dict[str, tuple[str, int]]:
        """Each physical device's resource name as the kubelet sees it, and
        how many replicas it is served as (1: exclusive): what the record
        tells the extender so it judges a pod as the kubelet will."""
        found: dict[str, tuple[str, int]] = {}
        for record in self.records:
            state = record.servicer.state
            physical = state.backing.devices if state.backing is not None else state.devices
            replicas = int(getattr(record.resource, "replicas", 1))
            for device in physical:
                found[device.id] = (record.resource.name, replicas)
        return found

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
        if self.dirwatch is not None and self.records:
            self.dirwatch.start()

    def signal_stop(self) -> None:
        self.registrar.signal_stop()
        if self.dirwatch is not None:
            self.dirwatch.signal_stop()
        for record in self.records:
            record.servicer.close_streams()

    def join(self, timeout: float | None = None) -> None:
        for record in self.records:
            record.server.stop(grace=STOP_GRACE)
        self.registrar.join(timeout)
        if self.dirwatch is not None:
            self.dirwatch.join(timeout)


class _FanOut:
    """The mixed MIG strategy: one kind's judged state, split among its
    resources by each device's MIG profile (None: whole GPUs). A profile
    that appears after start has no resource and is not served until the
    daemon restarts (one warning), as NVIDIA's plugin is restarted by its
    MIG manager after a reconfiguration."""

    def __init__(self, core: NodeCore) -> None:
        self._core = core
        self._parts: list[tuple[DevicePluginServicer, str | None]] = []
        self._warned: set[str] = set()

    def add(self, servicer: DevicePluginServicer, profile: str | None) -> None:
        self._parts.append((servicer, profile))

    def __call__(self, state: ResourceState) -> bool:
        by_profile: dict[str | None, set[str]] = {}
        for gpu in self._core.pipeline.inventory.gpus:
            profile = gpu.slice.device.profile if gpu.slice is not None else None
            by_profile.setdefault(profile, set()).add(gpu.uuid)
        known = {profile for _, profile in self._parts}
        for profile in sorted(p for p in by_profile if p is not None and p not in known):
            if profile not in self._warned:
                self._warned.add(profile)
                log.warning(
                    "MIG profile %s appeared after start: its devices are not served until "
                    "the daemon restarts",
                    profile,
                )
        changed = False
        for servicer, profile in self._parts:
            changed |= servicer.update(state.only(by_profile.get(profile, set())))
        return changed
