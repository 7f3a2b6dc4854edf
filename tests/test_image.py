"""The Dockerfile: multi-stage, wheel-installed (the compiled fold built in the
first stage), no build tools in the final one, OCI labels."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def stages() -> list[str]:
    return re.split(r"(?m)^FROM ", DOCKERFILE)[1:]


def test_two_stages_from_a_slim_python() -> None:
    parts = stages()
    assert len(parts) == 2
    assert all(part.startswith("python:${PYTHON}-slim") for part in parts)
    assert parts[0].split()[2] == "build"  # "... AS build"


def test_final_stage_installs_the_wheel_offline_and_keeps_no_build_tools() -> None:
    final = stages()[1]
    assert "COPY --from=build /wheels /wheels" in final
    assert "--no-index" in final
    assert "rm -rf /wheels" in final
    assert "pip uninstall -y pip setuptools wheel" in final
    commands = " ".join(re.findall(r"(?ms)^RUN (.*?)(?:\n(?=[A-Z])|\Z)", final))
    assert "pip install" in commands
    for tool in ("gcc", "build-essential", "apt-get", "apk", "git ", "make "):
        assert tool not in commands, tool


def test_build_stage_compiles_the_fold_and_refuses_a_wheel_without_it() -> None:
    build = stages()[0]
    assert "gcc" in build
    assert "COPY pyproject.toml setup.py" in build
    assert "DEVPLUGIN_REQUIRE_NATIVE=1 python -m pip wheel" in build
    setup = (ROOT / "setup.py").read_text()
    assert "optional=not REQUIRED" in setup
    assert "**/*.so" in (ROOT / ".dockerignore").read_text()  # never a host-built module


def test_entrypoint_and_labels() -> None:
    final = stages()[1]
    (entrypoint,) = re.findall(r"(?m)^ENTRYPOINT (.*)$", final)
    assert json.loads(entrypoint) == ["devplugin", "run"]
    for label in ("title", "description", "version", "licenses", "source"):
        assert f"org.opencontainers.image.{label}=" in final


def test_image_builds_where_a_docker_engine_exists() -> None:
    docker = shutil.which("docker")
    if (
        docker is None
        or subprocess.run([docker, "info"], capture_output=True, check=False).returncode
    ):
        pytest.skip("no Docker engine here (`make image` needs one)")
    result = subprocess.run(
        ["make", "image"], cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
