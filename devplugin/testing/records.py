"""NodeDevices records made up directly (no sysfs tree), for scale tests and
the extender benchmark: an HGX-like node (per NUMA node, switches each with
GPUs and HCAs, the GPUs of a node NVLinked all to all) of any size."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def hgx_record(
    name: str,
    *,
    gpus: int = 8,
    hcas: int = 8,
    per_switch: int = 2,
    nvlinks: int = 18,
    mesh: int = 8,
    held: Sequence[tuple[str, str, Sequence[str]]] = (),
    unhealthy: Sequence[str] = (),
    version: str = "1",
) -> dict[str, Any]:
    """`gpus` GPUs and `hcas` HCAs, `per_switch` of each kind under every
    PCIe switch, half the switches on each NUMA node; GPUs in groups of
    `mesh` are NVLinked all to all. `held`: (pod, uid, device ids)."""
    switches = max((gpus + per_switch - 1) // per_switch, (hcas + per_switch - 1) // per_switch)
    devices: list[dict[str, Any]] = []
    bad = set(unhealthy)

    def path(switch: int) -> list[str]:
        numa = 0 if switch < (switches + 1) // 2 else 1
        return [f"numa{numa}", f"pci0000:{numa:02x}", f"0000:{numa:02x}:{switch % 256:02x}.0",
                f"{switch // 256:04x}:{switch % 256:02x}:00.0"]  # fmt: skip

    for i in range(gpus):
        switch = i // per_switch
        group = range(i - i % mesh, min(gpus, i - i % mesh + mesh))
        health = "Unhealthy" if gpu_id(i) in bad else "Healthy"
        devices.append({
            "id": gpu_id(i), "kind": "gpu", "health": health,
            "pciAddress": _address(1, i), "numaNode": int(path(switch)[0][4:]),
            "topologyPath": path(switch),
            "nvlinkPeers": [{"id": gpu_id(j), "links": nvlinks} for j in group if j != i],
        })  # fmt: skip
    for i in range(hcas):
        switch = i // per_switch
        devices.append({
            "id": hca_id(i), "kind": "hca", "name": f"mlx5_{i}",
            "health": "Unhealthy" if hca_id(i) in bad else "Healthy",
            "pciAddress": hca_id(i), "numaNode": int(path(switch)[0][4:]),
            "topologyPath": path(switch),
        })  # fmt: skip
    allocations = [
        {"namespace": "default", "pod": pod, "podUID": uid, "container": "main",
         "devices": list(ids), "worstLevel": ""}
        for pod, uid, ids in held
    ]  # fmt: skip
    taken = {d for _, _, ids in held for d in ids}
    summary = {"unhealthy": sum(1 for d in devices if d["health"] != "Healthy")}
    for kind in ("gpu", "hca"):
        mine = [d for d in devices if d["kind"] == kind]
        summary[f"{kind}sTotal"] = len(mine)
        summary[f"{kind}sFree"] = sum(
            1 for d in mine if d["health"] == "Healthy" and d["id"] not in taken
        )
    # What the CRD requires of a status, so a real API server takes it too.
    registered = {"type": "Registered", "status": "True", "reason": "KubeletRegistration",
                  "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}  # fmt: skip
    return {
        "apiVersion": "devplugin.io/v1alpha1", "kind": "NodeDevices",
        "metadata": {"name": name, "resourceVersion": version},
        "status": {"devices": devices, "allocations": allocations, "updated": "",
                   "summary": summary, "conditions": [registered]},
    }  # fmt: skip


def gpu_id(index: int) -> str:
    return f"GPU-{index:08x}-0000-4000-8000-000000000000"


def hca_id(index: int) -> str:
    return _address(2, index)


def _address(kind: int, index: int) -> str:
    # A distinct bus per device: kind in the domain, index over bus and device.
    return f"{kind:04x}:{index // 32:02x}:{index % 32:02x}.0"
