"""`devplugin demo`: the daemon's main job on an embedded simulated node.

Builds an 8-GPU, 8-HCA node (sysfs tree, /dev tree, NVML fixture) in a
temporary directory, starts the daemon against the in-process kubelet
simulator and the API server imitation (the simulator creates each pod there
before admitting it, as a scheduler's binding would), admits a few pods,
prints what each container got (device nodes and variables, and CDI names:
the node has the GPU spec NVIDIA's toolkit would write, the daemon writes
its HCA spec), what a CDI runtime resolves one pod's names to, the node's
NodeDevices record and the events on the pods, restarts the kubelet to show
re-registration, and cleans up.

Then the same node core as a DRA driver, on a second simulated node: the
ResourceSlices it publishes, a claim from the chart's 2-pair template
allocated by the scheduler's allocator imitation, prepared over the
kubelet's DRA API, its CDI device ids and what a CDI runtime resolves them
to, and its unprepare.

Last, a cluster of mixed GPU models (`demo_models.py`): an A100 node and an
H100 node cut by MIG join, the daemons label their Nodes, the extender keeps
a pod that chose A100s to the A100 node, and a pod gets a MIG device with
the HCA on its parent's switch.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devplugin.config import Config, override
from devplugin.frontends.dra.plugin import WHOLE_CLAIM
from devplugin.node.alignment import alignment
from devplugin.node.report import topo_text
from devplugin.policy.topology import Topology
from devplugin.runtime import Daemon, build
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.cdi import CdiRuntime, nvidia_like_spec, write_spec
from devplugin.testing.demo_models import models_demo
from devplugin.testing.fake_nvml import FakeNvml
from devplugin.testing.kubelet import AdmissionError, ContainerRequest, KubeletSimulator, PodResult
from devplugin.testing.node import BuiltNode, build_node, hgx_node

GPU = "nvidia.com/gpu"
HCA = "rdma/hca"
STRATEGY = ["envvar", "device-nodes", "cdi-cri"]

PODS: list[tuple[str, list[ContainerRequest]]] = [
    # One HCA for two GPUs: the shape is read from the pod, not guessed.
    ("trainer-a", [ContainerRequest("main", {GPU: 2, HCA: 1})]),
    ("notebook", [ContainerRequest("jupyter", {GPU: 1})]),
    ("rdma-probe", [ContainerRequest("perftest", {HCA: 1})]),
    ("trainer-b", [ContainerRequest("main", {GPU: 4, HCA: 4})]),
]


def _print_pod(pod: PodResult, topology: Topology, out: Callable[[str], None]) -> None:
    out(f"pod {pod.namespace}/{pod.name}")
    for container in pod.containers:
        out(f"  container {container.name} (kubelet asked for: {', '.join(container.order)})")
        measured = alignment(
            topology, container.devices.get(GPU, ()), container.devices.get(HCA, ())
        )
        if measured is not None:
            out(f"    worst GPU-to-HCA level: {measured[0].name}")
        for resource in container.order:
            response = container.responses[resource]
            out(f"    {resource}: {', '.join(container.devices[resource])}")
            for key, value in sorted(response.envs.items()):
                out(f"      env    {key}={value}")
            for spec in response.devices:
                out(f"      device {spec.host_path} ({spec.permissions})")
            for cdi in response.cdi_devices:
                out(f"      cdi    {cdi.name}")


def _print_resolved(pod: PodResult, runtime: CdiRuntime, out: Callable[[str], None]) -> None:
    """What a CDI runtime makes of the pod's names (as containerd 2.x would)."""
    for container in pod.containers:
        names = [d.name for r in container.order for d in container.responses[r].cdi_devices]
        runtime.refresh()
        edits = runtime.resolve(names)
        out(f"a CDI runtime resolves {pod.name}/{container.name}'s {len(names)} names to:")
        shown: set[str] = set()
        for node in edits.device_nodes:
            if node["path"] in shown:
                continue  # a runtime adds each path once
            shown.add(node["path"])
            number = f" {node['major']}:{node['minor']}" if "major" in node else ""
            out(f"  device {node['path']}{number}")
        for mount in edits.mounts:
            out(f"  mount  {mount['hostPath']}")


Out = Callable[[str], None]


