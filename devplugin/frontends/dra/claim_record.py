"""A DRA claim this node prepared, as the claim ledger and the checkpoint
keep it: its devices, what the kubelet was told of each, and whether the
prepare finished. The node's custody book sees it only as a `Hold` (its uid,
the devices in its custody, its JSON form); the format is read here.
"""

from __future__ import annotations

from dataclasses import dataclass

from devplugin.model import DeviceKind


@dataclass(frozen=True)
class ClaimDevice:
    """One device of a prepared DRA claim, and what the kubelet was told."""

    kind: DeviceKind
    # The physical id (GPU UUID, HCA PCI address), as the rest of the node names it.
    id: str
    # The device as the ResourceSlice names it.
    pool: str
    device: str
    requests: tuple[str, ...] = ()
    cdi_ids: tuple[str, ...] = ()
    # CDI ids only a container that names the whole claim gets (the claim's
    # variables, when one request's would not do); answered as a second
    # entry for this device under a request name no container can name.
    whole: tuple[str, ...] = ()
    # Admin access (a request's adminAccess): the container sees the device
    # whoever holds it; the claim takes no custody of it, runs no hook on it
    # and owes it no cleanup (the scheduler counts it as allocated to no one).
    admin: bool = False

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            "kind": self.kind.value, "id": self.id, "pool": self.pool, "device": self.device,
            "requests": list(self.requests), "cdi_ids": list(self.cdi_ids),
        }  # fmt: skip
        if self.whole:
            data["whole_claim_cdi_ids"] = list(self.whole)
        if self.admin:
            data["admin"] = True
        return data

    @classmethod
    def from_json(cls, data: object) -> ClaimDevice:
        if not isinstance(data, dict):
            raise ValueError("claim devices must be mappings")
        kinds = {k.value: k for k in DeviceKind}
        kind = data.get("kind")
        if not isinstance(kind, str) or kind not in kinds:
            raise ValueError("claim device without a known kind")
        texts = [data.get(key) for key in ("id", "pool", "device")]
        if not all(isinstance(text, str) and text for text in texts):
            raise ValueError("claim device without id, pool or device")
        lists = [data.get(key, []) for key in ("requests", "cdi_ids", "whole_claim_cdi_ids")]
        admin = data.get("admin", False)
        if not isinstance(admin, bool):
            raise ValueError("claim device admin must be a boolean")
        for values in lists:
            if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                raise ValueError("claim device requests and cdi_ids must be lists of strings")
        return cls(
            kinds[kind],
            str(texts[0]),
            str(texts[1]),
            str(texts[2]),
            requests=tuple(lists[0]),
            cdi_ids=tuple(lists[1]),
            whole=tuple(lists[2]),
            admin=admin,
        )


@dataclass(frozen=True)
class ClaimRecord:
    """A DRA claim this node prepared (or began to)."""

    uid: str
    namespace: str
    name: str
    devices: tuple[ClaimDevice, ...]
    # False between the start of a prepare and its end: a daemon that finds
    # such a claim at start rolls it back (its init may have half run).
    completed: bool = False
    # The boot it was completed in: its CDI spec (in /var/run/cdi) and what
    # its init hooks did are gone after a reboot, though this record is not.
    boot: str = ""

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            "uid": self.uid, "namespace": self.namespace, "name": self.name,
            "state": "completed" if self.completed else "started",
            "devices": [device.to_json() for device in self.devices],
        }  # fmt: skip
        if self.boot:
            data["boot_id"] = self.boot
        return data

    def held(self) -> list[tuple[DeviceKind, str]]:
        """The devices in its custody: those given with admin access are only
        looked at, and stay in their holder's custody."""
        keys = ((device.kind, device.id) for device in self.devices if not device.admin)
        return list(dict.fromkeys(keys))

    @classmethod
    def from_json(cls, data: object) -> ClaimRecord:
        if not isinstance(data, dict):
            raise ValueError("claims entries must be mappings")
        uid, namespace, name = (data.get(key) for key in ("uid", "namespace", "name"))
        if not isinstance(uid, str) or not uid:
            raise ValueError("claim without a uid")
        if not isinstance(namespace, str) or not isinstance(name, str):
            raise ValueError("claim without a namespace or name")
        state = data.get("state")
        if state not in ("started", "completed"):
            raise ValueError("claim state must be started or completed")
        devices = data.get("devices", [])
        if not isinstance(devices, list):
            raise ValueError("claim devices must be a list")
        boot = data.get("boot_id", "")
        if not isinstance(boot, str):
            raise ValueError("claim boot_id must be a string")
        return cls(
            uid,
            namespace,
            name,
            tuple(ClaimDevice.from_json(d) for d in devices),
            completed=state == "completed",
            boot=boot,
        )
