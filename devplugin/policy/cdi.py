"""The Container Device Interface's format: names, versions, validation (pure).

A CDI spec file declares a `kind` (`vendor/class`) and devices by name; a
runtime resolves the fully qualified name `vendor/class=name` to the
device's container edits (plus the spec's own edits) and applies them.
This module holds what devplugin needs to know of the format, written from
the specification and held to the rules of the released reference library
at v1.0.1 (`pkg/cdi` and `specs-go` of tags.cncf.io/container-device-interface),
never looser: a spec that library refuses is refused here, so the daemon
never counts on a name a runtime will not resolve:

* names: vendor and class start with a letter, end with a letter or digit
  and hold letters, digits, `_`, `-`, `.`; device names start and end with
  a letter or digit and may also hold `:`;
* versions: a spec declares `cdiVersion`, which must be a known version at
  least as new as the fields it uses need (0.3.0 is the oldest still read;
  mount `type` needs 0.4.0; device node `hostPath` and device names that
  start with a digit 0.5.0; annotations and a `.` in the class 0.6.0;
  `additionalGids` and `intelRdt` 0.7.0; 0.8.0 and 1.0.0 added no field;
  1.1.0 and its `netDevices` are not known to v1.0.1, so they are refused);
* validation as a runtime does it: unknown fields refused, bad names
  refused, duplicate device names refused, a device must edit something,
  a device node's permissions made of `r`, `w` and `m` only (no `none`).

The oldest runtimes in use know fewer versions (the library at 0.5.2, in
Debian 12's podman 4.3.1, reads up to 0.5.0): devplugin writes the oldest
version its contents allow, which stays at 0.5.0 or below.

No I/O: callers read and parse the files (JSON or YAML) and hand the data in.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Known spec versions, oldest first; runtimes read 0.3.0 and later.
VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0")
OLDEST = "0.3.0"
ANNOTATION_PREFIX = "cdi.k8s.io/"
# The part of an annotation key after the prefix.
ANNOTATION_NAME_MAX = 63
HOOK_NAMES = frozenset(
    {"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"}
)
DEVICE_NODE_TYPES = frozenset({"", "b", "c", "u", "p"})

_VENDOR_OR_CLASS = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_DEVICE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
_ANNOTATION_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_NOT_NAME = re.compile(r"[^A-Za-z0-9_.:-]+")


class SpecError(ValueError):
    """A spec a runtime would refuse; the message says why."""


# -- names ---------------------------------------------------------------------------


def kind_problem(kind: str) -> str | None:
    """Why `kind` is not a valid `vendor/class`, or None."""
    vendor, slash, klass = kind.partition("/")
    if not slash or not vendor or not klass:
        return "must be vendor/class, like nvidia.com/gpu"
    if len(vendor) < 2 or len(klass) < 2:
        # The library at 0.5.2 (Debian 12's podman 4.3.1) panics on one.
        return "vendor and class must be two characters or more"
    if not _VENDOR_OR_CLASS.match(vendor):
        return (
            f"vendor {vendor!r}: letters, digits, '_', '-', '.', from a letter to a letter or digit"
        )
    if not _VENDOR_OR_CLASS.match(klass):
        return (
            f"class {klass!r}: letters, digits, '_', '-', '.', from a letter to a letter or digit"
        )
    return None


def device_name_problem(name: str) -> str | None:
    if not _DEVICE_NAME.match(name):
        return (
            f"device name {name!r}: letters, digits, '_', '-', '.', ':', "
            "from a letter or digit to a letter or digit"
        )
    return None


def sanitize_device_name(name: str) -> str:
    """A valid device name for `name` (an ibdev name like `mlx5_0` is one
    already): other characters become `-`, the ends are trimmed to a letter
    or digit. Raises SpecError when nothing usable is left."""
    cleaned = _NOT_NAME.sub("-", name).strip("_.:-")
    if not cleaned or device_name_problem(cleaned):
        raise SpecError(f"no CDI device name can be made of {name!r}")
    return cleaned


def qualified(kind: str, name: str) -> str:
    """The fully qualified device name `vendor/class=name`."""
    return f"{kind}={name}"


def split_qualified(text: str) -> tuple[str, str]:
    """(kind, name) of a fully qualified name; SpecError when it is not one."""
    kind, equals, name = text.partition("=")
    if not equals:
        raise SpecError(f"{text!r} is not a qualified CDI name (vendor/class=name)")
    problem = kind_problem(kind) or device_name_problem(name)
    if problem:
        raise SpecError(f"{text!r}: {problem}")
    return kind, name


def annotation_key(plugin: str, device_ids: Sequence[str]) -> str:
    """`cdi.k8s.io/<plugin>_<id>` for one container's devices of one plugin:
    the id is a short digest of the device ids (so the key stays within 63
    characters whatever they are, and differs per device set)."""
    digest = hashlib.sha256("\n".join(sorted(device_ids)).encode()).hexdigest()[:16]
    name = f"{plugin}_{digest}"
    if len(name) > ANNOTATION_NAME_MAX or not _ANNOTATION_NAME.match(name):
        raise SpecError(f"annotation name {name!r} is not valid")
    return ANNOTATION_PREFIX + name


# -- versions ------------------------------------------------------------------------


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def minimum_version(spec: Mapping[str, Any]) -> str:
    """The oldest `cdiVersion` the fields and names of `spec` allow."""
    needed = OLDEST
    edits = [spec.get("containerEdits") or {}]
    edits.extend((device.get("containerEdits") or {}) for device in spec.get("devices") or [])

    def need(version: str) -> None:
        nonlocal needed
        if _version_key(version) > _version_key(needed):
            needed = version

    for edit in edits:
        if any(mount.get("type") for mount in edit.get("mounts") or []):
            need("0.4.0")
        if any(node.get("hostPath") for node in edit.get("deviceNodes") or []):
            need("0.5.0")
        if edit.get("additionalGids") or edit.get("intelRdt") is not None:
            need("0.7.0")
    devices = spec.get("devices") or []
    if any(str(device.get("name", "a"))[:1].isdigit() for device in devices):
        need("0.5.0")
    if spec.get("annotations") or any(device.get("annotations") for device in devices):
        need("0.6.0")
    klass = str(spec.get("kind", "")).partition("/")[2]
    if "." in klass:
        need("0.6.0")
    return needed


# -- validation ----------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """A spec as a runtime has it once it accepted the file."""

    kind: str
    version: str
    # name -> the device's own edits (as in the file)
    devices: Mapping[str, Mapping[str, Any]]
    # edits applied once whenever any of its devices is
    edits: Mapping[str, Any] = field(default_factory=dict)


# field -> the JSON types it may have (None: an object checked on its own)
_SPEC_FIELDS = {"cdiVersion": str, "kind": str, "annotations": dict, "devices": list,
                "containerEdits": dict}  # fmt: skip
_DEVICE_FIELDS = {"name": str, "annotations": dict, "containerEdits": dict}
_EDIT_FIELDS = {"env": list, "deviceNodes": list, "hooks": list, "mounts": list,
                "intelRdt": dict, "additionalGids": list}  # fmt: skip
_NODE_FIELDS = {"path": str, "hostPath": str, "type": str, "major": int, "minor": int,
                "fileMode": int, "permissions": str, "uid": int, "gid": int}  # fmt: skip
_MOUNT_FIELDS = {"hostPath": str, "containerPath": str, "options": list, "type": str}
_HOOK_FIELDS = {"hookName": str, "path": str, "args": list, "env": list, "timeout": int}
_RDT_FIELDS = {"closID": str, "l3CacheSchema": str, "memBwSchema": str, "schemata": list,
               "enableCMT": bool, "enableMBM": bool, "enableMonitoring": bool}  # fmt: skip


def _fields(obj: Any, allowed: Mapping[str, type], where: str) -> Mapping[str, Any]:
    if not isinstance(obj, dict):
        raise SpecError(f"{where}: must be an object")
    for key, value in obj.items():
        kind = allowed.get(key)
        if kind is None:
            raise SpecError(f"{where}: unknown field {key!r}")
        if value is None:
            continue  # a null is an absent field
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise SpecError(f"{where}.{key}: must be {kind.__name__}")
    return obj


def _strings(values: Iterable[Any], where: str) -> list[str]:
    found = list(values)
    if not all(isinstance(value, str) for value in found):
        raise SpecError(f"{where}: must be a list of strings")
    return found


def _env(values: Iterable[Any], where: str) -> None:
    for entry in _strings(values, where):
        if entry.find("=") <= 0:
            raise SpecError(f"{where}: {entry!r} is not NAME=value")


def _edits(obj: Any, where: str) -> Mapping[str, Any]:
    edits = _fields(obj, _EDIT_FIELDS, where)
    _env(edits.get("env") or [], f"{where}.env")
    for i, node in enumerate(edits.get("deviceNodes") or []):
        at = f"{where}.deviceNodes[{i}]"
        _fields(node, _NODE_FIELDS, at)
        if not node.get("path"):
            raise SpecError(f"{at}.path: required")
        if node.get("type", "") not in DEVICE_NODE_TYPES:
            raise SpecError(f"{at}.type: must be one of b, c, u, p")
        if (node.get("major") or 0) < 0 or (node.get("minor") or 0) < 0:
            raise SpecError(f"{at}: negative device number")
        permissions = node.get("permissions") or ""
        if permissions.strip("rwm"):
            raise SpecError(f"{at}.permissions: {permissions!r} is not made of r, w, m")
    for i, hook in enumerate(edits.get("hooks") or []):
        at = f"{where}.hooks[{i}]"
        _fields(hook, _HOOK_FIELDS, at)
        if hook.get("hookName") not in HOOK_NAMES:
            raise SpecError(f"{at}.hookName: {hook.get('hookName')!r} is not a known hook")
        if not hook.get("path"):
            raise SpecError(f"{at}.path: required")
        _strings(hook.get("args") or [], f"{at}.args")
        _env(hook.get("env") or [], f"{at}.env")
    for i, mount in enumerate(edits.get("mounts") or []):
        at = f"{where}.mounts[{i}]"
        _fields(mount, _MOUNT_FIELDS, at)
        if not mount.get("hostPath") or not mount.get("containerPath"):
            raise SpecError(f"{at}: hostPath and containerPath are required")
        _strings(mount.get("options") or [], f"{at}.options")
    if edits.get("intelRdt") is not None:
        _fields(edits["intelRdt"], _RDT_FIELDS, f"{where}.intelRdt")
    for i, gid in enumerate(edits.get("additionalGids") or []):
        if not isinstance(gid, int) or isinstance(gid, bool) or gid < 0:
            raise SpecError(f"{where}.additionalGids[{i}]: must be a group id")
    return edits


def _edits_something(edits: Mapping[str, Any]) -> bool:
    return any(edits.get(key) for key in _EDIT_FIELDS)


def validate_spec(data: Any) -> Spec:
    """The spec in `data` (parsed JSON or YAML), as a runtime accepts it; a
    SpecError saying why it would refuse the file otherwise."""
    spec = _fields(data, _SPEC_FIELDS, "spec")
    version, kind = spec.get("cdiVersion"), spec.get("kind")
    if not version or not kind:
        raise SpecError("spec: cdiVersion and kind are required")
    if version not in VERSIONS:
        raise SpecError(f"cdiVersion {version!r} is not a known version ({', '.join(VERSIONS)})")
    problem = kind_problem(kind)
    if problem:
        raise SpecError(f"kind {kind!r}: {problem}")
    for key, value in (spec.get("annotations") or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise SpecError("spec.annotations: must map strings to strings")
    edits = _edits(spec.get("containerEdits") or {}, "spec.containerEdits")
    devices: dict[str, Mapping[str, Any]] = {}
    for i, device in enumerate(spec.get("devices") or []):
        where = f"devices[{i}]"
        _fields(device, _DEVICE_FIELDS, where)
        name = device.get("name")
        if not name:
            raise SpecError(f"{where}.name: required")
        problem = device_name_problem(name)
        if problem:
            raise SpecError(f"{where}: {problem}")
        if name in devices:
            raise SpecError(f"{where}: device {name!r} defined twice")
        device_edits = _edits(device.get("containerEdits") or {}, f"{where}.containerEdits")
        if not _edits_something(device_edits):
            raise SpecError(f"{where}: device {name!r} edits nothing")
        devices[name] = device_edits
    if not devices:
        raise SpecError("spec: no devices")
    needed = minimum_version(spec)
    if _version_key(needed) > _version_key(version):
        raise SpecError(f"cdiVersion {version} is too old for the fields used (needs {needed})")
    return Spec(kind, version, devices, edits)


# -- what devplugin writes -------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    """A character device node as a spec names it (host path = container path)."""

    path: str
    major: int
    minor: int


def device_spec(kind: str, devices: Mapping[str, Sequence[Node]]) -> dict[str, Any]:
    """A spec of `kind` whose devices (name -> nodes) each add their character
    device nodes, read-write (a runtime grants `rwm` when a node says
    nothing), declaring the oldest version its contents allow."""
    spec: dict[str, Any] = {
        "kind": kind,
        "devices": [
            {
                "name": name,
                "containerEdits": {
                    "deviceNodes": [
                        {
                            "path": node.path,
                            "type": "c",
                            "major": node.major,
                            "minor": node.minor,
                            "permissions": "rw",
                        }
                        for node in nodes
                    ]
                },
            }
            for name, nodes in sorted(devices.items())
        ],
    }
    return {"cdiVersion": minimum_version(spec), **spec}


@dataclass(frozen=True)
class ClaimNode:
    """A device node of a claim. With its number it is named whole (type
    `c`, major, minor): the runtime creates it as given. Without one, by path
    only: the runtime reads type and number from the host path at injection
    and refuses the container when that is missing. `host` differs from
    `path` only when the container's path is another."""

    path: str
    host: str
    permissions: str = "rw"
    number: tuple[int, int] | None = None

    def as_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"path": self.path}
        if self.host != self.path:
            entry["hostPath"] = self.host
        if self.number is not None:
            entry.update(type="c", major=self.number[0], minor=self.number[1])
        entry["permissions"] = self.permissions
        return entry


def claim_spec(
    kind: str,
    devices: Mapping[str, Sequence[ClaimNode]],
    variables: Mapping[str, Mapping[str, str]],
) -> dict[str, Any]:
    """A spec for one DRA claim with no spec-wide edits: the kubelet hands a
    container only the CDI ids of the requests it names, and spec-wide edits
    would reach it whatever it named. `devices`: each claim device's nodes
    (its own and those every device of its kind needs). `variables`: CDI
    devices that only set variables (one per request, listing that request's
    devices; one for the whole claim), applied after the devices they go with."""
    entries: list[dict[str, Any]] = [
        {"name": name, "containerEdits": {"deviceNodes": [n.as_json() for n in nodes]}}
        for name, nodes in sorted(devices.items())
    ]
    entries.extend(
        {"name": name, "containerEdits": {"env": [f"{k}={v}" for k, v in sorted(env.items())]}}
        for name, env in sorted(variables.items())
        if env
    )
    spec: dict[str, Any] = {"kind": kind, "devices": entries}
    return {"cdiVersion": minimum_version(spec), **spec}