def run_demo(out: Callable[[str], None] = print, workdir: Path | None = None) -> int:
    base = Path(tempfile.mkdtemp(prefix="dpdemo-", dir=workdir))
    try:
        node = build_node(hgx_node(), base / "node")
        api = ApiServerImitation()
        api.start()
        try:
            return _node_demo(base, node, api, out)
        finally:
            api.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _node_demo(base: Path, node: BuiltNode, api: ApiServerImitation, out: Out) -> int:
    """The daemon beside a kubelet on the simulated node, then DRA and models."""
    plugin_dir = base / "dp"
    pod_resources = base / "pr" / "kubelet.sock"
    kubeconfig = base / "kubeconfig"
    kubeconfig.write_text(json.dumps(api.kubeconfig()))
    api.put("nodes", {"metadata": {"name": "demo-node"}})
    # The GPU spec NVIDIA's toolkit would have written on this node.
    cdi_dirs = [base / "etc-cdi", base / "run-cdi"]
    write_spec(cdi_dirs[0], "nvidia.yaml", nvidia_like_spec(node))
    kubelet = KubeletSimulator(plugin_dir, pod_resources, seed=7, api=api, node_name="demo-node")
    kubelet.start()
    try:
        config = _demo_config(base, node, kubeconfig, cdi_dirs)
        daemon = build(config, FakeNvml.from_file(node.fixture))
        try:
            daemon.start()
            out(f"simulated node under {base}")
            out("")
            out(topo_text(daemon.inventory))
            out("")
            failed = (
                _registered(kubelet, node, out)
                or _admit_pods(kubelet, daemon, cdi_dirs, api, out)
                or _kubelet_restart(kubelet, out)
                or _dra_demo(base / "dra", api, out)
            )
            if failed:
                return failed
            out("")
            return models_demo(base / "models", api, out)
        finally:
            daemon.stop()
    finally:
        kubelet.stop()


def _node_settings(
    base: Path, node: BuiltNode, kubeconfig: Path, node_name: str, cdi_dirs: list[Path]
) -> dict[str, Any]:
    """A daemon on the simulated node under `base`, talking to the API."""
    return {
        **node.settings(base),
        "metrics.addresses": ["127.0.0.1:0"],
        "kubernetes.enabled": True,
        "kubernetes.kubeconfig": str(kubeconfig),
        "kubernetes.node_name": node_name,
        "cdi.spec_dirs": [str(d) for d in cdi_dirs],
    }


def _demo_config(base: Path, node: BuiltNode, kubeconfig: Path, cdi_dirs: list[Path]) -> Config:
    return override(
        Config(),
        **_node_settings(base, node, kubeconfig, "demo-node", cdi_dirs),
        **{
            "kubernetes.record_min_interval_seconds": 0.2,
            # Device nodes and variables as ever, and CDI names besides.
            "resources.gpu.device_list_strategy": STRATEGY,
            "resources.hca.device_list_strategy": STRATEGY,
        },
    )


def _registered(kubelet: KubeletSimulator, node: BuiltNode, out: Out) -> int:
    """Both resources registered and listed (0), else 1."""
    if not (
        kubelet.wait_for_devices(GPU, len(node.gpus), timeout=10)
        and kubelet.wait_for_devices(HCA, len(node.hcas), timeout=10)
    ):
        out("demo failed: the daemon did not register both resources in time")
        return 1
    for resource in (GPU, HCA):
        devices = kubelet.devices(resource)
        healthy = sum(1 for device in devices.values() if device.health == "Healthy")
        out(f"kubelet sees {resource}: {len(devices)} devices, {healthy} healthy")
    out("")
    return 0


def _admit_pods(
    kubelet: KubeletSimulator,
    daemon: Daemon,
    cdi_dirs: list[Path],
    api: ApiServerImitation,
    out: Out,
) -> int:
    """The demo's pods, what each got, the last one's CDI view and the cluster's."""
    admitted: list[PodResult] = []
    for name, containers in PODS:
        try:
            admitted.append(kubelet.admit(name, containers))
        except AdmissionError as exc:
            out(f"pod {name} not admitted: {exc}")
            return 1
        _print_pod(admitted[-1], daemon.core.coordinator.topology, out)
    out("")
    _print_resolved(admitted[-1], CdiRuntime(cdi_dirs), out)
    out("")
    _print_cluster_view(api, len(PODS), out)
    out("")
    return 0


