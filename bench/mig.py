"""MIG alignment: MIG devices paired with HCAs by a real daemon, against the
exhaustive optimum.

Two MIG layouts of the HGX-H100 node under the mixed strategy: half its
GPUs cut (one 3g.40gb, one 2g.20gb and two 1g.10gb each) beside four whole
GPUs, and every GPU cut that way. A real daemon serves each behind the
kubelet simulator, with the pod watch on the API server imitation (so a
container whose HCA the kubelet allocates first is planned for the profile
it asks for), and the kubelet takes each container's resources in seeded
random order. A seeded stream of pods of MIG and whole-GPU shapes arrives,
each admitted when its counts fit, with random deletions between.

For every admitted container, the reference tries every choice of the
asking resource's free devices and the free HCAs (the free sets at the
moment the pod arrived): the best worst GPU-to-HCA level any choice gives.
Goal: with the pod watch, every container at that level. The same streams
run with the daemon working from the kubelet alone, for comparison: there
an HCA the kubelet takes first is planned against every free GPU-kind
device, not knowing the profile its container asks for.
"""

from __future__ import annotations

import itertools
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from devplugin.config import Config, override
from devplugin.node.alignment import alignment
from devplugin.node.lifecycle.checkpoint import Checkpoint, LifecycleState
from devplugin.policy.topology import Level, Topology
from devplugin.runtime import build
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.fake_nvml import FakeNvml
from devplugin.testing.kubelet import AdmissionError, ContainerRequest, KubeletSimulator
from devplugin.testing.layouts import MIXED_CUTS, hgx_h100_mig
from devplugin.testing.node import BuiltNode, build_node

GPU, HCA = "nvidia.com/gpu", "rdma/hca"
ONE_G, TWO_G, THREE_G = (
    "nvidia.com/mig-1g.10gb",
    "nvidia.com/mig-2g.20gb",
    "nvidia.com/mig-3g.40gb",
)
ALL_CUT = (("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"),) * 8
LAYOUTS = {"half cut": MIXED_CUTS, "all cut": ALL_CUT}
SHAPES = [
    {ONE_G: 1, HCA: 1},
    {TWO_G: 1, HCA: 1},
    {THREE_G: 1, HCA: 1},
    {ONE_G: 2, HCA: 2},
    {ONE_G: 2, HCA: 1},
    {GPU: 1, HCA: 1},
    {GPU: 2, HCA: 2},
]
PODS = 120
SEEDS = [1, 2]


@dataclass
class Tally:
    containers: int = 0
    optimal: int = 0
    skipped: int = 0


def best_level(
    topology: Topology, free: dict[str, set[str]], shape: dict[str, int]
) -> Level | None:
    """The best worst level any choice of the free devices gives the shape."""
    (resource,) = [r for r in shape if r != HCA]
    best: Level | None = None
    for gpus in itertools.combinations(sorted(free[resource]), shape[resource]):
        for hcas in itertools.combinations(sorted(free[HCA]), shape[HCA]):
            found = alignment(topology, gpus, hcas)
            if found is not None and (best is None or found[0] < best):
                best = found[0]
    return best


def _config(node: BuiltNode, base: Path, kubeconfig: Path, watch: bool) -> Config:
    return override(
        Config(),
        **{
            **node.settings(base),
            "metrics.enabled": False,
            "kubernetes.enabled": watch,
            "kubernetes.kubeconfig": str(kubeconfig),
            "kubernetes.node_name": "mig-node",
            "kubernetes.node_devices": False,
            "kubernetes.node_labels": False,
            "kubernetes.events": False,
            "resources.gpu.mig.strategy": "mixed",
        },
    )


