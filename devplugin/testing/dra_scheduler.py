"""An imitation of the kube-scheduler's structured-parameters allocator.

Given the ResourceSlices of one node, the DeviceClasses, the devices other
claims already hold and a claim's spec, it finds devices as the scheduler's
allocator does:

* candidates in pool order: slices by name, devices in slice order; a pool
  whose slices disagree on the generation counts only its newest slices,
  and an incomplete pool (fewer slices than it says) is not used;
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
* first fit with backtracking: the first complete choice wins (no scoring,
  as in DRA), within a step budget like the scheduler's time limit.

Results name the request as the scheduler does (`gpu-0/pix` for a
subrequest).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
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
STEP_BUDGET = 200_000


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
    for item in sorted(slices, key=lambda s: s["metadata"]["name"]):
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
    """Compiled CEL programs, and each one's verdict per device, kept."""

    def __init__(self) -> None:
        self._env = celpy.Environment()
        self._programs: dict[str, Any] = {}
        self._verdicts: dict[tuple[str, str, str, str], bool] = {}

    def match(self, expression: str, device: Candidate) -> bool:
        key = (expression, device.driver, device.pool, device.name)
        verdict = self._verdicts.get(key)
        if verdict is None:
            program = self._programs.get(expression)
            if program is None:
                program = self._env.program(self._env.compile(expression))
                self._programs[expression] = program
            try:
                verdict = bool(program.evaluate({"device": device.view}))
            except Exception:  # noqa: BLE001 - a missing attribute is a non-match, as in the API
                verdict = False
            self._verdicts[key] = verdict
        return verdict


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
    ) -> None:
        self.devices = candidates(slices, node)
        self._classes = classes
        self._selectors = selectors or Selectors()
        # A cluster may set the gate either way; by default it follows the
        # version's default.
        self.device_taints = device_taints_on(version) if device_taints is None else device_taints
        self.steps = 0

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
                continue  # a class that does not exist matches nothing
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

    def _eligible(self, alternative: _Alternative, device: Candidate) -> bool:
        # Taints are checked only with the DRADeviceTaints feature
        # (structured/internal/stable/allocator_stable.go, allocateDevice:
        # `alloc.features.DeviceTaints && !allTaintsTolerated(...)`).
        for taint in device.taints if self.device_taints else ():
            if taint.get("effect") in NOSCHEDULE and not _tolerated(taint, alternative.tolerations):
                return False
        return all(self._selectors.match(e, device) for e in alternative.expressions)

    def allocate(
        self, spec: Mapping[str, Any], taken: Iterable[tuple[str, str, str]] = ()
    ) -> list[dict[str, str]] | None:
        """The claim's results, or None when no choice satisfies it."""
        devices_spec = spec.get("devices") or {}
        requests = list(devices_spec.get("requests") or [])
        constraints = [
            (tuple(c.get("requests") or ()), c["matchAttribute"])
            for c in devices_spec.get("constraints") or []
            if "matchAttribute" in c
        ]
        used = set(taken)
        chosen: list[tuple[_Alternative, Candidate]] = []
        self.steps = 0

        def fits(alternative: _Alternative, device: Candidate) -> bool:
            for scope, attribute in constraints:
                if scope and not set(scope) & set(alternative.scope):
                    continue
                if attribute not in device.attributes:
                    return False
                for other_alternative, other in chosen:
                    if scope and not set(scope) & set(other_alternative.scope):
                        continue
                    if other.attributes.get(attribute) != device.attributes[attribute]:
                        return False
            return True

        def place(index: int) -> bool:
            if index == len(requests):
                return True
            for alternative in self._alternatives(requests[index]):
                pool = [
                    d for d in self.devices
                    if (d.driver, d.pool, d.name) not in used and self._eligible(alternative, d)
                ]  # fmt: skip
                if alternative.mode == "All":
                    if pool and pick_all(alternative, pool, index):
                        return True
                    continue
                if pick(alternative, pool, 0, alternative.count, index):
                    return True
            return False

        def pick_all(alternative: _Alternative, pool: list[Candidate], index: int) -> bool:
            added = 0
            ok = True
            for device in pool:
                if not fits(alternative, device):
                    ok = False
                    break
                chosen.append((alternative, device))
                used.add((device.driver, device.pool, device.name))
                added += 1
            if ok and place(index + 1):
                return True
            for _ in range(added):
                _, device = chosen.pop()
                used.discard((device.driver, device.pool, device.name))
            return False

        def pick(
            alternative: _Alternative, pool: list[Candidate], start: int, left: int, index: int
        ) -> bool:
            if left == 0:
                return place(index + 1)
            for position in range(start, len(pool) - left + 1):
                self.steps += 1
                if self.steps > STEP_BUDGET:
                    return False
                device = pool[position]
                if not fits(alternative, device):
                    continue
                key = (device.driver, device.pool, device.name)
                chosen.append((alternative, device))
                used.add(key)
                if pick(alternative, pool, position + 1, left - 1, index):
                    return True
                chosen.pop()
                used.discard(key)
            return False

        if not place(0):
            return None
        return [
            {"request": alternative.request, "driver": device.driver, "pool": device.pool,
             "device": device.name}
            for alternative, device in chosen
        ]  # fmt: skip


def spec_slices(
    spec: NodeSpec,
    driver: str,
    node: str,
    *,
    unhealthy: frozenset[str] = frozenset(),
    mode: str = "taint",
) -> tuple[list[dict[str, Any]], Inventory]:
    """The ResourceSlices the driver would publish for a layout, built in
    memory (no daemon), and the inventory behind them."""
    gpus, hcas = devices_from_spec(spec)
    inventory = Inventory(gpus=gpus, hcas=hcas)
    slices = inventory_slices(inventory, driver, node, unhealthy=unhealthy, mode=mode)
    return slices, inventory


def inventory_slices(
    inventory: Inventory,
    driver: str,
    node: str,
    *,
    unhealthy: frozenset[str] = frozenset(),
    mode: str = "taint",
) -> list[dict[str, Any]]:
    """The ResourceSlices the driver would publish for these devices, with
    the unhealthy ones tainted or left out (`mode`, as dra.unhealthy)."""
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
    entries = published(devices, states, domain=driver, unhealthy=mode)
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
