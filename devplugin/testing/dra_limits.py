"""The API server's validation of a resource.k8s.io/v1 ResourceSlice, as far
as a driver can break it (written from the API's documented limits, apart
from the driver's own code so that one checks the other)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
_DNS_LABEL = re.compile(rf"^{_LABEL}$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_VALUE_KINDS = {"int", "bool", "string", "version", "ints", "bools", "strings", "versions"}
_EFFECTS = {"None", "NoSchedule", "NoExecute"}


def _subdomain(text: str, limit: int = 253) -> bool:
    return 0 < len(text) <= limit and bool(_SUBDOMAIN.match(text))


def _qualified(name: str) -> bool:
    domain, slash, local = name.rpartition("/")
    if slash and not _subdomain(domain, 63):
        return False
    return len(local) <= 32 and bool(_C_IDENTIFIER.match(local))


def _device_problems(where: str, device: Mapping[str, Any]) -> list[str]:
    found: list[str] = []
    name = device.get("name")
    if not isinstance(name, str) or len(name) > 63 or not _DNS_LABEL.match(name):
        found.append(f"{where}.name: {name!r} is not a DNS label")
    attributes = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    if len(attributes) + len(capacity) > 32:
        found.append(
            f"{where}: {len(attributes) + len(capacity)} attributes and capacities (max 32)"
        )
    values = 0
    for key, value in attributes.items():
        if not _qualified(key):
            found.append(f"{where}.attributes[{key}]: not a qualified name")
        kinds = set(value) if isinstance(value, Mapping) else set()
        if len(kinds) != 1 or not kinds <= _VALUE_KINDS:
            found.append(f"{where}.attributes[{key}]: exactly one value type required")
            continue
        ((kind, inner),) = value.items()
        items = inner if kind.endswith("s") and isinstance(inner, list) else [inner]
        values += len(items)
        for item in items:
            if kind.startswith(("string", "version")) and (
                not isinstance(item, str) or len(item) > 64
            ):
                found.append(f"{where}.attributes[{key}]: value longer than 64 characters")
            if kind.startswith("int") and (not isinstance(item, int) or isinstance(item, bool)):
                found.append(f"{where}.attributes[{key}]: not an integer")
    if values > 48:
        found.append(f"{where}: {values} attribute values (max 48)")
    for key in capacity:
        if not _qualified(key):
            found.append(f"{where}.capacity[{key}]: not a qualified name")
    taints = device.get("taints") or []
    if len(taints) > 16:
        found.append(f"{where}.taints: {len(taints)} (max 16)")
    for taint in taints:
        if taint.get("effect") not in _EFFECTS:
            found.append(f"{where}.taints: bad effect {taint.get('effect')!r}")
        if not isinstance(taint.get("key"), str) or not _qualified(taint["key"].replace("-", "_")):
            found.append(f"{where}.taints: bad key {taint.get('key')!r}")
    return found


INT64_MAX = 2**63 - 1


def slice_problems(obj: Mapping[str, Any]) -> list[str]:
    """Why the API server would refuse this ResourceSlice (empty: it would not)."""
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        return ["spec: Required value"]
    found: list[str] = []
    driver = spec.get("driver")
    if not isinstance(driver, str) or not _subdomain(driver, 63):
        found.append(f"spec.driver: {driver!r} is not a DNS subdomain of at most 63 characters")
    pool = spec.get("pool") or {}
    pool_name = pool.get("name")
    if (
        not isinstance(pool_name, str)
        or len(pool_name) > 253
        or not all(_subdomain(part) for part in pool_name.split("/"))
    ):
        found.append(f"spec.pool.name: {pool_name!r} is not a valid pool name")
    generation, count = pool.get("generation"), pool.get("resourceSliceCount")
    if not isinstance(generation, int) or generation < 0:
        found.append("spec.pool.generation: must be a non-negative integer")
    elif generation > INT64_MAX:
        # The API's int64: the server cannot even decode the body.
        found.append("spec.pool.generation: cannot unmarshal number into an int64")
    if not isinstance(count, int) or count < 1:
        found.append("spec.pool.resourceSliceCount: must be at least 1")
    chosen = [key for key in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")
              if spec.get(key)]  # fmt: skip
    if len(chosen) != 1:
        found.append(
            f"spec: exactly one of nodeName, nodeSelector, allNodes, "
            f"perDeviceNodeSelection required (got {chosen})"
        )
    devices = spec.get("devices") or []
    limited = any(
        d.get("taints")
        or d.get("consumesCounters")
        or any(k.endswith("s") for v in (d.get("attributes") or {}).values() for k in v)
        for d in devices
    )
    limit = 64 if limited else 128
    if len(devices) > limit:
        found.append(f"spec.devices: {len(devices)} devices (max {limit})")
    names = [d.get("name") for d in devices]
    if len(set(names)) != len(names):
        found.append("spec.devices: duplicate device names")
    for index, device in enumerate(devices):
        found.extend(_device_problems(f"spec.devices[{index}]", device))
    return found


_QUANTITY = re.compile(r"^([0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei)?$")
_SUFFIXES = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")


def _canonical(value: str) -> str:
    """A binary-SI integer quantity as the API server stores it (the largest
    suffix that keeps it whole: 81920Mi is 80Gi)."""
    match = _QUANTITY.match(value)
    if match is None:
        return value
    number, unit = int(match.group(1)), _SUFFIXES.index(match.group(2) or "")
    while number and number % 1024 == 0 and unit < len(_SUFFIXES) - 1:
        number //= 1024
        unit += 1
    return f"{number}{_SUFFIXES[unit]}"


def slice_defaults(obj: dict[str, Any], now: str) -> None:
    """What the API server fills in on a ResourceSlice it stores: canonical
    quantities and each taint's `timeAdded`."""
    for device in (obj.get("spec") or {}).get("devices") or []:
        for entry in (device.get("capacity") or {}).values():
            if isinstance(entry, dict) and isinstance(entry.get("value"), str):
                entry["value"] = _canonical(entry["value"])
        for taint in device.get("taints") or []:
            taint.setdefault("timeAdded", now)
