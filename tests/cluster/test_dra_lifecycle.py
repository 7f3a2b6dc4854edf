"""The DRA front-end across restarts and changes: a kubelet that restarts
(or wipes its directories), a daemon killed mid-prepare, hotplug and
health in the slices within one scan, and pools over the per-slice limit."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import yaml

from devplugin.node.lifecycle.checkpoint import Checkpoint, LifecycleState
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.dra_kubelet import DraKubeletSimulator
from devplugin.testing.dra_limits import slice_problems
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.node import BuiltNode, build_node, hgx_node, replug, unplug_hca
from tests.dra_support import DRIVER, NODE, DraCluster, pix_pair, published, start_dra
from tests.support import hook, runs, spawn
from tests.waiting import wait_until

__all__ = ["start_dra"]

Start = Callable[..., DraCluster]
# Only the scan the test asks for may notice a change.
RARE = {"health.interval_seconds": 120.0, "discovery.rescan_interval_seconds": 120.0}


def test_a_kubelet_restart_reregisters_and_the_wiped_slices_come_back(
    start_dra: Start, tmp_path: Path
) -> None:
    log = tmp_path / "init.log"
    cluster = start_dra(hgx_node(), **{"resources.gpu.hooks.init": hook(log, "ok")})
    assert wait_until(lambda: published(cluster, 16), timeout=10)
    gpu, _ = pix_pair(cluster)
    claim = cluster.claim("c", [("gpu", gpu)])
    first = cluster.prepare(claim)
    assert first[claim.uid]["error"] == ""
    # A restart that keeps the directories: the kubelet deletes the node's
    # slices as it starts and finds the sockets again.
    cluster.kubelet.restart()
    assert cluster.kubelet.wait_for(lambda: cluster.kubelet.registered(DRIVER), timeout=10)
    assert wait_until(lambda: published(cluster, 16), timeout=10)
    assert cluster.prepare(claim) == first  # the claim survived, init did not run again
    # A restart that wipes the registry: new sockets, registered again.
    starts = cluster.daemon.dra.plugin.registrar.starts  # type: ignore[union-attr]
    cluster.kubelet.restart(wipe=True)
    assert cluster.kubelet.wait_for(lambda: cluster.kubelet.registered(DRIVER), timeout=10)
    assert cluster.daemon.dra.plugin.registrar.starts == starts + 1  # type: ignore[union-attr]
    assert cluster.prepare(claim) == first
    assert len(runs(log)) == 1
    assert cluster.kubelet.wait_for(lambda: len(cluster.kubelet.health(DRIVER)) == 16, timeout=10)
    # The health stream was opened again by the new kubelet.
    assert cluster.daemon.dra.plugin.health.streams >= 1  # type: ignore[union-attr]
    # And a wiped DRA socket is served again (the kubelet dropped the endpoint).
    service = cluster.plugins_dir / DRIVER / "dra.sock"
    service.unlink()
    assert wait_until(service.exists, timeout=10)
    assert cluster.kubelet.wait_for(lambda: cluster.kubelet.registered(DRIVER), timeout=10)
    assert wait_until(lambda: _answers(cluster, claim, first), timeout=10)


def _answers(cluster: DraCluster, claim: Any, expected: Any) -> bool:
    # The kubelet may drop the endpoint (and register it again) after the
    # wait above saw the old registration: not registered yet is not an answer.
    try:
        return cluster.prepare(claim) == expected
    except (grpc.RpcError, KeyError):
        return False


def test_slices_are_written_only_when_something_changed(start_dra: Start) -> None:
    cluster = start_dra(hgx_node(), **{"health.interval_seconds": 0.05})
    assert wait_until(lambda: published(cluster, 16), timeout=10)
    publisher = cluster.daemon.dra.publisher  # type: ignore[union-attr]
    # Settled: what the API holds is what it wants, and no write is in flight.
    assert wait_until(publisher.current, timeout=10)  # type: ignore[union-attr]
    version = cluster.slices()[0]["metadata"]["resourceVersion"]
    writes, checks = publisher.writes, cluster.daemon.checks  # type: ignore[union-attr]
    assert wait_until(lambda: cluster.daemon.checks >= checks + 10, timeout=30)
    assert publisher.writes == writes  # type: ignore[union-attr]
    assert cluster.slices()[0]["metadata"]["resourceVersion"] == version


def test_a_port_going_down_is_tainted_after_one_scan_and_untainted_after_the_next(
    start_dra: Start,
) -> None:
    cluster = start_dra(hgx_node(), **RARE)
    assert wait_until(lambda: published(cluster, 16), timeout=10)
    hca = cluster.node.hcas[2]
    name = "hca-" + str(hca.address).replace(":", "-").replace(".", "-")
    state = hca.directory / "infiniband" / hca.name / "ports" / "1" / "state"
    state.write_text("1: DOWN\n")
    checks = cluster.daemon.checks
    cluster.daemon.rescan()
    assert wait_until(lambda: "taints" in cluster.devices()[name], timeout=10)
    assert cluster.daemon.checks == checks + 1
    entry = cluster.devices()[name]
    assert entry["attributes"]["portState"] == {"string": "DOWN"}
    assert entry["taints"][0]["value"] == "unhealthy"
    # The kubelet hears it on the health stream, with the reason.
    key = f"{NODE}/{name}"
    assert cluster.kubelet.wait_for(
        lambda: cluster.kubelet.health(DRIVER).get(key, (0, ""))[0] == 2, timeout=10
    )
    assert "DOWN" in cluster.kubelet.health(DRIVER)[key][1]
    others = {k: v for k, v in cluster.kubelet.health(DRIVER).items() if k != key}
    assert len(others) == 15
    assert all(status == 1 for status, _ in others.values())
    state.write_text("4: ACTIVE\n")
    cluster.daemon.rescan()
    assert wait_until(lambda: "taints" not in cluster.devices()[name], timeout=10)
    assert cluster.kubelet.wait_for(
        lambda: cluster.kubelet.health(DRIVER).get(key, (0, ""))[0] == 1, timeout=10
    )
    generations = {s["spec"]["pool"]["generation"] for s in cluster.slices()}
    assert generations == {3}


def test_hotplug_shows_in_the_slice_within_one_scan(start_dra: Start, tmp_path: Path) -> None:
    cluster = start_dra(hgx_node(), **RARE, **{"hotplug.udev": False})
    assert wait_until(lambda: published(cluster, 16), timeout=10)
    hca = cluster.node.hca("mlx5_5")
    name = "hca-" + str(hca.address).replace(":", "-").replace(".", "-")
    unplugged = unplug_hca(cluster.node, "mlx5_5", tmp_path / "stash")
    cluster.daemon.rescan()
    assert wait_until(
        lambda: name not in cluster.devices() and len(cluster.devices()) == 15, timeout=10
    )
    replug(unplugged)
    cluster.daemon.rescan()
    assert wait_until(lambda: published(cluster, 16), timeout=10)


def test_the_remove_switch_leaves_unhealthy_devices_out(start_dra: Start) -> None:
    cluster = start_dra(hgx_node(), **RARE, **{"dra.unhealthy": "remove"})
    assert wait_until(lambda: published(cluster, 16), timeout=10)
    hca = cluster.node.hcas[0]
    (hca.directory / "infiniband" / hca.name / "ports" / "1" / "state").write_text("1: DOWN\n")
    cluster.daemon.rescan()
    assert wait_until(lambda: len(cluster.devices()) == 15, timeout=10)
    assert all("taints" not in d for d in cluster.devices().values())


def test_a_large_pool_is_split_within_the_limits(start_dra: Start) -> None:
    cluster = start_dra(LAYOUTS["64-gpu-bridged"]())
    total = len(cluster.node.gpus) + len(cluster.node.hcas)
    assert total == 96
    assert wait_until(lambda: len(cluster.devices()) == total, timeout=20)
    slices = cluster.slices()
    assert len(slices) == 2  # 64 per slice: devices may carry taints
    for item in slices:
        assert slice_problems(item) == []
        assert item["spec"]["pool"]["resourceSliceCount"] == 2
    assert len({item["spec"]["pool"]["generation"] for item in slices}) == 1
    names = [d["name"] for item in slices for d in item["spec"]["devices"]]
    assert len(set(names)) == total


def _gated_init_config(
    tmp_path: Path, sock_dir: Path, node: BuiltNode, kubeconfig: Path, checkpoint: Path
) -> tuple[Path, Path, Path, Path]:
    """A DRA daemon's config whose GPU init hook waits for a gate file: the
    config file, the init and cleanup logs, the gate."""
    init_log, cleanup_log, gate = tmp_path / "init.log", tmp_path / "cleanup.log", tmp_path / "gate"
    config: dict[str, Any] = node.run_config(sock_dir, checkpoint)
    config["paths"].update(
        kubelet_plugins_dir=str(sock_dir / "plugins"),
        kubelet_registry_dir=str(sock_dir / "registry"),
    )
    config.update(
        kubernetes={"enabled": True, "kubeconfig": str(kubeconfig), "node_name": NODE},
        cdi={"spec_dirs": [str(tmp_path / "etc-cdi"), str(tmp_path / "run-cdi")]},
        kubelet={"watch_interval_seconds": 0.05},
        resources={
            "gpu": {
                "api": "dra",
                "hooks": {
                    "init": hook(init_log, f"wait:{gate}"),
                    "cleanup": hook(cleanup_log, "ok"),
                },
            },
            "hca": {"api": "dra", "hooks": {"cleanup": hook(cleanup_log, "ok")}},
        },
    )
    path = tmp_path / "devplugin.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, init_log, cleanup_log, gate


def test_a_daemon_killed_mid_prepare_rolls_back_and_the_retry_redoes_it(
    tmp_path: Path, sock_dir: Path, api: ApiServerImitation
) -> None:
    node = build_node(hgx_node(), tmp_path / "node")
    api.put("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(api.kubeconfig()))
    checkpoint = tmp_path / "state" / "checkpoint.json"
    Checkpoint(checkpoint).save(LifecycleState())
    path, init_log, cleanup_log, gate = _gated_init_config(
        tmp_path, sock_dir, node, kubeconfig, checkpoint
    )
    kubelet = DraKubeletSimulator(sock_dir / "registry", node=NODE, api=api)
    kubelet.start()
    first = spawn(path)
    second: subprocess.Popen[str] | None = None
    try:
        assert kubelet.wait_for(lambda: kubelet.registered(DRIVER), timeout=30)
        cluster = DraCluster(
            node,
            api,
            kubelet,
            None,
            None,
            tmp_path / "run-cdi",  # type: ignore[arg-type]
            sock_dir / "plugins",
            sock_dir / "registry",
            checkpoint,
        )
        assert wait_until(lambda: published(cluster, 16), timeout=20)
        gpu, hca = pix_pair(cluster)
        claim = cluster.claim("c", [("gpu", gpu), ("hca", hca)])
        lost: list[BaseException] = []

        def call() -> None:
            try:
                cluster.prepare(claim)
            except grpc.RpcError as exc:
                lost.append(exc)

        caller = threading.Thread(target=call)
        caller.start()

        def started() -> bool:
            try:
                claims = json.loads(checkpoint.read_text()).get("claims", [])
            except (OSError, ValueError):
                return False
            return [c["state"] for c in claims] == ["started"] and len(runs(init_log)) == 1

        assert wait_until(started, timeout=20)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        caller.join(timeout=60)
        assert len(lost) == 1  # the kubelet got no answer
        gate.touch()  # a new init would pass at once
        second = spawn(path)
        # Rolled back at start: the init that half ran is followed by a cleanup
        # of both devices (the killed hook itself was killed too).
        assert wait_until(lambda: len(runs(cleanup_log)) == 2, timeout=30)
        cleaned = {r["env"]["DEVPLUGIN_DEVICE_IDS"] for r in runs(cleanup_log)}
        assert cleaned == {
            cluster.attribute(gpu, "uuid"),
            cluster.attribute(hca, "resource.kubernetes.io/pciBusID"),
        }
        assert not (tmp_path / "run-cdi" / f"k8s.{DRIVER}-claim_{claim.uid}.json").exists()
        assert kubelet.wait_for(lambda: kubelet.registered(DRIVER), timeout=30)
        # The kubelet asks again: the prepare is redone, init runs once more.
        answer = wait_until(lambda: _prepared(cluster, claim), timeout=30)
        assert answer
        assert len(runs(init_log)) == 2
        assert runs(init_log)[1]["start"] > max(r["start"] for r in runs(cleanup_log))
        saved = json.loads(checkpoint.read_text())
        assert [c["state"] for c in saved["claims"]] == ["completed"]
        assert len(runs(cleanup_log)) == 2
    finally:
        gate.touch()
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=20)
        kubelet.stop()


def _prepared(cluster: DraCluster, claim: Any) -> bool:
    try:
        return cluster.prepare(claim)[claim.uid]["error"] == ""
    except grpc.RpcError:
        return False
    except KeyError:
        # The kubelet has the driver unregistered for a moment: the killed
        # daemon's registration was still listed, and its replacement is
        # only now seen as a new plugin. A real kubelet's call fails then too.
        return False


def test_what_the_server_fills_in_is_no_reason_to_write_again(start_dra: Start) -> None:
    # GPUs of 80 GiB: stored as "80Gi"; a port down: its taint gets a timeAdded.
    cluster = start_dra(hgx_node(), **{"health.interval_seconds": 0.05})
    assert wait_until(lambda: published(cluster, 16), timeout=10)
    hca = cluster.node.hcas[1]
    (hca.directory / "infiniband" / hca.name / "ports" / "1" / "state").write_text("1: DOWN\n")
    name = "hca-" + str(hca.address).replace(":", "-").replace(".", "-")
    assert wait_until(lambda: "taints" in cluster.devices()[name], timeout=10)
    assert "timeAdded" in cluster.devices()[name]["taints"][0]
    publisher = cluster.daemon.dra.publisher  # type: ignore[union-attr]
    assert wait_until(publisher.current, timeout=10)  # type: ignore[union-attr]
    writes, checks = publisher.writes, cluster.daemon.checks  # type: ignore[union-attr]
    assert wait_until(lambda: cluster.daemon.checks >= checks + 10, timeout=30)
    assert publisher.writes == writes  # type: ignore[union-attr]


def test_a_slice_is_created_once_even_when_the_watch_lags_behind_the_create(
    start_dra: Start, api: ApiServerImitation
) -> None:
    # The watch shows nothing new from before the first slice is created
    # until a moment after a second change (scans milliseconds apart).
    api.hold_watches()
    cluster = start_dra(hgx_node(), **RARE)
    assert wait_until(lambda: len(cluster.devices()) == 16, timeout=10)
    hca = cluster.node.hcas[3]
    (hca.directory / "infiniband" / hca.name / "ports" / "1" / "state").write_text("1: DOWN\n")
    cluster.daemon.rescan()
    threading.Timer(0.5, api.release_watches).start()
    name = "hca-" + str(hca.address).replace(":", "-").replace(".", "-")
    assert wait_until(lambda: "taints" in cluster.devices().get(name, {}), timeout=20)
    creates = [path for method, path in api.requests
               if method == "POST" and "/resourceslices" in path]  # fmt: skip
    assert len(creates) == 1  # never a second slice for the same devices
    assert len(cluster.slices()) == 1
    assert cluster.slices()[0]["spec"]["pool"]["generation"] == 2
