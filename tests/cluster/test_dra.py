"""The DRA front-end over real gRPC and real HTTP: registration, slices,
prepare and unprepare with their hooks, CDI specs and checkpoint."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from devplugin.frontends.dra.slices import FREE_GPUS, FREE_HCAS
from devplugin.policy.cdi import validate_spec
from devplugin.policy.claim_templates import Shape, claim_spec, device_classes
from devplugin.policy.topology import Level, Topology
from devplugin.testing.cdi import CdiRuntime
from devplugin.testing.dra_kubelet import ClaimCall
from devplugin.testing.dra_limits import slice_problems
from devplugin.testing.dra_scheduler import Allocator, taken_devices
from devplugin.testing.kubelet import ContainerRequest, KubeletSimulator
from devplugin.testing.node import hgx_node
from tests.dra_support import DRIVER, NODE, DraCluster, pix_pair, published, start_dra
from tests.support import hook, runs
from tests.waiting import wait_until

__all__ = ["start_dra"]

Start = Callable[..., DraCluster]


def test_the_driver_registers_and_publishes_one_valid_pool(start_dra: Start) -> None:
    cluster = start_dra(hgx_node())
    record = cluster.kubelet.plugin(DRIVER)
    assert record.endpoint == str(cluster.plugins_dir / DRIVER / "dra.sock")
    assert record.versions == ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth")
    assert (cluster.registry_dir / f"{DRIVER}-reg.sock").exists()
    assert wait_until(lambda: published(cluster, 16), timeout=10)
    slices = cluster.slices()
    assert len(slices) == 1
    (only,) = slices
    assert slice_problems(only) == []
    assert only["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    owner = only["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("Node", NODE, True)
    assert owner["uid"] == cluster.api.get("nodes", NODE)["metadata"]["uid"]  # type: ignore[index]
    gpu = cluster.node.gpus[0]
    name = "gpu-" + str(gpu.address).replace(":", "-").replace(".", "-")
    entry = cluster.devices()[name]
    attributes = {key: next(iter(value.values())) for key, value in entry["attributes"].items()}
    assert attributes["type"] == "gpu"
    assert attributes["uuid"] == gpu.uuid
    assert attributes["resource.kubernetes.io/pciBusID"] == str(gpu.address)
    assert attributes["resource.kubernetes.io/pcieRoot"].startswith("pci")
    assert isinstance(attributes["numaNode"], int)
    # Kubernetes reserves its domain: of it, only what upstream defines
    # (dynamic-resource-allocation deviceattribute: pcieRoot, pciBusID).
    for device in cluster.devices().values():
        standard = {k for k in device["attributes"] if k.startswith("resource.kubernetes.io/")}
        assert standard <= {"resource.kubernetes.io/pcieRoot", "resource.kubernetes.io/pciBusID"}
    assert attributes["nvlinkDomain"].startswith("nvl-")
    assert entry["capacity"]["memory"]["value"].endswith("Mi")

    # The node's NodeDevices record says the driver is registered.
    def condition() -> dict[str, Any]:
        record = cluster.api.get("nodedevices", NODE) or {}
        found = [c for c in (record.get("status") or {}).get("conditions", [])
                 if c["type"] == "Registered"]  # fmt: skip
        return found[0] if found else {}

    assert wait_until(lambda: condition().get("status") == "True", timeout=40)
    assert condition()["message"] == f"registered: DRA driver {DRIVER}"
    hca = next(d for n, d in cluster.devices().items() if n.startswith("hca-"))
    assert {"ibdev", "netdev", "linkLayer", "portState", "pcieSwitch"} <= set(hca["attributes"])
    assert hca["attributes"]["portState"] == {"string": "ACTIVE"}


def test_switch_attributes_say_exactly_the_pcie_levels(start_dra: Start) -> None:
    cluster = start_dra(hgx_node())
    assert wait_until(lambda: published(cluster, 16), timeout=10)
    topology = Topology.from_inventory(cluster.daemon.inventory)
    ids = {}
    for name, entry in cluster.devices().items():
        attributes = entry["attributes"]
        ids[name] = attributes[
            "uuid" if name.startswith("gpu-") else "resource.kubernetes.io/pciBusID"
        ]
    names = sorted(ids)
    checked = 0
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            level = topology.level(ids[first]["string"], ids[second]["string"])
            same_switch = cluster.attribute(first, "pcieSwitch") == cluster.attribute(
                second, "pcieSwitch"
            )
            same_top = cluster.attribute(first, "pcieTopSwitch") == cluster.attribute(
                second, "pcieTopSwitch"
            )
            assert same_switch == (level is Level.PIX), (first, second, level)
            assert same_top == (level <= Level.PXB), (first, second, level)
            checked += 1
    assert checked == 16 * 15 // 2


def test_prepare_runs_init_once_writes_the_claims_cdi_spec_and_answers_again(
    start_dra: Start, tmp_path: Path
) -> None:
    log = tmp_path / "init.log"
    cluster = start_dra(
        hgx_node(),
        **{
            "resources.gpu.hooks.init": hook(log, "ok"),
            "resources.hca.hooks.init": hook(log, "ok"),
        },
    )
    assert wait_until(lambda: published(cluster, 16), timeout=10)
    gpu, hca = pix_pair(cluster)
    claim = cluster.claim("pair", [("gpu", gpu), ("hca/ib", hca)])
    answer = cluster.prepare(claim)
    assert answer[claim.uid]["error"] == ""
    devices = {d["device"]: d for d in answer[claim.uid]["devices"]}
    assert set(devices) == {gpu, hca}
    assert devices[gpu]["requests"] == ["gpu"]
    assert devices[hca]["requests"] == ["hca"]  # the subrequest is not the kubelet's business
    kind = f"k8s.{DRIVER}/claim"
    # Its own nodes, then its request's variables.
    assert devices[gpu]["cdi"] == [f"{kind}={claim.uid}-{gpu}", f"{kind}={claim.uid}-request-gpu"]
    assert devices[hca]["cdi"] == [f"{kind}={claim.uid}-{hca}", f"{kind}={claim.uid}-request-hca"]
    spec_file = cluster.cdi_dir / f"k8s.{DRIVER}-claim_{claim.uid}.json"
    document = json.loads(spec_file.read_text())
    spec = validate_spec(document)
    assert spec.kind == kind
    assert "containerEdits" not in document  # nothing spec-wide
    nodes = {
        d["name"]: [n["path"] for n in d["containerEdits"].get("deviceNodes", [])]
        for d in document["devices"]
    }
    gpu_info = next(g for g in cluster.node.gpus if g.uuid == cluster.attribute(gpu, "uuid"))
    assert nodes[f"{claim.uid}-{gpu}"][0] == f"/dev/nvidia{gpu_info.minor}"
    assert "/dev/nvidiactl" in nodes[f"{claim.uid}-{gpu}"]
    assert any(path.startswith("/dev/infiniband/uverbs") for path in nodes[f"{claim.uid}-{hca}"])
    runtime = CdiRuntime([cluster.cdi_dir], host_dev=cluster.node.dev_root)
    env = runtime.resolve(devices[gpu]["cdi"] + devices[hca]["cdi"]).environment()
    assert env["NVIDIA_VISIBLE_DEVICES"] == gpu_info.uuid
    assert env["NCCL_IB_HCA"] == "=" + cluster.attribute(hca, "ibdev")
    inits = runs(log)
    assert sorted(r["env"]["DEVPLUGIN_HOOK"] for r in inits) == ["init", "init"]
    # Asked again (the kubelet retries after a lost answer): the same answer, no hook.
    again = cluster.prepare(claim)
    assert again == answer
    assert len(runs(log)) == 2
    sample = cluster.daemon.core.metrics.registry.get_sample_value
    assert sample("devplugin_dra_claims_total", {"call": "prepare", "result": "ok"}) == 1
    assert sample("devplugin_dra_claims_total", {"call": "prepare", "result": "again"}) == 1
    assert sample("devplugin_dra_prepare_seconds_count", {}) == 1
    assert sample("devplugin_dra_prepared_claims", {}) == 1
    assert (sample("devplugin_resource_slice_writes_total", {"result": "ok"}) or 0) >= 1
    saved = json.loads(cluster.checkpoint.read_text())
    (record,) = saved["claims"]
    assert (record["uid"], record["state"]) == (claim.uid, "completed")


def test_a_device_prepared_for_another_claim_is_refused(start_dra: Start) -> None:
    cluster = start_dra(hgx_node())
    assert wait_until(lambda: published(cluster, 16), timeout=10)
    gpu, hca = pix_pair(cluster)
    first = cluster.claim("first", [("gpu", gpu)])
    second = cluster.claim("second", [("gpu", gpu), ("hca", hca)])
    assert cluster.prepare(first)[first.uid]["error"] == ""
    answer = cluster.prepare(second)
    assert answer[second.uid]["error"] == f"device {gpu} is prepared for claim {first.uid}"
    assert answer[second.uid]["devices"] == []
    # Nothing of the refused claim stuck: its HCA is free for a third.
    third = cluster.claim("third", [("hca", hca)])
    assert cluster.prepare(third)[third.uid]["error"] == ""


def test_admin_access_sees_a_device_another_claim_holds_and_owes_no_cleanup(
    start_dra: Start, tmp_path: Path
) -> None:
    """The scheduler allocates adminAccess requests devices in use and counts
    them as held by no one (issue 39, difference 3): prepare gives the
    container the device, takes no custody, runs no hook and owes no
    cleanup; the holder's claim is untouched."""
    from devplugin.testing.dra_scheduler import put_claim

    log = tmp_path / "hooks.log"
    cluster = start_dra(
        hgx_node(),
        **{
            "resources.gpu.hooks.cleanup": hook(log, "ok"),
            "resources.gpu.hooks.init": hook(log, "ok"),
        },
    )
    assert wait_until(lambda: published(cluster, 16), timeout=10)
    gpu, _ = pix_pair(cluster)
    first = cluster.claim("first", [("gpu", gpu)])
    assert cluster.prepare(first)[first.uid]["error"] == ""
    assert [r["env"]["DEVPLUGIN_HOOK"] for r in runs(log)] == ["init"]
    result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": gpu, "adminAccess": True}
    spec = {"devices": {"requests": [
        {"name": "gpu", "exactly": {"deviceClassName": "x", "adminAccess": True}}]}}  # fmt: skip
    created = put_claim(cluster.api, "watch", spec, results=[result])
    watch = type(first)("default", created["metadata"]["uid"], "watch")
    answer = cluster.prepare(watch)[watch.uid]
    assert answer["error"] == ""
    (device,) = answer["devices"]
    assert device["device"] == gpu
    assert device["cdi"]
    spec_file = cluster.cdi_dir / f"k8s.{DRIVER}-claim_{watch.uid}.json"
    assert spec_file.exists()
    assert len(runs(log)) == 1  # no init on a device someone else uses
    # Unprepared: no cleanup owed, the holder keeps the device.
    assert cluster.unprepare(watch) == {watch.uid: ""}
    third = cluster.claim("third", [("gpu", gpu)])
    refused = cluster.prepare(third)[third.uid]["error"]
    assert refused == f"device {gpu} is prepared for claim {first.uid}"
    assert len(runs(log)) == 1
    assert "taints" not in cluster.devices()[gpu]
    # The holder's release is the one that owes the cleanup.
    assert cluster.unprepare(first) == {first.uid: ""}
    assert wait_until(lambda: len(runs(log)) == 2, timeout=10)
    assert runs(log)[-1]["env"]["DEVPLUGIN_HOOK"] == "cleanup"


