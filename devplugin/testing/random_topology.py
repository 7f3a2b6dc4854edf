"""Seeded random node layouts and allocator requests, for the randomized
equality corpora."""

from __future__ import annotations

import random

from devplugin.model import DeviceKind
from devplugin.policy.allocator import Request, Role
from devplugin.testing.node import Child, Gpu, Hca, NodeSpec, Port, RootComplex, Switch


def _children(rng: random.Random, depth: int) -> list[Child]:
    children: list[Child] = []
    for _ in range(rng.randint(1, 3)):
        roll = rng.random()
        if depth < 2 and roll < 0.35:
            children.append(Switch(_children(rng, depth + 1)))
        elif roll < 0.7:
            children.append(Gpu())
        else:
            children.append(Hca(ports=[Port()]))
    return children


def random_spec(rng: random.Random, *, max_gpus: int = 10) -> NodeSpec:
    """A node of 1-2 NUMA nodes, 1-3 host bridges each, nested switches, and
    NVLink that is absent, all-to-all, or a random set of pairs."""
    while True:
        roots: list[RootComplex] = []
        for numa in range(rng.randint(1, 2)):
            for _ in range(rng.randint(1, 3)):
                roots.append(
                    RootComplex(numa, f"{numa * 8}-{numa * 8 + 7}", [Switch(_children(rng, 1))])
                )
        spec = NodeSpec(roots=roots)
        gpus = _count(spec)
        if 1 <= gpus <= max_gpus:
            break
    mode = rng.random()
    if mode < 0.3:
        spec.nvlink_all_to_all = rng.choice([4, 12, 18])
    elif mode < 0.6:
        for i in range(gpus):
            for j in range(i + 1, gpus):
                if rng.random() < 0.3:
                    spec.nvlink_pairs[(i, j)] = rng.choice([1, 2, 4])
    return spec


def _count(spec: NodeSpec) -> int:
    def walk(children: list[Child]) -> int:
        total = 0
        for child in children:
            if isinstance(child, Switch):
                total += walk(child.children)
            elif isinstance(child, Gpu):
                total += 1
        return total

    return sum(walk(root.children) for root in spec.roots)


def random_requests(
    rng: random.Random, gpu_ids: list[str], hca_ids: list[str], count: int
) -> list[Request]:
    """`count` requests in every mode: either kind, either role, must-include,
    the partner count known or not, some devices busy."""
    requests: list[Request] = []
    while len(requests) < count:
        kind = rng.choice([DeviceKind.GPU, DeviceKind.HCA])
        same, other = (gpu_ids, hca_ids) if kind is DeviceKind.GPU else (hca_ids, gpu_ids)
        if not same:
            continue
        available = [d for d in same if rng.random() < 0.8] or same[:1]
        size = rng.randint(1, len(available))
        must = frozenset(rng.sample(available, rng.randint(0, min(2, size))))
        role = rng.choice([Role.FIRST, Role.SECOND])
        expected = rng.choice([None, 0, 1, 2, size, size + 1])
        other_free = [d for d in other if rng.random() < 0.7]
        if role is Role.SECOND and other:
            partner = frozenset(rng.sample(other, rng.randint(1, len(other))))
            other_free = [d for d in other_free if d not in partner]
        else:
            partner = frozenset(other_free)
        requests.append(
            Request(
                kind,
                frozenset(available),
                size,
                must,
                role,
                partner,
                frozenset(other_free),
                expected,
            )
        )
    return requests
