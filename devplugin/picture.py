"""A node's devices as a picture: the PCIe tree (NUMA nodes, host bridges,
root ports, switches), its GPUs (MIG devices drawn inside their parent)
and HCAs (each port with its state), the NVLinks between GPUs, every
device coloured by health and labelled by the pod holding it.

Pure: it reads a NodeDevices record's status (what the daemon publishes,
or what `devplugin topo` builds from discovery) and writes Graphviz's DOT
language; the CLI hands that to Graphviz's `dot` for SVG or PNG. One
picture, whatever the source, so a node seen from the cluster looks the
same as seen on the node.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from html import escape
from typing import Any

from devplugin.kinds.base import PictureError
from devplugin.kinds.registry import BY_KEY, KINDS
from devplugin.model import shown

__all__ = ["Edge", "Node", "Picture", "PictureError", "dot", "picture"]

HEALTH_FILL = {"Healthy": "#c8e6c9", "Unhealthy": "#ffcdd2"}
UNKNOWN_FILL = "#eeeeee"
DOMAIN_FILL = "#f5f5f5"
# One border colour per holder, in the order holders sort (repeats past eight).
HOLDER_COLOURS = (
    "#1565c0", "#6a1b9a", "#ef6c00", "#00838f", "#ad1457", "#2e7d32", "#4e342e", "#283593",
)  # fmt: skip
NVLINK_COLOUR = "#558b2f"
# A complete NVLink graph of this many GPUs or more, every pair with the
# same links, is drawn as one NVSwitch fabric instead of every pair.
FABRIC_AT = 4
DOMAINS = ("NUMA", "host bridge", "root port", "switch")


@dataclass(frozen=True)
class Node:
    key: str
    kind: str  # numa, host bridge, root port, switch, gpu, mig, hca, fabric, legend
    lines: tuple[str, ...]
    health: str | None = None
    holder: str | None = None
    # HCA ports: (text, good) rows drawn inside the node.
    ports: tuple[tuple[str, bool], ...] = ()
    # MIG devices: the cluster (their parent GPU) they are drawn inside.
    cluster: str | None = None


@dataclass(frozen=True)
class Edge:
    tail: str
    head: str
    kind: str  # tree, nvlink, fabric
    label: str = ""


@dataclass(frozen=True)
class Picture:
    title: str
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    # cluster key -> its label (a MIG parent GPU).
    clusters: Mapping[str, str] = field(default_factory=dict)
    holders: tuple[str, ...] = ()


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise PictureError(f"{what}: expected a string, got {type(value).__name__}")
    return value


def _holders(status: Mapping[str, Any]) -> dict[str, str]:
    """Device id -> the pod (namespace/pod) holding it."""
    held: dict[str, str] = {}
    for allocation in status.get("allocations") or ():
        if not isinstance(allocation, Mapping):
            raise PictureError("status.allocations: expected objects")
        holder = f"{allocation.get('namespace', '')}/{allocation.get('pod', '')}".strip("/")
        devices = allocation.get("devices") or ()
        if not isinstance(devices, list):
            raise PictureError("status.allocations[].devices: expected a list")
        for device in devices:
            held[_text(device, "status.allocations[].devices[]")] = holder or "(unknown)"
    return held


def _domains(path: Sequence[str]) -> list[tuple[str, str, str]]:
    """(key, kind, label) from the NUMA node down to the device's parent;
    a device straight under its root port has no switch level."""
    found: list[tuple[str, str, str]] = []
    parts: list[str] = []
    for depth, part in enumerate(path[: len(DOMAINS)]):
        if depth and part == path[depth - 1]:
            continue
        parts.append(part)
        kind = DOMAINS[depth]
        label = f"NUMA {part.removeprefix('numa')}" if depth == 0 else f"{kind} {part}"
        found.append(("/".join(parts), kind, label))
    return found


def _device_node(device: Mapping[str, Any], held: Mapping[str, str]) -> tuple[Node, str]:
    """The device's node, and the label of the cluster it is drawn inside."""
    found = BY_KEY.get(str(device.get("kind")))
    if found is None:
        raise PictureError(
            f"status.devices[].kind: {shown(str(device.get('kind')))!r} is no kind served"
        )
    box = found.box(device)
    lines = list(box.lines)
    if device.get("health") not in (None, "Healthy"):
        reason = str(device.get("reason", ""))[:60]
        lines.append(f"{device.get('health')}: {reason}" if reason else str(device["health"]))
    holder = held.get(device["id"])
    if holder is not None:
        lines.append(f"held by {holder}")
    node = Node(
        f"{box.kind}:{device['id']}",
        box.kind,
        tuple(line for line in lines if line),
        str(device.get("health", "")) or None,
        holder,
        box.ports,
        box.cluster[0] if box.cluster is not None else None,
    )
    return node, box.cluster[1] if box.cluster is not None else ""