def test_bad_claims_are_that_claims_error(start_dra: Start) -> None:
    cluster = start_dra(hgx_node())
    assert wait_until(lambda: published(cluster, 16), timeout=10)
    gpu, _ = pix_pair(cluster)
    good = cluster.claim("good", [("gpu", gpu)])
    replaced = cluster.claim("replaced", [("gpu", gpu)])
    stale = type(replaced)(replaced.namespace, "not-its-uid", replaced.name)
    missing = type(replaced)("default", "uid-x", "missing")
    unknown = cluster.claim("unknown", [("gpu", "gpu-ffff-ff-ff-7")])
    answer = cluster.prepare(good, stale, missing, unknown)
    assert answer[good.uid]["error"] == ""
    assert "was replaced" in answer["not-its-uid"]["error"]
    assert answer["uid-x"]["error"] == "ResourceClaim default/missing not found"
    assert answer[unknown.uid]["error"] == "device gpu-ffff-ff-ff-7 is not on this node now"


def test_unprepare_cleans_before_the_device_is_offered_again(
    start_dra: Start, tmp_path: Path
) -> None:
    log = tmp_path / "cleanup.log"
    gate = tmp_path / "gate"
    cluster = start_dra(hgx_node(), **{"resources.gpu.hooks.cleanup": hook(log, f"wait:{gate}")})
    assert wait_until(lambda: published(cluster, 16), timeout=10)
    gpu, _ = pix_pair(cluster)
    claim = cluster.claim("c", [("gpu", gpu)])
    assert cluster.prepare(claim)[claim.uid]["error"] == ""
    assert cluster.unprepare(claim) == {claim.uid: ""}
    spec_file = cluster.cdi_dir / f"k8s.{DRIVER}-claim_{claim.uid}.json"
    assert not spec_file.exists()
    # Owed a cleanup (running, held at the gate): tainted in the slice, and
    # Unhealthy in the health stream.
    assert wait_until(lambda: "taints" in cluster.devices().get(gpu, {}), timeout=10)
    taint = dict(cluster.devices()[gpu]["taints"][0])
    assert taint.pop("timeAdded")  # the API server's
    assert taint == {"key": f"{DRIVER}/unhealthy", "value": "cleanup", "effect": "NoSchedule"}
    assert cluster.kubelet.wait_for(
        lambda: cluster.kubelet.health(DRIVER).get(f"{NODE}/{gpu}", (0, ""))[0] == 2, timeout=10
    )
    gate.touch()
    ok = wait_until(lambda: "taints" not in cluster.devices()[gpu], timeout=20)
    assert ok, [
        (
            s["metadata"]["name"],
            s["spec"]["pool"],
            [d.get("taints") for d in s["spec"]["devices"] if d["name"] == gpu],
        )
        for s in cluster.slices()
    ]
    assert [r["env"]["DEVPLUGIN_HOOK"] for r in runs(log)] == ["cleanup"]
    # Unprepare again, or of a claim never prepared here: success, nothing run.
    assert cluster.unprepare(claim) == {claim.uid: ""}
    assert len(runs(log)) == 1


