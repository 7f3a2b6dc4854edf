"""What a container runtime does with CDI names, for the tests; and the GPU spec
NVIDIA's toolkit would generate for a simulated node.

`CdiRuntime` loads every spec of its directories the way a runtime does: a
`.json` or `.yaml` file that fails validation (unknown fields, bad names, a
version too old for what it uses) is refused and declares nothing; a later
directory wins a device both declare; two specs of one directory declaring
one device is a conflict and the device is unresolvable. `resolve` turns
fully qualified names into the container edits a runtime would apply: each
device's own, plus its spec's common edits once per spec.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from devplugin.policy.cdi import Spec, SpecError, split_qualified, validate_spec
from devplugin.testing.node import BuiltNode

LIBS = "/usr/lib/x86_64-linux-gnu"


class Unresolvable(LookupError):
    """Names the runtime cannot resolve: the container would not start."""


@dataclass
class Edits:
    """Container edits gathered for one container."""

    device_nodes: list[dict[str, Any]] = field(default_factory=list)
    env: list[str] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    hooks: list[dict[str, Any]] = field(default_factory=list)

    def add(self, edits: Mapping[str, Any]) -> None:
        self.device_nodes.extend(edits.get("deviceNodes") or [])
        self.env.extend(edits.get("env") or [])
        self.mounts.extend(edits.get("mounts") or [])
        self.hooks.extend(edits.get("hooks") or [])

    def node_paths(self) -> set[str]:
        return {node["path"] for node in self.device_nodes}

    def environment(self) -> dict[str, str]:
        """The variables the container ends with: applied in order, a later
        value of a name replaces an earlier one (the library's Apply, through
        runtime-tools' AddMultipleProcessEnv)."""
        found: dict[str, str] = {}
        for entry in self.env:
            name, _, value = entry.partition("=")
            found[name] = value
        return found

    def nodes(self) -> dict[str, tuple[str, int, int]]:
        """Container path -> (type, major, minor), each path once (a later
        node of a path replaces the earlier, as the library does)."""
        return {
            node["path"]: (node.get("type", ""), node.get("major", 0), node.get("minor", 0))
            for node in self.device_nodes
        }


def realize(node: BuiltNode) -> None:
    """Replace every marked file of the node's /dev tree with the real
    character device it stands for."""
    for path in sorted(node.dev_root.rglob("*")):
        if not path.is_file():
            continue
        found = host_device(path)
        if found is None:
            continue
        _, major, minor = found
        path.unlink()
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(major, minor))


