"""The DRA front-end as one part of the daemon: the judged state in, the
kubelet's sockets, the health stream and the ResourceSlices out.

After each judgement (`judged`) the devices as slices name them and the
states judged for them (the same states the device-plugin servicers get)
are taken together, once; the health stream and the slices are derived
from that, so a device that turns unhealthy, or is owed a cleanup, is
tainted (or left out) in the next write and reported Unhealthy to the
kubelet at once. One loop keeps the sockets (a kubelet that wiped its
directories gets fresh ones) and, after a start without a trustworthy
checkpoint, asks the API server which claims hold this node's devices.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from devplugin.config import Config, dra_cdi_kind, node_name
from devplugin.frontends.dra.ledger import ClaimLedger
from devplugin.frontends.dra.plugin import DraPlugin, health_list, socket_paths
from devplugin.frontends.dra.prepare import InitHooks, Preparer, Seat
from devplugin.frontends.dra.slices import SliceDevice, names, node_devices, published, split
from devplugin.loops import Backoff, ThreadLoop
from devplugin.model import DeviceKind, Health
from devplugin.node.core import NodeCore, check_socket_field
from devplugin.node.lifecycle.boot import read_boot_id
from devplugin.node.lifecycle.cdi_spec import ClaimSpecs
from devplugin.node.pipeline import Pipeline
from devplugin.node.resources import ResourceState
from devplugin.policy.claims import ClaimReader, ClaimReadError

log = logging.getLogger(__name__)


class Publisher(Protocol):
    """What the front-end needs of the ResourceSlice publisher (cluster/slices.py)."""

    def poke(self) -> None: ...
    def start(self) -> None: ...
    def signal_stop(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...
    def current(self) -> bool: ...


# The slices this node should have, as the publisher asks for them.
Desired = Callable[[], Sequence[Sequence[Mapping[str, Any]]]]


class DraFrontend(ThreadLoop):
    def __init__(
        self,
        *,
        preparer: Preparer,
        plugin: DraPlugin,
        pipeline: Pipeline,
        kinds: Collection[DeviceKind],
        publisher: Publisher | None,
        unhealthy: str,
        interval: float,
    ) -> None:
        # The slice publisher's writes give up at their request timeout.
        super().__init__(
            "dra",
            backoff=Backoff(interval, max(interval, 5.0)),
            join_timeout=0.5,
            failing="DRA sockets could not be restored",
        )
        self.preparer = preparer
        self.plugin = plugin
        self.publisher = publisher
        self._pipeline = pipeline
        self.kinds = frozenset(kinds)
        self._unhealthy = unhealthy
        self._interval = interval
        self._adopting = False
        # Devices the scheduler allocated to claims here, ahead of their
        # prepare (cluster/allocated.py); the free counts leave them out.
        self.allocated: Callable[[], Collection[str]] = frozenset
        self._states: dict[DeviceKind, ResourceState] = {}
        # The last judgement: its devices as slices name them, and the states.
        self._snapshot: tuple[list[SliceDevice], Mapping[DeviceKind, ResourceState | None]] = (
            [], {},
        )  # fmt: skip
        self._lock = threading.Lock()

    @classmethod
    def build(
        cls,
        config: Config,
        core: NodeCore,
        *,
        reader: ClaimReader,
        publisher: Callable[[Desired], Publisher | None],
    ) -> DraFrontend:
        """The DRA driver for the kinds configured for DRA; `reader` reads
        claims, `publisher` makes the slice writer (None without API)."""
        dra, paths, kinds, pipeline = config.dra, config.paths, core.dra_kinds, core.pipeline
        node = node_name(config)
        served = {resource.kind: resource for resource in core.resources if resource.kind in kinds}
        init = {kind: hook for kind in served if (hook := core.init_hook(kind)) is not None}
        preparer = Preparer(
            seat=Seat(dra.driver, node, read_boot_id(Path(paths.boot_id))),
            resources=served,
            pipeline=pipeline,
            ledger=ClaimLedger(
                core.lifecycle.book,
                names={resource.kind: resource.name for resource in core.resources},
                cancel=core.lifecycle.cancel,
            ),
            init=InitHooks(core.runner, init),
            specs=ClaimSpecs(Path(config.cdi.spec_dirs[-1]), dra_cdi_kind(config)),
            reader=reader,
            metrics=core.metrics,
        )
        plugins_dir, registry_dir = (
            Path(paths.kubelet_plugins_dir),
            Path(paths.kubelet_registry_dir),
        )
        service_path, registration_path = socket_paths(plugins_dir, registry_dir, dra.driver)
        check_socket_field("paths.kubelet_plugins_dir", service_path)
        check_socket_field("paths.kubelet_registry_dir", registration_path)
        plugin = DraPlugin(
            preparer,
            plugins_dir=plugins_dir,
            registry_dir=registry_dir,
            health_timeout=dra.health_timeout_seconds,
        )
        frontend = cls(
            preparer=preparer,
            plugin=plugin,
            pipeline=pipeline,
            kinds=kinds,
            publisher=None,
            unhealthy=dra.unhealthy,
            interval=config.kubelet.watch_interval_seconds,
        )
        frontend.publisher = publisher(frontend.desired)
        for kind in kinds:
            pipeline.connect(kind, partial(frontend.update, kind))
        pipeline.on_judged(frontend.judged)
        return frontend

    @property
    def pool(self) -> str:
        return self.preparer.pool

    # -- from the pipeline -------------------------------------------------------
    def update(self, kind: DeviceKind, state: ResourceState) -> bool:
        """A resource's judged state (the pipeline's sink); whether its
        device list changed. Publication waits for `judged`, when every
        resource of the judgement has its state."""
        with self._lock:
            before = self._states.get(kind)
            self._states[kind] = state
        return before is None or before.devices != state.devices

    def judged(self) -> None:
        """After a judgement: the inventory and the states judged from it,
        taken together, so a slice never shows a scan's attributes with the
        previous scan's health."""
        devices = node_devices(self._pipeline.inventory, self.kinds)
        states = {kind: self._pipeline.served(kind) for kind in self.kinds}
        with self._lock:
            self._snapshot = (devices, states)
        self.plugin.health.update(self._health(devices, states))
        if self.publisher is not None:
            self.publisher.poke()

    def devices(self) -> list[SliceDevice]:
        with self._lock:
            return self._snapshot[0]

    def names(self) -> dict[str, tuple[DeviceKind, str]]:
        return names(self.devices())

    def desired(self) -> list[list[dict[str, Any]]]:
        with self._lock:
            devices, states = self._snapshot
        entries = published(
            devices,
            states,
            domain=self.preparer.driver,
            unhealthy=self._unhealthy,
            held=self.preparer.held() | frozenset(self.allocated()),
        )
        return split(entries, tainting=self._unhealthy == "taint")

    def _health(
        self, devices: list[SliceDevice], states: Mapping[DeviceKind, ResourceState | None]
    ) -> list[Any]:
        entries: dict[str, tuple[bool, str]] = {}
        for device in devices:
            state = states.get(device.kind)
            judged = state.device(device.id) if state is not None else None
            if judged is None:
                entries[device.name] = (False, "not judged yet")
            else:
                entries[device.name] = (judged.health is Health.HEALTHY, judged.reason)
        return health_list(self.pool, entries)

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        """After the checkpoint was loaded and the first scan judged."""
        self._adopting = self.preparer.untrusted
        self.preparer.recover()
        self.plugin.start()
        if self.publisher is not None:
            self.publisher.start()
        super().start()

    def starting(self) -> None:
        log.info("DRA driver %s started (pool %s)", self.preparer.driver, self.pool)

    def step(self) -> float:
        if self._adopting:
            self._adopt()
        self.plugin.watch()
        return self._interval

    def _adopt(self) -> None:
        try:
            self.preparer.adopt()
        except ClaimReadError as exc:
            log.warning("claims not listed (%s); devices stay out until they are", exc)
            self.sleep(min(5.0, 10 * self._interval))
            return
        self._adopting = False
        self._pipeline.rejudge()

    def ready(self) -> tuple[bool, str]:
        if not self.plugin.registered():
            return False, f"DRA driver {self.preparer.driver} not registered with the kubelet"
        if self._adopting:
            return False, "no trustworthy checkpoint: waiting for the claims list"
        if self.publisher is not None and not self.publisher.current():
            return False, "ResourceSlices not current"
        return True, ""

    def signal_stop(self) -> None:
        super().signal_stop()
        if self.publisher is not None:
            self.publisher.signal_stop()

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.publisher is not None:
            self.publisher.join(timeout)

    def stop_serving(self) -> None:
        self.plugin.stop()