def test_a_claim_deleted_before_unprepare_is_unprepared_from_the_checkpoint(
    start_dra: Start, tmp_path: Path
) -> None:
    log = tmp_path / "cleanup.log"
    cluster = start_dra(hgx_node(), **{"resources.hca.hooks.cleanup": hook(log, "ok")})
    assert wait_until(lambda: published(cluster, 16), timeout=10)
    _, hca = pix_pair(cluster)
    claim = cluster.claim("gone", [("hca", hca)])
    assert cluster.prepare(claim)[claim.uid]["error"] == ""
    cluster.api.remove("resourceclaims", "gone", "default")
    assert cluster.unprepare(claim) == {claim.uid: ""}
    assert wait_until(lambda: len(runs(log)) == 1, timeout=10)
    (run,) = runs(log)
    assert run["env"]["DEVPLUGIN_DEVICE_IDS"] == cluster.attribute(
        hca, "resource.kubernetes.io/pciBusID"
    )


def test_a_failed_init_rolls_the_claim_back_and_cleans_its_devices(
    start_dra: Start, tmp_path: Path
) -> None:
    init, cleanup = tmp_path / "init.log", tmp_path / "cleanup.log"
    cluster = start_dra(
        hgx_node(),
        **{
            "resources.gpu.hooks.init": hook(init, "fail-times:1"),
            "resources.gpu.hooks.cleanup": hook(cleanup, "ok"),
        },
    )
    assert wait_until(lambda: published(cluster, 16), timeout=10)
    gpu, _ = pix_pair(cluster)
    claim = cluster.claim("c", [("gpu", gpu)])
    error = cluster.prepare(claim)[claim.uid]["error"]
    assert error.startswith("init hook failed with exit status 1")
    assert not (cluster.cdi_dir / f"k8s.{DRIVER}-claim_{claim.uid}.json").exists()
    assert wait_until(lambda: len(runs(cleanup)) == 1, timeout=10)
    # The kubelet retries: the device is clean, init runs again and succeeds.
    assert cluster.prepare(claim)[claim.uid]["error"] == ""
    assert len(runs(init)) == 2


