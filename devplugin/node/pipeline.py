"""Scan, judge, serve: from a node snapshot to what each server lists.

`ingest` takes a whole `Inventory` from the check loop (which read the
hardware, with deadlines, before calling it): it rebuilds the topology when
the device set changed, records each device's health on the hardware in the
health tracker, and judges. `rejudge` judges again without a scan (an XID
arrived, a cleanup changed state). Judging is the pure `judge.judge` under
one short lock that no hardware read ever holds; the result is published to
each resource's sink (its servicer) and to the coordinator. RPC handlers
read the published states and never wait for a scan.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

from devplugin.kinds.registry import CUT, PARTNER
from devplugin.model import DeviceKind, Health, Inventory
from devplugin.node.coordination import Coordinator
from devplugin.node.hca.resource import HcaResource
from devplugin.node.judge import Verdicts, judge, transitions
from devplugin.node.lifecycle.cdi_spec import HcaSpecWriter
from devplugin.node.lifecycle.health import HealthTracker
from devplugin.node.lifecycle.view import CustodyView
from devplugin.node.metrics import Metrics
from devplugin.node.resources import CDI_UNDECLARED, Resource, ResourceState
from devplugin.policy.topology import Topology

log = logging.getLogger(__name__)

# Receives a resource's served state; returns whether its device list changed.
Sink = Callable[[ResourceState], bool]


def topology_key(inventory: Inventory) -> Hashable:
    """What the topology depends on (not health): rebuild only when it changes."""
    return (
        tuple(
            (g.uuid, g.pci.path if g.pci else None, g.numa_node, g.nvlink_peers, g.index)
            for g in inventory.gpus
        ),
        tuple((h.device_id, h.pci.path if h.pci else None, h.numa_node) for h in inventory.hcas),
    )


@dataclass
class _Published:
    inventory: Inventory
    live: dict[DeviceKind, ResourceState]
    served: dict[DeviceKind, ResourceState]
    # Attach mode's view of the HCAs: judged when rdma/hca is served, else live.
    hcas: ResourceState | None


class Pipeline:
    def __init__(
        self,
        resources: Sequence[Resource],
        *,
        health: HealthTracker,
        custody: CustodyView,
        coordinator: Coordinator,
        metrics: Metrics,
        after_cleanup: bool,
        hca_view: HcaResource | None = None,
        hca_spec: HcaSpecWriter | None = None,
    ) -> None:
        self._resources = list(resources)
        # The HCA CDI spec, kept in step with each scan before it is judged.
        self._hca_spec = hca_spec
        self._health = health
        self._custody = custody
        self._coordinator = coordinator
        self._metrics = metrics
        self._after_cleanup = after_cleanup
        # HCA device nodes for attach mode when rdma/hca itself is not served.
        served_kinds = {resource.kind for resource in self._resources}
        self._hca_view = hca_view if PARTNER not in served_kinds else None
        self._sinks: dict[DeviceKind, Sink] = {}
        self._judged: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        # Served GPU ids gone while their GPU stayed (cut anew) and still
        # held -> the GPU's UUID; the GPUs withheld for them at the last judgement.
        self._former: dict[str, str] = {}
        self._blocked: set[str] = set()
        self._topology_key: Hashable = None
        # Whether rdma_cm was there at the last scan with HCAs (None: none yet).
        self._rdma_cm: bool | None = None
        # Replaced whole under the lock; readers take the reference without it.
        self._current = _Published(Inventory(), {}, {}, None)
        self.scans = 0

    # -- reads (any thread, never blocking on a scan) --------------------------
    @property
    def inventory(self) -> Inventory:
        return self._current.inventory

    def served(self, kind: DeviceKind) -> ResourceState | None:
        return self._current.served.get(kind)

    def hca_state(self) -> ResourceState | None:
        return self._current.hcas

    def resource(self, kind: DeviceKind) -> Resource:
        return next(r for r in self._resources if r.kind is kind)

    def connect(self, kind: DeviceKind, sink: Sink) -> None:
        self._sinks[kind] = sink

    def on_judged(self, listener: Callable[[], None]) -> None:
        """Call `listener` after each judgement, once the inventory and every
        resource's state it judged can be read together (`inventory`,
        `served`); it runs under the pipeline's lock and must be quick."""
        self._judged.append(listener)

    # -- writes ----------------------------------------------------------------
    def ingest(self, inventory: Inventory) -> None:
        """A new scan: topology (when the device set changed), health, judge."""
        key = topology_key(inventory)
        if key != self._topology_key:
            if self._topology_key is not None:
                log.info("device set changed; topology rebuilt")
            self._coordinator.set_topology(Topology.from_inventory(inventory))
            self._topology_key = key
        self._note_rdma_cm(inventory)
        unwritten = self._hca_spec.sync(inventory.hcas) if self._hca_spec is not None else {}
        live = {resource.kind: resource.state(inventory) for resource in self._resources}
        if unwritten and PARTNER in live:
            live[PARTNER] = _out(live[PARTNER], unwritten)
        if inventory.cdi is not None:
            self._metrics.cdi_refused_specs.set(len(inventory.cdi.refused))
            for resource in self._resources:
                undeclared = sum(
                    device.reason.startswith(CDI_UNDECLARED)
                    for device in live[resource.kind].devices
                )
                self._metrics.cdi_undeclared.labels(resource.name).set(undeclared)
        present: list[str] = []
        for kind, state in live.items():
            self._custody.present(kind, [device.id for device in state.devices])
            for device in state.devices:
                present.append(device.id)
                self._health.observe(device.id, device.health is Health.HEALTHY, device.reason)
        self._health.forget(present)
        changed, gone = recut(self._current.inventory, inventory)
        for new_id in changed:
            # A GPU cut anew (or made whole again) served someone through its
            # old devices: its new ones are cleaned before anyone gets them.
            self._custody.request_cleanup(CUT, new_id)
        with self._lock:
            self._former.update(gone)
        hcas = self._hca_view.state(inventory) if self._hca_view is not None else None
        with self._lock:
            current = self._current
            self._current = _Published(inventory, live, current.served, hcas)
            self._judge_locked()
            self.scans += 1

    def _note_rdma_cm(self, inventory: Inventory) -> None:
        """One line when rdma_cm goes or comes: HCAs are served either way."""
        if not inventory.hcas:
            return
        present = any(hca.rdma_cm.present for hca in inventory.hcas)
        if present == self._rdma_cm:
            return
        if not present:
            log.warning(
                "%s is missing (rdma_ucm not loaded?): HCAs are served without it; "
                "containers get verbs but not the RDMA connection manager",
                inventory.hcas[0].rdma_cm.path,
            )
        elif self._rdma_cm is not None:
            log.info("%s is there again", inventory.hcas[0].rdma_cm.path)
        self._rdma_cm = present

    def rejudge(self) -> None:
        """Judge again from the last scan (an event changed a verdict)."""
        with self._lock:
            self._judge_locked()

    def _judge_locked(self) -> None:
        current = self._current
        in_use = {kind: self._custody.in_use(kind) for kind in current.live}
        verdicts = Verdicts(
            faults=self._health.verdicts(),
            cleanup=self._custody.verdicts(),
            in_use=in_use,
            after_cleanup=self._after_cleanup,
            withheld=self._withheld(current.inventory, in_use.get(CUT, set())),
        )
        judgement = judge(current.live, verdicts)
        for kind, state in judgement.served.items():
            resource = self.resource(kind)
            for before, after in transitions(current.served.get(kind), state):
                _log_transition(resource.name, before is None, after.health, after.id, after.reason)
            self._coordinator.set_healthy(kind, state.healthy_ids())
            served = resource.serve(state)
            self._metrics.set_devices(resource.name, (d.health for d in served.devices))
            sink = self._sinks.get(kind)
            if sink is not None and sink(served):
                log.info("%s: device list changed", resource.name)
        hcas = judgement.served.get(PARTNER, current.hcas)
        if PARTNER not in judgement.served and hcas is not None:
            self._coordinator.set_healthy(PARTNER, hcas.healthy_ids())
        self._current = _Published(current.inventory, current.live, dict(judgement.served), hcas)
        for listener in self._judged:
            listener()
        for kind, device in judgement.cleanups:
            self._custody.request_cleanup(kind, device)

    def _withheld(self, inventory: Inventory, held: set[str]) -> dict[str, str]:
        """The devices of each GPU cut anew while a container still holds
        one of its old devices: not offered, new or whole, until every such
        holder is gone; then they are cleaned before anyone gets them."""
        blocking: dict[str, list[str]] = {}
        for old, physical in self._former.items():
            if old in held:
                blocking.setdefault(physical, []).append(old)
        cleared = self._blocked - set(blocking)
        self._blocked = set(blocking)
        # Old devices nobody holds any more say nothing further.
        self._former = {old: p for old, p in self._former.items() if old in held}
        withheld: dict[str, str] = {}
        for gpu in inventory.gpus:
            physical = gpu.physical_uuid
            if physical in blocking:
                olds = ", ".join(sorted(blocking[physical])[:3])
                withheld[gpu.uuid] = f"GPU {physical[:40]} was cut anew while {olds} is held"
            elif physical in cleared:
                # Its old holders are gone: what they may have left is cleaned.
                self._custody.request_cleanup(CUT, gpu.uuid)
        return withheld


