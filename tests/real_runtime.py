"""Real containers for the real-runtime tier: Debian's podman with runc, on
a tiny image made of busybox-static, reading CDI specs from the two
directories podman 4.3.1 knows (/etc/cdi, /var/run/cdi).

Each test writes its specs under kinds of its own (a vendor `t<random>.…`)
and removes them after, so tests running at once, or a real toolkit's
specs, are never in each other's way. The simulated node's /dev tree is
made of real character device nodes (mknod, with the numbers the node's
sysfs gives), so a runtime's lookup of a node named by path finds them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
import uuid
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from devplugin.testing.node import BuiltNode
from devplugin.testing.oci_image import SEEN_SCRIPT as SCRIPT
from devplugin.testing.oci_image import Seen, parse

CDI_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))
IMAGE = "localhost/devplugin-tiny:1"
APPLETS = ("sh", "find", "stat", "env", "echo", "cat", "ls", "true")
# Without CAP_SYS_RESOURCE runc cannot raise these limits to podman's defaults.
# Frames of the CDI library podman vendors, as a Go crash report names them.
CDI_LIBRARY = "container-device-interface/pkg/cdi"
LIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096")


def missing() -> str | None:
    """Why the tier cannot run here, in one line, or None."""
    for tool in ("podman", "runc"):
        if shutil.which(tool) is None:
            return f"real-runtime tier: {tool} is not installed (.ci/run installs it)"
    if not Path("/bin/busybox").is_file() and shutil.which("busybox") is None:
        return "real-runtime tier: busybox is not installed (.ci/run installs busybox-static)"
    if os.geteuid() != 0:
        return "real-runtime tier: needs root (mknod, /etc/cdi, rootful podman)"
    return None


class Podman:
    def __init__(self, base: Path) -> None:
        self.base = base
        self._baseline: Seen | None = None

    def command(self, *args: str) -> list[str]:
        return [
            "podman", "--root", str(self.base / "root"), "--runroot", str(self.base / "run"),
            "--storage-driver", "vfs", "--runtime", "runc", "--cgroup-manager", "cgroupfs",
            "--events-backend", "file", *args,
        ]  # fmt: skip

    def build_image(self) -> None:
        """A busybox-static image, imported from a tar made here (no registry)."""
        busybox = shutil.which("busybox") or "/bin/busybox"
        tar_path = self.base / "image.tar"
        with tarfile.open(tar_path, "w") as tar:
            tar.add(busybox, arcname="bin/busybox")
            for applet in APPLETS:
                link = tarfile.TarInfo(f"bin/{applet}")
                link.type, link.linkname = tarfile.SYMTYPE, "busybox"
                tar.addfile(link)
            for directory in ("dev", "proc", "sys", "etc", "tmp"):
                entry = tarfile.TarInfo(directory)
                entry.type, entry.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(entry)
        self.check(self.command("import", str(tar_path), IMAGE))

    def run(self, devices: Sequence[str] = (), env: Mapping[str, str] | None = None) -> Seen:
        """Start a container with these CDI names (`--device`) and variables
        (as the kubelet passes an Allocate answer's); what it saw."""
        args = ["run", "--rm", "--network", "none", *LIMITS]
        for name in devices:
            args += ["--device", name]
        for key, value in (env or {}).items():
            args += ["--env", f"{key}={value}"]
        result = self.check(self.command(*args, IMAGE, "/bin/sh", "-c", SCRIPT))
        return parse(result.stdout)

    def refuses(self, devices: Sequence[str]) -> str | None:
        """Why the container does not start, or None when it does."""
        args = ["run", "--rm", "--network", "none", *LIMITS]
        for name in devices:
            args += ["--device", name]
        result = self.attempt(self.command(*args, IMAGE, "/bin/true"))
        return None if result.returncode == 0 else result.stderr.strip()[-400:]

    def added(self, seen: Seen) -> Seen:
        """What a container saw beyond what any container sees."""
        if self._baseline is None:
            self._baseline = self.run()
        base = self._baseline
        return Seen(
            {p: n for p, n in seen.nodes.items() if p not in base.nodes},
            {k: v for k, v in seen.env.items() if k not in base.env},
        )

    @staticmethod
    def attempt(command: list[str]) -> subprocess.CompletedProcess[str]:
        """Run podman; a second time only where it crashed the first."""
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        crash = crashed(result)
        if crash is not None and CDI_LIBRARY not in crash:
            # Podman 4.3.1 itself crashed once in CI (a Go panic, no answer
            # about our specs either way): say so, and ask it once more. A
            # panic inside the CDI library is its answer to the spec (0.5.2
            # panics on a one-letter class), given again on every try.
            warnings.warn(PodmanCrashed(crash), stacklevel=2)
            result = subprocess.run(
                command, capture_output=True, text=True, timeout=120, check=False
            )
        return result

    @classmethod
    def check(cls, command: list[str]) -> subprocess.CompletedProcess[str]:
        result = cls.attempt(command)
        if result.returncode != 0:
            why = crashed(result) or result.stderr.strip()[-1500:]
            raise AssertionError(f"{' '.join(command[-6:])}: {why}")
        return result


class PodmanCrashed(UserWarning):
    """Podman ended in a Go panic or runtime fatal error, not an answer."""


def crashed(result: subprocess.CompletedProcess[str]) -> str | None:
    """The head of a Go crash report in podman's stderr (where the panic's
    reason is; the tail is only goroutine stacks), or None."""
    if result.returncode == 0:
        return None
    lines = result.stderr.splitlines()
    for at, line in enumerate(lines):
        if line.startswith(("panic: ", "fatal error: ")):
            return "podman crashed: " + "\n".join(lines[at : at + 12])
    return None


def skip_or_fail(why: str) -> None:
    """Skip, saying why; in CI (DEVPLUGIN_REQUIRE_REAL_RUNTIME=1) the tier
    must run, so it fails instead."""
    if os.environ.get("DEVPLUGIN_REQUIRE_REAL_RUNTIME") == "1":
        pytest.fail(f"{why} (DEVPLUGIN_REQUIRE_REAL_RUNTIME=1)")
    pytest.skip(why)


@pytest.fixture(scope="session")
def podman() -> Iterator[Podman]:
    why = missing()
    if why is not None:
        skip_or_fail(why)
    # Short: podman refuses a runroot path longer than 50 characters.
    base = Path(tempfile.mkdtemp(prefix="dpp-", dir="/tmp"))
    try:
        engine = Podman(base)
        engine.build_image()
        yield engine
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def vendor() -> Iterator[str]:
    """A CDI vendor of this test's own; its spec files go after the test."""
    name = f"t{uuid.uuid4().hex[:10]}.devplugin.io"
    yield name
    for directory in CDI_DIRS:
        if directory.is_dir():
            for path in directory.iterdir():
                if name in path.name:
                    path.unlink(missing_ok=True)


# -- what a container holding devices must see ----------------------------------------

CONTROL = {"/dev/nvidiactl": (195, 255), "/dev/nvidia-uvm": (510, 0),
           "/dev/nvidia-uvm-tools": (510, 1)}  # fmt: skip
RDMA_CM = {"/dev/infiniband/rdma_cm": (10, 58)}


def expected_nodes(
    node: BuiltNode, gpu_uuids: Iterable[str], hca_ids: Iterable[str]
) -> dict[str, tuple[int, int]]:
    """The nodes a container holding these devices must have, from the
    simulated node's own description."""
    gpus, hcas = set(gpu_uuids), set(hca_ids)
    found: dict[str, tuple[int, int]] = {}
    for gpu in node.gpus:
        if gpu.uuid in gpus:
            found[f"/dev/nvidia{gpu.minor}"] = (195, gpu.minor)
    if gpus:
        found.update(CONTROL)
    for hca in node.hcas:
        if hca.device_id in hcas:
            found[f"/dev/infiniband/uverbs{hca.uverbs}"] = (231, 192 + hca.uverbs)
            found.update({f"/dev/infiniband/umad{i}": (231, i) for i in hca.umads})
            found.update({f"/dev/infiniband/issm{i}": (231, 64 + i) for i in hca.issms})
    if hcas:
        found.update(RDMA_CM)
    return found


def ib_names(node: BuiltNode, hca_ids: Iterable[str]) -> str:
    wanted = list(hca_ids)
    return "=" + ",".join(node.hca_by_id(device).name for device in wanted)