def _kubelet_restart(kubelet: KubeletSimulator, out: Out) -> int:
    """A kubelet restart, and how soon both resources registered again."""
    restarted_at = kubelet.restart()
    ok = kubelet.wait_for(
        lambda: all(
            any(r.resource == name and r.at >= restarted_at for r in kubelet.registrations)
            for name in (GPU, HCA)
        ),
        timeout=10,
    )
    if not ok:
        out("demo failed: no re-registration after the kubelet restart")
        return 1
    elapsed = (
        max(record.at for record in kubelet.registrations if record.at >= restarted_at)
        - restarted_at
    )
    out(
        f"kubelet restarted (plugin directory wiped); both resources "
        f"re-registered {elapsed:.2f}s later"
    )
    out("")
    return 0


def _print_cluster_view(api: ApiServerImitation, pods: int, out: Callable[[str], None]) -> None:
    """What `kubectl get nodedevices` and the pods' events would show."""

    def allocations() -> int:
        record = api.get("nodedevices", "demo-node") or {}
        return len((record.get("status") or {}).get("allocations", []))

    deadline = time.monotonic() + 10
    while (allocations() < pods or len(api.items("events")) < pods) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    record = api.get("nodedevices", "demo-node") or {}
    status = record.get("status") or {}
    summary = status.get("summary") or {}
    out("kubectl get nodedevices")
    out(f"  {'NAME':10} {'GPUS-FREE':>9} {'GPUS':>4} {'HCAS-FREE':>9} {'HCAS':>4} {'UNHEALTHY':>9}")
    out(
        f"  {'demo-node':10} {summary.get('gpusFree', '?'):>9} {summary.get('gpusTotal', '?'):>4} "
        f"{summary.get('hcasFree', '?'):>9} {summary.get('hcasTotal', '?'):>4} "
        f"{summary.get('unhealthy', '?'):>9}"
    )
    for entry in status.get("allocations", []):
        out(
            f"  {entry['namespace']}/{entry['pod']}/{entry['container']}: "
            f"{len(entry['devices'])} devices, worst level {entry['worstLevel'] or '-'}"
        )
    out("events on the pods")
    for event in sorted(api.items("events"), key=lambda e: e["involvedObject"]["name"]):
        out(f"  {event['involvedObject']['name']}: {event['message']}")


def _dra_config(
    base: Path, node: BuiltNode, kubeconfig: Path, node_name: str, cdi_dirs: list[Path]
) -> Config:
    return override(
        Config(),
        **_node_settings(base, node, kubeconfig, node_name, cdi_dirs),
        **{
            "paths.kubelet_plugins_dir": str(base / "plugins"),
            "paths.kubelet_registry_dir": str(base / "registry"),
            "resources.gpu.api": "dra",
            "resources.hca.api": "dra",
        },
    )


def _show_slices(
    api: ApiServerImitation, node: BuiltNode, node_name: str, out: Callable[[str], None]
) -> None:
    """The node's ResourceSlices once every device is published (10 s at most)."""

    def published() -> list[dict[str, Any]]:
        return [s for s in api.items("resourceslices") if s["spec"]["nodeName"] == node_name]

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and sum(len(s["spec"]["devices"]) for s in published()) < len(
        node.gpus
    ) + len(node.hcas):
        time.sleep(0.05)
    slices = published()
    out(f"kubectl get resourceslices --field-selector spec.nodeName={node_name}")
    for item in slices:
        spec = item["spec"]
        out(
            f"  {item['metadata']['name']}: pool {spec['pool']['name']} generation "
            f"{spec['pool']['generation']}, {len(spec['devices'])} devices"
        )
    first = slices[0]["spec"]["devices"][:2] if slices else []
    for device in first:
        attributes = {k: next(iter(v.values())) for k, v in device["attributes"].items()}
        shown = ", ".join(
            f"{k.split('/')[-1]}={attributes[k]}"
            for k in ("type", "pcieSwitch", "pcieTopSwitch", "resource.kubernetes.io/pcieRoot")
            if k in attributes
        )
        out(f"    {device['name']}: {shown}")


