"""MIG devices through DRA: published as `type: mig` in their parent's place,
asked for by a MIG claim template whose ladder pairs each with the HCA on
its parent's switch, allocated by the scheduler's allocator imitation and
prepared over the kubelet's DRA API."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from devplugin.frontends.dra.slices import with_free_counts
from devplugin.policy.claim_templates import Shape, TemplateError, claim_spec, device_classes
from devplugin.testing.cdi import CdiRuntime
from devplugin.testing.dra_kubelet import ClaimCall
from devplugin.testing.dra_limits import slice_problems
from devplugin.testing.dra_scheduler import Allocator, put_claim, schedule_claim
from devplugin.testing.layouts import hgx_h100_mig
from tests.dra_support import DRIVER, NODE, DraCluster, published, start_dra
from tests.waiting import wait_until

__all__ = ["start_dra"]
Start = Callable[..., DraCluster]
MIXED = {"resources.gpu.mig.strategy": "mixed"}


def test_mig_claims_get_a_device_of_their_profile_paired_at_pix_and_prepared(
    start_dra: Start,
) -> None:
    cluster = start_dra(hgx_h100_mig(), **MIXED)
    assert wait_until(lambda: published(cluster, 4 + 16 + 8), timeout=10)
    for item in cluster.slices():
        assert slice_problems(item) == []
    migs = {n: d for n, d in cluster.devices().items() if cluster.attribute(n, "type") == "mig"}
    assert len(migs) == 16
    for name in migs:
        assert cluster.attribute(name, "parentUUID").startswith("GPU-")
    for device_class in device_classes(DRIVER):
        cluster.api.put("deviceclasses", device_class)
    spec = claim_spec(Shape(1, 1, mig="1g.10gb"), DRIVER)
    calls = []
    for n in range(4):
        put_claim(cluster.api, f"infer-{n}", spec)
        results = schedule_claim(cluster.api, f"infer-{n}", "default", NODE)
        assert results is not None, n
        chosen = {r["request"].split("/")[0]: r for r in results}
        gpu, hca = chosen["gpu-0"]["device"], chosen["hca-0"]["device"]
        assert chosen["gpu-0"]["request"] == "gpu-0/pix"
        assert cluster.attribute(gpu, "type") == "mig"
        assert cluster.attribute(gpu, "profile") == "1g.10gb"
        assert cluster.attribute(gpu, "pcieSwitch") == cluster.attribute(hca, "pcieSwitch")
        claim = cluster.api.get("resourceclaims", f"infer-{n}", "default") or {}
        calls.append(ClaimCall("default", claim["metadata"]["uid"], f"infer-{n}"))
    # Four claims, four parents: each took a different parent's PIX HCA.
    answers = cluster.prepare(*calls)
    runtime = CdiRuntime([cluster.cdi_dir])
    seen = set()
    for call in calls:
        answer = answers[call.uid]
        assert answer["error"] == ""
        ids = [i for d in answer["devices"] for i in d["cdi"]]
        env = runtime.resolve(ids).environment()
        visible = env["NVIDIA_VISIBLE_DEVICES"]
        assert visible.startswith("MIG-")
        seen.add(visible)
    assert len(seen) == 4
    assert cluster.unprepare(*calls) == {call.uid: "" for call in calls}


def test_a_mig_template_names_the_profile_and_refuses_nvlink() -> None:
    spec = claim_spec(Shape(2, 2, mig="3g.40gb"), DRIVER)
    requests = spec["devices"]["requests"]
    gpus = [r for r in requests if r["name"].startswith("gpu")]
    for request in gpus:
        for part in request["firstAvailable"]:
            assert part["deviceClassName"] == f"mig.{DRIVER}"
            expressions = [s["cel"]["expression"] for s in part["selectors"]]
            assert f'device.attributes["{DRIVER}"].profile == "3g.40gb"' in expressions
    with pytest.raises(TemplateError, match="no NVLink"):
        claim_spec(Shape(2, 2, mig="1g.10gb", nvlink=True), DRIVER)
    with pytest.raises(TemplateError, match="not a MIG profile"):
        claim_spec(Shape(1, 1, mig='1g" || true'), DRIVER)


def test_on_a_node_with_every_gpu_cut_the_gate_counts_mig_devices_of_the_profile(
    start_dra: Start,
) -> None:
    """freeGpus counts whole GPUs; a MIG claim's gate reads how many MIG
    devices of its profile are free, so a node cut everywhere still takes
    MIG claims, and one without enough of the profile is refused at once."""
    cuts = (("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"),) * 8
    cluster = start_dra(hgx_h100_mig(cuts), **MIXED)
    assert wait_until(lambda: published(cluster, 32 + 8), timeout=10)
    some = next(iter(cluster.devices()))
    assert cluster.attribute(some, "freeGpus") == 0
    for device_class in device_classes(DRIVER):
        cluster.api.put("deviceclasses", device_class)
    put_claim(cluster.api, "one", claim_spec(Shape(1, 1, mig="3g.40gb"), DRIVER))
    assert schedule_claim(cluster.api, "one", "default", NODE) is not None
    # Eight 1g pairs fit (sixteen 1g devices); nine 3g devices do not (eight exist).
    classes = {c["metadata"]["name"]: c for c in device_classes(DRIVER)}
    allocator = Allocator(cluster.slices(), classes, NODE)
    assert allocator.allocate(claim_spec(Shape(8, 8, mig="1g.10gb"), DRIVER)) is not None
    allocator = Allocator(cluster.slices(), classes, NODE, budget=20_000)
    assert allocator.allocate(claim_spec(Shape(9, 0, mig="3g.40gb"), DRIVER)) is None
    assert allocator.tries <= 10_000


def test_mig_templates_are_decided_within_ten_thousand_tries_free_and_one_short(
    start_dra: Start,
) -> None:
    """Each MIG shape (1, 2, 4, 8 pairs of a profile) on the mixed node: free,
    it fits where the profile has the devices; with all but one too few of
    its profile held by other claims (counted as the driver counts them),
    it is refused within 10,000 tries, under both rule sets."""
    cluster = start_dra(hgx_h100_mig(), **MIXED)
    assert wait_until(lambda: published(cluster, 4 + 16 + 8), timeout=10)
    classes = {c["metadata"]["name"]: c for c in device_classes(DRIVER)}
    items = cluster.slices()
    assert len(items) == 1  # one slice holds the pool: its counts are rewritten below
    entries = [d for item in items for d in item["spec"]["devices"]]
    for profile, have in (("1g.10gb", 8), ("2g.20gb", 4), ("3g.40gb", 4)):
        mine = [e["name"] for e in entries if cluster.attribute(e["name"], "profile") == profile]
        assert len(mine) == have
        for pairs in (1, 2, 4, 8):
            spec = claim_spec(Shape(pairs, pairs, mig=profile), DRIVER)
            held = set(mine[max(0, pairs - 1) :])
            counted = with_free_counts(entries, held)
            short = [{**items[0], "spec": {**items[0]["spec"], "devices": counted}}]
            for incubating in (False, True):
                free = Allocator(items, classes, NODE, incubating=incubating, budget=20_000)
                assert (free.allocate(spec) is not None) == (pairs <= have), (profile, pairs)
                assert free.tries <= 10_000
                walk = Allocator(short, classes, NODE, incubating=incubating, budget=20_000)
                taken = {(DRIVER, NODE, name) for name in held}
                assert walk.allocate(spec, taken) is None, (profile, pairs)
                assert walk.tries <= 10_000, (profile, pairs, walk.tries)
