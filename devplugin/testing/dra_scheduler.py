"""An imitation of the kube-scheduler's structured-parameters allocator.

Given the ResourceSlices of one node, the DeviceClasses, the devices other
claims already hold and a claim's spec, it finds devices as the scheduler's
allocator does:

* candidates in the order given: pools as their slices first come, slices
  in the order listed, devices in slice order; a pool whose slices
  disagree on the generation counts only its newest slices, and an
  incomplete pool (fewer slices than it says) is not used;
* a device tainted NoSchedule or NoExecute is skipped unless the request
  tolerates the taint, only where the DRADeviceTaints gate is on (by
  default from 1.36: the `version` parameter);
* requests in order; a `firstAvailable` request tries its subrequests in
  order, each with every way to pick its devices, before the next one;
  `ExactCount` picks `count` devices (in candidate order), `All` every
  matching one;
* selectors (the class's and the request's) are CEL expressions over
  `device.driver`, `device.attributes[domain].name` and
  `device.capacity[domain].name`, evaluated with cel-python;
* `matchAttribute` constraints hold over every device picked for the
  requests they name (a subrequest as `request/subrequest`; none named:
  every request): each has the attribute, all with one value;
* every device a request needs is looked for from the node's first device
  on (one try per device considered), with full backtracking: the first
  complete choice wins (no scoring, as in DRA), within a try budget that
  stands in for the scheduler's Filter timeout;
* `All` takes every selectable device, in use or not: one in use fails it;
* a missing DeviceClass, a CEL runtime error, or an `All` device a
  constraint refuses is an AllocationError, as the allocator errors out.

Results name the request as the scheduler does (`gpu-0/pix` for a
subrequest).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import celpy
from celpy.adapter import json_to_cel

from devplugin.frontends.dra.slices import node_devices, published, split
from devplugin.model import DeviceKind, Health, Inventory, PluginDevice
from devplugin.node.resources import ResourceState
from devplugin.policy.topology import Level, Topology
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.node import NodeSpec, devices_from_spec

NOSCHEDULE = {"NoSchedule", "NoExecute"}
# Device tries before the imitation gives up, as the scheduler's Filter
# gives up at its timeout (10 s); the real allocator itself has no budget.
TRY_BUDGET = 5_000_000


class AllocationError(Exception):
    """Where the scheduler's allocator returns an error, not "no fit"."""


@dataclass(frozen=True)
class Candidate:
    driver: str
    pool: str
    name: str
    attributes: Mapping[str, Any]  # fully qualified name -> value
    taints: tuple[Mapping[str, Any], ...]
    view: Any = field(compare=False, hash=False)  # the CEL `device`


def _value(entry: Mapping[str, Any]) -> Any:
    ((_, inner),) = entry.items()
    return inner


def _qualify(name: str, driver: str) -> tuple[str, str]:
    domain, slash, local = name.rpartition("/")
    return (domain, local) if slash else (driver, name)


def candidates(slices: Iterable[Mapping[str, Any]], node: str) -> list[Candidate]:
    """The node's devices in the order the allocator visits them."""
    pools: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    # Pools in the order their slices first come, slices in the order given
    # (the allocator walks what the lister hands it; it sorts nothing).
    for item in slices:
        spec = item["spec"]
        if spec.get("nodeName") != node:
            continue
        pools.setdefault((spec["driver"], spec["pool"]["name"]), []).append(item)
    found: list[Candidate] = []
    for (driver, pool), items in pools.items():
        newest = max(i["spec"]["pool"]["generation"] for i in items)
        current = [i for i in items if i["spec"]["pool"]["generation"] == newest]
        if len(current) != current[0]["spec"]["pool"]["resourceSliceCount"]:
            continue  # incomplete: the scheduler waits for the rest
        for item in current:
            for device in item["spec"].get("devices") or []:
                attributes: dict[str, Any] = {}
                by_domain: dict[str, dict[str, Any]] = {}
                for key, entry in (device.get("attributes") or {}).items():
                    domain, local = _qualify(key, driver)
                    attributes[f"{domain}/{local}"] = _value(entry)
                    by_domain.setdefault(domain, {})[local] = _value(entry)
                capacity: dict[str, dict[str, Any]] = {}
                for key, entry in (device.get("capacity") or {}).items():
                    domain, local = _qualify(key, driver)
                    capacity.setdefault(domain, {})[local] = entry.get("value")
                view = json_to_cel(
                    {"driver": driver, "attributes": by_domain, "capacity": capacity}
                )
                found.append(
                    Candidate(
                        driver,
                        pool,
                        device["name"],
                        attributes,
                        tuple(device.get("taints") or ()),
                        view,
                    )
                )
    return found


