"""Releases confirmed by the pod watch: with API access, a device is cleaned
only once PodResources stops listing it and its pod is gone or finished."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from devplugin.model import DeviceKind
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.kubelet import ContainerRequest, KubeletSimulator
from devplugin.testing.node import hgx_node
from tests.conftest import GPU, HCA, Cluster
from tests.support import hook, runs
from tests.waiting import wait_until

Start = Callable[..., Cluster]
# Quick PodResources polls: these tests count polls.
QUICK = {"pod_resources.poll_interval_seconds": 0.1, "pod_resources.min_interval_seconds": 0.05}


def hca_cleaning(
    start_cluster: Start, api: ApiServerImitation, tmp_path: Path
) -> tuple[Cluster, Path]:
    """A node watching the API imitation, with an HCA cleanup hook that logs its runs."""
    log = tmp_path / "cleanup.log"
    settings = {"resources.hca.hooks.cleanup": hook(log, "ok"), **QUICK}
    return start_cluster(hgx_node(), api=api, **settings), log


def polls_pass(cluster: Cluster, count: int) -> None:
    monitor = cluster.daemon.core.monitor
    target = monitor.polls + count
    assert wait_until(lambda: (monitor.poke() or True) and monitor.polls >= target, timeout=10)


def admit_init_and_main(kubelet: KubeletSimulator) -> set[str]:
    """Pod "p": an init container with two HCAs, then a main one with two
    GPUs. The init container's HCAs."""
    pod = kubelet.admit(
        "p",
        [
            ContainerRequest("prep", {HCA: 2}, init=True),
            ContainerRequest("main", {GPU: 2}),
        ],
    )
    return set(pod.container("prep").devices[HCA])


def held_until_the_pod_ends(cluster: Cluster, log: Path, prep_hcas: set[str]) -> None:
    """The init container's HCAs are not cleaned through several polls that
    do not list them, and are cleaned, exactly they, once pod "p" ends."""
    polls_pass(cluster, 6)
    assert runs(log) == []
    assert prep_hcas <= cluster.daemon.core.lifecycle.book.in_use(DeviceKind.HCA)
    cluster.kubelet.remove("p")
    assert wait_until(lambda: len(runs(log)) == 2, timeout=10)
    assert {r["env"]["DEVPLUGIN_DEVICE_IDS"] for r in runs(log)} == prep_hcas


def test_briefly_empty_pod_resources_never_cleans_a_running_pods_devices(
    start_cluster: Start, api: ApiServerImitation, tmp_path: Path
) -> None:
    log = tmp_path / "cleanup.log"
    settings = {"resources.gpu.hooks.cleanup": hook(log, "ok"), **QUICK}
    cluster = start_cluster(hgx_node(), api=api, **settings)
    kubelet = cluster.kubelet
    pod = kubelet.admit("train", [ContainerRequest("main", {GPU: 8})])
    gpus = set(pod.container("main").devices[GPU])
    cleanup = cluster.daemon.core.lifecycle.book
    assert wait_until(lambda: cleanup.in_use(DeviceKind.GPU) == gpus)
    polls_pass(cluster, 2)  # PodResources has shown the pod holding them
    kubelet.blank_pod_resources = True
    polls_pass(cluster, 10)  # far more than the 2 confirmations
    assert runs(log) == []
    assert cleanup.in_use(DeviceKind.GPU) == gpus
    assert cleanup.pending() == {}
    assert all(d.health == "Healthy" for d in kubelet.devices(GPU).values())
    # The pod ends (deleted from the API) while PodResources is still blank:
    # now the release is real and each device is cleaned once.
    kubelet.remove("train")
    assert wait_until(lambda: len(runs(log)) == 8, timeout=10)
    kubelet.blank_pod_resources = False
    assert kubelet.wait_for(
        lambda: all(d.health == "Healthy" for d in kubelet.devices(GPU).values()), timeout=10
    )
    assert sorted(r["env"]["DEVPLUGIN_DEVICE_IDS"] for r in runs(log)) == sorted(
        cluster.daemon.servicer(GPU).resource.physical(sorted(gpus))
    )