def test_a_v1beta1_kubelet_is_served_the_same(start_dra: Start) -> None:
    cluster = start_dra(hgx_node())
    cluster.kubelet.prefer = "v1beta1"
    assert wait_until(lambda: published(cluster, 16), timeout=10)
    gpu, hca = pix_pair(cluster)
    claim = cluster.claim("old-kubelet", [("gpu", gpu), ("hca", hca)])
    answer = cluster.prepare(claim)[claim.uid]
    assert answer["error"] == ""
    assert {d["device"] for d in answer["devices"]} == {gpu, hca}
    assert cluster.unprepare(claim) == {claim.uid: ""}


def test_one_resource_per_api_on_one_node(start_dra: Start, sock_dir: Path) -> None:
    kubelet = KubeletSimulator(sock_dir / "dp", sock_dir / "pr" / "kubelet.sock")
    kubelet.start()
    try:
        cluster = start_dra(hgx_node(), **{"resources.gpu.api": "device-plugin"})
        assert kubelet.wait_for_devices("nvidia.com/gpu", 8, timeout=10)
        assert wait_until(lambda: len(cluster.devices()) == 8, timeout=10)
        assert all(name.startswith("hca-") for name in cluster.devices())
        assert not kubelet.registered("rdma/hca")
        # The GPU through the device-plugin API, an HCA through a claim.
        pod = kubelet.admit("p", [ContainerRequest("c", {"nvidia.com/gpu": 1})])
        assert len(pod.container("c").devices["nvidia.com/gpu"]) == 1
        hca = min(cluster.devices())
        claim = cluster.claim("hca-only", [("hca", hca)])
        assert cluster.prepare(claim)[claim.uid]["error"] == ""
        gpu_claim = cluster.claim("gpu-too", [("gpu", "gpu-0000-13-00-0")])
        error = cluster.prepare(gpu_claim)[gpu_claim.uid]["error"]
        assert error == "device gpu-0000-13-00-0 is not on this node now"
    finally:
        kubelet.stop()


