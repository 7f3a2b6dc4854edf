"""MIG devices through DRA: published as `type: mig` in their parent's place,
asked for by a MIG claim template whose ladder pairs each with the HCA on
its parent's switch, allocated by the scheduler's allocator imitation and
prepared over the kubelet's DRA API."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from devplugin.policy.claim_templates import Shape, TemplateError, claim_spec, device_classes
from devplugin.testing.cdi import CdiRuntime
from devplugin.testing.dra_kubelet import ClaimCall
from devplugin.testing.dra_limits import slice_problems
from devplugin.testing.dra_scheduler import put_claim, schedule_claim
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
