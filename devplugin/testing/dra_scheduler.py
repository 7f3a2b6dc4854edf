"""An imitation of the kube-scheduler's structured-parameters allocator.

Given the ResourceSlices of one node, the DeviceClasses, the devices other
claims already hold and a pod's claims, it finds devices as the
scheduler's allocator does. The walk itself is policy/dra_walk.py (the
extender predicts with the same rules); this side adds what the scheduler
adds around it:

* selectors (the class's and the request's) are CEL expressions over
  `device.driver`, `device.attributes[domain].name` and
  `device.capacity[domain].name`, evaluated with cel-python; a verdict is
  kept per allocator (isSelectable's cache); a runtime error aborts;
* a device tainted NoSchedule or NoExecute is skipped unless the request
  tolerates the taint, only where the DRADeviceTaints gate is on (by
  default from 1.36: the `version` parameter);
* a try budget stands in for the scheduler's Filter timeout.

Results name the request as the scheduler does (`gpu-0/pix` for a
subrequest).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import celpy
from celpy.adapter import json_to_cel

from devplugin.frontends.dra.slices import node_devices, published, split
from devplugin.model import DeviceKind, Health, Inventory, PluginDevice
from devplugin.node.resources import ResourceState
from devplugin.policy.dra_walk import (
    Alternative,
    Device,
    Walk,
    WalkError,
    alternatives,
    candidates,
    constraints_of,
    results,
    untainted,
)
from devplugin.policy.topology import Level, Topology
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.node import NodeSpec, devices_from_spec

# Device tries before the imitation gives up, as the scheduler's Filter
# gives up at its timeout (10 s); the real allocator itself has no budget.
TRY_BUDGET = 5_000_000

# The walk's error, under the name the tests and bench know.
AllocationError = WalkError


class Selectors:
    """Compiled CEL programs, kept across allocators (the scheduler's CEL
    cache); verdicts are kept per allocator, whose slices they judge."""

    def __init__(self) -> None:
        self._env = celpy.Environment()
        self._programs: dict[str, Any] = {}

    def evaluate(self, expression: str, device: Device, view: Any) -> bool:
        program = self._programs.get(expression)
        if program is None:
            program = self._env.program(self._env.compile(expression))
            self._programs[expression] = program
        try:
            return bool(program.evaluate({"device": view}))
        except Exception as exc:
            # selectorsMatch: a CEL runtime error (a missing attribute
            # read without has(), a type mismatch) aborts the allocation.
            raise AllocationError(
                f"selector {expression!r} on device {device.name}: CEL runtime error: {exc}"
            ) from exc


# The Kubernetes version the imitation follows unless told another.
DEFAULT_VERSION = (1, 36)


def incubating_on(version: tuple[int, int]) -> bool:
    """Whether the scheduler runs the incubating allocator at this version:
    dynamic-resource-allocation structured/allocator.go picks the most
    stable implementation supporting every enabled feature, and the
    DRADeviceBindingConditions and DRAConsumableCapacity gates, which only
    the incubating one supports, are beta and on by default from 1.36."""
    return version >= (1, 36)


def device_taints_on(version: tuple[int, int]) -> bool:
    """Whether the scheduler honours device taints by default at this
    version: the DRADeviceTaints gate (pkg/features/kube_features.go) is
    alpha, off by default, from 1.33 and beta, on by default, from 1.36."""
    return version >= (1, 36)


class Allocator:
    """One node's allocator: its slices, the DeviceClasses, the cluster's
    version (which decides whether device taints count), a try budget."""

    def __init__(
        self,
        slices: Iterable[Mapping[str, Any]],
        classes: Mapping[str, Mapping[str, Any]],
        node: str,
        *,
        selectors: Selectors | None = None,
        version: tuple[int, int] = DEFAULT_VERSION,
        device_taints: bool | None = None,
        incubating: bool | None = None,
        budget: int = TRY_BUDGET,
    ) -> None:
        # Which implementation walks: the stable one (allocator_stable.go)
        # or, from 1.36 by default, the incubating one (allocator_incubating.go:
        # pools and slices sorted, each request's device sets tried once).
        self.incubating = incubating_on(version) if incubating is None else incubating
        self.devices = candidates(slices, node, sort=self.incubating)
        self.budget = budget
        self._classes = classes
        self._selectors = selectors or Selectors()
        # isSelectable's deviceMatchesRequest: a verdict per expression and
        # device, for these slices.
        self._verdicts: dict[tuple[str, str, str, str], bool] = {}
        self._views: dict[tuple[str, str, str], Any] = {}
        # A cluster may set the gate either way; by default it follows the
        # version's default.
        self.device_taints = device_taints_on(version) if device_taints is None else device_taints
        self.tries = 0
        self.timed_out = False

    def selectable(self, alternative: Alternative, device: Device) -> bool:
        """The class's and the request's selectors match (isSelectable)."""
        return all(self._match(e, device) for e in alternative.expressions)

    def _match(self, expression: str, device: Device) -> bool:
        key = (expression, device.driver, device.pool, device.name)
        verdict = self._verdicts.get(key)
        if verdict is None:
            view = self._views.get(device.key)
            if view is None:
                view = self._views[device.key] = json_to_cel(dict(device.view))
            verdict = self._verdicts[key] = self._selectors.evaluate(expression, device, view)
        return verdict

    def allowed(self, alternative: Alternative, device: Device) -> bool:
        """Taints count only with the DRADeviceTaints feature (allocateDevice:
        `alloc.features.DeviceTaints && taintPreventsAllocation(...)`)."""
        return not self.device_taints or untainted(alternative, device)

    def allocate_all(
        self, specs: Sequence[Mapping[str, Any]], taken: Iterable[tuple[str, str, str]] = ()
    ) -> list[list[dict[str, str]]] | None:
        """A pod's claims allocated together: each one's results, or None."""
        requests = [
            alternatives(index, request, self._classes)
            for index, spec in enumerate(specs)
            for request in (spec.get("devices") or {}).get("requests") or []
        ]
        walk = Walk(
            self.devices,
            requests,
            [constraints_of(spec) for spec in specs],
            taken,
            selectable=self.selectable,
            allowed=self.allowed,
            budget=self.budget,
            combinations=self.incubating,
        )
        try:
            chosen = walk.run()
        finally:
            self.tries = walk.tries
            self.timed_out = walk.timed_out
        return None if chosen is None else results(chosen, len(specs))

    def allocate(
        self, spec: Mapping[str, Any], taken: Iterable[tuple[str, str, str]] = ()
    ) -> list[dict[str, str]] | None:
        """The claim's results, or None when no choice satisfies it (or the
        walk ran past its try budget). AllocationError where the scheduler's
        allocator errors out: a missing DeviceClass, a CEL runtime error, an
        `All` request that a constraint makes impossible."""
        found = self.allocate_all([spec], taken)
        return None if found is None else found[0]


def spec_slices(
    spec: NodeSpec,
    driver: str,
    node: str,
    *,
    unhealthy: frozenset[str] = frozenset(),
    mode: str = "taint",
    held: Collection[str] = frozenset(),
) -> tuple[list[dict[str, Any]], Inventory]:
    """The ResourceSlices the driver would publish for a layout, built in
    memory (no daemon), and the inventory behind them."""
    gpus, hcas = devices_from_spec(spec)
    inventory = Inventory(gpus=gpus, hcas=hcas)
    slices = inventory_slices(inventory, driver, node, unhealthy=unhealthy, mode=mode, held=held)
    return slices, inventory


def inventory_slices(
    inventory: Inventory,
    driver: str,
    node: str,
    *,
    unhealthy: frozenset[str] = frozenset(),
    mode: str = "taint",
    held: Collection[str] = frozenset(),
) -> list[dict[str, Any]]:
    """The ResourceSlices the driver would publish for these devices, with
    the unhealthy ones tainted or left out (`mode`, as dra.unhealthy), and
    the free counts with the devices `held` (slice names) taken by
    prepared claims."""
    devices = node_devices(inventory, [DeviceKind.GPU, DeviceKind.HCA])
    states = {
        kind: ResourceState(
            devices=tuple(
                PluginDevice(
                    d.id, Health.UNHEALTHY if d.id in unhealthy else Health.HEALTHY,
                    reason="unhealthy" if d.id in unhealthy else "",
                )
                for d in devices
                if d.kind is kind
            ),
            allocations={},
        )
        for kind in DeviceKind
    }  # fmt: skip
    entries = published(devices, states, domain=driver, unhealthy=mode, held=held)
    chunks = split(entries, tainting=mode == "taint")
    slices = [
        {
            "metadata": {"name": f"{index:05x}-{driver}-{node}"},
            "spec": {
                "driver": driver,
                "nodeName": node,
                "devices": chunk,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": len(chunks)},
            },
        }
        for index, chunk in enumerate(chunks)
    ]
    return slices


def node_ids(slices: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Slice device name -> the node's id (GPU UUID, HCA PCI address)."""
    found = {}
    for item in slices:
        for device in item["spec"]["devices"]:
            attributes = device["attributes"]
            key = "uuid" if "uuid" in attributes else "resource.kubernetes.io/pciBusID"
            found[device["name"]] = attributes[key]["string"]
    return found


