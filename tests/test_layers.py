"""Dependencies point one way: data <- discovery/policy <- serving <- entry points."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "devplugin"

# module (relative to the package) -> prefixes it must not import.
FORBIDDEN = {
    "model.py": ("devplugin.", "grpc"),
    "topology.py": (
        "devplugin.discovery",
        "devplugin.server",
        "devplugin.kubelet",
        "devplugin.daemon",
        "devplugin.cli",
        "devplugin.api",
        "grpc",
    ),
    "resources.py": (
        "devplugin.discovery",
        "devplugin.server",
        "devplugin.kubelet",
        "devplugin.daemon",
        "devplugin.cli",
        "devplugin.api",
        "grpc",
    ),
    "config.py": ("devplugin.", "grpc"),
    "discovery/sysfs.py": (
        "devplugin.server",
        "devplugin.kubelet",
        "devplugin.daemon",
        "devplugin.cli",
        "devplugin.api",
        "grpc",
        "pynvml",
    ),
    "discovery/fake_nvml.py": (
        "devplugin.server",
        "devplugin.daemon",
        "devplugin.cli",
        "grpc",
        "pynvml",
    ),
    "server.py": ("devplugin.daemon", "devplugin.cli", "devplugin.kubelet", "devplugin.discovery"),
    "kubelet.py": ("devplugin.daemon", "devplugin.cli", "devplugin.discovery"),
    "daemon.py": ("devplugin.cli",),
    "allocator.py": ("grpc", "devplugin.api", "devplugin.server", "devplugin.kubelet",
                     "devplugin.daemon", "devplugin.cli", "devplugin.discovery",
                     "devplugin.coordination"),
    "coordination.py": ("grpc", "devplugin.api", "devplugin.server", "devplugin.daemon",
                        "devplugin.cli"),
    "sharing.py": ("grpc", "devplugin.api", "devplugin.server", "devplugin.daemon",
                   "devplugin.cli"),
    "lifecycle/health.py": ("grpc", "devplugin.api", "devplugin.server", "devplugin.daemon",
                            "devplugin.discovery", "devplugin.cli"),
    "lifecycle/hooks.py": ("devplugin.", "grpc"),
    "lifecycle/checkpoint.py": ("grpc", "devplugin.server", "devplugin.daemon", "devplugin.cli"),
    "lifecycle/cleanup.py": ("grpc", "devplugin.server", "devplugin.daemon", "devplugin.cli",
                             "devplugin.api"),
    "lifecycle/xid.py": ("grpc", "devplugin.server", "devplugin.daemon", "pynvml"),
    "metrics.py": ("grpc", "devplugin.server", "devplugin.daemon", "devplugin.cli"),
    "recent.py": ("grpc", "devplugin.server", "devplugin.daemon", "devplugin.cli"),
}  # fmt: skip


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_layering(module: str) -> None:
    imported = imports_of(PACKAGE / module)
    bad = sorted(
        name
        for name in imported
        for prefix in FORBIDDEN[module]
        if name == prefix.rstrip(".") or name.startswith(prefix)
    )
    assert bad == [], f"{module} imports {bad}"


def test_only_the_nvml_module_imports_pynvml() -> None:
    importers = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if "pynvml" in imports_of(path)
    )
    assert importers == ["discovery/nvml.py"]
