"""The metrics the alerts read, on a running daemon: custody phases and the
oldest owed cleanup, containers below their pod's required alignment, the
Lease's age, and series at zero from the start."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from devplugin.cluster.required import shortfall
from devplugin.model import DeviceKind
from devplugin.node.alignment import ContainerAlignment
from devplugin.node.lifecycle.custody import Census, Custody, Phase, census
from devplugin.policy.pod_request import ALIGNMENT_ANNOTATION, POLICY_ANNOTATION
from devplugin.policy.topology import Level
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.kubelet import ContainerRequest
from devplugin.testing.node import hgx_node
from tests.conftest import GPU, HCA, Cluster
from tests.support import hook
from tests.waiting import wait_until

Start = Callable[..., Cluster]
GPU_KIND, HCA_KIND = DeviceKind.GPU, DeviceKind.HCA


def sample(cluster: Cluster, name: str, **labels: str) -> float | None:
    return cluster.daemon.core.metrics.registry.get_sample_value(name, labels)


def test_the_census_counts_every_phase_but_free_and_times_the_oldest_owed_cleanup() -> None:
    records = {
        (GPU_KIND, "g0"): Custody(phase=Phase.HELD, since=10.0),
        (GPU_KIND, "g1"): Custody(phase=Phase.QUARANTINED, since=40.0),
        (GPU_KIND, "g2"): Custody(phase=Phase.OWED, since=70.0),
        (HCA_KIND, "h0"): Custody(phase=Phase.CLEANING, since=90.0),
    }
    found: Census = census(records, frozenset({GPU_KIND, HCA_KIND}), now=100.0)
    assert found.phases[(GPU_KIND, Phase.HELD)] == 1
    assert found.phases[(GPU_KIND, Phase.QUARANTINED)] == 1
    assert found.phases[(GPU_KIND, Phase.OWED)] == 1
    assert found.phases[(HCA_KIND, Phase.CLEANING)] == 1
    assert found.phases[(HCA_KIND, Phase.QUARANTINED)] == 0
    assert (GPU_KIND, Phase.FREE) not in found.phases
    # Held devices owe nothing: the oldest owing GPU is the quarantined one.
    assert found.oldest_owing == {GPU_KIND: 60.0, HCA_KIND: 10.0}
    # A kind not served is left out.
    only_gpus = census(records, frozenset({GPU_KIND}), now=100.0)
    assert {kind for kind, _ in only_gpus.phases} == {GPU_KIND}
    assert only_gpus.oldest_owing == {GPU_KIND: 60.0}
    idle = census({}, frozenset({GPU_KIND}), now=5.0)
    assert idle.oldest_owing == {GPU_KIND: 0.0}
    assert set(idle.phases.values()) == {0}


def _container(worst: Level | None) -> ContainerAlignment:
    return ContainerAlignment("default", "p", "c", ("g",), ("h",), worst, None)


def test_only_a_required_level_that_was_missed_is_a_shortfall() -> None:
    required = {ALIGNMENT_ANNOTATION: "PIX", POLICY_ANNOTATION: "required"}
    assert shortfall(_container(Level.PHB), required) is Level.PIX
    assert shortfall(_container(Level.PIX), required) is None
    assert shortfall(_container(None), required) is None
    preferred = {ALIGNMENT_ANNOTATION: "PIX"}
    assert shortfall(_container(Level.SYS), preferred) is None
    assert shortfall(_container(Level.SYS), {}) is None
    broken = {ALIGNMENT_ANNOTATION: "FAST", POLICY_ANNOTATION: "required"}
    assert shortfall(_container(Level.SYS), broken) is None
    node = {ALIGNMENT_ANNOTATION: "NODE", POLICY_ANNOTATION: "required"}
    assert shortfall(_container(Level.SYS), node) is Level.NODE


def test_series_with_known_labels_are_zero_from_the_start(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node())
    assert sample(cluster, "devplugin_allocations_total", resource=GPU, result="refused") == 0
    assert (
        sample(cluster, "devplugin_hook_runs_total", resource=HCA, phase="cleanup", result="failed")
        == 0
    )
    assert sample(cluster, "devplugin_dra_claims_total", call="prepare", result="error") == 0
    assert sample(cluster, "devplugin_alignment_below_required_total", required="PIX") == 0
    assert sample(cluster, "devplugin_custody_devices", resource=GPU, phase="quarantined") == 0
    assert sample(cluster, "devplugin_cleanup_oldest_seconds", resource=HCA) == 0


def test_a_failing_cleanup_shows_as_quarantined_and_owed_for_longer_and_longer(
    start_cluster: Start, tmp_path: Path
) -> None:
    cluster = start_cluster(
        hgx_node(),
        **{
            "resources.gpu.hooks.cleanup": hook(tmp_path / "cleanup.log", "fail"),
            "lifecycle.cleanup_retry_initial_seconds": 30.0,
        },
    )
    kubelet = cluster.kubelet
    kubelet.admit("p", [ContainerRequest("c", {GPU: 2})])
    assert wait_until(
        lambda: sample(cluster, "devplugin_custody_devices", resource=GPU, phase="held") == 2
    )
    kubelet.remove("p")
    assert wait_until(
        lambda: sample(cluster, "devplugin_custody_devices", resource=GPU, phase="quarantined") == 2
    )
    assert sample(cluster, "devplugin_custody_devices", resource=GPU, phase="held") == 0
    first = sample(cluster, "devplugin_cleanup_oldest_seconds", resource=GPU)
    assert first is not None
    assert wait_until(
        lambda: (sample(cluster, "devplugin_cleanup_oldest_seconds", resource=GPU) or 0) > first
    )
    assert sample(cluster, "devplugin_cleanup_oldest_seconds", resource=HCA) == 0
    failed = sample(
        cluster, "devplugin_hook_runs_total", resource=GPU, phase="cleanup", result="failed"
    )
    assert failed == 2


def test_a_container_below_its_pods_required_level_is_counted_once(
    start_cluster: Start, api: ApiServerImitation
) -> None:
    cluster = start_cluster(hgx_node(), api=api)
    kubelet = cluster.kubelet
    required = {POLICY_ANNOTATION: "required"}
    # One GPU beside its own HCA: PIX, as required.
    kubelet.admit(
        "met", [ContainerRequest("c", {GPU: 1, HCA: 1})],
        annotations={ALIGNMENT_ANNOTATION: "PIX", **required},
    )  # fmt: skip
    # Two GPUs and one HCA cannot both sit beside it, but PIX is only
    # preferred; five GPUs and one HCA reach across sockets though PHB is
    # required.
    kubelet.admit(
        "preferred", [ContainerRequest("c", {GPU: 2, HCA: 1})],
        annotations={ALIGNMENT_ANNOTATION: "PIX"},
    )  # fmt: skip
    kubelet.admit(
        "short", [ContainerRequest("c", {GPU: 5, HCA: 1})],
        annotations={ALIGNMENT_ANNOTATION: "PHB", **required},
    )  # fmt: skip
    assert wait_until(
        lambda: sample(cluster, "devplugin_alignment_below_required_total", required="PHB") == 1
    )
    # Later polls see the same holders: counted once.
    monitor = cluster.daemon.core.monitor
    seen = monitor.polls
    assert wait_until(lambda: monitor.polls >= seen + 3)
    assert sample(cluster, "devplugin_alignment_below_required_total", required="PIX") == 0
    assert sample(cluster, "devplugin_alignment_below_required_total", required="PHB") == 1


def test_the_lease_age_stays_below_its_renewal_interval(
    start_cluster: Start, api: ApiServerImitation
) -> None:
    cluster = start_cluster(hgx_node(), api=api, **{"kubernetes.lease_renew_seconds": 0.5})
    assert wait_until(lambda: bool(api.items("leases")))
    age = sample(cluster, "devplugin_lease_age_seconds")
    assert age is not None
    assert age < 5.0
    # What the alert holds the age to: the duration each renewal promises.
    assert sample(cluster, "devplugin_lease_duration_seconds") == 40
