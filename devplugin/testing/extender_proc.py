"""`devplugin extender` as its own process against the API server imitation
(or a real API server, given its kubeconfig): what the end-to-end tests,
the cluster tier and the benches start."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import yaml

from devplugin.testing.apiserver import ApiServerImitation


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def extender_command(
    api: ApiServerImitation | dict[str, Any],
    base: Path,
    port: int,
    *,
    stale_after: float,
    dra: bool = False,
) -> list[str]:
    """The command line, with a kubeconfig for the imitation (or the given
    kubeconfig of a real API server) written under `base`."""
    kubeconfig = base / f"extender-kubeconfig-{port}"
    config = api.kubeconfig() if isinstance(api, ApiServerImitation) else api
    kubeconfig.write_text(yaml.safe_dump(config))
    return [
        sys.executable,
        "-m",
        "devplugin",
        "extender",
        "--listen",
        f"127.0.0.1:{port}",
        "--kubeconfig",
        str(kubeconfig),
        "--stale-after-seconds",
        str(stale_after),
        *(["--dra"] if dra else []),
    ]


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=1) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


@contextmanager
def extender_process(
    api: ApiServerImitation | dict[str, Any],
    base: Path,
    *,
    stale_after: float = 120.0,
    dra: bool = False,
    output: IO[Any] | int | None = None,
    within: float = 30.0,
) -> Iterator[str]:
    """The extender serving on a free local port, ready (every cache
    listed); its URL. Stopped (SIGTERM, then waited for) on exit."""
    port = free_port()
    command = extender_command(api, base, port, stale_after=stale_after, dra=dra)
    process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + within
        while not ready(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the extender did not become ready")
            time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        process.wait(10)