def host_device(path: Path) -> tuple[str, int, int] | None:
    """(type, major, minor) of a device node as a runtime finds it on the
    host, or None where a runtime finds none. A real character or block
    device answers for itself. The simulated /dev trees hold plain files
    instead: one whose text is `c MAJOR:MINOR` (what `mark_device` writes)
    stands for that device; any other file is not a device."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode):
        kind = "c" if stat.S_ISCHR(info.st_mode) else "b"
        return kind, os.major(info.st_rdev), os.minor(info.st_rdev)
    if not stat.S_ISREG(info.st_mode) or info.st_size > 64:
        return None
    match = _MARK.fullmatch(path.read_text(encoding="ascii", errors="replace").strip())
    if match is None:
        return None
    return match[1], int(match[2]), int(match[3])


_MARK = re.compile(r"([cb]) (\d+):(\d+)")


class CdiRuntime:
    """`host_dev`: where the host's /dev is for the lookup a runtime does of
    a node named by path only (the library's fillMissingInfo): it must exist
    there as a device, and its type and numbers are taken from it. Without
    `host_dev` no lookup is made (only for tests of spec loading)."""

    def __init__(self, dirs: Iterable[Path | str], host_dev: Path | None = None) -> None:
        self.dirs = [Path(d) for d in dirs]
        self.host_dev = host_dev
        self.refused: dict[str, str] = {}
        self.conflicts: set[str] = set()
        # qualified name -> (priority, the spec, the device's edits)
        self._devices: dict[str, tuple[int, Spec, Mapping[str, Any]]] = {}
        self.refresh()

    def refresh(self) -> None:
        self.refused, self.conflicts, self._devices = {}, set(), {}
        for priority, directory in enumerate(self.dirs):
            try:
                entries = sorted(os.listdir(directory))
            except OSError:
                continue
            for entry in entries:
                path = directory / entry
                if path.suffix not in (".json", ".yaml") or not path.is_file():
                    continue
                try:
                    text = path.read_text(encoding="utf-8")
                    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
                    spec = validate_spec(data)
                except (SpecError, ValueError, yaml.YAMLError) as exc:
                    self.refused[str(path)] = str(exc)
                    continue
                for name, edits in spec.devices.items():
                    qualified = f"{spec.kind}={name}"
                    known = self._devices.get(qualified)
                    if known is not None and known[0] == priority:
                        self.conflicts.add(qualified)
                    elif known is None or priority > known[0]:
                        self._devices[qualified] = (priority, spec, edits)
                        self.conflicts.discard(qualified)

    def names(self) -> set[str]:
        return set(self._devices) - self.conflicts

    def resolve(self, names: Sequence[str]) -> Edits:
        """The edits for these names, or Unresolvable naming every bad one."""
        bad = []
        for name in names:
            try:
                split_qualified(name)
            except SpecError:
                bad.append(name)
                continue
            if name not in self._devices or name in self.conflicts:
                bad.append(name)
        if bad:
            raise Unresolvable(", ".join(bad))
        edits = Edits()
        specs_done: list[Spec] = []
        for name in names:
            _, spec, device_edits = self._devices[name]
            if not any(spec is done for done in specs_done):
                specs_done.append(spec)
                edits.add(spec.edits)
            edits.add(device_edits)
        if self.host_dev is not None:
            edits.device_nodes = [self._filled(node) for node in edits.device_nodes]
        return edits

    def _filled(self, node: Mapping[str, Any]) -> dict[str, Any]:
        """The node with type and numbers, looked up on the host where the
        spec leaves them out (pkg/cdi/container-edits_unix.go,
        fillMissingInfo): a missing host node fails the container."""
        kind = node.get("type", "")
        if kind and (node.get("major") or kind == "p"):
            return dict(node)
        host = str(node.get("hostPath") or node["path"])
        # The simulated host's /dev is `host_dev`; any other path is this machine's.
        if host.startswith("/dev/") and self.host_dev is not None:
            found = host_device(self.host_dev / host.removeprefix("/dev/"))
        else:
            found = host_device(Path(host))
        if found is None:
            raise Unresolvable(f"failed to stat CDI host device {host!r}")
        if kind and kind != found[0]:
            raise Unresolvable(f"CDI device {host!r}: host type {found[0]}, spec type {kind}")
        filled = dict(node)
        filled["type"] = found[0]
        if not node.get("major"):
            filled["major"], filled["minor"] = found[1], found[2]
        return filled


def nvidia_like_spec(
    node: BuiltNode,
    *,
    names: str = "index",
    skip: Sequence[int] = (),
    kind: str = "nvidia.com/gpu",
    host_dev: Path | None = None,
    driver_files: bool = True,
) -> Any:
    """The shape of the spec `nvidia-ctk cdi generate` writes for this node's
    GPUs: a device per GPU named by its index (or UUID) plus `all`, the
    control nodes, driver mounts and a hook as common edits, every node by
    path only. GPUs whose index is in `skip` are left out. `host_dev`: the
    nodes are found there on the host (hostPath) instead of at /dev;
    `driver_files` False leaves out the mounts and the hook (a host without
    the driver)."""

    def node_at(name: str) -> dict[str, str]:
        entry = {"path": f"/dev/{name}"}
        if host_dev is not None:
            entry["hostPath"] = str(host_dev / name)
        return entry

    devices = []
    for gpu in node.gpus:
        if gpu.index in skip:
            continue
        devices.append({
            "name": str(gpu.index) if names == "index" else gpu.uuid,
            "containerEdits": {"deviceNodes": [node_at(f"nvidia{gpu.minor}")]},
        })  # fmt: skip
    devices.append({
        "name": "all",
        "containerEdits": {"deviceNodes": [
            node_at(f"nvidia{gpu.minor}") for gpu in node.gpus if gpu.index not in skip
        ]},
    })  # fmt: skip
    common: dict[str, Any] = {
        "env": ["NVIDIA_VISIBLE_DEVICES=void"],
        "deviceNodes": [node_at(n) for n in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")],
    }
    if driver_files:
        common["mounts"] = [{
            "hostPath": f"{LIBS}/libcuda.so.550.54.15",
            "containerPath": f"{LIBS}/libcuda.so.550.54.15",
            "options": ["ro", "nosuid", "nodev", "bind"],
        }]  # fmt: skip
        common["hooks"] = [{
            "hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
            "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", LIBS],
        }]  # fmt: skip
    return {"cdiVersion": "0.5.0", "kind": kind, "devices": devices, "containerEdits": common}


def write_spec(directory: Path, name: str, spec: Any) -> Path:
    """Put a spec file (YAML for `.yaml`, else JSON) in place whole."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    text = yaml.safe_dump(spec) if name.endswith(".yaml") else json.dumps(spec)
    temporary = directory / f".{name}.tmp"
    temporary.write_text(text, encoding="utf-8")
    temporary.replace(path)
    return path
