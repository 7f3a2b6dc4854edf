"""The walk of kube-scheduler's structured-parameters allocator (pure).

Follows k8s.io/dynamic-resource-allocation/structured/internal/stable/
allocator_stable.go (`Allocate`, `allocateOne`, `allocateDevice`) and
pool.go (`GatherPools`):

* candidates in the order given: pools as their slices first come, slices
  in the order listed, devices in slice order; a pool whose slices
  disagree on the generation counts only its newest slices; an incomplete
  pool (fewer slices than it says) is not used;
* the pod's claims in order, each claim's requests in order; a
  `firstAvailable` request tries its subrequests in order, each with every
  way to pick its devices, before the next one;
* every device a request needs is looked for from the node's first device
  on (one try per device considered: one in use, not selectable, tainted
  or breaking a constraint is passed over), with full backtracking; the
  first complete choice wins (DRA has no scoring);
* `matchAttribute` constraints hold over every device picked for the
  requests they name in their claim (`request/subrequest` for one rung;
  none named: every request): each has the attribute, all one value;
* `All` takes every selectable device, in use or not: one in use fails it,
  one a constraint refuses is an error.

What a device matches (selectors) and whether its taints allow it are the
caller's: the scheduler's imitation evaluates CEL with cel-python and
gates taints on the Kubernetes version; the extender uses its own CEL
subset. Both walk here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

NOSCHEDULE = frozenset({"NoSchedule", "NoExecute"})


class WalkError(Exception):
    """Where the allocator returns an error, not "no fit"."""


@dataclass(frozen=True, slots=True)
class Device:
    driver: str
    pool: str
    name: str
    attributes: Mapping[str, Any]  # fully qualified name -> value
    taints: tuple[Mapping[str, Any], ...] = ()
    capacity: Mapping[str, Any] = field(default_factory=dict)  # qualified name -> quantity

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.driver, self.pool, self.name)

    @property
    def view(self) -> dict[str, Any]:
        """What a selector sees: {driver, attributes: {domain: {name:
        value}}, capacity: the same}. Built when asked (a verdict is kept
        per device), not kept: a fleet's devices would hold it twice."""
        return {
            "driver": self.driver,
            "attributes": _by_domain(self.attributes),
            "capacity": _by_domain(self.capacity),
        }


