"""The Helm chart: rendered by the real Helm engine, and checked without it.

With Helm: helm-sdkpy (Helm's Go library) runs in its own Python 3.12
environment (`.venv-helm`, made by `make test` with scripts/helm-env.sh)
and installs the chart against a fake API server that records every object, for the default values
and for each switch (sharing, hooks, metrics, privileges, placement); bad
values must make the install fail on the chart's schema. Where helm-sdkpy
cannot be installed those tests are skipped, saying why.

Without Helm: the values (defaults and every switch) are checked against
values.schema.json, the daemon config the chart renders is rebuilt from the
values the way the template builds it and must load in devplugin, and the
schema must be the one generated from devplugin's config.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from devplugin.config import json_schema, parse_config
from tests.chart_support import CASES
from tests.monitoring_support import ALERTS_FILE, DASHBOARD_FILE

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "devplugin"
HELM_ENV = ROOT / ".venv-helm"
RENDER = Path(__file__).resolve().parents[1] / "helm" / "render.py"
sys.path.insert(0, str(ROOT / "scripts"))
from chart_schema import values_schema  # noqa: E402

DEFAULTS: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())

# The cluster a case installs into, where it is not the default one
# (v1.31.0, serving every API the chart uses).
OLD = {"kubeVersion": "v1.29.9", "without": ["admissionregistration.k8s.io/v1"]}
CLUSTERS: dict[str, dict[str, Any]] = {
    "managed-cluster": {"kubeVersion": "v1.34.2-eks-4f9b2c1"},
    "pinned-scheduler": {"kubeVersion": "v1.34.2"},
    "old-cluster": OLD,
    "no-node-restriction": OLD,
    "dra": {"kubeVersion": "v1.34.2"},
    "dra-1.36": {"kubeVersion": "v1.36.1"},
    "dra-scheduler": {"kubeVersion": "v1.35.3"},
    "dra-taint-forced": {"kubeVersion": "v1.34.2"},
}

BAD: dict[str, tuple[dict[str, Any], str]] = {
    "unknown-config-key": ({"config": {"resources": {"gpu": {"nmae": "x/y"}}}}, "nmae"),
    "zero-replicas": ({"config": {"sharing": {"gpu": {"replicas": 0}}}}, "replicas"),
    "shell-string-hook": (
        {"config": {"resources": {"gpu": {"hooks": {"init": "reset --all"}}}}}, "init"
    ),
    "port-out-of-range": ({"metrics": {"port": 70000}}, "port"),
    "chart-managed-path": ({"config": {"paths": {"dev_root": "/x"}}}, "paths"),
    "chart-managed-cdi-dirs": ({"config": {"cdi": {"spec_dirs": ["/x"]}}}, "spec_dirs"),
    "unknown-strategy": (
        {"config": {"resources": {"gpu": {"device_list_strategy": ["cdi"]}}}},
        "device_list_strategy",
    ),
    "no-strategy": (
        {"config": {"resources": {"hca": {"device_list_strategy": []}}}}, "device_list_strategy"
    ),
    "bad-recovery": ({"config": {"health": {"recovery": "never"}}}, "recovery"),
    "bad-resource-name": ({"config": {"resources": {"hca": {"name": "hca"}}}}, "name"),
    "unknown-top-level": ({"replicas": 3}, "replicas"),
    "bad-api": ({"config": {"resources": {"gpu": {"api": "grpc"}}}}, "api"),
    "bad-template-namespace": (
        {"dra": {"claimTemplates": {"namespaces": ["Team A"]}}}, "namespaces"
    ),
}  # fmt: skip


def merged(values: dict[str, Any]) -> dict[str, Any]:
    """Helm's merge of user values over the chart's: maps deep, lists replaced."""

    def merge(base: Any, over: Any) -> Any:
        if isinstance(base, dict) and isinstance(over, dict):
            out = dict(base)
            for key, value in over.items():
                out[key] = merge(base.get(key), value) if key in base else copy.deepcopy(value)
            return out
        return copy.deepcopy(over)

    result: dict[str, Any] = merge(DEFAULTS, values)
    return result


def expected_config(values: dict[str, Any], kube_version: str = "v1.31.0") -> dict[str, Any]:
    """The daemon config the chart's `devplugin.config` template renders on
    a cluster of `kube_version`."""
    full = merged(values)
    config: dict[str, Any] = copy.deepcopy(full["config"])
    config.setdefault("lifecycle", {})["checkpoint_file"] = "/var/lib/devplugin/checkpoint.json"
    config["version"] = "v1"
    config["paths"] = {
        "sysfs_root": "/host/sys",
        "dev_root": "/host/dev",
        "device_plugin_dir": "/var/lib/kubelet/device-plugins",
        "pod_resources_socket": "/var/lib/kubelet/pod-resources/kubelet.sock",
        "kubelet_plugins_dir": full["hostPaths"]["kubeletPlugins"],
        "kubelet_registry_dir": full["hostPaths"]["kubeletRegistry"],
    }
    config["metrics"] = {"enabled": full["metrics"]["enabled"]}
    paths = full["hostPaths"]
    config.setdefault("cdi", {})["spec_dirs"] = [paths["cdiStatic"], paths["cdiDynamic"]]
    if paths["kubeletConfig"]:
        config.setdefault("kubelet", {})["config_file"] = "/host/kubelet/config"
    resources = config.get("resources") or {}
    if any(
        (resources.get(kind) or {}).get("api") == "dra"
        and (resources.get(kind) or {}).get("enabled", True)
        for kind in ("gpu", "hca")
    ):
        # Device taints are honoured by default from 1.36 (DRADeviceTaints beta).
        major, minor = (int(n) for n in kube_version.lstrip("v").split(".")[:2])
        dra = config.setdefault("dra", {})
        dra.setdefault("unhealthy", "taint" if (major, minor) >= (1, 36) else "remove")
    return config


# -- without Helm ------------------------------------------------------------------


def test_values_schema_is_generated_from_the_daemon_config() -> None:
    assert values_schema() == SCHEMA
    assert SCHEMA["properties"]["config"] == json_schema()


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_switch_passes_the_schema(case: str) -> None:
    jsonschema.validate(merged(CASES[case]), SCHEMA)


def test_the_schema_accepts_global_values_set_by_a_parent_chart() -> None:
    jsonschema.validate(merged({"global": {"imageRegistry": "registry.example.com"}}), SCHEMA)


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_values_fail_the_schema(case: str) -> None:
    values, _ = BAD[case]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(merged(values), SCHEMA)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_rendered_daemon_config_loads(case: str) -> None:
    config = parse_config(expected_config(CASES[case]))
    assert config.paths.sysfs_root == "/host/sys"
    assert config.lifecycle.checkpoint_file == "/var/lib/devplugin/checkpoint.json"
    if case == "sharing":
        assert config.sharing.gpu.replicas == 4
        assert config.sharing.gpu.resource_name == "nvidia.com/gpu.shared"
        assert config.sharing.hca.units == 8
    if case == "hooks":
        assert config.resources.gpu.hooks.cleanup == (
            "python3",
            "-m",
            "devplugin.hooks.gpu_cleanup",
        )
        assert config.resources.gpu.hooks.init_phase == "pre_start"
        assert config.health.recovery == "after_cleanup"
    assert config.metrics.enabled is (case != "no-metrics")


# -- with Helm ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def helm_python() -> str:
    """The Helm environment `make test` made (scripts/helm-env.sh); the
    tests install nothing themselves."""
    python = HELM_ENV / "bin" / "python"
    if not (HELM_ENV / ".installed").exists():
        why = HELM_ENV / "UNAVAILABLE"
        reason = why.read_text().strip() if why.exists() else "not made (run make test)"
        pytest.skip(f"Helm tests: .venv-helm {reason}")
    return str(python)


def run_helm(python: str, cases: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    entries = [
        {"name": name, "values": values, **CLUSTERS.get(name, {})} for name, values in cases.items()
    ]
    payload = json.dumps(entries)
    result = subprocess.run(
        [python, str(RENDER), str(CHART)],
        input=payload,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=dict(os.environ, HELM_DRIVER="memory"),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return {entry["name"]: entry for entry in json.loads(result.stdout)}


@pytest.fixture(scope="session")
def installs(
    helm_python: str, tmp_path_factory: pytest.TempPathFactory, worker_id: str
) -> dict[str, dict[str, Any]]:
    # Rendering every case takes about 24 s of Helm: under xdist the first
    # worker to get here renders for all of them (the run's shared base
    # directory), the others wait on the lock and read its result.
    if worker_id == "master":
        return run_helm(helm_python, CASES)
    shared = tmp_path_factory.getbasetemp().parent / "helm-installs.json"
    with shared.with_suffix(".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if shared.exists():
            found: dict[str, dict[str, Any]] = json.loads(shared.read_text())
            return found
        rendered = run_helm(helm_python, CASES)
        shared.write_text(json.dumps(rendered))
        return rendered


def objects(installs: dict[str, dict[str, Any]], case: str) -> dict[str, dict[str, Any]]:
    """The daemon's objects by kind. With the extender on, some kinds come
    twice or three times; the daemon's has the chart's base name, the
    extender's and the scheduler's add a suffix (and Helm's order among
    objects of one kind is not fixed)."""
    entry = installs[case]
    assert entry["ok"], entry.get("error")
    by_kind: dict[str, dict[str, Any]] = {}
    for obj in entry["objects"]:
        kept = by_kind.get(obj["kind"])
        if kept is None or len(obj["metadata"]["name"]) < len(kept["metadata"]["name"]):
            by_kind[obj["kind"]] = obj
    return by_kind


def container(objs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (main,) = objs["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    result: dict[str, Any] = main
    return result


def test_helm_lint_passes(helm_python: str) -> None:
    result = subprocess.run(
        [helm_python, str(RENDER), str(CHART), "lint"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["TotalChartsLinted"] == 1
    assert not report["Errors"]


def test_default_install_renders_a_least_privilege_daemonset(
    installs: dict[str, dict[str, Any]],
) -> None:
    objs = objects(installs, "defaults")
    assert set(objs) == {
        "ConfigMap",
        "DaemonSet",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "CustomResourceDefinition",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
    daemonset = objs["DaemonSet"]
    spec = daemonset["spec"]["template"]["spec"]
    assert daemonset["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    assert spec["priorityClassName"] == "system-node-critical"
    assert {t["key"] for t in spec["tolerations"]} == {"nvidia.com/gpu", "CriticalAddonsOnly"}
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    keys = {term["matchExpressions"][0]["key"] for term in terms["nodeSelectorTerms"]}
    assert "feature.node.kubernetes.io/pci-0302_10de.present" in keys
    assert "feature.node.kubernetes.io/pci-0207_15b3.present" in keys
    # The vendor-only labels NVIDIA's chart and the GPU Operator use.
    assert "feature.node.kubernetes.io/pci-10de.present" in keys
    assert "feature.node.kubernetes.io/pci-15b3.present" in keys
    assert "hostNetwork" not in spec
    main = container(objs)
    security = main["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert "privileged" not in security
    mounts = {m["name"]: m for m in main["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    for name, host in [
        ("device-plugins", "/var/lib/kubelet/device-plugins"),
        ("pod-resources", "/var/lib/kubelet/pod-resources"),
        ("sys", "/sys"),
        ("dev", "/dev"),
        ("state", "/var/lib/devplugin"),
    ]:
        assert volumes[name]["hostPath"]["path"] == host
    assert mounts["sys"]["readOnly"] is True
    assert mounts["dev"]["readOnly"] is True
    assert mounts["pod-resources"]["readOnly"] is True
    assert not mounts["device-plugins"].get("readOnly", False)
    assert main["args"] == [
        "--config=/etc/devplugin/config.yaml",
        "--metrics-address=127.0.0.1:9410",
        "--metrics-address=$(POD_IP):9410",
    ]
    assert main["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert main["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert main["image"] == "ghcr.io/devplugin/devplugin:0.1.0"


def test_cdi_directories_are_mounted_only_when_a_strategy_uses_cdi(
    installs: dict[str, dict[str, Any]],
) -> None:
    defaults = container(objects(installs, "defaults"))
    assert not {m["name"] for m in defaults["volumeMounts"]} & {"cdi-static", "cdi-dynamic"}
    objs = objects(installs, "cdi")
    mounts = {m["name"]: m for m in container(objs)["volumeMounts"]}
    volumes = {v["name"]: v for v in objs["DaemonSet"]["spec"]["template"]["spec"]["volumes"]}
    # The node's GPU spec is read; the daemon's HCA spec is written.
    assert mounts["cdi-static"] == {"name": "cdi-static", "mountPath": "/etc/cdi", "readOnly": True}
    assert mounts["cdi-dynamic"] == {"name": "cdi-dynamic", "mountPath": "/run/cdi"}
    assert volumes["cdi-static"]["hostPath"]["path"] == "/etc/cdi"
    assert volumes["cdi-dynamic"]["hostPath"]["path"] == "/run/cdi"
    config = yaml.safe_load(objs["ConfigMap"]["data"]["config.yaml"])
    assert config["cdi"]["spec_dirs"] == ["/etc/cdi", "/run/cdi"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_config_is_the_expected_one_and_rolls_the_pods(
    installs: dict[str, dict[str, Any]], case: str
) -> None:
    objs = objects(installs, case)
    text = objs["ConfigMap"]["data"]["config.yaml"]
    version = CLUSTERS.get(case, {}).get("kubeVersion", "v1.31.0")
    assert yaml.safe_load(text) == expected_config(CASES[case], version)
    parse_config(yaml.safe_load(text))
    annotations = objs["DaemonSet"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["checksum/config"] == hashlib.sha256(text.rstrip("\n").encode()).hexdigest()


def test_the_second_scheduler_weighs_dra_scores_above_the_default_plugins_from_1_35(
    installs: dict[str, dict[str, Any]],
) -> None:
    def profile(case: str) -> dict[str, Any]:
        objs = installs[case]["objects"]
        maps = [
            o for o in objs if o["kind"] == "ConfigMap" and "scheduler-config.yaml" in o["data"]
        ]
        (found,) = maps
        config = yaml.safe_load(found["data"]["scheduler-config.yaml"])
        (only,) = config["profiles"]
        return dict(only)

    weighed = profile("dra-scheduler")["plugins"]["score"]["enabled"]
    assert weighed == [{"name": "DynamicResources", "weight": 1301}]
    # The other default score plugins together: TaintToleration 3, NodeAffinity,
    # PodTopologySpread and InterPodAffinity 2 each, four more at 1.
    assert weighed[0]["weight"] > 100 * (3 + 2 + 2 + 2 + 1 + 1 + 1 + 1)
    # Without DRA (1.34, device plugins) the profile is the default one.
    assert "plugins" not in profile("managed-cluster")


def test_unhealthy_dra_devices_are_left_out_where_the_scheduler_ignores_taints(
    installs: dict[str, dict[str, Any]],
) -> None:
    def unhealthy(case: str) -> str:
        text = objects(installs, case)["ConfigMap"]["data"]["config.yaml"]
        return str(parse_config(yaml.safe_load(text)).dra.unhealthy)

    assert unhealthy("dra") == "remove"  # 1.34: DRADeviceTaints off by default
    assert unhealthy("dra-1.36") == "taint"
    assert unhealthy("dra-taint-forced") == "taint"


def test_a_config_change_changes_the_checksum(installs: dict[str, dict[str, Any]]) -> None:
    def checksum(case: str) -> str:
        template = objects(installs, case)["DaemonSet"]["spec"]["template"]
        value: str = template["metadata"]["annotations"]["checksum/config"]
        return value

    assert checksum("defaults") != checksum("sharing")
    assert checksum("defaults") != checksum("hooks")
    assert checksum("defaults") == checksum("placement")  # no config change, no roll


def test_metrics_switches(installs: dict[str, dict[str, Any]]) -> None:
    objs = objects(installs, "metrics")
    service = objs["Service"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["ports"][0]["port"] == 9500
    assert service["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    monitor = objs["ServiceMonitor"]
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s"}
    ]
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    main = container(objs)
    assert main["ports"] == [{"name": "metrics", "containerPort": 9500, "protocol": "TCP"}]
    off = container(objects(installs, "no-metrics"))
    assert "ports" not in off
    assert "livenessProbe" not in off
    assert off["args"] == ["--config=/etc/devplugin/config.yaml"]


def test_alerts_dashboard_and_the_extenders_monitor_are_opt_in(
    installs: dict[str, dict[str, Any]],
) -> None:
    default = {obj["kind"] for obj in installs["defaults"]["objects"]}
    assert "PrometheusRule" not in default
    assert not [
        o for o in installs["defaults"]["objects"] if o["metadata"]["name"].endswith("-dashboard")
    ]
    entry = installs["monitoring"]
    assert entry["ok"], entry.get("error")
    objs = entry["objects"]
    (rule,) = [o for o in objs if o["kind"] == "PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "prom"
    # The rules promtool tests, with only the runbooks' address changed.
    shipped = yaml.safe_load(ALERTS_FILE.read_text())
    text = json.dumps(shipped["groups"]).replace(
        "https://devplugin.io/docs/operators/alerts", "https://wiki.example.com/gpu/runbooks"
    )
    assert rule["spec"]["groups"] == json.loads(text)
    (board,) = [
        o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboard")
    ]
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(board["data"]["devplugin.json"]) == json.loads(DASHBOARD_FILE.read_text())
    monitors = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ServiceMonitor"}
    (extender_monitor,) = [m for name, m in monitors.items() if name.endswith("-extender")]
    services = [o for o in objs if o["kind"] == "Service"]
    selector = extender_monitor["spec"]["selector"]["matchLabels"]
    chosen = [s for s in services if selector.items() <= s["metadata"]["labels"].items()]
    assert [s["metadata"]["name"] for s in chosen] == [
        n for n in (s["metadata"]["name"] for s in services) if n.endswith("-extender")
    ]
    (endpoint,) = extender_monitor["spec"]["endpoints"]
    assert endpoint["port"] == chosen[0]["spec"]["ports"][0]["name"]
    assert endpoint["scheme"] == "https"


def test_privileged_and_placement_switches(installs: dict[str, dict[str, Any]]) -> None:
    assert container(objects(installs, "hooks"))["securityContext"] == {"privileged": True}
    objs = objects(installs, "placement")
    spec = objs["DaemonSet"]["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"gpu.example.com/pool": "training"}
    assert spec["affinity"] == {"podAntiAffinity": {}}
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert container(objs)["image"] == "registry.example.com/devplugin:1.2.3"


def test_the_kubelets_config_file_is_mounted_read_only_where_named(
    installs: dict[str, dict[str, Any]],
) -> None:
    objs = objects(installs, "no-kube-proxy")
    mounts = {m["name"]: m for m in container(objs)["volumeMounts"]}
    assert mounts["kubelet-config"] == {
        "name": "kubelet-config",
        "mountPath": "/host/kubelet/config",
        "readOnly": True,
    }
    volumes = {v["name"]: v for v in objs["DaemonSet"]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["kubelet-config"]["hostPath"] == {
        "path": "/var/lib/kubelet/config.yaml",
        "type": "File",
    }
    config = yaml.safe_load(objs["ConfigMap"]["data"]["config.yaml"])
    assert config["kubelet"]["config_file"] == "/host/kubelet/config"
    plain = container(objects(installs, "extender"))
    assert all(m["name"] != "kubelet-config" for m in plain["volumeMounts"])


def test_the_api_servers_address_where_its_service_is_out_of_reach(
    installs: dict[str, dict[str, Any]],
) -> None:
    """kubernetesService: both programs' in-cluster address; unset, the
    kubelet's own (no variable of the chart's)."""
    wanted = [{"name": "KUBERNETES_SERVICE_HOST", "value": "10.0.0.10"},
              {"name": "KUBERNETES_SERVICE_PORT", "value": "6443"}]  # fmt: skip
    objs = objects(installs, "no-kube-proxy")
    assert all(entry in container(objs)["env"] for entry in wanted)
    deployment = objs["Deployment"]["spec"]["template"]["spec"]
    (extender,) = deployment["containers"]
    assert extender["env"] == wanted
    assert deployment["hostNetwork"] is True
    assert deployment["dnsPolicy"] == "ClusterFirstWithHostNet"
    default = objects(installs, "extender")
    assert not any(e["name"].startswith("KUBERNETES_") for e in container(default)["env"])
    (plain,) = default["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert "env" not in plain
    assert "hostNetwork" not in default["Deployment"]["spec"]["template"]["spec"]


def test_paths_probes_and_rollout_switches(installs: dict[str, dict[str, Any]]) -> None:
    objs = objects(installs, "paths-and-probes")
    daemonset = objs["DaemonSet"]
    spec = daemonset["spec"]["template"]["spec"]
    volumes = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert volumes["device-plugins"] == "/data/kubelet/device-plugins"
    assert volumes["pod-resources"] == "/data/kubelet/pod-resources"
    assert volumes["state"] == "/data/devplugin"
    main = container(objs)
    # The container sees the kubelet's directories where the daemon expects them.
    mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
    assert mounts["device-plugins"] == "/var/lib/kubelet/device-plugins"
    assert "livenessProbe" not in main
    assert main["readinessProbe"]["periodSeconds"] == 2
    # Maps merge into the chart's defaults, as Helm merges values.
    assert main["resources"] == {
        "requests": {"cpu": "10m", "memory": "64Mi"},
        "limits": {"memory": "256Mi"},
    }
    assert daemonset["spec"]["updateStrategy"]["type"] == "OnDelete"
    assert spec["priorityClassName"] == "gpu-infra-critical"


def test_helm_install_rejects_bad_values(helm_python: str) -> None:
    results = run_helm(helm_python, {name: values for name, (values, _) in BAD.items()})
    for name, (_, field) in BAD.items():
        entry = results[name]
        assert not entry["ok"], name
        assert "schema" in entry["error"], (name, entry["error"])
        assert field in entry["error"], (name, entry["error"])


def test_service_monitor_without_service_fails_clearly(helm_python: str) -> None:
    results = run_helm(
        helm_python, {"monitor-only": {"metrics": {"serviceMonitor": {"enabled": True}}}}
    )
    entry = results["monitor-only"]
    assert not entry["ok"]
    assert "metrics.serviceMonitor.enabled needs metrics.service.enabled" in entry["error"]


def test_the_daemon_gets_api_access_with_the_least_rights_that_work(
    installs: dict[str, dict[str, Any]],
) -> None:
    objs = objects(installs, "defaults")
    account = objs["ServiceAccount"]["metadata"]["name"]
    spec = objs["DaemonSet"]["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == account
    env = {e["name"]: e for e in container(objs)["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    rules = {
        (group, resource): sorted(rule["verbs"])
        for rule in objs["ClusterRole"]["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert rules == {
        ("", "pods"): ["get", "list", "watch"],
        ("", "nodes"): ["get", "list", "patch", "watch"],
        ("", "events"): ["create", "patch"],
        ("devplugin.io", "nodedevices"): sorted(
            ["get", "list", "watch", "create", "update", "patch"]
        ),
        ("devplugin.io", "nodedevices/status"): sorted(
            ["get", "list", "watch", "create", "update", "patch"]
        ),
    }
    binding = objs["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == objs["ClusterRole"]["metadata"]["name"]
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": account,
            "namespace": objs["ServiceAccount"]["metadata"]["namespace"],
        }
    ]
    # The heartbeat: its own Lease, in its own namespace only.
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    lease_role = objs["Role"]
    namespace = objs["ServiceAccount"]["metadata"]["namespace"]
    assert lease_role["metadata"]["namespace"] == namespace
    assert lease_role["rules"] == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "verbs": ["get", "create", "update"],
        }
    ]
    assert objs["RoleBinding"]["roleRef"]["name"] == lease_role["metadata"]["name"]
    crd = objs["CustomResourceDefinition"]
    assert crd["metadata"]["name"] == "nodedevices.devplugin.io"
    shipped = yaml.safe_load((CHART / "crds" / "nodedevices.yaml").read_text())
    assert crd["spec"] == shipped["spec"]
    config = yaml.safe_load(objs["ConfigMap"]["data"]["config.yaml"])
    assert config["kubernetes"]["enabled"] is True


def test_without_node_labels_the_daemon_may_only_read_its_node(
    installs: dict[str, dict[str, Any]],
) -> None:
    objs = objects(installs, "no-node-restriction")
    (nodes,) = [rule for rule in objs["ClusterRole"]["rules"] if rule["resources"] == ["nodes"]]
    assert nodes["verbs"] == ["get"]
    config = yaml.safe_load(objs["ConfigMap"]["data"]["config.yaml"])
    assert config["kubernetes"]["node_labels"] is False


def test_an_existing_service_account_without_rbac(installs: dict[str, dict[str, Any]]) -> None:
    objs = objects(installs, "own-service-account")
    assert "ServiceAccount" not in objs
    assert "ClusterRole" not in objs
    assert objs["DaemonSet"]["spec"]["template"]["spec"]["serviceAccountName"] == "gpu-agents"


def test_the_extender_and_a_second_scheduler_profile(installs: dict[str, dict[str, Any]]) -> None:
    entry = installs["extender"]
    assert entry["ok"], entry.get("error")
    found = {(o["kind"], o["metadata"]["name"]): o for o in entry["objects"]}
    deployment = found[("Deployment", "extender-devplugin-extender")]
    (main,) = deployment["spec"]["template"]["spec"]["containers"]
    assert main["args"][:3] == [
        "extender",
        "--listen=0.0.0.0:9443",
        "--stale-after-seconds=90",
    ]
    assert main["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # The DaemonSet's selector must not take the extender's pods.
    daemonset = next(o for o in entry["objects"] if o["kind"] == "DaemonSet")
    ds_labels = daemonset["spec"]["selector"]["matchLabels"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert not ds_labels.items() <= pod_labels.items()
    service = found[("Service", "extender-devplugin-extender")]
    assert service["spec"]["ports"][0]["port"] == 9443
    role = found[("ClusterRole", "extender-devplugin-extender")]
    assert {
        (g, r): sorted(rule["verbs"])
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    } == {
        ("devplugin.io", "nodedevices"): ["get", "list", "watch"],
        ("", "pods"): ["get", "list", "watch"],
        ("policy", "poddisruptionbudgets"): ["get", "list", "watch"],
    }
    leases = found[("Role", "extender-devplugin-extender-leases")]
    assert leases["rules"][0]["resources"] == ["leases"]
    assert sorted(leases["rules"][0]["verbs"]) == ["get", "list", "watch"]
    assert f"--lease-namespace={leases['metadata']['namespace']}" in main["args"]
    config = yaml.safe_load(
        found[("ConfigMap", "extender-devplugin-scheduler")]["data"]["scheduler-config.yaml"]
    )
    assert config["kind"] == "KubeSchedulerConfiguration"
    assert config["profiles"] == [{"schedulerName": "devplugin-scheduler"}]
    (extender,) = config["extenders"]
    namespace = service["metadata"]["namespace"]
    url = extender.pop("urlPrefix")
    assert url == f"http://extender-devplugin-extender.{namespace}.svc:9443/scheduler"
    assert extender == {
        "filterVerb": "filter",
        "prioritizeVerb": "prioritize",
        "preemptVerb": "preempt",
        "weight": 7,
        "nodeCacheCapable": True,
        "enableHTTPS": False,
        "ignorable": True,
        "managedResources": [
            {"name": "nvidia.com/gpu", "ignoredByScheduler": False},
            {"name": "rdma/hca", "ignoredByScheduler": False},
        ],
    }
    scheduler = found[("Deployment", "extender-devplugin-scheduler")]
    (kube,) = scheduler["spec"]["template"]["spec"]["containers"]
    assert kube["command"] == ["kube-scheduler", "--config=/etc/kubernetes/scheduler-config.yaml"]
    bindings = {
        o["roleRef"]["name"]
        for o in entry["objects"]
        if o["kind"] in ("ClusterRoleBinding", "RoleBinding")
    }
    assert {
        "system:kube-scheduler",
        "system:volume-scheduler",
        "extension-apiserver-authentication-reader",
    } <= bindings
    # Off by default.
    assert not any("extender" in o["metadata"]["name"] for o in installs["defaults"]["objects"])


# -- least privilege: each node's daemon writes only its own node's objects -------------

POLICY_NAME = "defaults-devplugin-node-restriction"  # the release is named after its case


def _daemon_user(objs: dict[str, dict[str, Any]], node: str | None) -> dict[str, Any]:
    account = objs["ServiceAccount"]["metadata"]
    extra = {"authentication.kubernetes.io/node-name": [node]} if node else {}
    return {
        "username": f"system:serviceaccount:{account['namespace']}:{account['name']}",
        "extra": extra,
    }


def _request(
    user: dict[str, Any], operation: str, group: str, resource: str, sub: str = ""
) -> dict[str, Any]:
    return {"operation": operation, "userInfo": user, "subResource": sub,
            "resource": {"group": group, "version": "v1", "resource": resource}}  # fmt: skip


def _record(node: str, label: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": node, "labels": {"devplugin.io/node": label or node}}
    return {"apiVersion": "devplugin.io/v1alpha1", "kind": "NodeDevices", "metadata": meta,
            "status": {"devices": []}}  # fmt: skip


def _lease(name: str, label: str) -> dict[str, Any]:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "namespace": "devplugin-system",
                         "labels": {"devplugin.io/node": label}},
            "spec": {"holderIdentity": label, "leaseDurationSeconds": 40}}  # fmt: skip


def test_the_node_restriction_policy_is_installed_and_bound(
    installs: dict[str, dict[str, Any]],
) -> None:
    found = {(o["kind"], o["metadata"]["name"]): o for o in installs["defaults"]["objects"]}
    policy = found[("ValidatingAdmissionPolicy", POLICY_NAME)]
    assert policy["spec"]["failurePolicy"] == "Fail"
    binding = found[("ValidatingAdmissionPolicyBinding", POLICY_NAME)]
    assert binding["spec"] == {"policyName": POLICY_NAME, "validationActions": ["Deny"]}
    # Off on request (a cluster older than 1.30 serves no such API) ...
    assert not any(
        o["kind"].startswith("ValidatingAdmissionPolicy")
        for o in installs["no-node-restriction"]["objects"]
    )
    # ... and without RBAC from the chart there is no account to restrict.
    assert not any(
        o["kind"].startswith("ValidatingAdmissionPolicy")
        for o in installs["own-service-account"]["objects"]
    )


def test_an_old_cluster_must_turn_the_node_restriction_off_knowingly(helm_python: str) -> None:
    result = run_helm(helm_python, {"old-cluster": {}})["old-cluster"]
    assert not result["ok"]
    assert "rbac.nodeRestriction" in result["error"]


def test_the_policy_refuses_another_nodes_record_and_admits_the_nodes_own(
    installs: dict[str, dict[str, Any]],
) -> None:
    from tests.admission_policy import judge

    objs = {(o["kind"], o["metadata"]["name"]): o for o in installs["defaults"]["objects"]}
    policy = objs[("ValidatingAdmissionPolicy", POLICY_NAME)]
    daemon = objects(installs, "defaults")
    node_a = _daemon_user(daemon, "node-a")
    records = ("devplugin.io", "nodedevices")

    # Its own record: created, its status written, deleted.
    assert judge(policy, _request(node_a, "CREATE", *records), _record("node-a")).allowed
    own = judge(
        policy, _request(node_a, "UPDATE", *records, "status"), _record("node-a"), _record("node-a")
    )
    assert own.applies
    assert own.allowed
    assert judge(policy, _request(node_a, "DELETE", *records), None, _record("node-a")).allowed

    # Another node's record: not created, not rewritten, not deleted.
    for operation, sub, new, old in [
        ("CREATE", "", _record("node-b"), None),
        ("UPDATE", "status", _record("node-b"), _record("node-b")),
        ("UPDATE", "", _record("node-b"), _record("node-b")),
        ("DELETE", "", None, _record("node-b")),
    ]:
        verdict = judge(policy, _request(node_a, operation, *records, sub), new, old)
        assert verdict.applies
        assert not verdict.allowed, (operation, sub)
        assert "node-a may write only its own NodeDevices record, not node-b" in verdict.message
    # Its own name but claiming another node by label (what the extender keys by).
    spoof = judge(policy, _request(node_a, "CREATE", *records), _record("node-a", "node-b"))
    assert not spoof.allowed
    assert "may not label an object for node node-b" in spoof.message

    # Heartbeats: its own Lease only.
    leases = ("coordination.k8s.io", "leases")
    lease_a = _lease("devplugin-node-a", "node-a")
    assert judge(policy, _request(node_a, "UPDATE", *leases), lease_a, lease_a).allowed
    lease_b = _lease("devplugin-node-b", "node-b")
    other = judge(policy, _request(node_a, "UPDATE", *leases), lease_b, lease_b)
    assert not other.allowed
    assert "only the Lease devplugin-node-a, not devplugin-node-b" in other.message
    for duration in (0, 301, 2**31 - 1):  # a promise of years keeps a dead node alive
        long = _lease("devplugin-node-a", "node-a")
        long["spec"]["leaseDurationSeconds"] = duration
        verdict = judge(policy, _request(node_a, "UPDATE", *leases), long, lease_a)
        assert not verdict.allowed, duration
        assert "between 1 and 300 seconds" in verdict.message
    forged = judge(
        policy, _request(node_a, "UPDATE", *leases), _lease("devplugin-node-a", "node-b"), lease_a
    )
    assert not forged.allowed

    # A token bound to no node (a long-lived secret token): refused outright.
    unbound = _daemon_user(daemon, None)
    verdict = judge(policy, _request(unbound, "CREATE", *records), _record("node-a"))
    assert not verdict.allowed
    assert "names no node" in verdict.message

    # Anyone else (an operator, a controller) is not this policy's business.
    admin = {"username": "kubernetes-admin", "extra": {}}
    record_b = _record("node-b")
    verdict = judge(policy, _request(admin, "UPDATE", *records), record_b, record_b)
    assert not verdict.applies
    assert verdict.allowed
    # Nor are the daemon's other writes (Events on pods).
    event = {"metadata": {"name": "x", "namespace": "default"}}
    assert not judge(policy, _request(node_a, "CREATE", "", "events"), event).applies


def _node(name: str, labels: dict[str, str], **spec: Any) -> dict[str, Any]:
    metadata = {
        "name": name,
        "labels": labels,
        "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
    }
    return {"apiVersion": "v1", "kind": "Node", "metadata": metadata, "spec": spec}


def test_the_policy_lets_a_daemon_change_only_devplugin_labels_on_its_own_node(
    installs: dict[str, dict[str, Any]],
) -> None:
    from tests.admission_policy import judge

    objs = {(o["kind"], o["metadata"]["name"]): o for o in installs["defaults"]["objects"]}
    policy = objs[("ValidatingAdmissionPolicy", POLICY_NAME)]
    node_a = _daemon_user(objects(installs, "defaults"), "node-a")
    patch = _request(node_a, "UPDATE", "", "nodes")
    base = {"kubernetes.io/hostname": "node-a", "devplugin.io/gpu.count": "4"}
    old = _node("node-a", base, podCIDR="10.0.0.0/24")

    def verdict(new: dict[str, Any], before: dict[str, Any] = old) -> Any:
        return judge(policy, patch, new, before)

    # Its own labels: set, changed, removed, and the first ever on a bare Node.
    mine = dict(base, **{"devplugin.io/gpu.count": "8", "devplugin.io/gpu.product": "A100"})
    assert verdict(_node("node-a", mine, podCIDR="10.0.0.0/24")).allowed
    gone = {"kubernetes.io/hostname": "node-a"}
    assert verdict(_node("node-a", gone, podCIDR="10.0.0.0/24")).allowed
    bare = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}}
    first = dict(bare, metadata={"name": "node-a", "labels": {"devplugin.io/gpu.count": "8"}})
    assert verdict(first, bare).allowed

    refused = {
        "another node": (_node("node-b", mine, podCIDR="10.0.0.0/24"), "only its own Node"),
        "a foreign label changed": (
            _node("node-a", dict(base, **{"kubernetes.io/hostname": "x"}), podCIDR="10.0.0.0/24"),
            "only labels under devplugin.io/",
        ),
        "a foreign label added": (
            _node(
                "node-a", dict(base, **{"nvidia.com/gpu.product": "A100"}), podCIDR="10.0.0.0/24"
            ),
            "only labels under devplugin.io/",
        ),
        "a foreign label removed": (
            _node("node-a", {"devplugin.io/gpu.count": "4"}, podCIDR="10.0.0.0/24"),
            "only labels under devplugin.io/",
        ),
        "a taint": (
            _node(
                "node-a", base, podCIDR="10.0.0.0/24", taints=[{"key": "x", "effect": "NoSchedule"}]
            ),
            "not its spec",
        ),
        "cordoned": (
            _node("node-a", base, podCIDR="10.0.0.0/24", unschedulable=True),
            "not its spec",
        ),
    }
    for case, (new, why) in refused.items():
        found = verdict(new)
        assert found.applies, case
        assert not found.allowed, case
        assert why in found.message, (case, found.message)
    annotated = _node("node-a", base, podCIDR="10.0.0.0/24")
    annotated["metadata"]["annotations"]["x"] = "y"
    assert not verdict(annotated).allowed
    # A finalizer holds the Node's deletion; an owner that does not exist
    # lets the garbage collector delete the Node (issue 39, difference 8).
    finalized = _node("node-a", base, podCIDR="10.0.0.0/24")
    finalized["metadata"]["finalizers"] = ["devplugin.io/hold"]
    owned = _node("node-a", base, podCIDR="10.0.0.0/24")
    owned["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "gone", "uid": "0000"}
    ]
    for new in (finalized, owned):
        found = verdict(new)
        assert not found.allowed
        assert "finalizers, owners" in found.message
        # Nor may it take away what someone else set.
        assert not verdict(old, new).allowed
    # The kubelet and everyone else are not this policy's business.
    kubelet = {"username": "system:node:node-a", "extra": {}}
    tainted = _node("node-a", {}, taints=[{"key": "x", "effect": "NoSchedule"}])
    assert not judge(policy, _request(kubelet, "UPDATE", "", "nodes"), tainted, old).applies


def test_the_second_schedulers_image_follows_the_cluster(
    installs: dict[str, dict[str, Any]],
) -> None:
    def image(case: str) -> str:
        found = {(o["kind"], o["metadata"]["name"]): o for o in installs[case]["objects"]}
        deployment = found[("Deployment", f"{case}-devplugin-scheduler")]
        (kube,) = deployment["spec"]["template"]["spec"]["containers"]
        value: str = kube["image"]
        return value

    assert image("extender") == "registry.k8s.io/kube-scheduler:v1.31.0"
    # A vendor's build suffix is dropped: the registry has the plain release only.
    assert image("managed-cluster") == "registry.k8s.io/kube-scheduler:v1.34.2"
    assert image("pinned-scheduler") == "mirror.example.com/kube-scheduler:v1.33.5"


def test_dra_installs_classes_templates_mounts_and_rights(
    installs: dict[str, dict[str, Any]],
) -> None:
    from devplugin.policy.claim_templates import CHART_SHAPES, claim_template

    driver = "dra.example.com"
    everything = installs["dra"]["objects"]
    classes = {o["metadata"]["name"]: o for o in everything if o["kind"] == "DeviceClass"}
    assert set(classes) == {f"gpu.{driver}", f"hca.{driver}", f"mig.{driver}"}
    # The chart's classes are the ones the code's templates name.
    from devplugin.policy.claim_templates import device_classes

    for expected in device_classes(driver):
        name = expected["metadata"]["name"]
        assert classes[name]["spec"] == expected["spec"], name
    templates = {
        (o["metadata"]["namespace"], o["metadata"]["name"]): o
        for o in everything
        if o["kind"] == "ResourceClaimTemplate"
    }
    assert len(templates) == 2 * len(CHART_SHAPES)
    for namespace in ("default", "training"):
        for shape in CHART_SHAPES:
            expected = claim_template(shape, driver, namespace=namespace)
            found = templates[(namespace, expected["metadata"]["name"])]
            assert found["spec"] == expected["spec"]
    objs = objects(installs, "dra")
    mounts = {m["name"]: m for m in container(objs)["volumeMounts"]}
    volumes = {v["name"]: v for v in objs["DaemonSet"]["spec"]["template"]["spec"]["volumes"]}
    assert mounts["kubelet-plugins"]["mountPath"] == "/data/kubelet/plugins"
    assert volumes["kubelet-plugins"]["hostPath"]["path"] == "/data/kubelet/plugins"
    assert mounts["kubelet-registry"]["mountPath"] == "/var/lib/kubelet/plugins_registry"
    assert "cdi-dynamic" in mounts  # the claims' CDI specs are written there
    rules = objs["ClusterRole"]["rules"]
    assert {
        "apiGroups": ["resource.k8s.io"],
        "resources": ["resourceclaims"],
        "verbs": ["get", "list", "watch"],
    } in rules
    writes = ["get", "list", "watch", "create", "update", "patch", "delete"]
    assert {
        "apiGroups": ["resource.k8s.io"],
        "resources": ["resourceslices"],
        "verbs": writes,
    } in rules
    assert {
        "apiGroups": ["resource.k8s.io"],
        "resources": ["resourceclaims/driver"],
        "resourceNames": [driver],
        "verbs": ["associated-node:update", "associated-node:patch"],
    } in rules
    # Without DRA: none of it.
    defaults = installs["defaults"]["objects"]
    assert not [o for o in defaults if o["kind"] in ("DeviceClass", "ResourceClaimTemplate")]
    default_rules = objects(installs, "defaults")["ClusterRole"]["rules"]
    assert not [r for r in default_rules if "resource.k8s.io" in r["apiGroups"]]
    assert "kubelet-plugins" not in {
        m["name"] for m in container(objects(installs, "defaults"))["volumeMounts"]
    }


def test_the_policy_lets_a_node_write_only_its_own_slices(
    installs: dict[str, dict[str, Any]],
) -> None:
    from tests.admission_policy import judge

    found = {(o["kind"], o["metadata"]["name"]): o for o in installs["dra"]["objects"]}
    policy = found[("ValidatingAdmissionPolicy", "dra-devplugin-node-restriction")]
    node_a = _daemon_user(objects(installs, "dra"), "node-a")
    slices = ("resource.k8s.io", "resourceslices")

    def piece(node: str | None) -> dict[str, Any]:
        spec: dict[str, Any] = {"driver": "dra.example.com", "pool": {"name": node or "x"}}
        if node is not None:
            spec["nodeName"] = node
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                "metadata": {"name": f"00000-{node}-x"}, "spec": spec}  # fmt: skip

    assert judge(policy, _request(node_a, "CREATE", *slices), piece("node-a")).allowed
    assert judge(
        policy, _request(node_a, "UPDATE", *slices), piece("node-a"), piece("node-a")
    ).allowed
    assert judge(policy, _request(node_a, "DELETE", *slices), None, piece("node-a")).allowed
    for operation, new, old in [
        ("CREATE", piece("node-b"), None),
        ("UPDATE", piece("node-b"), piece("node-b")),
        ("DELETE", None, piece("node-b")),
        ("CREATE", piece(None), None),
    ]:
        verdict = judge(policy, _request(node_a, operation, *slices), new, old)
        assert verdict.applies
        assert not verdict.allowed, operation
        assert "may write only ResourceSlices of its own node" in verdict.message
    # On its own node, but another node's pool, or another driver's name.
    for spec in ({"pool": {"name": "node-b"}}, {"driver": "gpu.nvidia.com"}):
        forged = piece("node-a")
        forged["spec"].update(spec)
        verdict = judge(policy, _request(node_a, "CREATE", *slices), forged)
        assert not verdict.allowed, spec
        assert "may publish only the pool node-a of the driver dra.example.com" in verdict.message


def test_with_dra_the_second_scheduler_asks_the_extender_about_claim_only_pods(
    installs: dict[str, dict[str, Any]],
) -> None:
    entry = installs["dra-scheduler"]
    assert entry["ok"], entry.get("error")
    found = {(o["kind"], o["metadata"]["name"]): o for o in entry["objects"]}
    maps = [o for o in entry["objects"] if o["kind"] == "ConfigMap"]
    (text,) = [
        o["data"]["scheduler-config.yaml"] for o in maps if "scheduler-config.yaml" in o["data"]
    ]
    resources, claims = yaml.safe_load(text)["extenders"]
    assert resources["urlPrefix"].endswith("/scheduler")
    assert [r["name"] for r in resources["managedResources"]] == ["nvidia.com/gpu", "rdma/hca"]
    # No managedResources: the scheduler asks it about every pod of the profile.
    assert claims["urlPrefix"] == resources["urlPrefix"] + "/claims"
    assert "managedResources" not in claims
    assert (claims["filterVerb"], claims["prioritizeVerb"]) == ("filter", "prioritize")
    assert claims["nodeCacheCapable"] is True
    assert claims["ignorable"] is True
    deployment = next(
        o
        for (kind, name), o in found.items()
        if kind == "Deployment" and name.endswith("-extender")
    )
    (main,) = deployment["spec"]["template"]["spec"]["containers"]
    # 1.35: the scheduler ignores device taints, and the predictions follow it.
    assert "--dra" in main["args"]
    assert "--dra-device-taints=off" in main["args"]
    role = next(
        o
        for (kind, name), o in found.items()
        if kind == "ClusterRole" and name.endswith("-extender")
    )
    granted = {
        (group, resource): sorted(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    for resource in ("resourceclaims", "resourceslices", "deviceclasses"):
        assert granted[("resource.k8s.io", resource)] == ["get", "list", "watch"]
    # Without DRA the extender neither watches claims nor is asked about them.
    plain = installs["extender"]["objects"]
    plain_config = next(
        o for o in plain if o["kind"] == "ConfigMap" and "scheduler-config.yaml" in o["data"]
    )
    assert len(yaml.safe_load(plain_config["data"]["scheduler-config.yaml"])["extenders"]) == 1