def _links(by_kind: Mapping[str, list[Mapping[str, Any]]]) -> tuple[list[Edge], list[Node]]:
    """Each kind's direct links (NVLink between GPUs), or its fabric node's
    where at least FABRIC_AT devices are all linked alike (an NVSwitch
    system); and the fabric nodes drawn."""
    edges: list[Edge] = []
    fabrics: list[Node] = []
    for wing in KINDS:
        entries = by_kind.get(wing.key, [])
        pairs, linked = wing.links(entries)
        if not pairs:
            continue
        box = {entry["id"]: f"{wing.box(entry).kind}:{entry['id']}" for entry in entries}
        label = wing.link_label
        complete = len(pairs) == len(linked) * (len(linked) - 1) // 2
        if wing.fabric and len(linked) >= FABRIC_AT and complete and len(set(pairs.values())) == 1:
            key, name = wing.fabric
            count = next(iter(pairs.values()))
            edges += [Edge(box[d], key, "fabric", f"{label}{count}") for d in linked]
            fabrics.append(Node(key, "fabric", (name,)))
        else:
            edges += [
                Edge(box[a], box[b], wing.link_kind, f"{label}{n}")
                for (a, b), n in sorted(pairs.items())
            ]
    return edges, fabrics


def _title(name: str, summary: Mapping[str, Any]) -> str:
    counts = [
        f"{summary.get(f'{w.plural}Free', '?')}/{summary.get(f'{w.plural}Total', '?')} {w.noun}s"
        for w in KINDS
    ]
    listed = ", ".join(counts[:-1]) + " and " + counts[-1] if len(counts) > 1 else counts[0]
    return f"{name}: {listed} free, {summary.get('unhealthy', 0)} unhealthy"


def picture(name: str, status: Mapping[str, Any]) -> Picture:
    """The picture of one node's record status."""
    devices = status.get("devices")
    if not isinstance(devices, list):
        raise PictureError("status.devices: expected a list (is this a NodeDevices record?)")
    held = _holders(status)
    nodes: dict[str, Node] = {}
    edges: list[Edge] = []
    clusters: dict[str, str] = {}
    by_kind: dict[str, list[Mapping[str, Any]]] = {}
    for device in devices:
        if not isinstance(device, Mapping) or not isinstance(device.get("id"), str):
            raise PictureError("status.devices[]: expected objects with an id")
        listed = device.get("topologyPath") or []
        if not isinstance(listed, list):
            raise PictureError("status.devices[].topologyPath: expected a list")
        path = [_text(part, "topologyPath[]") for part in listed]
        parent = None
        for key, kind, label in _domains(path) or [("unknown", "host bridge", "position unknown")]:
            # A domain's node and the edge into it, once for all its devices.
            if key not in nodes:
                nodes[key] = Node(key, kind, (label,))
                if parent is not None:
                    edges.append(Edge(parent, key, "tree"))
            parent = key
        assert parent is not None
        node, cluster_label = _device_node(device, held)
        nodes[node.key] = node
        edges.append(Edge(parent, node.key, "tree"))
        if node.cluster is not None:
            clusters.setdefault(node.cluster, cluster_label)
        by_kind.setdefault(str(device["kind"]), []).append(device)
    links, fabrics = _links(by_kind)
    nodes.update((fabric.key, fabric) for fabric in fabrics)
    holders = tuple(sorted(set(held.values())))
    summary = status.get("summary") or {}
    if not isinstance(summary, Mapping):
        raise PictureError("status.summary: expected an object")
    title = _title(name, summary)
    return Picture(title, tuple(nodes.values()), tuple(edges + links), clusters, holders)


