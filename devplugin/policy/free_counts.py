"""The free counts a claim template's gate reads, recounted from what a
cluster-wide view knows (pure).

The node's driver publishes `freeGpus` and `freeHcas` on every device,
`freeInNvlinkDomain` on an NVLink GPU and `freeOfProfile` on a MIG device
(frontends/dra/slices.py). A view
that sees claims as they are allocated (the extender's) can know better
for a moment: the slice says what the driver last wrote. Recounted, a
device counts as free when no allocated claim holds it and no taint keeps
it out, and each count is the lower of the published one and the recount,
so a view that misses something the driver knows never counts higher than
the driver does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from devplugin.policy.dra_walk import Device

FREE = {"gpu": "freeGpus", "hca": "freeHcas"}
IN_DOMAIN = "freeInNvlinkDomain"
OF_PROFILE = "freeOfProfile"


def recounted(devices: Sequence[Device], held: Collection[tuple[str, str, str]]) -> list[Device]:
    """`devices` with the published free counts lowered to what `held`
    (driver, pool, device: devices allocated claims hold) leaves."""
    by_pool: dict[tuple[str, str], dict[str, int]] = {}
    for device in devices:
        driver = device.driver
        kind = str(device.attributes.get(f"{driver}/type"))
        if f"{driver}/{FREE['gpu']}" not in device.attributes:
            continue
        tally = by_pool.setdefault((driver, device.pool), {})
        if device.key in held or device.taints:
            continue
        tally[kind] = tally.get(kind, 0) + 1
        if kind == "mig":
            profile = f"profile:{device.attributes.get(f'{driver}/profile')}"
            tally[profile] = tally.get(profile, 0) + 1
        domain = device.attributes.get(f"{driver}/nvlinkDomain")
        if domain is not None:
            tally[f"domain:{domain}"] = tally.get(f"domain:{domain}", 0) + 1
    if not by_pool:
        return list(devices)
    found = []
    for device in devices:
        counts = by_pool.get((device.driver, device.pool))
        if counts is None:
            found.append(device)
            continue
        driver, attributes = device.driver, dict(device.attributes)
        for kind, name in FREE.items():
            key = f"{driver}/{name}"
            if isinstance(attributes.get(key), int):
                attributes[key] = min(attributes[key], counts.get(kind, 0))
        key, domain = f"{driver}/{IN_DOMAIN}", attributes.get(f"{driver}/nvlinkDomain")
        if isinstance(attributes.get(key), int) and domain is not None:
            attributes[key] = min(attributes[key], counts.get(f"domain:{domain}", 0))
        key = f"{driver}/{OF_PROFILE}"
        if isinstance(attributes.get(key), int):
            mine = f"profile:{attributes.get(f'{driver}/profile')}"
            attributes[key] = min(attributes[key], counts.get(mine, 0))
        found.append(dataclasses.replace(device, attributes=attributes))
    return found
