"""Named node layouts for tests, benchmarks and the demo.

Each is a `NodeSpec`; `build_node` writes it to disk, `devices_from_spec`
builds it in memory.
"""

from __future__ import annotations

from collections.abc import Callable

from devplugin.testing.node import Gpu, Hca, NodeSpec, RootComplex, Switch, hgx_node


def _cpus(numa: int, per_node: int = 32) -> str:
    return f"{numa * per_node}-{numa * per_node + per_node - 1}"


def a100() -> Gpu:
    return Gpu(name="NVIDIA A100-SXM4-80GB", memory_mib=81920, compute=(8, 0))


def dgx_a100() -> NodeSpec:
    """Four switch complexes, each a top switch over two switches of one GPU
    and one HCA (two GPUs + two HCAs per complex), NV12 between all GPUs;
    A100s, where every other layout has H100s."""
    roots = [
        RootComplex(numa, _cpus(numa), [Switch([Switch([a100(), Hca()]), Switch([a100(), Hca()])])])
        for numa in (0, 0, 1, 1)
    ]
    return NodeSpec(roots=roots, nvlink_all_to_all=12)


def hgx_h100() -> NodeSpec:
    """One GPU and one HCA behind each of eight switches, NV18 through NVSwitch."""
    return hgx_node(sockets=2, pairs_per_socket=4, nvlinks=18)


def pcie_server() -> NodeSpec:
    """Eight PCIe GPUs in pairs behind four switches, one HCA per NUMA node
    (sharing a switch with one GPU pair), no NVLink."""
    roots = []
    for numa in (0, 1):
        roots.append(RootComplex(numa, _cpus(numa), [Switch([Gpu(), Gpu(), Hca()])]))
        roots.append(RootComplex(numa, _cpus(numa), [Switch([Gpu(), Gpu()])]))
    return NodeSpec(roots=roots)


def asymmetric() -> NodeSpec:
    """Uneven switches: some without HCAs, one with two; NVLink bridges
    between GPU pairs that share a switch."""
    roots = [
        RootComplex(0, _cpus(0), [Switch([Gpu(), Gpu(), Hca()])]),
        RootComplex(0, _cpus(0), [Switch([Gpu(), Gpu()])]),
        RootComplex(1, _cpus(1), [Switch([Gpu(), Hca(), Hca()])]),
        RootComplex(1, _cpus(1), [Switch([Switch([Gpu(), Gpu()]), Switch([Gpu()])])]),
    ]
    return NodeSpec(roots=roots, nvlink_pairs={(0, 1): 4, (2, 3): 4, (5, 6): 4})


# DGX-1 (V100) hybrid cube mesh: two quads of four GPUs plus a link pair
# between GPU i and i+4; six NVLinks per GPU.
_CUBE = {(0, 1): 1, (0, 2): 1, (0, 3): 2, (1, 2): 2, (1, 3): 1, (2, 3): 1}


def _cube_mesh(offset: int) -> dict[tuple[int, int], int]:
    links: dict[tuple[int, int], int] = {}
    for quad in (0, 4):
        for (a, b), count in _CUBE.items():
            links[(offset + quad + a, offset + quad + b)] = count
    for i in range(4):
        links[(offset + i, offset + i + 4)] = 2
    return links


def _dgx1_roots(numa_base: int) -> list[RootComplex]:
    # Per CPU two PCIe switches, each with two GPUs and one NIC.
    return [
        RootComplex(numa, _cpus(numa), [Switch([Gpu(), Gpu(), Hca()])])
        for numa in (numa_base, numa_base, numa_base + 1, numa_base + 1)
    ]


def dgx_1() -> NodeSpec:
    """DGX-1 (8 V100): four switches of two GPUs and one NIC, two per CPU,
    NVLink in a hybrid cube mesh the PCIe tree does not follow."""
    return NodeSpec(roots=_dgx1_roots(0), nvlink_pairs=_cube_mesh(0))


def dgx_1_twice() -> NodeSpec:
    """Two DGX-1 meshes in one 16-GPU node (no NVLink between them)."""
    return NodeSpec(
        roots=_dgx1_roots(0) + _dgx1_roots(2), nvlink_pairs={**_cube_mesh(0), **_cube_mesh(8)}
    )


