"""Where `devplugin topo --format dot|svg|png` gets a node's record, and
how the picture (picture.py) becomes SVG or PNG.

Four sources, one picture: this node's hardware as discovery sees it
(health judged on the hardware alone, no holders), a running daemon's
record from its status endpoint (`/record`: holders included, with or
without the API), a NodeDevices record saved to a file (`kubectl get
nodedevices NODE -o json`), or any node's record read from the API server
(what its daemon last published). Graphviz's `dot` (Debian's graphviz
package) lays it out.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from lightkube import ApiError

from devplugin.cluster.client import make_client
from devplugin.cluster.objects import as_dict
from devplugin.cluster.record import Registration, build_status
from devplugin.config import Config, KubernetesConfig, node_name
from devplugin.model import Inventory
from devplugin.node.core import build_resources
from devplugin.wire.resources import NodeDevices

# Graphviz gets this long for one node's picture (milliseconds in practice).
RENDER_TIMEOUT = 60.0
# A daemon's /record answers from memory: seconds mean it is not there.
DAEMON_TIMEOUT = 10.0
# A record is a few hundred kilobytes at most (the CRD's limits).
MAX_RECORD = 8 << 20
FORMATS = ("svg", "png")


class SourceError(Exception):
    """The record could not be had or read (one line for the operator)."""


def from_inventory(config: Config, inventory: Inventory) -> tuple[str, dict[str, Any]]:
    """This node as discovery sees it: each served kind's devices with the
    health the hardware gives them (no holders: those are the daemon's)."""
    states = {resource.kind: resource.state(inventory) for resource in build_resources(config)}
    status = build_status(inventory, states, (), Registration(False, "from discovery"))
    return node_name(config) or socket.gethostname(), status


def _one_record(document: Any, node: str | None) -> tuple[str, dict[str, Any]]:
    items = document.get("items") if isinstance(document, dict) else None
    if isinstance(items, list):
        chosen = [i for i in items if node is None or _name_of(i) == node]
        if len(chosen) != 1:
            raise SourceError(
                f"the file lists {len(items)} records; name one with --node"
                if node is None
                else f"no record of node {node} in the file"
            )
        document = chosen[0]
    if not isinstance(document, dict) or not isinstance(document.get("status"), dict):
        raise SourceError("not a NodeDevices record (no status)")
    return _name_of(document) or node or "node", document["status"]


def _name_of(document: Any) -> str | None:
    """metadata.name, where the document has one."""
    meta = document.get("metadata") if isinstance(document, dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) else None


def from_file(path: Path, node: str | None) -> tuple[str, dict[str, Any]]:
    """A record saved as JSON or YAML (one object, or a List of them)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise SourceError(f"--record: {exc.strerror}: {path}") from exc
    try:
        document = json.loads(text) if text.lstrip().startswith("{") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise SourceError(f"--record: {path} is neither JSON nor YAML ({exc})") from exc
    return _one_record(document, node)


def from_daemon(address: str) -> tuple[str, dict[str, Any]]:
    """A running daemon's record from its status endpoint (HOST:PORT, as
    metrics.addresses gives it; the chart's is the pod's loopback)."""
    url = f"http://{address}/record"
    try:
        with urllib.request.urlopen(url, timeout=DAEMON_TIMEOUT) as answer:
            body = answer.read(MAX_RECORD + 1)
    except urllib.error.HTTPError as exc:
        raise SourceError(f"--daemon: {url} answered {exc.code}") from exc
    except (OSError, ValueError) as exc:
        raise SourceError(f"--daemon: no answer from {url} ({exc})") from exc
    if len(body) > MAX_RECORD:
        raise SourceError(f"--daemon: {url} answered more than {MAX_RECORD} bytes")
    try:
        document = json.loads(body)
    except ValueError as exc:
        raise SourceError(f"--daemon: {url} did not answer JSON") from exc
    return _one_record(document, None)


def from_api(kube: KubernetesConfig, node: str) -> tuple[str, dict[str, Any]]:
    """The node's record as its daemon last published it."""
    client = make_client(kube, quiet=True)
    if client is None:
        raise SourceError("no cluster to read from (--kubeconfig, or run in a pod)")
    try:
        found = client.get(NodeDevices, name=node)
    except ApiError as exc:
        raise SourceError(f"NodeDevices {node}: {exc.status.message}") from exc
    except OSError as exc:
        raise SourceError(f"NodeDevices {node}: the API server did not answer ({exc})") from exc
    return _one_record(as_dict(found), node)


def render(dot_text: str, fmt: str) -> bytes:
    """The picture laid out by Graphviz in `fmt` (svg or png)."""
    if fmt not in FORMATS:
        raise SourceError(f"--format: {fmt} is not one of {', '.join(FORMATS)}")
    program = shutil.which("dot")
    if program is None:
        raise SourceError(
            f"--format {fmt} needs Graphviz's dot (apt install graphviz); --format dot prints "
            "the picture's source"
        )
    try:
        done = subprocess.run(
            [program, f"-T{fmt}"],
            input=dot_text.encode(),
            capture_output=True,
            timeout=RENDER_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise SourceError(f"Graphviz took more than {RENDER_TIMEOUT:.0f}s") from exc
    if done.returncode != 0:
        raise SourceError(f"Graphviz failed: {done.stderr.decode(errors='replace')[-300:]}")
    return done.stdout