def _by_domain(qualified: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for key, value in qualified.items():
        domain, _, local = key.rpartition("/")
        found.setdefault(domain, {})[local] = value
    return found


def _value(entry: Mapping[str, Any]) -> Any:
    ((_, inner),) = entry.items()
    # Nodes of one model repeat the same names and values (types, product
    # names, PCI paths): one copy each across the fleet.
    return sys.intern(inner) if type(inner) is str else inner


def qualify(name: str, driver: str) -> tuple[str, str]:
    domain, slash, local = name.rpartition("/")
    return (domain, local) if slash else (driver, name)


@dataclass(frozen=True)
class PoolSlice:
    """One ResourceSlice as the allocator reads it."""

    name: str
    node: str  # "" for a slice that names no node
    driver: str
    pool: str
    generation: int
    count: int  # resourceSliceCount
    devices: tuple[Device, ...]


def pool_slice(item: Mapping[str, Any]) -> PoolSlice:
    """One slice's devices, with their qualified attributes (KeyError,
    TypeError or ValueError for a slice that is not one)."""
    spec = item["spec"]
    driver, pool = str(spec["driver"]), spec["pool"]
    found = []
    for device in spec.get("devices") or []:
        attributes: dict[str, Any] = {}
        for key, entry in (device.get("attributes") or {}).items():
            domain, local = qualify(key, driver)
            attributes[sys.intern(f"{domain}/{local}")] = _value(entry)
        capacity: dict[str, Any] = {}
        for key, entry in (device.get("capacity") or {}).items():
            domain, local = qualify(key, driver)
            capacity[f"{domain}/{local}"] = entry.get("value")
        taints = tuple(device.get("taints") or ())
        found.append(
            Device(driver, str(pool["name"]), str(device["name"]), attributes, taints, capacity)
        )
    node = spec.get("nodeName")
    return PoolSlice(
        str(item["metadata"]["name"]),
        node if isinstance(node, str) else "",
        driver,
        str(pool["name"]),
        int(pool.get("generation", 0)),
        int(pool.get("resourceSliceCount", 1)),
        tuple(found),
    )


def gather(slices: Iterable[PoolSlice], *, sort: bool = False) -> list[Device]:
    """Devices in the order the allocator visits them (GatherPools): pools
    as their slices first come, slices in the order given, devices in slice
    order; a pool counts only its newest generation's slices, and not at
    all while it has fewer than it says (the scheduler waits for the rest).
    The stable allocator walks what the lister hands it; it sorts nothing.
    `sort`: the incubating allocator's order (incubating/pools_incubating.go
    GatherPools): pools by (driver, pool), each pool's slices by name."""
    pools: dict[tuple[str, str], list[PoolSlice]] = {}
    for item in slices:
        pools.setdefault((item.driver, item.pool), []).append(item)
    found: list[Device] = []
    order = sorted(pools) if sort else list(pools)
    for key in order:
        items = pools[key]
        newest = max(i.generation for i in items)
        current = [i for i in items if i.generation == newest]
        if len(current) != current[0].count:
            continue
        if sort:
            current.sort(key=lambda i: i.name)
        for item in current:
            found.extend(item.devices)
    return found


def candidates(
    slices: Iterable[Mapping[str, Any]], node: str, *, sort: bool = False
) -> list[Device]:
    """The node's devices in the order the allocator visits them."""
    return gather((s for s in map(pool_slice, slices) if s.node == node), sort=sort)


@dataclass(frozen=True)
class Alternative:
    """A request, or one subrequest of a `firstAvailable` request."""

    claim: int  # index in the pod's claims
    request: str  # as results name it (`gpu-0/pix`)
    scope: tuple[str, ...]  # the names a constraint may use for it
    expressions: tuple[str, ...]  # the class's selectors, then the request's
    mode: str
    count: int
    tolerations: tuple[Mapping[str, Any], ...]
    # adminAccess: may take a device in use, and is not counted as holding it.
    admin: bool = False


def tolerated(taint: Mapping[str, Any], tolerations: Sequence[Mapping[str, Any]]) -> bool:
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


def untainted(alternative: Alternative, device: Device) -> bool:
    """No NoSchedule or NoExecute taint the request does not tolerate
    (taintPreventsAllocation); the caller asks only where the cluster
    honours device taints."""
    for taint in device.taints:
        if taint.get("effect") in NOSCHEDULE and not tolerated(taint, alternative.tolerations):
            return False
    return True


def alternatives(
    claim: int, request: Mapping[str, Any], classes: Mapping[str, Mapping[str, Any]]
) -> list[Alternative]:
    """A request's alternatives in the order tried; WalkError for a class
    that does not exist (validateDeviceRequest)."""
    name = request["name"]
    if "firstAvailable" in request:
        options = [(f"{name}/{sub['name']}", sub) for sub in request["firstAvailable"]]
    else:
        options = [(name, request["exactly"])]
    found = []
    for label, body in options:
        device_class = classes.get(body["deviceClassName"])
        if device_class is None:
            raise WalkError(
                f"request {label}: could not retrieve device class {body['deviceClassName']}"
            )
        expressions = [s["cel"]["expression"] for s in device_class["spec"].get("selectors") or []]
        expressions += [s["cel"]["expression"] for s in body.get("selectors") or []]
        found.append(
            Alternative(
                claim,
                label,
                (name, label) if label != name else (name,),
                tuple(expressions),
                body.get("allocationMode", "ExactCount"),
                int(body.get("count", 1)),
                tuple(body.get("tolerations") or ()),
                bool(body.get("adminAccess")),
            )
        )
    return found


# A claim's allocation holds at most this many results
# (k8s.io/api resource/v1 AllocationResultsMaxSize).
MAX_RESULTS = 32


def least_devices(
    requests: Sequence[Sequence[Alternative]],
    devices: Sequence[Device],
    selectable: Callable[[Alternative, Device], bool],
) -> int:
    """The fewest devices one claim's requests can be given: each request's
    smallest alternative (an `All` counts the devices it selects), as
    allocator_stable.go's Allocate sums minDevicesPerClaim before it walks."""
    total = 0
    for options in requests:
        total += min(
            sum(1 for d in devices if selectable(a, d)) if a.mode == "All" else a.count
            for a in options
        )
    return total


def constraints_of(spec: Mapping[str, Any]) -> list[tuple[tuple[str, ...], str]]:
    return [
        (tuple(c.get("requests") or ()), c["matchAttribute"])
        for c in (spec.get("devices") or {}).get("constraints") or []
        if "matchAttribute" in c
    ]


Choice = tuple[Alternative, Device]


class Walk:
    """One pod's claims walked together, as allocateOne walks them."""

    def __init__(
        self,
        devices: Sequence[Device],
        requests: Sequence[Sequence[Alternative]],
        constraints: Sequence[Sequence[tuple[tuple[str, ...], str]]],
        used: Iterable[tuple[str, str, str]],
        *,
        selectable: Callable[[Alternative, Device], bool],
        allowed: Callable[[Alternative, Device], bool] = lambda a, d: True,
        budget: int,
        combinations: bool = False,
    ) -> None:
        self.devices = devices
        self.requests = requests
        self.constraints = constraints
        self.used = set(used)  # allocated before this walk
        # The claims of this walk that took each device (allocatingDevices).
        self.taking: dict[tuple[str, str, str], list[int]] = {}
        self.selectable = selectable
        self.allowed = allowed
        self.budget = budget
        # The incubating allocator tries each set of devices for one request
        # once (allocateOne's startLocation: later devices only); the stable
        # one tries every order of them.
        self.combinations = combinations
        self.chosen: list[Choice] = []
        self.tries = 0

    @property
    def timed_out(self) -> bool:
        return self.tries > self.budget

    def run(self) -> list[Choice] | None:
        """The first complete choice, or None (no fit, or past the budget);
        WalkError for a claim that needs more devices than a claim holds."""
        for claim in range(len(self.constraints)):
            mine = [r for r in self.requests if r and r[0].claim == claim]
            least = least_devices(mine, self.devices, self.selectable)
            if least > MAX_RESULTS:
                raise WalkError(
                    f"claim {claim}: number of requested devices {least} exceeds the claim "
                    f"limit of {MAX_RESULTS}"
                )
        return list(self.chosen) if self.request(0) else None

    def taken(self, alternative: Alternative, device: Device) -> bool:
        """In use for this alternative (allocateDevice): an admin request
        only skips what its own claim took; any other skips what is
        allocated or taken by any claim of the walk, admin ones included."""
        takers = self.taking.get(device.key, ())
        if alternative.admin:
            return alternative.claim in takers
        return device.key in self.used or bool(takers)

    def held(self, claim: int) -> int:
        return sum(1 for a, _ in self.chosen if a.claim == claim)

    def take(self, alternative: Alternative, device: Device) -> None:
        self.chosen.append((alternative, device))
        self.taking.setdefault(device.key, []).append(alternative.claim)

    def untake(self) -> None:
        alternative, device = self.chosen.pop()
        takers = self.taking[device.key]
        takers.remove(alternative.claim)
        if not takers:
            del self.taking[device.key]

    def fits(self, alternative: Alternative, device: Device) -> bool:
        """Every constraint of the claim naming the request holds with this
        device added (matchAttributeConstraint.add: the attribute present,
        and equal to the value of the devices already in the set)."""
        for scope, attribute in self.constraints[alternative.claim]:
            if scope and not set(scope) & set(alternative.scope):
                continue
            if attribute not in device.attributes:
                return False
            for other_alternative, other in self.chosen:
                if other_alternative.claim != alternative.claim:
                    continue
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
            if self.timed_out:
                return False
        return False

    def every(self, alternative: Alternative, index: int) -> bool:
        """`All`: every selectable device of the node, in use or not
        (validateDeviceRequest collects them before the walk); one in use
        fails the request, one a constraint refuses is an error."""
        wanted = [d for d in self.devices if self.selectable(alternative, d)]
        if not wanted:
            return False
        if self.held(alternative.claim) + len(wanted) > MAX_RESULTS:
            return False
        added = 0
        for device in wanted:
            self.tries += 1
            if self.taken(alternative, device) or not self.allowed(alternative, device):
                break
            if not self.fits(alternative, device):
                raise WalkError(
                    f"request {alternative.request}: cannot add device {device.name} because "
                    "a claim constraint would not be satisfied"
                )
            self.take(alternative, device)
            added += 1
        else:
            if self.request(index + 1):
                return True
        for _ in range(added):
            self.untake()
        return False

    def pick(self, alternative: Alternative, left: int, index: int, start: int = 0) -> bool:
        if left == 0:
            return self.request(index + 1)
        # Past the claim's limit this branch cannot succeed; the walk goes
        # on with others (allocateOne's numDevicesAfterAlloc check).
        if self.held(alternative.claim) + left > MAX_RESULTS:
            return False
        for position in range(start, len(self.devices)):
            device = self.devices[position]
            self.tries += 1
            if self.tries > self.budget:
                return False
            if self.taken(alternative, device) or not self.selectable(alternative, device):
                continue
            if not self.allowed(alternative, device) or not self.fits(alternative, device):
                continue
            self.take(alternative, device)
            after = position + 1 if self.combinations else 0
            if self.pick(alternative, left - 1, index, after):
                return True
            self.untake()
        return False


def results(chosen: Sequence[Choice], claims: int) -> list[list[dict[str, Any]]]:
    """Each claim's allocation results, as the scheduler writes them."""
    by_claim: list[list[dict[str, Any]]] = [[] for _ in range(claims)]
    for alternative, device in chosen:
        result: dict[str, Any] = {
            "request": alternative.request, "driver": device.driver, "pool": device.pool,
            "device": device.name,
        }  # fmt: skip
        if alternative.admin:
            result["adminAccess"] = True
        by_claim[alternative.claim].append(result)
    return by_claim