def test_a_finished_pod_releases_its_devices_while_its_object_remains(
    start_cluster: Start, api: ApiServerImitation, tmp_path: Path
) -> None:
    cluster, log = hca_cleaning(start_cluster, api, tmp_path)
    kubelet = cluster.kubelet
    pod = kubelet.admit("job", [ContainerRequest("main", {GPU: 1, HCA: 2})])
    hcas = set(pod.container("main").devices[HCA])
    polls_pass(cluster, 2)
    kubelet.finish("job")
    assert wait_until(lambda: len(runs(log)) == 2, timeout=10)
    assert {r["env"]["DEVPLUGIN_DEVICE_IDS"] for r in runs(log)} == hcas
    pod_object = api.get("pods", "job", "default")
    assert pod_object is not None
    assert pod_object["status"]["phase"] == "Succeeded"


def test_an_init_containers_devices_stay_the_pods_until_it_ends(
    start_cluster: Start, api: ApiServerImitation, tmp_path: Path
) -> None:
    # PodResources never lists a finished init container, but the kubelet
    # keeps its devices for the pod: they must not be cleaned under it.
    cluster, log = hca_cleaning(start_cluster, api, tmp_path)
    prep_hcas = admit_init_and_main(cluster.kubelet)
    held_until_the_pod_ends(cluster, log, prep_hcas)


def test_an_init_containers_devices_stay_the_pods_even_when_the_watch_lagged_its_allocate(
    start_cluster: Start, api: ApiServerImitation, tmp_path: Path
) -> None:
    # The pod reaches the watch only after the kubelet allocated for it, so the
    # daemon could not name the init container's pod: PodResources' silence
    # about those HCAs still proves nothing while a live pod's init container
    # asks for HCAs.
    cluster, log = hca_cleaning(start_cluster, api, tmp_path)
    pods = cluster.daemon.pods
    assert pods is not None
    assert wait_until(lambda: pods.current)
    api.hold_watches()
    prep_hcas = admit_init_and_main(cluster.kubelet)
    assert not any(p.name == "p" for p in pods.pods().values())
    api.release_watches()
    assert wait_until(lambda: any(p.name == "p" for p in pods.pods().values()))
    held_until_the_pod_ends(cluster, log, prep_hcas)


def test_a_sidecar_holds_its_devices_and_app_containers_reuse_an_init_containers(
    start_cluster: Start, api: ApiServerImitation
) -> None:
    cluster = start_cluster(hgx_node(), api=api)
    pod = cluster.kubelet.admit(
        "p",
        [
            ContainerRequest("side", {HCA: 1}, init=True, sidecar=True),
            ContainerRequest("prep", {GPU: 2}, init=True),
            ContainerRequest("main", {GPU: 4, HCA: 1}),
        ],
    )
    side, prep, main = (pod.container(n).devices for n in ("side", "prep", "main"))
    # The kubelet reuses the init container's GPUs; the sidecar's HCA is not reused.
    assert set(prep[GPU]) <= set(main[GPU])
    assert not set(side[HCA]) & set(main[HCA])
    # The app container's extra GPUs were asked with the reused ones as must-include.
    gpu_calls = [c for c in cluster.kubelet.preferred_calls if c.resource == GPU]
    assert gpu_calls[-1].must_include == tuple(sorted(prep[GPU]))
    assert gpu_calls[-1].size == 4


def test_without_the_pod_watch_released_devices_wait_and_come_back_after(
    start_cluster: Start, api: ApiServerImitation, tmp_path: Path
) -> None:
    # The API server is down when the pod ends: nothing is released on
    # PodResources' word alone; once the watch lists again, it is.
    cluster, log = hca_cleaning(start_cluster, api, tmp_path)
    kubelet = cluster.kubelet
    kubelet.admit("p", [ContainerRequest("main", {HCA: 1})])
    polls_pass(cluster, 2)
    pods = cluster.daemon.pods
    assert pods is not None
    api.fail_next(10_000, code=500)
    api.cut_watches()
    assert wait_until(lambda: not pods.current, timeout=10)
    kubelet.remove("p")
    polls_pass(cluster, 6)
    assert runs(log) == []
    api.clear_failures()
    assert wait_until(lambda: len(runs(log)) == 1, timeout=15)