def pair_levels(
    results: Iterable[Mapping[str, str]], names: Mapping[str, str], topology: Topology
) -> list[Level]:
    """The level of each GPU+HCA pair of a claim made from the templates
    (requests `gpu-i` and `hca-i`, subrequests included), in pair order."""
    chosen = {r["request"].split("/")[0]: names[r["device"]] for r in results}
    pairs = sorted(int(key[4:]) for key in chosen if key.startswith("gpu-") and key[4:].isdigit())
    return [topology.level(chosen[f"gpu-{i}"], chosen[f"hca-{i}"]) for i in pairs]


def taken_devices(claims: Iterable[Mapping[str, Any]]) -> set[tuple[str, str, str]]:
    """Every device an allocated claim holds; a result with admin access
    holds nothing (scheduler dynamicresources/allocateddevices.go)."""
    found = set()
    for claim in claims:
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for result in (allocation.get("devices") or {}).get("results") or []:
            if result.get("adminAccess"):
                continue
            found.add((result["driver"], result["pool"], result["device"]))
    return found


def schedule_claim(
    api: ApiServerImitation,
    name: str,
    namespace: str,
    node: str,
    *,
    version: tuple[int, int] = DEFAULT_VERSION,
) -> list[dict[str, str]] | None:
    """Allocate one claim from what the API imitation holds and write its
    allocation into its status, as the scheduler of `version` does; None if
    it fits not."""
    claim = api.get("resourceclaims", name, namespace)
    if claim is None:
        raise KeyError(f"{namespace}/{name}")
    classes = {c["metadata"]["name"]: c for c in api.items("deviceclasses")}
    allocator = Allocator(api.items("resourceslices"), classes, node, version=version)
    results = allocator.allocate(claim["spec"], taken_devices(api.items("resourceclaims")))
    if results is None:
        return None
    allocate(api, name, namespace, results)
    return results


def allocate(
    api: ApiServerImitation, name: str, namespace: str, results: Sequence[Mapping[str, str]]
) -> None:
    """Write a claim's allocation into its status, as the scheduler does."""
    status = {"allocation": {"devices": {"results": [dict(r) for r in results]}}}
    api.set_status("resourceclaims", name, namespace, status)


def put_claim(
    api: ApiServerImitation,
    name: str,
    spec: Mapping[str, Any],
    *,
    namespace: str = "default",
    results: Sequence[Mapping[str, str]] | None = None,
) -> dict[str, Any]:
    """A ResourceClaim stored in the API imitation (allocated with `results`
    when given); the object as stored."""
    created = api.put(
        "resourceclaims",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": dict(spec),
        },
    )
    if results is not None:
        allocate(api, name, namespace, results)
    return created


def put_slices(api: ApiServerImitation, slices: Iterable[Mapping[str, Any]]) -> None:
    """ResourceSlices built in memory (spec_slices) stored in the API imitation."""
    head = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice"}
    for item in slices:
        api.put("resourceslices", {**head, **item})