def run(
    base: Path, cuts: tuple[tuple[str, ...], ...], seed: int, pods: int, watch: bool = True
) -> Tally:
    """One stream; `watch`: the daemon has the pod watch (else it works from
    the kubelet alone, and an HCA allocated first cannot know the profile)."""
    node = build_node(hgx_h100_mig(cuts), base / "node")
    api = ApiServerImitation()
    api.start()
    kubelet = KubeletSimulator(
        base / "dp", base / "pr" / "kubelet.sock", seed=seed, api=api, node_name="mig-node"
    )
    kubelet.start()
    kubeconfig = base / "kubeconfig"
    kubeconfig.write_text(json.dumps(api.kubeconfig()))
    Checkpoint(base / "checkpoint.json").save(LifecycleState())
    config = _config(node, base, kubeconfig, watch)
    daemon = build(config, FakeNvml.from_file(node.fixture))
    tally = Tally()
    try:
        daemon.start()
        resources = [GPU, ONE_G, TWO_G, THREE_G, HCA]
        expected = len(daemon.inventory.gpus) + len(daemon.inventory.hcas)
        kubelet.wait_for(
            lambda: sum(len(kubelet.devices(r)) for r in resources) == expected, timeout=10
        )
        cache = daemon.pods
        deadline = time.monotonic() + 10
        while cache is not None and not cache.current and time.monotonic() < deadline:
            time.sleep(0.01)
        topology = daemon.core.coordinator.topology
        rng = random.Random(seed)
        running: list[str] = []
        for n in range(pods):
            if running and rng.random() < 0.4:
                kubelet.remove(running.pop(rng.randrange(len(running))))
            shape = rng.choice(SHAPES)
            held = kubelet.allocated()
            free = {r: set(kubelet.devices(r)) - held.get(r, set()) for r in resources}
            if any(len(free[r]) < count for r, count in shape.items()):
                tally.skipped += 1
                continue
            best = best_level(topology, free, shape)
            name = f"pod-{n}"
            try:
                pod = kubelet.admit(name, [ContainerRequest("main", shape)])
            except AdmissionError:
                tally.skipped += 1
                continue
            running.append(name)
            got = pod.container("main")
            (resource,) = [r for r in shape if r != HCA]
            found = alignment(topology, got.devices[resource], got.devices[HCA])
            tally.containers += 1
            if found is not None and best is not None and found[0] <= best:
                tally.optimal += 1
    finally:
        daemon.stop()
        kubelet.stop()
        api.stop()
    return tally


def mig_bench(quick: bool = False) -> bool:
    seeds = SEEDS[:1] if quick else SEEDS
    pods = 30 if quick else PODS
    print(
        f"MIG alignment: HGX-H100 under the mixed strategy, {pods} pods per seed "
        f"({len(SHAPES)} shapes of MIG devices or whole GPUs with HCAs, random deletions), "
        "each container against every choice of the free devices"
    )
    print(
        f"{'layout':<10} {'seed':>4} {'daemon':<13} {'containers':>10} {'optimal':>8} {'share':>7}"
    )
    total, alone = Tally(), Tally()
    with tempfile.TemporaryDirectory(prefix="dpmig-", dir="/tmp") as scratch:
        for label, cuts in LAYOUTS.items():
            for seed in seeds:
                for watch, sum_into in ((True, total), (False, alone)):
                    tag = f"{label.replace(' ', '-')}-{seed}-{'w' if watch else 'k'}"
                    tally = run(Path(scratch) / tag, cuts, seed, pods, watch)
                    sum_into.containers += tally.containers
                    sum_into.optimal += tally.optimal
                    share = tally.optimal / tally.containers if tally.containers else 0.0
                    print(
                        f"{label:<10} {seed:>4} {'pod watch' if watch else 'kubelet only':<13} "
                        f"{tally.containers:>10} {tally.optimal:>8} {share:>7.1%}"
                    )
    met = total.containers > 0 and total.optimal == total.containers
    share = total.optimal / total.containers if total.containers else 0.0
    baseline = alone.optimal / alone.containers if alone.containers else 0.0
    print(
        f"== MIG: with the pod watch {share:.1%} of {total.containers} containers at the best "
        f"level any free choice gives (goal 100%), from the kubelet alone {baseline:.1%}: "
        + ("met" if met else "NOT met")
    )
    return met or quick


if __name__ == "__main__":
    import sys

    sys.exit(0 if mig_bench(quick="--quick" in sys.argv) else 1)