class Selectors:
    """Compiled CEL programs, kept across allocators (the scheduler's CEL
    cache); verdicts are kept per allocator, whose slices they judge."""

    def __init__(self) -> None:
        self._env = celpy.Environment()
        self._programs: dict[str, Any] = {}

    def evaluate(self, expression: str, device: Candidate) -> bool:
        program = self._programs.get(expression)
        if program is None:
            program = self._env.program(self._env.compile(expression))
            self._programs[expression] = program
        try:
            return bool(program.evaluate({"device": device.view}))
        except Exception as exc:
            # selectorsMatch: a CEL runtime error (a missing attribute
            # read without has(), a type mismatch) aborts the allocation.
            raise AllocationError(
                f"selector {expression!r} on device {device.name}: CEL runtime error: {exc}"
            ) from exc


@dataclass(frozen=True)
class _Alternative:
    request: str  # as results name it
    scope: tuple[str, ...]  # the names constraints may use for it
    expressions: tuple[str, ...]
    mode: str
    count: int
    tolerations: tuple[Mapping[str, Any], ...]


def _tolerated(taint: Mapping[str, Any], tolerations: Sequence[Mapping[str, Any]]) -> bool:
    for toleration in tolerations:
        if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
            continue
        if toleration.get("operator", "Equal") == "Exists":
            if not toleration.get("key") or toleration["key"] == taint.get("key"):
                return True
        elif toleration.get("key") == taint.get("key") and toleration.get("value") == taint.get(
            "value"
        ):
            return True
    return False


# The Kubernetes version the imitation follows unless told another.
DEFAULT_VERSION = (1, 36)


def device_taints_on(version: tuple[int, int]) -> bool:
    """Whether the scheduler honours device taints by default at this
    version: the DRADeviceTaints gate (pkg/features/kube_features.go) is
    alpha, off by default, from 1.33 and beta, on by default, from 1.36."""
    return version >= (1, 36)


class Allocator:
    def __init__(
        self,
        slices: Iterable[Mapping[str, Any]],
        classes: Mapping[str, Mapping[str, Any]],
        node: str,
        *,
        selectors: Selectors | None = None,
        version: tuple[int, int] = DEFAULT_VERSION,
        device_taints: bool | None = None,
        budget: int = TRY_BUDGET,
    ) -> None:
        self.devices = candidates(slices, node)
        self.budget = budget
        self._classes = classes
        self._selectors = selectors or Selectors()
        # isSelectable's deviceMatchesRequest: a verdict per expression and
        # device, for these slices.
        self._verdicts: dict[tuple[str, str, str, str], bool] = {}
        # A cluster may set the gate either way; by default it follows the
        # version's default.
        self.device_taints = device_taints_on(version) if device_taints is None else device_taints
        self.tries = 0
        self.timed_out = False

    def _alternatives(self, request: Mapping[str, Any]) -> list[_Alternative]:
        name = request["name"]
        if "firstAvailable" in request:
            options = [(f"{name}/{sub['name']}", sub) for sub in request["firstAvailable"]]
        else:
            options = [(name, request["exactly"])]
        alternatives = []
        for label, body in options:
            device_class = self._classes.get(body["deviceClassName"])
            if device_class is None:
                # validateDeviceRequest: "could not retrieve device class".
                raise AllocationError(
                    f"request {label}: could not retrieve device class {body['deviceClassName']}"
                )
            expressions = [
                s["cel"]["expression"] for s in device_class["spec"].get("selectors") or []
            ]
            expressions += [s["cel"]["expression"] for s in body.get("selectors") or []]
            alternatives.append(
                _Alternative(
                    label,
                    (name, label) if label != name else (name,),
                    tuple(expressions),
                    body.get("allocationMode", "ExactCount"),
                    int(body.get("count", 1)),
                    tuple(body.get("tolerations") or ()),
                )
            )
        return alternatives

    def selectable(self, alternative: _Alternative, device: Candidate) -> bool:
        """The class's and the request's selectors match (isSelectable)."""
        return all(self._match(e, device) for e in alternative.expressions)

    def _match(self, expression: str, device: Candidate) -> bool:
        key = (expression, device.driver, device.pool, device.name)
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = self._verdicts[key] = self._selectors.evaluate(expression, device)
        return verdict

    def untainted(self, alternative: _Alternative, device: Candidate) -> bool:
        """No untolerated NoSchedule or NoExecute taint, checked only with
        the DRADeviceTaints feature (allocateDevice:
        `alloc.features.DeviceTaints && taintPreventsAllocation(...)`)."""
        for taint in device.taints if self.device_taints else ():
            if taint.get("effect") in NOSCHEDULE and not _tolerated(taint, alternative.tolerations):
                return False
        return True

    def allocate(
        self, spec: Mapping[str, Any], taken: Iterable[tuple[str, str, str]] = ()
    ) -> list[dict[str, str]] | None:
        """The claim's results, or None when no choice satisfies it (or the
        walk ran past its try budget). AllocationError where the scheduler's
        allocator errors out: a missing DeviceClass, a CEL runtime error, an
        `All` request that a constraint makes impossible."""
        devices_spec = spec.get("devices") or {}
        walk = _Walk(
            self,
            [self._alternatives(request) for request in devices_spec.get("requests") or []],
            [
                (tuple(c.get("requests") or ()), c["matchAttribute"])
                for c in devices_spec.get("constraints") or []
                if "matchAttribute" in c
            ],
            set(taken),
        )
        try:
            found = walk.request(0)
        finally:
            self.tries = walk.tries
            self.timed_out = walk.tries > self.budget
        if not found:
            return None
        return [
            {"request": alternative.request, "driver": device.driver, "pool": device.pool,
             "device": device.name}
            for alternative, device in walk.chosen
        ]  # fmt: skip


