"""The wire contract: committed stubs are fresh and match the kubelet's protos."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.descriptor import FieldDescriptor

from devplugin.api import deviceplugin_v1beta1_pb2 as dp
from devplugin.api import dra_health_v1alpha1_pb2 as health
from devplugin.api import dra_v1_pb2 as dra1
from devplugin.api import dra_v1beta1_pb2 as dra1beta1
from devplugin.api import pluginregistration_v1_pb2 as reg
from devplugin.api import podresources_v1_pb2 as pr

ROOT = Path(__file__).resolve().parents[2]
STEMS = [
    "deviceplugin_v1beta1",
    "podresources_v1",
    "dra_v1",
    "dra_v1beta1",
    "dra_health_v1alpha1",
    "pluginregistration_v1",
]
PROTOS = [f"devplugin/api/{stem}.proto" for stem in STEMS]
GENERATED = [
    f"{stem}{suffix}"
    for stem in STEMS
    for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")
]


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    bin_dir = Path(sys.executable).parent
    plugins = [bin_dir / "protoc-gen-mypy", bin_dir / "protoc-gen-mypy_grpc"]
    missing = [str(plugin) for plugin in plugins if not plugin.exists()]
    assert missing == [], "install the dev extras (make install)"
    shutil.copytree(ROOT / "proto", tmp_path / "proto")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Iproto",
            f"--plugin=protoc-gen-mypy={plugins[0]}",
            f"--plugin=protoc-gen-mypy_grpc={plugins[1]}",
            "--python_out=.",
            "--mypy_out=.",
            "--grpc_python_out=.",
            "--mypy_grpc_out=.",
            *(f"proto/{name}" for name in PROTOS),
        ],
        cwd=tmp_path,
        check=True,
        capture_output=True,
    )
    stale = [
        name
        for name in GENERATED
        if not filecmp.cmp(
            tmp_path / "devplugin" / "api" / name, ROOT / "devplugin" / "api" / name, shallow=False
        )
    ]
    assert stale == [], f"stale generated stubs (run `make proto`): {stale}"


STRING, BOOL, INT64, INT32, MESSAGE, ENUM = (
    FieldDescriptor.TYPE_STRING,
    FieldDescriptor.TYPE_BOOL,
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_INT32,
    FieldDescriptor.TYPE_MESSAGE,
    FieldDescriptor.TYPE_ENUM,
)

# (message, field name, number, type) as the kubelet defines them.
DEVICE_PLUGIN_FIELDS = [
    ("DevicePluginOptions", "pre_start_required", 1, BOOL),
    ("DevicePluginOptions", "get_preferred_allocation_available", 2, BOOL),
    ("RegisterRequest", "version", 1, STRING),
    ("RegisterRequest", "endpoint", 2, STRING),
    ("RegisterRequest", "resource_name", 3, STRING),
    ("RegisterRequest", "options", 4, MESSAGE),
    ("ListAndWatchResponse", "devices", 1, MESSAGE),
    ("TopologyInfo", "nodes", 1, MESSAGE),
    ("NUMANode", "ID", 1, INT64),
    ("Device", "ID", 1, STRING),
    ("Device", "health", 2, STRING),
    ("Device", "topology", 3, MESSAGE),
    ("PreStartContainerRequest", "devices_ids", 1, STRING),
    ("PreferredAllocationRequest", "container_requests", 1, MESSAGE),
    ("ContainerPreferredAllocationRequest", "available_deviceIDs", 1, STRING),
    ("ContainerPreferredAllocationRequest", "must_include_deviceIDs", 2, STRING),
    ("ContainerPreferredAllocationRequest", "allocation_size", 3, INT32),
    ("PreferredAllocationResponse", "container_responses", 1, MESSAGE),
    ("ContainerPreferredAllocationResponse", "deviceIDs", 1, STRING),
    ("AllocateRequest", "container_requests", 1, MESSAGE),
    ("ContainerAllocateRequest", "devices_ids", 1, STRING),
    ("CDIDevice", "name", 1, STRING),
    ("AllocateResponse", "container_responses", 1, MESSAGE),
    ("ContainerAllocateResponse", "envs", 1, MESSAGE),
    ("ContainerAllocateResponse", "mounts", 2, MESSAGE),
    ("ContainerAllocateResponse", "devices", 3, MESSAGE),
    ("ContainerAllocateResponse", "annotations", 4, MESSAGE),
    ("ContainerAllocateResponse", "cdi_devices", 5, MESSAGE),
    ("Mount", "container_path", 1, STRING),
    ("Mount", "host_path", 2, STRING),
    ("Mount", "read_only", 3, BOOL),
    ("DeviceSpec", "container_path", 1, STRING),
    ("DeviceSpec", "host_path", 2, STRING),
    ("DeviceSpec", "permissions", 3, STRING),
]

POD_RESOURCES_FIELDS = [
    ("ListPodResourcesResponse", "pod_resources", 1, MESSAGE),
    ("PodResources", "name", 1, STRING),
    ("PodResources", "namespace", 2, STRING),
    ("PodResources", "containers", 3, MESSAGE),
    ("ContainerResources", "name", 1, STRING),
    ("ContainerResources", "devices", 2, MESSAGE),
    ("ContainerResources", "cpu_ids", 3, INT64),
    ("ContainerResources", "memory", 4, MESSAGE),
    ("ContainerResources", "dynamic_resources", 5, MESSAGE),
    ("ContainerDevices", "resource_name", 1, STRING),
    ("ContainerDevices", "device_ids", 2, STRING),
    ("ContainerDevices", "topology", 3, MESSAGE),
    ("AllocatableResourcesResponse", "devices", 1, MESSAGE),
    ("AllocatableResourcesResponse", "cpu_ids", 2, INT64),
    ("AllocatableResourcesResponse", "memory", 3, MESSAGE),
    ("GetPodResourcesRequest", "pod_name", 1, STRING),
    ("GetPodResourcesRequest", "pod_namespace", 2, STRING),
    ("GetPodResourcesResponse", "pod_resources", 1, MESSAGE),
]


@pytest.mark.parametrize(("message", "name", "number", "kind"), DEVICE_PLUGIN_FIELDS)
def test_device_plugin_fields(message: str, name: str, number: int, kind: int) -> None:
    field = dp.DESCRIPTOR.message_types_by_name[message].fields_by_name[name]
    assert (field.number, field.type) == (number, kind)


@pytest.mark.parametrize(("message", "name", "number", "kind"), POD_RESOURCES_FIELDS)
def test_pod_resources_fields(message: str, name: str, number: int, kind: int) -> None:
    field = pr.DESCRIPTOR.message_types_by_name[message].fields_by_name[name]
    assert (field.number, field.type) == (number, kind)


def test_packages_and_services_are_the_kubelets() -> None:
    assert dp.DESCRIPTOR.package == "v1beta1"
    assert pr.DESCRIPTOR.package == "v1"
    registration = dp.DESCRIPTOR.services_by_name["Registration"]
    assert registration.full_name == "v1beta1.Registration"
    assert [m.name for m in registration.methods] == ["Register"]
    plugin = dp.DESCRIPTOR.services_by_name["DevicePlugin"]
    assert [m.name for m in plugin.methods] == [
        "GetDevicePluginOptions",
        "ListAndWatch",
        "GetPreferredAllocation",
        "Allocate",
        "PreStartContainer",
    ]
    streaming = {m.name for m in plugin.methods if m.server_streaming or m.client_streaming}
    assert streaming == {"ListAndWatch"}
    assert not plugin.methods_by_name["ListAndWatch"].client_streaming
    lister = pr.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert lister.full_name == "v1.PodResourcesLister"
    assert {m.name for m in lister.methods} == {"List", "GetAllocatableResources", "Get"}


# The DRA kubelet plugin API as the kubelet defines it (v1; v1beta1 lacks share_id).
DRA_FIELDS = [
    ("NodePrepareResourcesRequest", "claims", 1, MESSAGE),
    ("NodePrepareResourcesResponse", "claims", 1, MESSAGE),
    ("NodePrepareResourceResponse", "devices", 1, MESSAGE),
    ("NodePrepareResourceResponse", "error", 2, STRING),
    ("Device", "request_names", 1, STRING),
    ("Device", "pool_name", 2, STRING),
    ("Device", "device_name", 3, STRING),
    ("Device", "cdi_device_ids", 4, STRING),
    ("NodeUnprepareResourcesRequest", "claims", 1, MESSAGE),
    ("NodeUnprepareResourcesResponse", "claims", 1, MESSAGE),
    ("NodeUnprepareResourceResponse", "error", 1, STRING),
    ("Claim", "namespace", 1, STRING),
    ("Claim", "uid", 2, STRING),
    ("Claim", "name", 3, STRING),
]

HEALTH_FIELDS = [
    ("NodeWatchResourcesResponse", "devices", 1, MESSAGE),
    ("DeviceIdentifier", "pool_name", 1, STRING),
    ("DeviceIdentifier", "device_name", 2, STRING),
    ("DeviceHealth", "device", 1, MESSAGE),
    ("DeviceHealth", "health", 2, ENUM),
    ("DeviceHealth", "last_updated_time", 3, INT64),
    ("DeviceHealth", "health_check_timeout_seconds", 4, INT64),
    ("DeviceHealth", "message", 5, STRING),
]

REGISTRATION_FIELDS = [
    ("PluginInfo", "type", 1, STRING),
    ("PluginInfo", "name", 2, STRING),
    ("PluginInfo", "endpoint", 3, STRING),
    ("PluginInfo", "supported_versions", 4, STRING),
    ("RegistrationStatus", "plugin_registered", 1, BOOL),
    ("RegistrationStatus", "error", 2, STRING),
]


@pytest.mark.parametrize("module", [dra1, dra1beta1], ids=["v1", "v1beta1"])
@pytest.mark.parametrize(("message", "name", "number", "kind"), DRA_FIELDS)
def test_dra_fields(module: object, message: str, name: str, number: int, kind: int) -> None:
    descriptor = module.DESCRIPTOR  # type: ignore[attr-defined]
    field = descriptor.message_types_by_name[message].fields_by_name[name]
    assert (field.number, field.type) == (number, kind)


def test_only_dra_v1_has_the_share_id() -> None:
    field = dra1.DESCRIPTOR.message_types_by_name["Device"].fields_by_name["share_id"]
    assert (field.number, field.type, field.has_presence) == (5, STRING, True)
    assert "share_id" not in dra1beta1.DESCRIPTOR.message_types_by_name["Device"].fields_by_name


@pytest.mark.parametrize(("message", "name", "number", "kind"), HEALTH_FIELDS)
def test_dra_health_fields(message: str, name: str, number: int, kind: int) -> None:
    field = health.DESCRIPTOR.message_types_by_name[message].fields_by_name[name]
    assert (field.number, field.type) == (number, kind)


@pytest.mark.parametrize(("message", "name", "number", "kind"), REGISTRATION_FIELDS)
def test_plugin_registration_fields(message: str, name: str, number: int, kind: int) -> None:
    field = reg.DESCRIPTOR.message_types_by_name[message].fields_by_name[name]
    assert (field.number, field.type) == (number, kind)


def test_dra_packages_and_methods_are_the_kubelets() -> None:
    for module, package in ((dra1, "v1"), (dra1beta1, "v1beta1")):
        service = module.DESCRIPTOR.services_by_name["DRAPlugin"]
        assert service.full_name == f"k8s.io.kubelet.pkg.apis.dra.{package}.DRAPlugin"
        assert [m.name for m in service.methods] == [
            "NodePrepareResources",
            "NodeUnprepareResources",
        ]
        answers = module.DESCRIPTOR.message_types_by_name["NodePrepareResourcesResponse"]
        assert answers.fields_by_name["claims"].message_type.GetOptions().map_entry
    watch = health.DESCRIPTOR.services_by_name["DRAResourceHealth"]
    assert watch.full_name == "v1alpha1.DRAResourceHealth"
    method = watch.methods_by_name["NodeWatchResources"]
    assert method.server_streaming
    assert not method.client_streaming
    statuses = health.DESCRIPTOR.enum_types_by_name["HealthStatus"]
    assert {v.name: v.number for v in statuses.values} == {
        "UNKNOWN": 0,
        "HEALTHY": 1,
        "UNHEALTHY": 2,
    }
    registration = reg.DESCRIPTOR.services_by_name["Registration"]
    assert registration.full_name == "pluginregistration.Registration"
    assert [m.name for m in registration.methods] == ["GetInfo", "NotifyRegistrationStatus"]