def test_without_a_checkpoint_the_claims_list_says_what_is_held(
    start_dra: Start, tmp_path: Path
) -> None:
    log = tmp_path / "cleanup.log"
    first = start_dra(hgx_node(), **{"resources.gpu.hooks.cleanup": hook(log, "ok")})
    assert wait_until(lambda: published(first, 16), timeout=10)
    gpu, _ = pix_pair(first)
    held = first.claim("held", [("gpu", gpu)])
    assert first.prepare(held)[held.uid]["error"] == ""
    first.daemon.stop()
    first.kubelet.stop()
    first.checkpoint.unlink()  # lost: nothing is known of what held what
    second = start_dra(
        hgx_node(),
        known_clean=False,
        **{
            "resources.gpu.hooks.cleanup": hook(log, "ok"),
            "lifecycle.checkpoint_file": str(first.checkpoint),
        },
    )
    # Every GPU but the claimed one is cleaned before it is offered; the
    # claimed one stays in use, untouched, and its claim is known again.
    assert wait_until(lambda: len(runs(log)) == 7, timeout=20)
    cleaned = {r["env"]["DEVPLUGIN_DEVICE_IDS"] for r in runs(log)}
    assert first.attribute(gpu, "uuid") not in cleaned
    assert wait_until(lambda: published(second, 16), timeout=20)
    assert wait_until(lambda: second.daemon.ready()[0], timeout=20), second.daemon.ready()
    again = second.prepare(held)[held.uid]
    assert again["error"] == ""
    assert [d["device"] for d in again["devices"]] == [gpu]
    assert second.unprepare(held) == {held.uid: ""}
    assert wait_until(lambda: len(runs(log)) == 8, timeout=20)
    assert len(runs(log)) == 8


def test_a_slow_init_holds_up_neither_another_claim_nor_the_retry_of_its_own(
    start_dra: Start, tmp_path: Path
) -> None:
    log, gate = tmp_path / "init.log", tmp_path / "gate"
    cluster = start_dra(hgx_node(), **{"resources.gpu.hooks.init": hook(log, f"wait:{gate}")})
    assert wait_until(lambda: published(cluster, 16), timeout=10)
    gpu, hca = pix_pair(cluster)
    slow = cluster.claim("slow", [("gpu", gpu)])
    quick = cluster.claim("quick", [("hca", hca)])  # HCAs have no init hook
    answers: dict[str, Any] = {}
    caller = threading.Thread(target=lambda: answers.update(cluster.prepare(slow)))
    caller.start()
    assert wait_until(lambda: len(runs(log)) == 1, timeout=10)  # the GPU's init is waiting
    assert cluster.prepare(quick)[quick.uid]["error"] == ""
    assert caller.is_alive()
    # The kubelet's retry of the slow claim waits for the first call, then
    # gets the same answer; init ran once.
    retry: dict[str, Any] = {}
    second = threading.Thread(target=lambda: retry.update(cluster.prepare(slow)))
    second.start()
    gate.touch()
    caller.join(timeout=30)
    second.join(timeout=30)
    assert answers[slow.uid]["error"] == ""
    assert retry == answers
    assert len(runs(log)) == 1


