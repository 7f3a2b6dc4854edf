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
from devplugin.api import podresources_v1_pb2 as pr

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ["devplugin/api/deviceplugin_v1beta1.proto", "devplugin/api/podresources_v1.proto"]
GENERATED = [
    "deviceplugin_v1beta1_pb2.py",
    "deviceplugin_v1beta1_pb2.pyi",
    "deviceplugin_v1beta1_pb2_grpc.py",
    "deviceplugin_v1beta1_pb2_grpc.pyi",
    "podresources_v1_pb2.py",
    "podresources_v1_pb2.pyi",
    "podresources_v1_pb2_grpc.py",
    "podresources_v1_pb2_grpc.pyi",
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


STRING, BOOL, INT64, INT32, MESSAGE = (
    FieldDescriptor.TYPE_STRING,
    FieldDescriptor.TYPE_BOOL,
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_INT32,
    FieldDescriptor.TYPE_MESSAGE,
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
