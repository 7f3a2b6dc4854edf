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


class CdiRuntime:
    def __init__(self, dirs: Iterable[Path | str]) -> None:
        self.dirs = [Path(d) for d in dirs]
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
        return edits


def nvidia_like_spec(node: BuiltNode, *, names: str = "index", skip: Sequence[int] = ()) -> Any:
    """The shape of the spec `nvidia-ctk cdi generate` writes for this node's
    GPUs (kind nvidia.com/gpu): a device per GPU named by its index (or UUID)
    plus `all`, the control nodes, driver mounts and a hook as common edits.
    GPUs whose index is in `skip` are left out."""
    devices = []
    for gpu in node.gpus:
        if gpu.index in skip:
            continue
        devices.append({
            "name": str(gpu.index) if names == "index" else gpu.uuid,
            "containerEdits": {"deviceNodes": [{"path": f"/dev/nvidia{gpu.minor}"}]},
        })  # fmt: skip
    devices.append({
        "name": "all",
        "containerEdits": {"deviceNodes": [
            {"path": f"/dev/nvidia{gpu.minor}"} for gpu in node.gpus if gpu.index not in skip
        ]},
    })  # fmt: skip
    return {
        "cdiVersion": "0.5.0",
        "kind": "nvidia.com/gpu",
        "devices": devices,
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=void"],
            "deviceNodes": [
                {"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia-uvm"},
                {"path": "/dev/nvidia-uvm-tools"},
            ],
            "mounts": [{
                "hostPath": f"{LIBS}/libcuda.so.550.54.15",
                "containerPath": f"{LIBS}/libcuda.so.550.54.15",
                "options": ["ro", "nosuid", "nodev", "bind"],
            }],
            "hooks": [{
                "hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
                "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", LIBS],
            }],
        },
    }  # fmt: skip


def write_spec(directory: Path, name: str, spec: Any) -> Path:
    """Put a spec file (YAML for `.yaml`, else JSON) in place whole."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    text = yaml.safe_dump(spec) if name.endswith(".yaml") else json.dumps(spec)
    temporary = directory / f".{name}.tmp"
    temporary.write_text(text, encoding="utf-8")
    temporary.replace(path)
    return path