def test_a_slow_or_failing_api_server_is_the_claims_error_not_a_hung_call(
    start_dra: Start,
) -> None:
    cluster = start_dra(hgx_node(), **{"dra.claim_timeout_seconds": 0.3})
    assert wait_until(lambda: published(cluster, 16), timeout=10)
    gpu, _ = pix_pair(cluster)
    claim = cluster.claim("c", [("gpu", gpu)])
    # Every request fails for a while (the slice watch's too): the claim's read is one.
    cluster.api.fail_next(1000, 503)
    error = cluster.prepare(claim)[claim.uid]["error"]
    cluster.api.clear_failures()
    assert error.startswith("reading ResourceClaim default/c: 503")
    cluster.api.delay = 2.0
    started = time.monotonic()
    error = cluster.prepare(claim)[claim.uid]["error"]
    assert time.monotonic() - started < 1.5
    assert error.startswith("reading ResourceClaim default/c:")
    assert "Timeout" in error
    cluster.api.delay = 0.0
    assert cluster.prepare(claim)[claim.uid]["error"] == ""


def test_a_claim_without_a_uid_is_refused_and_the_driver_keeps_serving(start_dra: Start) -> None:
    cluster = start_dra(hgx_node())
    assert wait_until(lambda: published(cluster, 16), timeout=10)
    with pytest.raises(grpc.RpcError) as refused:
        cluster.prepare(ClaimCall("default", "", "nameless"))
    call = refused.value
    assert isinstance(call, grpc.Call)
    assert call.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "default/nameless has no uid" in (call.details() or "")
    gpu, _ = pix_pair(cluster)
    claim = cluster.claim("fine", [("gpu", gpu)])
    assert cluster.prepare(claim)[claim.uid]["error"] == ""


def test_claims_prepared_and_unprepared_back_to_back_clean_each_release_once(
    start_dra: Start, tmp_path: Path
) -> None:
    log = tmp_path / "cleanup.log"
    cluster = start_dra(
        hgx_node(),
        **{
            "resources.gpu.hooks.cleanup": hook(log, "ok"),
            "resources.hca.hooks.cleanup": hook(log, "ok"),
        },
    )
    assert wait_until(lambda: published(cluster, 16), timeout=10)
    devices = sorted(cluster.devices())
    rounds = 3
    for turn in range(rounds):
        # Every device claimed and given back with no pause between calls.
        claims = [cluster.claim(f"c{turn}-{i}", [("d", name)]) for i, name in enumerate(devices)]
        answers = cluster.prepare(*claims)
        assert all(answers[c.uid]["error"] == "" for c in claims), answers
        assert cluster.unprepare(*claims) == {c.uid: "" for c in claims}
        for claim in claims:
            cluster.api.remove("resourceclaims", claim.name, "default")
        # The next round's prepares wait for (or run inline) the cleanups owed.
    assert wait_until(lambda: len(runs(log)) == rounds * 16, timeout=60)
    cleaned = [r["env"]["DEVPLUGIN_DEVICE_IDS"] for r in runs(log)]
    assert all(cleaned.count(device) == rounds for device in set(cleaned))
    assert len(set(cleaned)) == 16
    assert wait_until(lambda: published(cluster, 16), timeout=20)
    assert json.loads(cluster.checkpoint.read_text())["claims"] == []


