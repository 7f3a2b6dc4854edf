"""What a pod asks of a node (pure): its containers' GPUs and HCAs in the
kubelet's admission order, the resources it names them by, its whole CPUs,
and the alignment its annotations require or prefer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from devplugin.model import (
    DeviceKind,
)
from devplugin.policy.podinfo import ContainerInfo, PodInfo
from devplugin.policy.topology import Level

ALIGNMENT_ANNOTATION = "devplugin.io/alignment"
POLICY_ANNOTATION = "devplugin.io/alignment-policy"
LEVELS_BY_NAME = {level.name: level for level in Level}


@dataclass(frozen=True)
class Shape:
    """A pod's device requests: (GPUs, HCAs) per container in admission order
    (init containers' devices are reused by later ones: they count only
    when larger than what follows)."""

    containers: tuple[tuple[int, int], ...]
    gpus: int
    hcas: int
    # Per container, the GPU and HCA resources it asks them as ("": the
    # kind's whole devices); empty: "" for every container.
    resources: tuple[tuple[str, str], ...] = ()
    # Per container, the whole CPUs it asks of a static CPU manager (a
    # Guaranteed pod's integer CPUs; 0 otherwise); empty: none anywhere.
    cpus: tuple[int, ...] = ()
    # A run-once init container asks for devices or CPUs: the Topology
    # Manager admits it on its own, which placement does not follow.
    init_asks: bool = False

    def resources_of(self, index: int) -> tuple[str, str]:
        return self.resources[index] if index < len(self.resources) else ("", "")

    def cpus_of(self, index: int) -> int:
        return self.cpus[index] if index < len(self.cpus) else 0

    @property
    def wants_devices(self) -> bool:
        return self.gpus > 0 or self.hcas > 0


@dataclass(frozen=True)
class Requirement:
    level: Level | None  # worst GPU-HCA level the pod requires or prefers
    required: bool


def resource_kind(resource: str, gpu: str, hca: str) -> DeviceKind | None:
    """Which kind of device a requested resource is: the GPU resource, a
    name it is renamed to for time-slicing (`<gpu>.<suffix>`, NVIDIA's
    convention: nvidia.com/gpu.shared) or a MIG profile of its domain
    (`<domain>/mig-<profile>`); the HCA resource or `<hca>.<suffix>`."""
    if resource == gpu or resource.startswith(gpu + "."):
        return DeviceKind.GPU
    if resource == hca or resource.startswith(hca + "."):
        return DeviceKind.HCA
    if resource.startswith(gpu.split("/", 1)[0] + "/mig-"):
        return DeviceKind.GPU
    return None


def _asks(container: ContainerInfo, gpu: str, hca: str) -> list[tuple[int, int, str, str]]:
    """A container's requests as (GPUs, HCAs, GPU resource, HCA resource);
    one entry per distinct resource of a kind (the first of each paired)."""
    by_kind: dict[DeviceKind, list[tuple[str, int]]] = {kind: [] for kind in DeviceKind}
    for resource, count in container.requests.items():
        kind = resource_kind(resource, gpu, hca)
        if kind is not None and count:
            by_kind[kind].append((resource, count))
    gpus, hcas = by_kind[DeviceKind.GPU], by_kind[DeviceKind.HCA]
    found = []
    for index in range(max(len(gpus), len(hcas))):
        g_res, g = gpus[index] if index < len(gpus) else ("", 0)
        h_res, h = hcas[index] if index < len(hcas) else ("", 0)
        found.append((g, h, g_res, h_res))
    return found


def shape_of(pod: PodInfo, gpu: str, hca: str) -> Shape:
    """The pod's containers in admission order, as (GPUs, HCAs) with the
    resources they ask them as."""
    once = [c for c in pod.init_containers if not c.sidecar]
    init = [a for c in once for a in _asks(c, gpu, hca)]
    held: list[tuple[int, int, str, str]] = []
    cpus: list[int] = []
    for container in (*[c for c in pod.init_containers if c.sidecar], *pod.containers):
        # A container asking only whole CPUs still takes them from a NUMA
        # node where the kubelet aligns: it is one step of the admission.
        asks = _asks(container, gpu, hca) or ([(0, 0, "", "")] if container.cpus else [])
        held.extend(asks)
        cpus.extend([container.cpus] + [0] * (len(asks) - 1) if asks else [])
    gpus = sum(a[0] for a in held)
    hcas = sum(a[1] for a in held)
    # A larger init container decides the count the node must have free.
    for g, h, _, _ in init:
        gpus, hcas = max(gpus, g), max(hcas, h)
    return Shape(
        tuple((g, h) for g, h, _, _ in held),
        gpus,
        hcas,
        tuple((g_res, h_res) for _, _, g_res, h_res in held),
        tuple(cpus) if any(cpus) else (),
        init_asks=bool(init) or any(c.cpus for c in once),
    )


def requirement_of(annotations: Mapping[str, str]) -> Requirement:
    """The alignment a pod asks for; ValueError for a level or policy not understood."""
    name = annotations.get(ALIGNMENT_ANNOTATION)
    policy = annotations.get(POLICY_ANNOTATION, "preferred")
    if policy not in ("preferred", "required"):
        raise ValueError(f"{POLICY_ANNOTATION} must be preferred or required, not {policy!r}")
    if name is None:
        return Requirement(None, False)
    level = LEVELS_BY_NAME.get(name)
    if level is None or level is Level.SYS:
        raise ValueError(f"{ALIGNMENT_ANNOTATION} must be PIX, PXB, PHB or NODE, not {name!r}")
    return Requirement(level, policy == "required")
