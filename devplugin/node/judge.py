"""The judge: what each resource serves, from one snapshot of what is known.

A pure function. Inputs: each resource's live state (its devices with their
health on the hardware alone, from the last scan), the health tracker's
latched faults, the custody book's verdicts and which devices are in use.
Output: the judged physical state per resource and the cleanups owed
(`after_cleanup` recovery: a device that went bad while idle is cleaned before
it may come back). No locks, no I/O: the runtime calls it after every scan
and after every event, and RPC handlers only ever read its last result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Set
from dataclasses import dataclass

from devplugin.model import DeviceKind, Health, PluginDevice
from devplugin.node.lifecycle.health import HEALTHY, Verdict
from devplugin.node.resources import ResourceState


@dataclass(frozen=True)
class Verdicts:
    """Everything besides the hardware that decides a device's health."""

    # device id -> latched fault (health tracker)
    faults: Mapping[str, Verdict]
    # (kind, device id) -> cleanup owed, running, quarantined or unverified
    cleanup: Mapping[tuple[DeviceKind, str], Verdict]
    # devices held by containers (never cleaned on the judge's initiative)
    in_use: Mapping[DeviceKind, Set[str]]
    after_cleanup: bool = False
    # device id -> why it is withheld whatever else is true (a GPU cut anew
    # while a container still holds one of its old MIG devices)
    withheld: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class Judgement:
    served: Mapping[DeviceKind, ResourceState]
    # Idle devices found bad in after_cleanup mode: clean them before reuse.
    cleanups: tuple[tuple[DeviceKind, str], ...]


def verdict_for(kind: DeviceKind, device: str, verdicts: Verdicts) -> Verdict:
    """Withheld first, then cleanup state (it says most about a device),
    then latched faults."""
    withheld = verdicts.withheld.get(device)
    if withheld is not None:
        return Verdict(Health.UNHEALTHY, withheld)
    return verdicts.cleanup.get((kind, device)) or verdicts.faults.get(device, HEALTHY)


def judge(live: Mapping[DeviceKind, ResourceState], verdicts: Verdicts) -> Judgement:
    served: dict[DeviceKind, ResourceState] = {}
    cleanups: list[tuple[DeviceKind, str]] = []
    for kind, state in live.items():
        devices: list[PluginDevice] = []
        in_use = verdicts.in_use.get(kind, frozenset())
        for device in state.devices:
            verdict = verdict_for(kind, device.id, verdicts)
            if verdict.health is device.health and verdict.reason == device.reason:
                devices.append(device)
            else:
                devices.append(
                    dataclasses.replace(device, health=verdict.health, reason=verdict.reason)
                )
            if (
                verdicts.after_cleanup
                and verdict.health is Health.UNHEALTHY
                and device.health is Health.HEALTHY
                and (kind, device.id) not in verdicts.cleanup
                and device.id not in in_use
            ):
                cleanups.append((kind, device.id))
        served[kind] = dataclasses.replace(state, devices=tuple(devices))
    return Judgement(served=served, cleanups=tuple(cleanups))


def transitions(
    before: ResourceState | None, after: ResourceState
) -> list[tuple[PluginDevice | None, PluginDevice]]:
    """Devices whose health or reason changed (or that are new and Unhealthy)."""
    previous = {d.id: d for d in before.devices} if before is not None else {}
    changed: list[tuple[PluginDevice | None, PluginDevice]] = []
    for device in after.devices:
        old = previous.get(device.id)
        if old is None:
            if device.health is Health.UNHEALTHY:
                changed.append((None, device))
        elif old.health is not device.health or old.reason != device.reason:
            changed.append((old, device))
    return changed
