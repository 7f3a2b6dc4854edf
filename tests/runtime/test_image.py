"""The Dockerfile: multi-stage, installed from wheels (the compiled fold built
in the first stage), no build tools in the final one, OCI labels; and the
image built with podman and run."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.real_runtime import LIMITS, Podman, podman, skip_or_fail

__all__ = ["podman"]

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def stages() -> list[str]:
    return re.split(r"(?m)^FROM ", DOCKERFILE)[1:]


def test_two_stages_from_one_base_a_slim_python_unless_told_otherwise() -> None:
    parts = stages()
    assert len(parts) == 2
    assert all(part.startswith("${BASE}") for part in parts)
    assert parts[0].split()[2] == "build"  # "... AS build"
    assert re.search(r"(?m)^ARG BASE=python:\$\{PYTHON\}-slim$", DOCKERFILE)


def test_final_stage_copies_the_environment_and_keeps_no_build_tools() -> None:
    final = stages()[1]
    assert "COPY --from=build /opt/devplugin /opt/devplugin" in final
    assert "pip uninstall -y pip setuptools wheel" in final  # the base's own, where it has one
    commands = " ".join(re.findall(r"(?ms)^RUN (.*?)(?:\n(?=[A-Z])|\Z)", final))
    for tool in ("gcc", "build-essential", "apt-get", "apk", "git ", "make ", "pip install"):
        assert tool not in commands, tool
    assert "ENV PATH=/opt/devplugin/bin:" in final


def test_build_stage_compiles_the_fold_and_installs_from_its_wheels_only() -> None:
    build = stages()[0]
    assert "gcc" in build
    assert "COPY pyproject.toml setup.py" in build
    assert "DEVPLUGIN_REQUIRE_NATIVE=1 /opt/devplugin/bin/pip wheel" in build
    assert "install --no-cache-dir --no-index --find-links=/wheels devplugin" in build
    assert "/opt/devplugin/bin/pip uninstall -y pip setuptools wheel" in build
    setup = (ROOT / "setup.py").read_text()
    assert "optional=not REQUIRED" in setup
    assert "**/*.so" in (ROOT / ".dockerignore").read_text()  # never a host-built module


def test_entrypoint_and_labels() -> None:
    final = stages()[1]
    (entrypoint,) = re.findall(r"(?m)^ENTRYPOINT (.*)$", final)
    assert json.loads(entrypoint) == ["devplugin", "run"]
    for label in ("title", "description", "version", "licenses", "source"):
        assert f"org.opencontainers.image.{label}=" in final


@pytest.mark.real_runtime
@pytest.mark.slow  # two minutes of building: CI runs it with the slow tier
@pytest.mark.timeout(1200)  # a build fetches and compiles: minutes
def test_the_image_builds_with_podman_and_runs_the_demo(podman: Podman) -> None:
    """Built by a real OCI builder and run: `devplugin --version` and
    `devplugin demo` inside it. The base: a folder of Debian made by
    scripts/image-base.sh (what CI does; Docker Hub is out of reach there)
    or an image podman can pull."""
    rootfs = os.environ.get("DEVPLUGIN_IMAGE_BASE_ROOTFS")
    base = os.environ.get("DEVPLUGIN_IMAGE_BASE")
    if rootfs:
        base = "localhost/devplugin-base:test"
        with subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE) as tar:
            imported = subprocess.run(
                podman.command("import", "-", base),
                stdin=tar.stdout,
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
        assert imported.returncode == 0, imported.stderr[-2000:]
    if not base:
        skip_or_fail(
            "image test: no base (set DEVPLUGIN_IMAGE_BASE_ROOTFS to a folder "
            "scripts/image-base.sh made, or DEVPLUGIN_IMAGE_BASE to a pullable image)"
        )
    tag = "localhost/devplugin:test"
    built = subprocess.run(
        podman.command(
            "build",
            "--network",
            "host",
            "--build-arg",
            f"BASE={base}",
            "--build-arg",
            "VERSION=0.1.0",
            "-t",
            tag,
            str(ROOT),
        ),
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-2000:]

    def inside(*args: str) -> str:
        return podman.check(
            podman.command(
                "run", "--rm", "--network", "none", *LIMITS, "--entrypoint", "devplugin", tag, *args
            )
        ).stdout

    assert inside("--version").strip() == "devplugin 0.1.0"
    demo = inside("demo")
    assert "kubelet sees nvidia.com/gpu: 8 devices, 8 healthy" in demo
    assert "NCCL_IB_HCA==" in demo
    # Nothing that builds or fetches code is left in it.
    tools = podman.check(
        podman.command(
            "run",
            "--rm",
            "--network",
            "none",
            *LIMITS,
            "--entrypoint",
            "sh",
            tag,
            "-c",
            "command -v gcc pip pip3 || true; python3 -m pip 2>&1 | head -1",
        )
    ).stdout
    assert "gcc" not in tools
    assert "No module named pip" in tools