class _Walk:
    """One claim's allocation, walked as the stable allocator walks it
    (structured/internal/stable/allocator_stable.go, allocateOne and
    allocateDevice): requests in order; a request's subrequests in order,
    each tried to the end before the next; for each device a request
    needs, every device of the node considered in slice order from the
    first (one try each: in use, not selectable, tainted, or breaking a
    constraint, it is passed over), with full backtracking; the first
    complete choice wins."""

    def __init__(
        self,
        allocator: Allocator,
        requests: list[list[_Alternative]],
        constraints: list[tuple[tuple[str, ...], str]],
        used: set[tuple[str, str, str]],
    ) -> None:
        self.allocator = allocator
        self.requests = requests
        self.constraints = constraints
        self.used = used
        self.chosen: list[tuple[_Alternative, Candidate]] = []
        self.tries = 0

    def fits(self, alternative: _Alternative, device: Candidate) -> bool:
        """Every constraint naming the request holds with this device added
        (matchAttributeConstraint.add: the attribute present, and equal to
        the value of the devices already in the set)."""
        for scope, attribute in self.constraints:
            if scope and not set(scope) & set(alternative.scope):
                continue
            if attribute not in device.attributes:
                return False
            for other_alternative, other in self.chosen:
                if scope and not set(scope) & set(other_alternative.scope):
                    continue
                if other.attributes.get(attribute) != device.attributes[attribute]:
                    return False
        return True

    def request(self, index: int) -> bool:
        if index == len(self.requests):
            return True
        for alternative in self.requests[index]:
            if alternative.mode == "All":
                if self.every(alternative, index):
                    return True
            elif self.pick(alternative, alternative.count, index):
                return True
            if self.tries > self.allocator.budget:
                return False
        return False

    def every(self, alternative: _Alternative, index: int) -> bool:
        """`All`: every selectable device of the node, in use or not
        (validateDeviceRequest collects them before the walk); one in use
        fails the request, one a constraint refuses is an error."""
        allocator = self.allocator
        wanted = [d for d in allocator.devices if allocator.selectable(alternative, d)]
        if not wanted:
            return False
        added = 0
        for device in wanted:
            self.tries += 1
            key = (device.driver, device.pool, device.name)
            if key in self.used or not allocator.untainted(alternative, device):
                break
            if not self.fits(alternative, device):
                raise AllocationError(
                    f"request {alternative.request}: cannot add device {device.name} because "
                    "a claim constraint would not be satisfied"
                )
            self.chosen.append((alternative, device))
            self.used.add(key)
            added += 1
        else:
            if self.request(index + 1):
                return True
        for _ in range(added):
            _, device = self.chosen.pop()
            self.used.discard((device.driver, device.pool, device.name))
        return False

    def pick(self, alternative: _Alternative, left: int, index: int) -> bool:
        if left == 0:
            return self.request(index + 1)
        allocator = self.allocator
        for device in allocator.devices:
            self.tries += 1
            if self.tries > allocator.budget:
                return False
            key = (device.driver, device.pool, device.name)
            if key in self.used or not allocator.selectable(alternative, device):
                continue
            if not allocator.untainted(alternative, device) or not self.fits(alternative, device):
                continue
            self.chosen.append((alternative, device))
            self.used.add(key)
            if self.pick(alternative, left - 1, index):
                return True
            self.chosen.pop()
            self.used.discard(key)
        return False


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
    """Every device an allocated claim holds."""
    found = set()
    for claim in claims:
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for result in (allocation.get("devices") or {}).get("results") or []:
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
    api.set_status(
        "resourceclaims", name, namespace,
        {"allocation": {"devices": {"results": results}}},
    )  # fmt: skip
    return results