# -- DOT ----------------------------------------------------------------------------


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _html_label(node: Node, colour: str | None) -> str:
    fill = HEALTH_FILL.get(node.health or "", UNKNOWN_FILL)
    rows = [f'<TR><TD BGCOLOR="{fill}"><B>{escape(node.lines[0])}</B></TD></TR>']
    rows += [f"<TR><TD>{escape(line)}</TD></TR>" for line in node.lines[1:]]
    for text, good in node.ports:
        port_fill = HEALTH_FILL["Healthy" if good else "Unhealthy"]
        rows.append(f'<TR><TD BGCOLOR="{port_fill}">{escape(text)}</TD></TR>')
    border = f' COLOR="{colour}"' if colour else ""
    return (
        f'<<TABLE BORDER="{3 if colour else 1}"{border} CELLBORDER="0" CELLSPACING="0" '
        f'CELLPADDING="3" BGCOLOR="{fill}">' + "".join(rows) + "</TABLE>>"
    )


def _node_line(node: Node, colours: Mapping[str, str]) -> str:
    if node.kind in DOMAINS:
        return (
            f'  {_quote(node.key)} [shape=box, style="rounded,filled", '
            f'fillcolor="{DOMAIN_FILL}", label={_quote(node.lines[0])}];'
        )
    if node.kind == "fabric":
        return (
            f'  {_quote(node.key)} [shape=hexagon, style=filled, fillcolor="#dcedc8", '
            f"label={_quote(node.lines[0])}];"
        )
    colour = colours.get(node.holder) if node.holder else None
    return f"  {_quote(node.key)} [shape=plain, label={_html_label(node, colour)}];"


def _legend(picture: Picture, colours: Mapping[str, str]) -> str:
    rows = ['<TR><TD COLSPAN="2"><B>legend</B></TD></TR>']
    for health, fill in HEALTH_FILL.items():
        rows.append(f'<TR><TD BGCOLOR="{fill}">   </TD><TD>{health}</TD></TR>')
    for holder in picture.holders:
        rows.append(
            f'<TR><TD BGCOLOR="{colours[holder]}">   </TD><TD>held by {escape(holder)}</TD></TR>'
        )
    table = '<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0">' + "".join(rows) + "</TABLE>>"
    return f'  "legend" [shape=plain, label={table}];'


def dot(picture: Picture) -> str:
    """The picture in Graphviz's DOT language (the tree from left to right,
    so a node's devices stack up instead of spreading across)."""
    colours = {h: HOLDER_COLOURS[i % len(HOLDER_COLOURS)] for i, h in enumerate(picture.holders)}
    lines = [
        "digraph node_devices {",
        '  graph [rankdir=LR, nodesep=0.15, ranksep=0.4, compound=true, fontname="Helvetica",',
        f"    labelloc=t, label={_quote(picture.title)}];",
        '  node [fontname="Helvetica", fontsize=10];',
        '  edge [arrowhead=none, color="#757575", fontname="Helvetica", fontsize=9];',
    ]
    inside: dict[str, list[Node]] = {}
    for node in picture.nodes:
        if node.cluster is not None:
            inside.setdefault(node.cluster, []).append(node)
        else:
            lines.append(_node_line(node, colours))
    for cluster, members in inside.items():
        lines.append(f"  subgraph {_quote(cluster)} {{")
        lines.append(
            f'    label={_quote(picture.clusters[cluster])}; style="rounded,filled"; '
            f'fillcolor="#fafafa";'
        )
        lines.extend("  " + _node_line(node, colours) for node in members)
        lines.append("  }")
    lines.append(_legend(picture, colours))
    for edge in picture.edges:
        attrs = []
        if edge.kind in ("nvlink", "fabric"):
            attrs += [f'color="{NVLINK_COLOUR}"', "penwidth=2"]
        if edge.kind == "nvlink":
            # Pairwise links must not pull the tree's ranks about; the
            # fabric sits one rank past the GPUs.
            attrs.append("constraint=false")
        if edge.label:
            attrs.append(f"label={_quote(edge.label)}")
        suffix = f" [{', '.join(attrs)}]" if attrs else ""
        lines.append(f"  {_quote(edge.tail)} -> {_quote(edge.head)}{suffix};")
    lines.append("}")
    return "\n".join(lines) + "\n"