def _dra_demo(base: Path, api: ApiServerImitation, out: Callable[[str], None]) -> int:
    """Both resources through DRA on a second node, one claim end to end."""
    from devplugin.policy.claim_templates import Shape, claim_template, device_classes
    from devplugin.testing.dra_kubelet import ClaimCall, DraKubeletSimulator, container_cdi_ids

    try:
        # The allocator imitation evaluates CEL with cel-python (a dev extra).
        from devplugin.testing.dra_scheduler import schedule_claim
    except ImportError as exc:
        out(f"DRA demo skipped: {exc} (install devplugin[dev]; `make demo` does)")
        return 0

    driver, node_name = "devplugin.io", "dra-node"
    node = build_node(hgx_node(), base / "node")
    kubeconfig = base / "kubeconfig"
    kubeconfig.write_text(json.dumps(api.kubeconfig()))
    api.put("nodes", {"metadata": {"name": node_name}})
    for device_class in device_classes(driver):
        api.put("deviceclasses", device_class)
    cdi_dirs = [base / "etc-cdi", base / "run-cdi"]
    kubelet = DraKubeletSimulator(base / "registry", node=node_name, api=api)
    kubelet.start()
    config = _dra_config(base, node, kubeconfig, node_name, cdi_dirs)
    daemon = build(config, FakeNvml.from_file(node.fixture))
    try:
        daemon.start()
        out(f"DRA: node {node_name}, both resources served by DRA driver {driver}")
        if not kubelet.wait_for(lambda: kubelet.registered(driver), timeout=10):
            out("demo failed: the DRA driver did not register with the kubelet")
            return 1
        plugin = kubelet.plugin(driver)
        out(f"  registered: endpoint {plugin.endpoint}, services {', '.join(plugin.versions)}")

        _show_slices(api, node, node_name, out)
        template = claim_template(Shape(2, 2), driver, namespace="default")
        api.put("resourceclaims", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "trainer-c-gpus", "namespace": "default"},
            "spec": template["spec"]["spec"],
        })  # fmt: skip
        out(
            f"claim default/trainer-c-gpus from the chart's template {template['metadata']['name']}"
        )
        results = schedule_claim(api, "trainer-c-gpus", "default", node_name)
        if results is None:
            out("demo failed: the allocator imitation found no devices for the claim")
            return 1
        for result in results:
            out(f"  allocated {result['request']:12} -> {result['device']}")
        claim = api.get("resourceclaims", "trainer-c-gpus", "default") or {}
        call = ClaimCall("default", claim["metadata"]["uid"], "trainer-c-gpus")
        answer = kubelet.prepare(driver, [call])[call.uid]
        if answer["error"]:
            out(f"demo failed: prepare: {answer['error']}")
            return 1
        topology = daemon.core.coordinator.topology
        devices = [d for d in answer["devices"] if d["requests"] != [WHOLE_CLAIM]]
        by_request = {d["requests"][0]: d for d in devices}
        out("NodePrepareResources answered:")
        for device in answer["devices"]:
            requests, ids = ",".join(device["requests"]), ", ".join(device["cdi"])
            whom = "the whole claim" if device["requests"] == [WHOLE_CLAIM] else requests
            out(f"  {device['device']} for {whom}: {ids}")
        names = {d.name: d.id for d in daemon.dra.devices()} if daemon.dra is not None else {}
        for i in range(2):
            gpu, hca = by_request[f"gpu-{i}"]["device"], by_request[f"hca-{i}"]["device"]
            level = topology.level(names[gpu], names[hca]).name
            out(f"  pair {i}: {gpu} + {hca} at {level}")
        runtime = CdiRuntime(cdi_dirs, host_dev=node.dev_root)
        for request in ("", "hca-0"):
            edits = runtime.resolve(container_cdi_ids(answer["devices"], request))
            whom = f"request {request}" if request else "the whole claim"
            out(f"a container naming {whom} gets {len(edits.nodes())} device nodes and:")
            for key, value in sorted(edits.environment().items()):
                out(f"  env {key}={value}")
        errors = kubelet.unprepare(driver, [call])
        out(
            f"NodeUnprepareResources: {errors[call.uid] or 'done'}; the claim's CDI spec removed: "
            f"{not any((cdi_dirs[1]).glob(f'*{call.uid}*'))}"
        )
        return 0
    finally:
        daemon.stop()
        kubelet.stop()