def recut(before: Inventory, after: Inventory) -> tuple[list[str], dict[str, str]]:
    """GPUs whose MIG layout changed (cut anew, or whole again) between two
    scans: the served ids that stand for them now, and the ids they were
    served as that are gone (old id -> the physical GPU's UUID). Both
    empty for a plain hotplug or an unchanged node."""
    old: dict[str, set[str]] = {}
    for gpu in before.gpus:
        old.setdefault(gpu.physical_uuid, set()).add(gpu.uuid)
    new: dict[str, set[str]] = {}
    for gpu in after.gpus:
        new.setdefault(gpu.physical_uuid, set()).add(gpu.uuid)
    present = set().union(*new.values())
    changed = sorted(
        device
        for physical, ids in new.items()
        if physical in old and old[physical] != ids
        for device in ids - old[physical]
    )
    gone = {
        device: physical
        for physical, ids in old.items()
        if physical in new
        for device in ids - present
    }
    return changed, gone


def _out(state: ResourceState, reasons: Mapping[str, str]) -> ResourceState:
    """The state with these devices Unhealthy for these reasons."""
    devices = tuple(
        dataclasses.replace(device, health=Health.UNHEALTHY, reason=reasons[device.id])
        if device.id in reasons
        else device
        for device in state.devices
    )
    return dataclasses.replace(state, devices=devices)


def _log_transition(name: str, new: bool, health: Health, device: str, reason: str) -> None:
    if health is Health.HEALTHY:
        if not new:
            log.info("%s: %s is Healthy again", name, device)
    else:
        log.warning("%s: %s is Unhealthy: %s", name, device, reason)


def log_inventory(inventory: Inventory) -> None:
    """One line for NVML and one per HCA, at start."""
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
