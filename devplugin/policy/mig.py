"""MIG strategies as NVIDIA defines them, on discovered GPUs (pure).

`none` serves whole GPUs. `single` serves every MIG device as the GPU
resource and needs every GPU MIG-enabled with one profile throughout.
`mixed` serves each profile as its own resource (`<domain>/mig-<profile>`)
beside the GPUs that are not MIG-enabled. A MIG device is served in its
parent's place: the same PCI address and PCIe path, so the allocator pairs
it with HCAs by the same levels as a whole GPU; it has no NVLink peers
(MIG devices do not talk over NVLink) and it inherits its parent's error.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from devplugin.model import GpuInfo, MigDevice, MigSlice

STRATEGIES = ("none", "single", "mixed")
# GPU slices a MIG-capable GPU has (A100, H100, H200, B200: 7).
MAX_GPU_SLICES = 7
# A slice's index is past every GPU's: unique, and never an NVLink peer.
SLICE_INDEX_BASE = 1000


def profile_name(gpu_slices: int, compute_slices: int, memory_mib: int) -> str:
    """NVIDIA's profile name from a MIG device's attributes: `<g>g.<GB>gb`,
    with `<c>c.` in front when its compute instance has fewer slices than
    its GPU instance; the memory in GB rounded up."""
    gigabytes = (memory_mib + 1023) // 1024
    name = f"{gpu_slices}g.{gigabytes}gb"
    return f"{compute_slices}c.{name}" if 0 < compute_slices < gpu_slices else name


def gpu_slices(profile: str) -> int:
    """The GPU slices a profile name says (`1c.3g.40gb` -> 3); 0 when it says none."""
    for part in profile.split("."):
        if part.endswith("g") and part[:-1].isdigit():
            return int(part[:-1])
    return 0


def report_problem(devices: Sequence[MigDevice]) -> str | None:
    """Why one GPU's MIG devices as NVML listed them cannot be true (None
    when they can): a device with no slices or no memory, a UUID listed
    twice, one GPU instance with two sizes, or instances taking more
    slices than the GPU has (overlapping placements)."""
    seen: set[str] = set()
    instances: dict[int, int] = {}
    for device in devices:
        slices = gpu_slices(device.profile)
        if slices <= 0 or device.memory_mib <= 0:
            return (
                f"MIG device {device.uuid[:80]} reports profile {device.profile[:40]} with "
                f"{device.memory_mib} MiB"
            )
        if device.uuid in seen:
            return f"MIG device {device.uuid[:80]} is listed twice"
        seen.add(device.uuid)
        known = instances.setdefault(device.gpu_instance, slices)
        if known != slices:
            return f"GPU instance {device.gpu_instance} is listed with {known} and {slices} slices"
    total = sum(instances.values())
    if total > MAX_GPU_SLICES:
        return f"its MIG devices take {total} of {MAX_GPU_SLICES} GPU slices (overlapping)"
    return None


def shared_uuids(devices_by_gpu: Mapping[int, Sequence[MigDevice]]) -> dict[int, str]:
    """GPU index -> why, for each GPU listing a MIG UUID another GPU lists too."""
    owners: dict[str, list[int]] = {}
    for index, devices in devices_by_gpu.items():
        for device in devices:
            owners.setdefault(device.uuid, []).append(index)
    found: dict[int, str] = {}
    for uuid, gpus in owners.items():
        if len(set(gpus)) > 1:
            for index in gpus:
                found.setdefault(
                    index,
                    f"MIG device {uuid[:80]} is listed under GPUs "
                    + ", ".join(str(g) for g in sorted(set(gpus))),
                )
    return found


def slice_index(parent_index: int, mig_index: int) -> int:
    return SLICE_INDEX_BASE * (parent_index + 1) + mig_index


def served_gpus(gpus: Sequence[GpuInfo], strategy: str) -> tuple[GpuInfo, ...]:
    """The GPU entries a strategy serves: whole GPUs, and each MIG-enabled
    GPU's MIG devices in its place (`none` serves every GPU whole)."""
    if strategy == "none":
        return tuple(gpus)
    cut = {gpu.index for gpu in gpus if gpu.mig_enabled}
    served: list[GpuInfo] = []
    for gpu in gpus:
        if gpu.index not in cut:
            peers = tuple((peer, links) for peer, links in gpu.nvlink_peers if peer not in cut)
            served.append(dataclasses.replace(gpu, nvlink_peers=peers))
            continue
        for device in gpu.mig_devices:
            served.append(
                dataclasses.replace(
                    gpu,
                    index=slice_index(gpu.index, device.index),
                    uuid=device.uuid,
                    memory_total_mib=device.memory_mib,
                    nvlink_peers=(),
                    mig_devices=(),
                    slice=MigSlice(gpu.uuid, gpu.index, device, gpu.memory_total_mib),
                )
            )
    return tuple(served)


def mig_problem(gpus: Sequence[GpuInfo], strategy: str) -> str | None:
    """Why the GPUs a strategy serves (`served_gpus`) cannot be served that
    way, or None. Read at start: a strategy the node cannot serve is a
    configuration error."""
    if strategy == "none" or not gpus:
        return None
    if not any(gpu.mig_capable for gpu in gpus):
        names = ", ".join(sorted({gpu.name for gpu in gpus}))
        return f"{strategy}: no GPU on this node is MIG-capable ({names})"
    if strategy == "single":
        whole = [str(gpu.index) for gpu in gpus if gpu.slice is None]
        if whole:
            return (
                f"single: GPU {', '.join(whole)} is not cut into MIG devices; single needs "
                "every GPU MIG-enabled (use mixed to serve whole GPUs beside MIG devices)"
            )
        profiles = sorted(profiles_of(gpus))
        if len(profiles) > 1:
            return (
                f"single: the MIG devices have several profiles ({', '.join(profiles)}); "
                "single needs one (use mixed)"
            )
    return None


def profiles_of(gpus: Iterable[GpuInfo]) -> Counter[str]:
    """How many served MIG devices of each profile there are."""
    return Counter(gpu.slice.device.profile for gpu in gpus if gpu.slice is not None)


def profile_resource(gpu_resource: str, profile: str) -> str:
    """The mixed strategy's resource for a profile: the GPU resource's
    domain with `mig-<profile>` (nvidia.com/gpu -> nvidia.com/mig-1g.10gb)."""
    domain = gpu_resource.split("/", 1)[0]
    return f"{domain}/mig-{profile}"