def test_free_counts_follow_prepare_and_cleanup_and_refuse_a_short_node_at_once(
    start_dra: Start, tmp_path: Path
) -> None:
    log = tmp_path / "cleanup.log"
    gate = tmp_path / "gate"
    cluster = start_dra(hgx_node(), **{"resources.gpu.hooks.cleanup": hook(log, f"wait:{gate}")})
    assert wait_until(lambda: published(cluster, 16), timeout=10)

    def counts() -> set[tuple[int, int]]:
        return {
            (d["attributes"][FREE_GPUS]["int"], d["attributes"][FREE_HCAS]["int"])
            for d in cluster.devices().values()
        }

    assert counts() == {(8, 8)}
    gpus = sorted(n for n in cluster.devices() if n.startswith("gpu-"))
    hca = next(n for n in sorted(cluster.devices()) if n.startswith("hca-"))
    claim = cluster.claim("c", [("gpu", gpus[0]), ("gpu", gpus[1]), ("hca", hca)])
    assert cluster.prepare(claim)[claim.uid]["error"] == ""
    # The take rejudges, which pokes the publisher: no scan or poll waited for.
    assert wait_until(lambda: counts() == {(6, 7)}, timeout=2)  # the check runs every 5 s
    # The scheduler's walk on these slices: an 8-pair claim no longer fits
    # and is refused by its first scan.
    classes = {c["metadata"]["name"]: c for c in device_classes(DRIVER)}
    allocator = Allocator(cluster.slices(), classes, NODE)
    taken = taken_devices(cluster.api.items("resourceclaims"))
    assert allocator.allocate(claim_spec(Shape(8, 8), DRIVER), taken) is None
    assert allocator.tries <= 10_000
    assert allocator.allocate(claim_spec(Shape(6, 6), DRIVER), taken) is not None
    # Released, the GPUs are owed a cleanup: still not free while it runs.
    assert cluster.unprepare(claim) == {claim.uid: ""}
    assert wait_until(lambda: counts() == {(6, 8)}, timeout=10)
    assert all("taints" in cluster.devices()[g] for g in gpus[:2])
    gate.touch()
    assert wait_until(lambda: counts() == {(8, 8)}, timeout=20)


def bound_pod(cluster: DraCluster, name: str, claims: list[str]) -> None:
    """A pod the scheduler bound to the node, naming its claims."""
    cluster.api.put(
        "pods",
        {"apiVersion": "v1", "kind": "Pod",
         "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
         "spec": {"nodeName": NODE, "containers": [{"name": "main", "image": "x"}],
                  "resourceClaims": [{"name": c, "resourceClaimName": c} for c in claims]},
         "status": {"phase": "Pending"}},
    )  # fmt: skip


def test_free_counts_follow_the_schedulers_allocation_before_any_prepare(
    start_dra: Start,
) -> None:
    """Claims allocated to pods bound here leave the free counts at once
    (the pod watch's event), before the kubelet prepares anything, so a
    burst's next pod meets a gate that knows; when the pods go, they come
    back. Under churn, the counts settle on what the live pods hold."""
    cluster = start_dra(hgx_node())
    assert wait_until(lambda: published(cluster, 16), timeout=10)

    def counts() -> set[tuple[int, int]]:
        return {
            (d["attributes"][FREE_GPUS]["int"], d["attributes"][FREE_HCAS]["int"])
            for d in cluster.devices().values()
        }

    gpus = sorted(n for n in cluster.devices() if n.startswith("gpu-"))
    hcas = sorted(n for n in cluster.devices() if n.startswith("hca-"))
    cluster.claim("a", [("gpu", gpus[0]), ("gpu", gpus[1]), ("hca", hcas[0])])
    bound_pod(cluster, "pa", ["a"])
    assert wait_until(lambda: counts() == {(6, 7)}, timeout=5)
    # A walk on these slices refuses a claim the node cannot hold in its first scan.
    classes = {c["metadata"]["name"]: c for c in device_classes(DRIVER)}
    allocator = Allocator(cluster.slices(), classes, NODE)
    taken = taken_devices(cluster.api.items("resourceclaims"))
    assert allocator.allocate(claim_spec(Shape(7, 7), DRIVER), taken) is None
    assert allocator.tries <= 10_000
    cluster.api.remove("pods", "pa", "default")
    assert wait_until(lambda: counts() == {(8, 8)}, timeout=5)
    # Churn: pods and their claims come and go milliseconds apart.
    live: dict[str, tuple[str, str]] = {}
    for step in range(40):
        name = f"c{step}"
        if live and step % 3 == 2:
            gone = sorted(live)[0]
            del live[gone]
            cluster.api.remove("pods", f"p{gone}", "default")
            continue
        free_g = [g for g in gpus if g not in {v[0] for v in live.values()}]
        free_h = [h for h in hcas if h not in {v[1] for v in live.values()}]
        if not free_g or not free_h:
            continue
        live[name] = (free_g[0], free_h[0])
        cluster.claim(name, [("gpu", free_g[0]), ("hca", free_h[0])])
        bound_pod(cluster, f"p{name}", [name])
        time.sleep(0.005)
    assert wait_until(lambda: counts() == {(8 - len(live), 8 - len(live))}, timeout=10)
