"""Tiny container images made here, for runtimes that reach no registry: one
layer holding Debian's static busybox (and the applet links a test needs),
written as an OCI image layout archive (image-spec image-layout.md) that
`ctr images import` and `podman load` read. The index names the image with
containerd's `io.containerd.image.name` annotation and the spec's
`org.opencontainers.image.ref.name`."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

PAUSE_IMAGE = "localhost/devplugin/pause:1"
WORK_IMAGE = "localhost/devplugin/work:1"
# What a container of the work image prints: every character device under
# /dev with its numbers (hexadecimal, as stat gives them), then its environment.
SEEN_SCRIPT = 'for f in $(find /dev -type c); do stat -c "%n %t %T" "$f"; done; echo ---; env'
APPLETS = ("sh", "sleep", "ls", "cat", "env", "test", "stat", "echo", "true", "find")


@dataclass(frozen=True)
class Seen:
    """What a container saw: its character devices and its environment."""

    nodes: Mapping[str, tuple[int, int]]
    env: Mapping[str, str]


def parse(output: str) -> Seen:
    devices, _, environment = output.partition("---\n")
    nodes = {}
    for line in devices.splitlines():
        path, major, minor = line.split()
        nodes[path] = (int(major, 16), int(minor, 16))
    env = dict(line.split("=", 1) for line in environment.splitlines() if "=" in line)
    return Seen(nodes, env)


_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _member(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    tar.addfile(info, io.BytesIO(data))


def busybox_layer(busybox: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for folder in ("bin", "dev", "etc", "proc", "sys", "tmp"):
            info = tarfile.TarInfo(folder)
            info.type = tarfile.DIRTYPE
            info.mode = 0o755
            tar.addfile(info)
        _member(tar, "bin/busybox", busybox.read_bytes(), 0o755)
        for applet in APPLETS:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type = tarfile.SYMTYPE
            info.linkname = "busybox"
            tar.addfile(info)
    return buffer.getvalue()


def find_busybox() -> Path:
    found = shutil.which("busybox")
    if found is None:
        raise FileNotFoundError("busybox (Debian's busybox-static) is not installed")
    return Path(found)


def write_image(
    archive: Path, ref: str, entrypoint: Sequence[str] | None, busybox: Path | None = None
) -> None:
    """An OCI image layout archive of one busybox layer, named `ref`."""
    layer = busybox_layer(busybox or find_busybox())
    image_config: dict[str, object] = {"Env": ["PATH=/bin"]}
    if entrypoint is not None:
        image_config["Entrypoint"] = list(entrypoint)
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": image_config,
            "rootfs": {"type": "layers", "diff_ids": [_digest(layer)]},
        }
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": _MANIFEST,
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": _digest(config),
                "size": len(config),
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": _digest(layer),
                    "size": len(layer),
                }
            ],
        }
    ).encode()
    tag = ref.rsplit(":", 1)[1]
    index = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {
                    "mediaType": _MANIFEST,
                    "digest": _digest(manifest),
                    "size": len(manifest),
                    "annotations": {
                        "io.containerd.image.name": ref,
                        "org.opencontainers.image.ref.name": tag,
                    },
                }
            ],
        }
    ).encode()
    with tarfile.open(archive, "w") as tar:
        _member(tar, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        _member(tar, "index.json", index)
        for blob in (layer, config, manifest):
            _member(tar, "blobs/sha256/" + _digest(blob).split(":", 1)[1], blob)
