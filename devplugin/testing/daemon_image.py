"""The daemon's image as the project's build makes it, for a real node to
run the chart's DaemonSet from: the Dockerfile built with podman on a base
made of Debian's packages (scripts/image-base.sh, or any base podman can
pull), saved as an OCI archive that the node's containerd imports (no
registry is reachable here).

Built once per content: the archive is kept under ~/.cache/devplugin-image
(DEVPLUGIN_IMAGE_CACHE), named by a hash of everything the build context
takes (the Dockerfile, the package metadata and every file of the package,
less what .dockerignore leaves out), so a fresh clone of the same tree on
the same machine reuses it and any change to the daemon builds a new one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import IO

from devplugin.testing.controlplane import REPO, Unavailable

# What the Dockerfile copies, besides the package (pyproject, setup, README).
BUILD_FILES = ("Dockerfile", ".dockerignore", "pyproject.toml", "setup.py", "README.md")
REPOSITORY = "localhost/devplugin"
BASE_TAG = "localhost/devplugin-base:debian"
# A build fetches the dependencies' wheels and compiles the fold: minutes.
BUILD_TIMEOUT = 1800


def version() -> str:
    for line in (REPO / "pyproject.toml").read_text().splitlines():
        if line.startswith("version = "):
            return line.split('"')[1]
    raise Unavailable("pyproject.toml names no version")


def content_key(repo: Path = REPO) -> str:
    """A hash of the build context as the Dockerfile reads it."""
    digest = hashlib.sha256()
    files = [repo / name for name in BUILD_FILES]
    for path in sorted((repo / "devplugin").rglob("*")):
        if "__pycache__" in path.parts or path.suffix in (".so", ".pyc") or not path.is_file():
            continue
        files.append(path)
    for path in files:
        digest.update(str(path.relative_to(repo)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _cache() -> Path:
    return Path(os.environ.get("DEVPLUGIN_IMAGE_CACHE", Path.home() / ".cache/devplugin-image"))


def _podman(*args: str) -> list[str]:
    store = _cache() / "podman"
    return [
        "podman", "--root", str(store / "root"), "--runroot", str(store / "run"),
        "--storage-driver", "vfs", "--runtime", "runc", "--cgroup-manager", "cgroupfs",
        "--events-backend", "file", *args,
    ]  # fmt: skip


def _run(
    command: list[str], what: str, timeout: float = 600, stdin: IO[bytes] | None = None
) -> None:
    done = subprocess.run(command, capture_output=True, timeout=timeout, check=False, stdin=stdin)
    if done.returncode != 0:
        said = (done.stdout + done.stderr).decode(errors="replace").strip()
        raise Unavailable(f"{what} failed: {said[-600:]}")


def _base() -> str:
    """The base image's name in podman: a pullable one (DEVPLUGIN_IMAGE_BASE),
    or the Debian folder scripts/image-base.sh made, imported."""
    pullable = os.environ.get("DEVPLUGIN_IMAGE_BASE")
    if pullable:
        return pullable
    rootfs = Path(os.environ.get("DEVPLUGIN_IMAGE_BASE_ROOTFS", REPO / ".cache" / "image-base"))
    if not (rootfs / "usr" / "bin" / "python3").exists():
        raise Unavailable(
            f"no image base: run scripts/image-base.sh {rootfs} (or set DEVPLUGIN_IMAGE_BASE)"
        )
    with subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE) as tar:
        _run(_podman("import", "-", BASE_TAG), "importing the image base", stdin=tar.stdout)
    return BASE_TAG


def image_archive() -> tuple[Path, str]:
    """(the OCI archive of the daemon's image, its reference), built now
    where the cache lacks one for this tree; Unavailable where it cannot be."""
    if shutil.which("podman") is None:
        raise Unavailable("podman is not installed: the daemon's image cannot be built")
    tag = version()
    reference = f"{REPOSITORY}:{tag}"
    archive = _cache() / f"devplugin-{tag}-{content_key()}.tar"
    if archive.exists():
        return archive, reference
    archive.parent.mkdir(parents=True, exist_ok=True)
    arguments = ("--build-arg", f"BASE={_base()}", "--build-arg", f"VERSION={tag}")
    build = _podman("build", "--network", "host", *arguments, "-t", reference, str(REPO))
    _run(build, "building the daemon's image", timeout=BUILD_TIMEOUT)
    partial = archive.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    _run(_podman("save", "--format", "oci-archive", "-o", str(partial), reference), "saving it")
    partial.rename(archive)
    for old in archive.parent.glob("devplugin-*.tar"):
        if old != archive:
            old.unlink(missing_ok=True)  # one tree's image at a time
    return archive, reference
