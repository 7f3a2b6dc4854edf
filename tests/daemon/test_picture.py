"""`devplugin topo --format dot|svg|png`: every named layout drawn by
Graphviz, and the SVG's nodes and edges held to the topology discovery
found (each device under its switch, root port, host bridge and NUMA node;
every NVLink; each HCA's ports; MIG devices inside their parent), coloured
by health and labelled by holder."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from devplugin.drawing import SourceError, from_file, render
from devplugin.model import Inventory, PciFunction
from devplugin.node.alignment import ContainerAlignment
from devplugin.picture import HEALTH_FILL, HOLDER_COLOURS, PictureError, dot, picture
from devplugin.policy.topology import Level
from devplugin.testing.kubelet import ContainerRequest
from devplugin.testing.layouts import LAYOUTS, hgx_h100_mig
from devplugin.testing.node import hgx_node
from tests.conftest import GPU, HCA, Cluster
from tests.extender_support import inventory, record
from tests.waiting import wait_until

SVG = "{http://www.w3.org/2000/svg}"
CRD = Path(__file__).resolve().parents[2] / "charts/devplugin/crds/nodedevices.yaml"


@pytest.fixture(scope="module")
def graphviz() -> None:
    if shutil.which("dot") is None:
        if os.environ.get("DEVPLUGIN_REQUIRE_GRAPHVIZ"):
            pytest.fail("Graphviz's dot is required here (Debian's graphviz package)")
        pytest.skip("Graphviz's dot not installed (Debian's graphviz package)")


@dataclass
class Drawn:
    """The rendered SVG, read back: node key -> its texts and fills, the
    edges, and each cluster's and node's bounding box."""

    texts: dict[str, str]
    fills: dict[str, list[str]]
    edges: list[tuple[str, str]]
    boxes: dict[str, tuple[float, float, float, float]]


def _points(group: ET.Element) -> Iterator[tuple[float, float]]:
    """The corners of a group's shapes (polygons, and the paths Graphviz
    draws rounded boxes with: their coordinates come in x,y pairs)."""
    for shape in group.iter():
        if shape.tag in (f"{SVG}polygon", f"{SVG}polyline"):
            text = shape.get("points") or ""
        elif shape.tag == f"{SVG}path":
            text = shape.get("d") or ""
        else:
            continue
        numbers = [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", text)]
        yield from zip(numbers[::2], numbers[1::2], strict=False)


def read_svg(data: bytes) -> Drawn:
    root = ET.fromstring(data)
    drawn = Drawn({}, {}, [], {})
    for group in root.iter(f"{SVG}g"):
        title = group.find(f"{SVG}title")
        if title is None or title.text is None:
            continue
        kind = group.get("class")
        points = list(_points(group))
        if points:
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            drawn.boxes[title.text] = (min(xs), min(ys), max(xs), max(ys))
        if kind == "node":
            drawn.texts[title.text] = " | ".join(t.text or "" for t in group.iter(f"{SVG}text"))
            drawn.fills[title.text] = [
                p.get("fill", "") for p in group.iter(f"{SVG}polygon") if p.get("fill")
            ]
        elif kind == "edge":
            tail, _, head = title.text.partition("->")
            drawn.edges.append((tail, head))
    return drawn


def holdings(inv: Inventory) -> list[ContainerAlignment]:
    """Two pods: four GPUs and HCAs for one, one of each for the other."""
    gpus = [g.uuid for g in inv.gpus]
    hcas = [h.device_id for h in inv.hcas]
    return [
        ContainerAlignment(
            "training", "llm-0", "main", tuple(gpus[:4]), tuple(hcas[:2]), Level.PIX, 4, "uid-a"
        ),
        ContainerAlignment(
            "inference",
            "chat-7",
            "server",
            tuple(gpus[4:5]),
            tuple(hcas[2:3]),
            Level.PIX,
            1,
            "uid-b",
        ),
    ]


def ancestors(drawn: Drawn, key: str) -> list[str]:
    """The labels from a node up to its tree's root, following the one
    tree edge into each (NVLink and fabric edges end at GPUs or the fabric)."""
    parents = {
        head: tail
        for tail, head in drawn.edges
        if not (tail.startswith(("gpu:", "mig:")) or head == "nvswitch")
    }
    found = []
    while key in parents:
        key = parents[key]
        found.append(drawn.texts[key])
    return found


def expected_chain(function: PciFunction) -> list[str]:
    """What the topology says lies above a device: its switch (behind one),
    root port, host bridge and NUMA node."""
    chain = [str(a) for a in function.path.chain]
    labels = []
    if len(chain) >= 3 and chain[-3] != chain[0]:
        labels.append(f"switch {chain[-3]}")
    labels += [f"root port {chain[0]}", f"host bridge {function.path.root}"]
    labels.append(f"NUMA {function.numa_node}")
    return labels


def draw(inv: Inventory, name: str, unhealthy: frozenset[str]) -> tuple[dict[str, Any], Drawn]:
    status = record(inv, name=name, unhealthy=unhealthy, allocations=holdings(inv))["status"]
    return status, read_svg(render(dot(picture(name, status)), "svg"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_named_layout_is_drawn_as_its_topology(
    graphviz: None, layout: str, tmp_path: Path
) -> None:
    inv = inventory(layout, tmp_path)
    sick = inv.hcas[-1].device_id
    status, drawn = draw(inv, layout, frozenset({sick}))
    held = {d: f"{h.namespace}/{h.pod}" for h in holdings(inv) for d in (*h.gpus, *h.hcas)}
    devices = [(f"gpu:{g.uuid}", g.uuid, g.pci) for g in inv.gpus]
    devices += [(f"hca:{h.device_id}", h.device_id, h.pci) for h in inv.hcas]
    for key, device, function in devices:
        assert key in drawn.texts, key
        assert function is not None
        assert ancestors(drawn, key) == expected_chain(function), key
        if device in held:
            assert f"held by {held[device]}" in drawn.texts[key]
        else:
            assert "held by" not in drawn.texts[key]
        want = HEALTH_FILL["Unhealthy" if device == sick else "Healthy"]
        assert drawn.fills[key][0] == want, key
    for hca in inv.hcas:
        for port in hca.ports:
            assert f"port {port.number}: {port.link_layer}" in drawn.texts[f"hca:{hca.device_id}"]
    # NVLinks: every linked pair, or (a complete graph of equal links, as
    # NVSwitch systems are) every GPU to the fabric.
    by_index = {g.index: g.uuid for g in inv.gpus}
    pairs = {
        tuple(sorted((g.uuid, by_index[peer])))
        for g in inv.gpus
        for peer, links in g.nvlink_peers
        if links > 0 and peer in by_index
    }
    links = {(t, h) for t, h in drawn.edges if t.startswith("gpu:") and h.startswith("gpu:")}
    fabric = {t for t, h in drawn.edges if h == "nvswitch"}
    n = len(inv.gpus)
    if fabric:
        assert len(pairs) == n * (n - 1) // 2
        assert fabric == {f"gpu:{g.uuid}" for g in inv.gpus}
        assert not links
    else:
        assert {tuple(sorted((t[4:], h[4:]))) for t, h in links} == pairs
    # The legend names each holder in its colour.
    assert "held by training/llm-0" in drawn.texts["legend"]
    assert status["summary"]["unhealthy"] == 1
    assert HOLDER_COLOURS[1] in drawn.fills["legend"]  # training/llm-0 sorts second


def test_mig_devices_are_drawn_inside_their_parent_gpu(graphviz: None, tmp_path: Path) -> None:
    inv = inventory(hgx_h100_mig(), tmp_path, mig_strategy="mixed")
    slices = [g for g in inv.gpus if g.slice is not None]
    assert slices
    _, drawn = draw(inv, "hgx-h100-mig", frozenset())
    for gpu in slices:
        assert gpu.slice is not None
        key = f"mig:{gpu.uuid}"
        cluster = drawn.boxes[f"cluster_gpu:{gpu.slice.parent_uuid}"]
        box = drawn.boxes[key]
        assert cluster[0] <= box[0], key
        assert cluster[1] <= box[1], key
        assert box[2] <= cluster[2], key
        assert box[3] <= cluster[3], key
        assert gpu.slice.device.profile in drawn.texts[key]
        assert gpu.pci is not None
        assert ancestors(drawn, key) == expected_chain(gpu.pci)


def test_the_cli_draws_a_saved_record_and_refuses_what_it_cannot_draw(
    graphviz: None, tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    from devplugin.cli import main

    inv = inventory("pcie-server", tmp_path / "node")
    saved = tmp_path / "record.json"
    saved.write_text(json.dumps({"kind": "List", "items": [record(inv, name="gpu-7")]}))
    out = tmp_path / "gpu-7.png"
    # Once as an operator runs it, the rest in this process.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "devplugin",
            "topo",
            "--record",
            str(saved),
            "--format",
            "png",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def topo(*args: str) -> tuple[int, str, str]:
        code = main(["topo", *args])
        captured = capsysbinary.readouterr()
        return code, captured.out.decode(), captured.err.decode()

    code, source, _ = topo("--record", str(saved), "--format", "dot")
    assert code == 0
    assert source.startswith("digraph node_devices {")
    assert '"legend"' in source
    # Text is the hardware's matrix; a record is only drawn.
    assert topo("--record", str(saved))[0] == 2
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("kind: Pod\nmetadata: {name: x}\n")
    code, _, error = topo("--record", str(wrong), "--format", "svg")
    assert code == 1
    assert "not a NodeDevices record" in error
    code, _, error = topo("--record", str(tmp_path / "nope.json"), "--format", "svg")
    assert code == 1
    assert "nope.json" in error


def test_a_record_of_the_wrong_shape_fails_with_the_field_named(tmp_path: Path) -> None:
    with pytest.raises(PictureError, match=r"status\.devices"):
        picture("n", {"devices": {"id": "x"}})
    with pytest.raises(PictureError, match="topologyPath"):
        picture("n", {"devices": [{"id": "x", "kind": "gpu", "topologyPath": [3]}]})
    gpu = {"id": "g", "kind": "gpu", "topologyPath": ["numa0", "pci0000:10"]}
    for bad, field in (
        ({**gpu, "nvlinkPeers": ["g2"]}, "nvlinkPeers"),
        ({**gpu, "nvlinkPeers": [{"id": "g2", "links": "many"}]}, "links"),
        ({**gpu, "kind": "hca", "ports": [7]}, "ports"),
        ({**gpu, "topologyPath": "numa0"}, "topologyPath"),
    ):
        with pytest.raises(PictureError, match=field):
            picture("n", {"devices": [bad, {**gpu, "id": "g2"}]})
    with pytest.raises(PictureError, match="summary"):
        picture("n", {"devices": [gpu], "summary": [1]})
    with pytest.raises(PictureError, match="allocations"):
        picture("n", {"devices": [gpu], "allocations": [{"pod": "p", "devices": "g"}]})
    listed = tmp_path / "two.json"
    listed.write_text(json.dumps({"items": [{"metadata": {"name": "a"}, "status": {}}] * 2}))
    with pytest.raises(SourceError, match="name one with --node"):
        from_file(listed, None)
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"items": [7, {"metadata": "x", "status": {}}]}))
    with pytest.raises(SourceError, match="no record of node a"):
        from_file(odd, "a")


def test_discovery_draws_this_nodes_hardware_with_its_own_health_and_no_holders(
    tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    from devplugin.cli import main
    from devplugin.testing.node import build_node, hgx_node

    node = build_node(hgx_node(), tmp_path / "node")
    down = node.hcas[3]
    (down.directory / "infiniband" / down.name / "ports" / "1" / "state").write_text("1: DOWN\n")
    flags = ["--sysfs-root", str(node.sysfs_root), "--dev-root", str(node.dev_root)]
    flags += ["--nvml-fixture", str(node.fixture)]
    assert main(["topo", *flags, "--format", "dot"]) == 0
    source = capsysbinary.readouterr().out.decode()
    for gpu in node.gpus:
        assert f'"gpu:{gpu.uuid}"' in source
    lines = {
        hca.device_id: next(
            r for r in source.splitlines() if r.startswith(f'  "hca:{hca.device_id}"')
        )
        for hca in node.hcas
    }
    assert HEALTH_FILL["Unhealthy"] in lines[down.device_id]
    assert all(
        HEALTH_FILL["Healthy"] in line for device, line in lines.items() if device != down.device_id
    )
    assert "held by" not in source
    assert ": 8/8 GPUs and 7/8 HCAs free, 1 unhealthy" in source


def test_a_running_daemon_serves_its_record_and_the_cli_draws_it_without_the_api(
    start_cluster: Callable[..., Cluster], capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    from devplugin.cli import main

    cluster = start_cluster(hgx_node())
    kubelet = cluster.kubelet
    kubelet.admit("train", [ContainerRequest("c", {GPU: 4, HCA: 2})], order=[GPU, HCA])
    hca = cluster.node.hcas[6]
    (hca.directory / "infiniband" / hca.name / "ports" / "1" / "state").write_text("1: DOWN\n")
    assert cluster.daemon.status is not None
    host, port = cluster.daemon.status.bound[0]

    def record() -> dict[str, Any]:
        with urllib.request.urlopen(f"http://{host}:{port}/record", timeout=5) as answer:
            found: dict[str, Any] = json.loads(answer.read())
        return found

    # Named once PodResources lists the container.
    assert wait_until(
        lambda: (
            [a["pod"] for a in record()["status"]["allocations"]] == ["train"]
            and record()["status"]["summary"]["unhealthy"] == 1
        ),
        timeout=10,
    )
    found = record()
    # The record's own shape: what the CRD the chart ships admits.
    crd = yaml.safe_load(CRD.read_text())
    jsonschema.validate(found, crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    assert main(["topo", "--daemon", f"{host}:{port}", "--format", "dot"]) == 0
    source = capsysbinary.readouterr().out.decode()
    assert source.count("held by default/train") == 6 + 1
    line = next(r for r in source.splitlines() if r.startswith(f'  "hca:{hca.device_id}"'))
    assert HEALTH_FILL["Unhealthy"] in line
    # Nobody there: one line, exit 1.
    cluster.daemon.stop()
    assert main(["topo", "--daemon", f"{host}:{port}", "--format", "dot"]) == 1
    assert "--daemon: no answer" in capsysbinary.readouterr().err.decode()