def _pcie_tree(gpus: int) -> NodeSpec:
    """`gpus` PCIe GPUs, one HCA per two: two NUMA nodes, each with host
    bridges that hold a top switch over two switches of two GPUs and one HCA."""
    tops = gpus // 4
    roots = [
        RootComplex(
            2 * top // tops,
            _cpus(2 * top // tops),
            [Switch([Switch([Gpu(), Gpu(), Hca()]), Switch([Gpu(), Gpu(), Hca()])])],
        )
        for top in range(tops)
    ]
    return NodeSpec(roots=roots)


def _bridged(gpus: int) -> NodeSpec:
    """The PCIe tree of `_pcie_tree` with 4-link NVLink bridges joining the
    second GPU of each switch to the first of its neighbour under the same
    top switch: links the tree cannot express."""
    spec = _pcie_tree(gpus)
    bridges = {(4 * top + 1, 4 * top + 2): 4 for top in range(gpus // 4)}
    return NodeSpec(roots=spec.roots, nvlink_pairs=bridges)


def sixteen_gpu() -> NodeSpec:
    """Sixteen PCIe GPUs, eight HCAs: per NUMA node two host bridges, each a
    top switch over two switches of two GPUs and one HCA."""
    return _pcie_tree(16)


def sixteen_gpu_bridged() -> NodeSpec:
    """The 16-GPU PCIe tree with NVLink bridges between neighbouring switches."""
    return _bridged(16)


def thirty_two_gpu_bridged() -> NodeSpec:
    """The same at 32 GPUs (16 HCAs, four host bridges per NUMA node)."""
    return _bridged(32)


def sixty_four_gpu_bridged() -> NodeSpec:
    """The same at 64 GPUs (32 HCAs, eight host bridges per NUMA node)."""
    return _bridged(64)


def node_64() -> NodeSpec:
    """64 GPUs and 16 HCAs: per NUMA node four host bridges, each with two
    switches of four GPUs and one HCA. No NVLink (PCIe only)."""
    roots = [
        RootComplex(
            numa,
            _cpus(numa, 64),
            [Switch([Gpu(), Gpu(), Gpu(), Gpu(), Hca()]) for _ in range(2)],
        )
        for numa in (0, 0, 0, 0, 1, 1, 1, 1)
    ]
    return NodeSpec(roots=roots)


# A mixed MIG node: half its H100s cut (one 3g, one 2g, two 1g each), half whole.
MIXED_CUTS: tuple[tuple[str, ...], ...] = (("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"),) * 4 + (
    (),
) * 4


def hgx_h100_mig(cuts: tuple[tuple[str, ...] | None, ...] = MIXED_CUTS) -> NodeSpec:
    """HGX-H100 whose GPU i is cut into MIG devices of `cuts[i]` (() leaves it
    whole, MIG disabled; None makes it not MIG-capable). Kept out of LAYOUTS:
    its devices are not whole GPUs, so the whole-GPU corpora skip it."""
    spec = hgx_node(sockets=2, pairs_per_socket=4, nvlinks=18)
    gpus = iter(cuts)
    for root in spec.roots:
        for switch in root.children:
            assert isinstance(switch, Switch)
            switch.children[:] = [
                Gpu(mig=next(gpus), compute=(9, 0)) if isinstance(c, Gpu) else c
                for c in switch.children
            ]
    return spec


LAYOUTS: dict[str, Callable[[], NodeSpec]] = {
    "dgx-a100": dgx_a100,
    "dgx-1": dgx_1,
    "dgx-1x2": dgx_1_twice,
    "hgx-h100": hgx_h100,
    "pcie-server": pcie_server,
    "asymmetric": asymmetric,
    "16-gpu": sixteen_gpu,
    "16-gpu-bridged": sixteen_gpu_bridged,
    "32-gpu-bridged": thirty_two_gpu_bridged,
    "64-gpu-bridged": sixty_four_gpu_bridged,
    "64-gpu": node_64,
}
