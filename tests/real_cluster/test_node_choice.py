"""Node labels the daemons write, nodeSelector and node affinity on them
(and on the node's name), and the extender's GPU-model annotations, judged
by the real kube-scheduler; each verdict held against the imitations'
(the scheduler imitation's selector_fits, the extender's own filter)."""

from __future__ import annotations

import contextlib
import itertools
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from devplugin.testing.cluster import SimCluster
from devplugin.testing.controlplane import ApiFailure, ControlPlane, kubeconfig
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.node import devices_from_spec
from devplugin.testing.scheduler import call_extender, selector_fits
from tests.real_cluster.cluster_support import (
    SCHEDULER_NAME,
    chart_extender,
    chart_scheduler_config,
    verb_calls,
)
from tests.real_cluster.conftest import NAMESPACE, RELEASE
from tests.real_cluster.nodes import (
    GPU,
    HCA,
    add_node,
    decision,
    delete_pod,
    eventually,
    node_token,
)

pytestmark = pytest.mark.cluster

_pods = itertools.count()


class Models:
    """An H100 node and an A100 node, each with its daemon labelling it,
    the extender and the real scheduler with the chart's configuration."""

    def __init__(self, plane: ControlPlane, stack: ExitStack) -> None:
        self.plane = plane
        self.why = ""
        minor = plane.bins.minor[1]
        self.names = {"h100": f"mdl{minor}-h100", "a100": f"mdl{minor}-a100"}
        for layout, name in (("hgx-h100", self.names["h100"]), ("dgx-a100", self.names["a100"])):
            spec = LAYOUTS[layout]()
            gpus, hcas = devices_from_spec(spec)
            add_node(plane, name, {GPU: len(gpus), HCA: len(hcas)})
            token = node_token(plane, NAMESPACE, f"{RELEASE}-devplugin", name)
            stack.enter_context(
                SimCluster(
                    spec,
                    node_name=name,
                    settings={"kubernetes.lease_namespace": NAMESPACE},
                    kubeconfig=kubeconfig(plane.server, plane.pki.ca, token=token),
                )
            )
        base = Path(tempfile.mkdtemp(prefix="models-", dir=plane.folder))
        self.url = stack.enter_context(chart_extender(plane, base))
        plane.start_scheduler(chart_scheduler_config(plane, self.url))
        assert eventually(
            lambda: all("devplugin.io/gpu.product" in self.labels(n) for n in self.names.values()),
            timeout=30,
        )
        # In service: the extender reads both nodes' live records (a model
        # every GPU here matches lets both through).
        both = _pod(annotations={"devplugin.io/gpu-product": "nvidia"})
        assert eventually(lambda: self.imitation(both) == set(self.names.values()), timeout=30)

    def labels(self, name: str) -> dict[str, str]:
        node = self.plane.request("GET", f"/api/v1/nodes/{name}")
        found: dict[str, str] = node["metadata"].get("labels") or {}
        return found

    def imitation(self, pod: dict[str, Any]) -> set[str]:
        """The nodes the imitations let the pod onto: the node affinity
        filter's rule (selector_fits), then the extender's filter."""
        fits = [n for n in sorted(self.names.values()) if selector_fits(pod, self.labels(n), n)]
        if not fits:
            return set()
        probe = {**pod, "metadata": {**pod["metadata"], "uid": f"probe-{pod['metadata']['name']}"}}
        verdict = call_extender(self.url, "filter", {"Pod": probe, "NodeNames": fits})
        return set(verdict["NodeNames"] or [])

    def decide(self, pod: dict[str, Any]) -> str:
        """The node the real scheduler binds the pod to ('' if it stays
        unschedulable); the pod is deleted after."""
        name = pod["metadata"]["name"]
        asked = verb_calls(self.url, "filter", "ok")
        self.plane.request("POST", "/api/v1/namespaces/default/pods", pod)
        try:
            state, live = decision(self.plane, name, timeout=30)
        finally:
            with contextlib.suppress(ApiFailure):
                delete_pod(self.plane, name)
        # Every case leaves a node past the scheduler's own filters: the
        # extender was asked and answered (with `ignorable` a dead one would not be).
        assert verb_calls(self.url, "filter", "ok") > asked, f"{name}: the extender was not asked"
        if state == "unschedulable":
            # Nothing else changes here: a pod found unschedulable stays so.
            conditions = (live.get("status") or {}).get("conditions") or []
            self.why = "; ".join(str(c.get("message")) for c in conditions)
            return ""
        return str(live["spec"]["nodeName"])


def _pod(**spec: Any) -> dict[str, Any]:
    annotations = spec.pop("annotations", {})
    limits = {GPU: "1", HCA: "1"}
    container = {"name": "main", "image": "tier/none", "resources": {"limits": limits}}
    meta = {"name": f"choice-{next(_pods)}", "namespace": "default", "annotations": annotations}
    body = {"schedulerName": SCHEDULER_NAME, "containers": [container], **spec}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": body}


def _required(*terms: dict[str, Any]) -> dict[str, Any]:
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}
        }
    }


@pytest.fixture
def models(installed: ControlPlane) -> Iterator[Models]:
    with ExitStack() as stack:
        found = Models(installed, stack)
        yield found
    for name in found.names.values():
        with contextlib.suppress(ApiFailure):
            installed.request("DELETE", f"/api/v1/nodes/{name}")


def test_labels_affinity_and_model_annotations_choose_as_the_imitations_say(
    models: Models,
) -> None:
    h100, a100 = models.names["h100"], models.names["a100"]
    a100_product = models.labels(a100)["devplugin.io/gpu.product"]
    cases = {
        "nodeSelector on the product": (
            _pod(nodeSelector={"devplugin.io/gpu.product": a100_product}), a100,
        ),
        "affinity on family and memory": (
            _pod(affinity=_required({"matchExpressions": [
                {"key": "devplugin.io/gpu.family", "operator": "NotIn", "values": ["ampere"]},
                {"key": "devplugin.io/gpu.memory", "operator": "Gt", "values": ["40000"]},
            ]})),
            h100,
        ),
        "affinity on the node's name": (
            _pod(affinity=_required({"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [a100]}]})),
            a100,
        ),
        "names and labels in one term": (
            _pod(affinity=_required({
                "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": [a100]}],
                "matchExpressions": [{"key": "devplugin.io/gpu.count", "operator": "Exists"}],
            })),
            h100,
        ),
        "the extender's model choice": (
            _pod(annotations={"devplugin.io/gpu-product": "h100"}), h100,
        ),
        "the extender's model exclusion": (
            _pod(annotations={"devplugin.io/gpu-product-exclude": "h100"}), a100,
        ),
        "a model no node has": (_pod(annotations={"devplugin.io/gpu-product": "v100"}), ""),
    }  # fmt: skip
    verdicts = {}
    for case, (pod, expected) in cases.items():
        allowed = models.imitation(pod)
        real = models.decide(pod)
        verdicts[case] = (real, sorted(allowed))
        assert real == expected, (case, real, models.why)
        # The imitations agree: what the real scheduler did is all they allow.
        assert allowed == ({real} if real else set()), (case, allowed)
    assert len(verdicts) == len(cases)
