"""What every kind of device tells the rest of the house about itself.

A kind is a wing: its identity (config key, record list, noun), the role it
plays when a pod's devices are paired, and what the kind alone knows about
its devices: how they are found in an inventory, what the NodeDevices record
says of each beyond the fields every device has, how the node picture draws
one, and what a hook is told about one. Layers above ask the wing instead of
testing which kind they hold, so a new kind is a new wing, not new branches.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from devplugin.model import DeviceKind, Inventory, PciAddress, PciFunction


class PairRole(enum.Enum):
    """How a kind takes part in pairing. The anchor is what a pod's work runs
    on (GPUs); a partner is placed next to the anchors it serves (HCAs), and
    a container's alignment is the worst anchor-to-partner level."""

    ANCHOR = "anchor"
    PARTNER = "partner"


@dataclass(frozen=True)
class HookFacts:
    """What a hook is told about one device: its PCI function, the device
    nodes it cannot be used without, its NUMA node and the kind's own fields
    (for example `gpu_uuid`), keyed as the hook's JSON spells them, and the
    same in its environment (variable suffix -> value)."""

    pci_address: str
    device_nodes: tuple[str, ...]
    numa_node: int | None
    extra: Mapping[str, str]
    env: Mapping[str, str]


@dataclass(frozen=True)
class Box:
    """How the node picture draws one recorded device: its drawing kind, its
    lines of text (before health and holder), its ports (text, good) and the
    cluster it is drawn in (a MIG device inside its GPU) with that cluster's
    label, if any."""

    kind: str
    lines: tuple[str, ...]
    ports: tuple[tuple[str, bool], ...] = ()
    cluster: tuple[str, str] | None = None


@dataclass(frozen=True)
class SliceFields:
    """What a ResourceSlice says of one device beyond where it sits (the
    placement attributes every device has): its own attributes and
    capacities, and what its name adds to the one its PCI address gives
    (a MIG device's instance numbers)."""

    attributes: Mapping[str, Any]
    capacity: Mapping[str, Any]
    name_suffix: str = ""


class PictureError(ValueError):
    """A record the picture cannot be drawn from; the message names the field."""


D = TypeVar("D")


class Kind(ABC, Generic[D]):
    """One kind of device. Subclasses are stateless; one instance per kind
    is registered in devplugin.kinds.registry."""

    kind: DeviceKind
    # Its sections in the config (resources.<key>, sharing.<key>), its value
    # of `kind` in the record and its name in log lines and hook variables.
    key: str
    # Its list in the record's summary (<plural>Total, <plural>Free).
    plural: str
    # In sentences.
    noun: str
    role: PairRole
    # Where its devices come in a slice's device list, among those under
    # one switch (anchors first, so first fit tends to align).
    slice_rank: int

    # The CRD's schema of each field `record_fields` writes (the record's
    # status.devices[] properties this kind owns); a test holds the shipped
    # CRD to it.
    record_schema: ClassVar[Mapping[str, Mapping[str, Any]]]

    @abstractmethod
    def devices(self, inventory: Inventory) -> Sequence[D]:
        """This kind's devices in a snapshot, in the order the record lists them."""

    @abstractmethod
    def device_id(self, device: D) -> str:
        """The id the kubelet and the record know the device by."""

    @abstractmethod
    def pci(self, device: D) -> tuple[PciAddress, PciFunction | None, int | None]:
        """The device's PCI address, its function when sysfs has it, its NUMA node."""

    @abstractmethod
    def record_fields(self, device: D, inventory: Inventory) -> dict[str, Any]:
        """What the record says of the device beyond the fields every device
        has (id, kind, health, PCI address, NUMA node, place in the tree)."""

    def slice_context(self, inventory: Inventory) -> Any:
        """What `slice_fields` needs of the whole node (GPUs: their NVLink
        domains), worked out once per listing of the node's devices."""
        del inventory
        return None

    @abstractmethod
    def slice_fields(self, device: D, context: Any) -> SliceFields:
        """The device's own attributes and capacities in a ResourceSlice;
        `context` is what `slice_context` gave for its inventory."""

    @abstractmethod
    def box(self, entry: Mapping[str, Any]) -> Box:
        """How the picture draws a recorded device of this kind; PictureError
        names the field when the entry is not what this kind writes."""

    # Its devices may be cut into smaller devices served in their place
    # (MIG): cut anew, a device's old pieces are cleaned before reuse, and
    # under the mixed strategy each piece's profile is a resource of its own.
    cut: bool = False
    # Direct links between devices of this kind: the picture's edge kind
    # and label prefix, and the fabric node (key, label) drawn instead when
    # every pair has the same links. Most kinds have none.
    link_kind: str = ""
    link_label: str = ""
    fabric: tuple[str, str] | None = None

    def links(
        self, entries: Sequence[Mapping[str, Any]]
    ) -> tuple[dict[tuple[str, str], int], tuple[str, ...]]:
        """Direct links between recorded devices of this kind ((id, id) in
        sorted order -> how many) and the devices that can have any."""
        del entries
        return {}, ()

    @abstractmethod
    def hook_facts(self, device: D) -> HookFacts:
        """What init and cleanup hooks are told about the device."""
