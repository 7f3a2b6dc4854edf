"""Versioned, typed, validated configuration.

The file is YAML with `version: v1`. Unknown versions and unknown keys are
rejected; every error names the field (`resources.gpu.name: ...`). Defaults
are applied for keys the file leaves out; command-line flags override the
file. The schema is the dataclasses below: each field's type drives parsing
and an optional `check` in its metadata validates the value.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from devplugin.kinds.base import Kind
from devplugin.kinds.registry import ANCHOR, KINDS, PARTNER, wing
from devplugin.model import DeviceKind
from devplugin.policy.cdi import kind_problem

CONFIG_VERSION = "v1"

_RESOURCE_NAME = re.compile(
    r"^(?=.{1,253}/)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
    r"/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ConfigError(ValueError):
    """A configuration problem; `str()` is one line naming the field."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"{field_path}: {message}" if field_path else message)
        self.field_path = field_path


def _resource_name(value: Any) -> str | None:
    if not _RESOURCE_NAME.match(value):
        return "must be an extended resource name like vendor.example/name"
    if value.split("/", 1)[0].endswith("kubernetes.io"):
        return "the kubernetes.io domain is reserved for native resources"
    return None


def _env_name(value: Any) -> str | None:
    return None if _ENV_NAME.match(value) else "must be an environment variable name"


def _absolute(value: Any) -> str | None:
    return None if value.startswith("/") else "must be an absolute path"


_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _driver_name(value: Any) -> str | None:
    # The API's rule for a DRA driver name.
    if len(value) > 63 or not _DNS_SUBDOMAIN.match(value):
        return "must be a lowercase DNS subdomain of at most 63 characters, like devplugin.io"
    return None


def _cdi_kind_or_empty(value: Any) -> str | None:
    return kind_problem(value) if value else None


def _positive(value: Any) -> str | None:
    return None if value > 0 else "must be greater than 0"


def _at_least_one(value: Any) -> str | None:
    return None if value >= 1 else "must be at least 1"


def _lease_duration(value: Any) -> str | None:
    return None if 1 <= value <= 300 else "must be between 1 and 300"


def _argv(value: Any) -> str | None:
    if value and not all(value):
        return "every argument must be a non-empty string"
    return None


def parse_address(text: str) -> tuple[str, int]:
    """`host:port` (IPv6 hosts in brackets); an empty host means every address."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"not a host:port address: {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _addresses(value: Any) -> str | None:
    for address in value:
        try:
            parse_address(address)
        except ValueError:
            return f"every address must be host:port ({address!r} is not)"
    return None


def _xids(value: Any) -> str | None:
    return None if all(0 < xid < 1000 for xid in value) else "XIDs are integers from 1 to 999"


def _checked(default: Any, check: Callable[[Any], str | None]) -> Any:
    return field(default=default, metadata={"check": check})


@dataclass(frozen=True)
class HooksConfig:
    # Commands as argv lists (never a shell string); empty = no hook.
    init: tuple[str, ...] = _checked((), _argv)
    cleanup: tuple[str, ...] = _checked((), _argv)
    timeout_seconds: float = _checked(60.0, _positive)
    # Where init runs: in Allocate, or in PreStartContainer (the resource then
    # advertises pre_start_required).
    init_phase: Literal["allocate", "pre_start"] = "allocate"


# How a container is told about its devices: `envvar` (NVIDIA_VISIBLE_DEVICES;
# NCCL_IB_HCA is set for HCAs whatever the strategy), `device-nodes` (the
# device specs in the Allocate answer), `cdi-cri` (CDI device names the
# kubelet hands the runtime), `cdi-annotations` (the same as cdi.k8s.io/
# annotations, for kubelets before the CDI field).
Strategy = Literal["envvar", "device-nodes", "cdi-cri", "cdi-annotations"]
CDI_STRATEGIES = frozenset({"cdi-cri", "cdi-annotations"})
DEFAULT_STRATEGY: tuple[Strategy, ...] = ("envvar", "device-nodes")


def _strategies(value: Any) -> str | None:
    if not value:
        return "must name at least one strategy"
    if len(set(value)) != len(value):
        return "names a strategy twice"
    return None


def _cdi_kind(value: Any) -> str | None:
    return kind_problem(value)


def _dirs(value: Any) -> str | None:
    if not value:
        return "must name at least one directory"
    if not all(entry.startswith("/") for entry in value):
        return "every directory must be an absolute path"
    return None


# How the kubelet learns of a resource's devices: the Device Plugin API (an
# extended resource), or Dynamic Resource Allocation (ResourceSlices and
# claims). Never both for one resource on one node (KEP-5004).
Api = Literal["device-plugin", "dra"]


# How MIG-enabled GPUs are served, with NVIDIA's meaning: `none` serves
# whole GPUs only; `single` serves every MIG device as the GPU resource
# (every GPU must be MIG-enabled with one profile); `mixed` serves one
# resource per profile, `<domain of the GPU resource>/mig-<profile>`, beside
# whole GPUs that are not MIG-enabled.
MigStrategy = Literal["none", "single", "mixed"]


@dataclass(frozen=True)
class MigConfig:
    strategy: MigStrategy = "none"


@dataclass(frozen=True)
class GpuResourceConfig:
    enabled: bool = True
    api: Api = "device-plugin"
    name: str = _checked("nvidia.com/gpu", _resource_name)
    hooks: HooksConfig = field(default_factory=HooksConfig)
    device_list_strategy: tuple[Strategy, ...] = _checked(DEFAULT_STRATEGY, _strategies)
    mig: MigConfig = field(default_factory=MigConfig)


@dataclass(frozen=True)
class HcaResourceConfig:
    enabled: bool = True
    api: Api = "device-plugin"
    name: str = _checked("rdma/hca", _resource_name)
    # The variable naming the allocated HCAs in the container (NCCL syntax).
    env_var: str = _checked("NCCL_IB_HCA", _env_name)
    hooks: HooksConfig = field(default_factory=HooksConfig)
    device_list_strategy: tuple[Strategy, ...] = _checked(DEFAULT_STRATEGY, _strategies)


@dataclass(frozen=True)
class CdiConfig:
    # The kind of the node's GPU spec (NVIDIA's toolkit generates nvidia.com/gpu).
    gpu_kind: str = _checked("nvidia.com/gpu", _cdi_kind)
    # How that spec names a GPU: by NVML index (the toolkit's default) or UUID.
    gpu_device_name: Literal["index", "uuid"] = "index"
    # The kind of the HCA spec devplugin writes.
    hca_kind: str = _checked("devplugin.io/hca", _cdi_kind)
    # Where runtimes read specs; a later directory wins a conflict, and the
    # HCA spec is written into the last one.
    spec_dirs: tuple[str, ...] = _checked(("/etc/cdi", "/var/run/cdi"), _dirs)

    def kind_of(self, kind: DeviceKind) -> str:
        """The CDI kind a device kind is named under (`<key>_kind`)."""
        value: str = getattr(self, f"{kind.value}_kind")
        return value


@dataclass(frozen=True)
class ResourcesConfig:
    gpu: GpuResourceConfig = field(default_factory=GpuResourceConfig)
    hca: HcaResourceConfig = field(default_factory=HcaResourceConfig)

    def of(self, kind: DeviceKind) -> GpuResourceConfig | HcaResourceConfig:
        """A kind's section (each kind's section is named by its value)."""
        section: GpuResourceConfig | HcaResourceConfig = getattr(self, kind.value)
        return section


@dataclass(frozen=True)
class PathsConfig:
    sysfs_root: str = _checked("/sys", _absolute)
    dev_root: str = _checked("/dev", _absolute)
    device_plugin_dir: str = _checked("/var/lib/kubelet/device-plugins", _absolute)
    pod_resources_socket: str = _checked("/var/lib/kubelet/pod-resources/kubelet.sock", _absolute)
    # The DRA driver's socket goes in <kubelet_plugins_dir>/<driver>/, its
    # registration socket in kubelet_registry_dir (the kubelet's plugin
    # watcher). Both paths must be the same inside the container and on the host.
    kubelet_plugins_dir: str = _checked("/var/lib/kubelet/plugins", _absolute)
    kubelet_registry_dir: str = _checked("/var/lib/kubelet/plugins_registry", _absolute)
    # Where the driver says which nvidia-caps nodes each MIG device needs.
    nvidia_caps_root: str = _checked("/proc/driver/nvidia/capabilities", _absolute)
    # The kernel's boot id (the host's, also inside a container): a DRA claim
    # prepared in another boot is prepared again.
    boot_id: str = _checked("/proc/sys/kernel/random/boot_id", _absolute)


@dataclass(frozen=True)
class NvmlConfig:
    # A JSON fixture for the built-in fake NVML (demo, tests); null = real NVML.
    fixture: str | None = None


@dataclass(frozen=True)
class DiscoveryConfig:
    # The safety net under udev events (and the only hotplug source without udev).
    rescan_interval_seconds: float = _checked(30.0, _positive)


@dataclass(frozen=True)
class KubeletConfig:
    # How often sockets are checked for a kubelet restart.
    watch_interval_seconds: float = _checked(1.0, _positive)
    register_timeout_seconds: float = _checked(5.0, _positive)
    register_backoff_initial_seconds: float = _checked(0.1, _positive)
    register_backoff_max_seconds: float = _checked(5.0, _positive)
    # The kubelet's own configuration file (a KubeletConfiguration, YAML or
    # JSON), read for what its Topology and CPU Managers align; null: not read.
    config_file: str | None = _checked(None, _absolute)
    # What the kubelet runs with where no file says (set by its flags): ""
    # takes the file's, or the kubelet's defaults without a file.
    topology_manager_policy: Literal[
        "", "none", "best-effort", "restricted", "single-numa-node"
    ] = ""
    topology_manager_scope: Literal["", "container", "pod"] = ""
    cpu_manager_policy: Literal["", "none", "static"] = ""


@dataclass(frozen=True)
class AllocationConfig:
    # Offer GetPreferredAllocation (topology-aware choice) for both resources.
    preferred: bool = True
    # A request for one resource within this many seconds of an Allocate of
    # the other is taken as the same container's second resource.
    pairing_window_seconds: float = _checked(2.0, _positive)
    # A GPU search on an NVLink graph the PCIe tree cannot express stops
    # after this long and answers its best so far (counted in a metric).
    search_budget_ms: float = _checked(200.0, _positive)
    # Shared-HCA setups: a GPU allocation also gets the nearest HCAs' device
    # nodes and the HCA variable, with no rdma/hca request needed.
    attach_hcas: bool = False


@dataclass(frozen=True)
class PodResourcesConfig:
    poll_interval_seconds: float = _checked(2.0, _positive)
    # After polls in a row that changed nothing (and no Allocate awaiting
    # its container), polls slow to this, at most five poll intervals; any
    # change, Allocate or pod event brings the poll interval back.
    quiet_interval_seconds: float = _checked(10.0, _positive)
    # Never poll more often than this (the kubelet allows 100 requests/s).
    min_interval_seconds: float = _checked(0.5, _positive)
    # The kubelet records an allocation just after Allocate returns; a device
    # allocated this recently counts as taken until a poll has seen it.
    bookkeeping_grace_seconds: float = _checked(5.0, _positive)
    # However long PodResources stays unreachable, an allocation not seen by
    # any poll stops counting as taken after this long (bounds the ledger).
    unconfirmed_max_age_seconds: float = _checked(300.0, _positive)


@dataclass(frozen=True)
class HealthConfig:
    # Light health checks (HCA ports, device nodes, NVML handles) this often.
    # GPU faults arrive between checks as NVML events.
    interval_seconds: float = _checked(5.0, _positive)
    # An HCA port's state has no event in sysfs: between checks only the
    # ports' state files are read this often, and a change checks at once.
    # This bounds how late a port going down is seen.
    port_interval_seconds: float = _checked(1.0, _positive)
    # How an unhealthy device comes back: after `good_checks` consecutive
    # good checks, or only after its cleanup hook succeeds.
    recovery: Literal["auto", "after_cleanup"] = "auto"
    good_checks: int = _checked(1, _at_least_one)
    # An XID or double-bit ECC error is a real GPU fault: it needs this many
    # good checks in a row (auto recovery) before the GPU is offered again.
    xid_good_checks: int = _checked(30, _at_least_one)
    # Application-caused XIDs that say nothing about the GPU's health.
    xid_ignore: tuple[int, ...] = _checked((13, 31, 43, 45, 68, 109), _xids)
    # One hardware read (an NVML call, a sysfs file) that has not returned
    # after this long is abandoned and its device reported Unhealthy.
    read_timeout_seconds: float = _checked(5.0, _positive)
    # /healthz fails when no check has read every device within this long (a
    # wedged read, or a stalled check loop), so the liveness probe restarts
    # the daemon; the devices that could be checked keep being served.
    stale_after_seconds: float = _checked(60.0, _positive)


@dataclass(frozen=True)
class KubernetesConfig:
    # Talk to the API server (the pod cache). Off, the daemon works from the
    # kubelet alone, as before.
    enabled: bool = False
    # A kubeconfig file; empty means the pod's service account (in-cluster).
    kubeconfig: str = ""
    # This node's name; empty means the NODE_NAME environment variable.
    node_name: str = ""
    # Every API request gives up after this long (RPCs never wait on it).
    request_timeout_seconds: float = _checked(5.0, _positive)
    # The server ends each watch after this long (timeoutSeconds) and it is
    # opened again. A watch that says nothing for this plus the request
    # timeout is dead (a connection gone silent without a FIN): the cache
    # lists again, and until it has, it says it is not current.
    watch_timeout_seconds: float = _checked(30.0, _positive)
    # Failed lists and watches are retried after 0.2 s, doubling up to this.
    watch_backoff_max_seconds: float = _checked(10.0, _positive)
    # How long GetPreferredAllocation may wait for a pod to reach the cache.
    pod_wait_seconds: float = _checked(0.1, _positive)
    # A container identified at GetPreferredAllocation counts as holding its
    # devices for this long, or until PodResources lists it.
    claim_seconds: float = _checked(10.0, _positive)
    # An Event on each pod saying what its containers got and how aligned.
    events: bool = True
    # Publish this node's NodeDevices record (devices, health, holders).
    node_devices: bool = True
    # Keep devplugin.io/ labels on this node's Node (GPU product, memory,
    # count, family; HCA count; MIG strategy) for nodeSelectors. Needs the
    # chart's Node patch right; only keys under devplugin.io/ are touched.
    node_labels: bool = True
    # At most one record write per this many seconds (changes are batched).
    record_min_interval_seconds: float = _checked(1.0, _positive)
    # Read the record back this often even without a change (a deleted
    # record is recreated). It is written only when its content changes.
    record_resync_seconds: float = _checked(30.0, _positive)
    # The node's liveness: a small Lease renewed every lease_renew_seconds,
    # promising the next renewal within lease_duration_seconds (the extender
    # treats the record as stale past that). Its namespace: this one, or
    # $POD_NAMESPACE, or "default".
    lease_namespace: str = ""
    lease_renew_seconds: float = _checked(10.0, _positive)
    # At most 300: the chart's admission policy and the extender hold a
    # Lease to that.
    lease_duration_seconds: int = _checked(40, _lease_duration)


@dataclass(frozen=True)
class HotplugConfig:
    # Watch udev for PCI and InfiniBand add/remove events (falls back to the
    # periodic rescan where udev is not available).
    udev: bool = True


@dataclass(frozen=True)
class LifecycleConfig:
    checkpoint_file: str = _checked("/var/lib/devplugin/checkpoint.json", _absolute)
    # PodResources polls in a row that must miss a device before it counts as
    # released (guards against a transiently empty answer).
    release_confirmations: int = _checked(2, _at_least_one)
    cleanup_retry_initial_seconds: float = _checked(5.0, _positive)
    cleanup_retry_max_seconds: float = _checked(300.0, _positive)


@dataclass(frozen=True)
class GpuSharingConfig:
    # Time-slicing: each GPU advertised as this many replicas (1 = no sharing).
    replicas: int = _checked(1, _at_least_one)
    # Serve the replicas under another resource name ("" = resources.gpu.name).
    resource_name: str = ""
    policy: Literal["distributed", "packed"] = "distributed"
    # Refuse a container several replicas of one GPU.
    refuse_multiple_per_gpu: bool = False

    @property
    def renamed(self) -> str:
        return self.resource_name

    @property
    def copies(self) -> tuple[str, int, str]:
        """(its field, how many copies each device is served as, what that is called)."""
        return "replicas", self.replicas, "time-slicing is"


@dataclass(frozen=True)
class HcaSharingConfig:
    # Shared HCAs: each HCA advertised as this many units (1 = no sharing).
    units: int = _checked(1, _at_least_one)
    policy: Literal["distributed", "packed"] = "distributed"

    @property
    def renamed(self) -> str:
        # Shared HCAs keep their resource's name.
        return ""

    @property
    def copies(self) -> tuple[str, int, str]:
        return "units", self.units, "shared HCAs are"


@dataclass(frozen=True)
class SharingConfig:
    gpu: GpuSharingConfig = field(default_factory=GpuSharingConfig)
    hca: HcaSharingConfig = field(default_factory=HcaSharingConfig)

    def of(self, kind: DeviceKind) -> GpuSharingConfig | HcaSharingConfig:
        """A kind's section (named by the kind's value, as in resources)."""
        section: GpuSharingConfig | HcaSharingConfig = getattr(self, kind.value)
        return section


@dataclass(frozen=True)
class MetricsConfig:
    # /metrics, /healthz and /readyz on each host:port (the chart adds the pod IP).
    enabled: bool = True
    addresses: tuple[str, ...] = _checked(("127.0.0.1:9410",), _addresses)


@dataclass(frozen=True)
class LoggingConfig:
    format: Literal["text", "json"] = "text"
    level: Literal["debug", "info", "warning", "error"] = "info"


@dataclass(frozen=True)
class DraConfig:
    # The driver name: ResourceSlices, DeviceClasses and claims name it.
    driver: str = _checked("devplugin.io", _driver_name)
    # NodePrepareResources reads each claim from the API server; a read that
    # has not answered after this long fails that claim (the kubelet retries).
    claim_timeout_seconds: float = _checked(10.0, _positive)
    # The CDI kind of the per-claim specs; empty means k8s.<driver>/claim.
    cdi_kind: str = _checked("", _cdi_kind_or_empty)
    # A device that is unhealthy or not yet cleaned: published with a
    # NoSchedule taint (device taints: beta in 1.36, GA in 1.37), or left
    # out of the slice (clusters without device taints).
    unhealthy: Literal["taint", "remove"] = "taint"
    # How long the kubelet waits for a health update before a device is
    # Unknown (sent with each health report).
    health_timeout_seconds: int = _checked(60, _at_least_one)


@dataclass(frozen=True)
class Config:
    version: Literal["v1"] = "v1"
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    nvml: NvmlConfig = field(default_factory=NvmlConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    kubelet: KubeletConfig = field(default_factory=KubeletConfig)
    allocation: AllocationConfig = field(default_factory=AllocationConfig)
    pod_resources: PodResourcesConfig = field(default_factory=PodResourcesConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    hotplug: HotplugConfig = field(default_factory=HotplugConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)
    cdi: CdiConfig = field(default_factory=CdiConfig)
    lifecycle: LifecycleConfig = field(default_factory=LifecycleConfig)
    dra: DraConfig = field(default_factory=DraConfig)
    sharing: SharingConfig = field(default_factory=SharingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def _type_name(kind: Any) -> str:
    if kind is bool:
        return "a boolean"
    if kind is int:
        return "an integer"
    if kind is float:
        return "a number"
    if kind is str:
        return "a string"
    return "a mapping"


def _convert(value: Any, kind: Any, where: str) -> Any:
    origin = typing.get_origin(kind)
    if origin is Literal:
        allowed = typing.get_args(kind)
        if value not in allowed:
            choices = ", ".join(repr(choice) for choice in allowed)
            raise ConfigError(where, f"must be one of {choices}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        options = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        if value is None:
            return None
        return _convert(value, options[0], where)
    if origin is tuple:
        (item,) = typing.get_args(kind)[:1]
        if not isinstance(value, list):
            raise ConfigError(where, "must be a list")
        return tuple(_convert(entry, item, f"{where}[{i}]") for i, entry in enumerate(value))
    if dataclasses.is_dataclass(kind):
        return _build(kind, value, where)
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif kind is str:
        ok = isinstance(value, str)
    else:  # pragma: no cover - schema error, not a user error
        raise TypeError(f"unsupported config type {kind!r} at {where}")
    if not ok:
        raise ConfigError(where, f"must be {_type_name(kind)}, got {type(value).__name__}")
    return value


def _build(cls: Any, data: Any, where: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(where, f"must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            raise ConfigError(_join(where, str(key)), "unknown key")
    values: dict[str, Any] = {}
    for name, spec in fields.items():
        if name not in data:
            continue
        path = _join(where, name)
        value = _convert(data[name], hints[name], path)
        check = spec.metadata.get("check")
        if check is not None and value is not None:
            problem = check(value)
            if problem:
                raise ConfigError(path, f"{problem}, got {value!r}")
        values[name] = value
    return cls(**values)


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def parse_config(data: Any) -> Config:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError("", "the configuration must be a mapping")
    version = data.get("version")
    if version is None:
        raise ConfigError("version", f"missing; this daemon reads version {CONFIG_VERSION!r}")
    if version != CONFIG_VERSION:
        raise ConfigError(
            "version", f"unsupported version {version!r}; expected {CONFIG_VERSION!r}"
        )
    config: Config = _build(Config, data, "")
    validate(config)
    return config


def served_name(config: Config, kind: DeviceKind) -> str:
    """The resource name the kubelet sees for a kind (sharing may rename it)."""
    return config.sharing.of(kind).renamed or config.resources.of(kind).name


def validate(config: Config) -> None:
    """Checks that span fields (single-field checks live in the schema)."""
    gpu = config.resources.gpu
    if config.sharing.gpu.resource_name:
        problem = _resource_name(config.sharing.gpu.resource_name)
        if problem:
            raise ConfigError("sharing.gpu.resource_name", problem)
    enabled = [info for info in KINDS if config.resources.of(info.kind).enabled]
    if not enabled:
        raise ConfigError("resources", "every resource is disabled; nothing to serve")
    named: dict[str, Kind[Any]] = {}
    for info in enabled:
        name = served_name(config, info.kind)
        if name in named:
            raise ConfigError(
                f"resources.{info.key}.name",
                f"same as the {named[name].noun} resource name ({name!r})",
            )
        named[name] = info
    if config.health.recovery == "after_cleanup":
        for info in enabled:
            if not config.resources.of(info.kind).hooks.cleanup:
                raise ConfigError(
                    f"resources.{info.key}.hooks.cleanup",
                    "health.recovery after_cleanup needs a cleanup hook for every resource",
                )
    lifecycle = config.lifecycle
    if lifecycle.cleanup_retry_initial_seconds > lifecycle.cleanup_retry_max_seconds:
        raise ConfigError(
            "lifecycle.cleanup_retry_initial_seconds",
            "must not exceed lifecycle.cleanup_retry_max_seconds",
        )
    if config.allocation.attach_hcas and not gpu.enabled:
        raise ConfigError("allocation.attach_hcas", "needs resources.gpu.enabled")
    _validate_dra(config)
    kubelet = config.kubelet
    if kubelet.register_backoff_initial_seconds > kubelet.register_backoff_max_seconds:
        raise ConfigError(
            "kubelet.register_backoff_initial_seconds",
            "must not exceed kubelet.register_backoff_max_seconds",
        )


def dra_kinds(config: Config) -> frozenset[str]:
    """The enabled resources (by key: "gpu", "hca") served through DRA."""
    return frozenset(
        info.key
        for info in KINDS
        if (resource := config.resources.of(info.kind)).enabled and resource.api == "dra"
    )


def dra_cdi_kind(config: Config) -> str:
    return config.dra.cdi_kind or f"k8s.{config.dra.driver}/claim"


def _validate_dra(config: Config) -> None:
    """What DRA cannot do that the device-plugin API can, named by field."""
    kinds = dra_kinds(config)
    if not kinds:
        return
    if not config.kubernetes.enabled:
        raise ConfigError(
            f"resources.{min(kinds)}.api",
            "dra needs kubernetes.enabled (claims are read and slices written through the API)",
        )
    problem = kind_problem(dra_cdi_kind(config))
    if problem:
        raise ConfigError("dra.cdi_kind", f"{dra_cdi_kind(config)!r}: {problem}")
    for name in sorted(kinds):
        hooks = config.resources.of(DeviceKind(name)).hooks
        if hooks.init and hooks.init_phase == "pre_start":
            raise ConfigError(
                f"resources.{name}.hooks.init_phase",
                "pre_start is a Device Plugin API call; with api dra, init runs at prepare",
            )
    for name in sorted(kinds):
        field_name, copies, what = config.sharing.of(DeviceKind(name)).copies
        if copies > 1:
            raise ConfigError(f"sharing.{name}.{field_name}", f"{what} not offered through dra")
    anchor = wing(ANCHOR)
    if anchor.key in kinds and config.allocation.attach_hcas:
        raise ConfigError(
            "allocation.attach_hcas",
            f"not with resources.{anchor.key}.api dra (claim {wing(PARTNER).noun}s instead)",
        )


def _program_problem(program: str) -> str | None:
    if "/" in program:
        if not os.path.exists(program):
            return f"{program} does not exist"
        if os.path.isdir(program) or not os.access(program, os.X_OK):
            return f"{program} is not executable"
        return None
    if shutil.which(program) is None:
        return f"{program} not found on PATH ({os.environ.get('PATH', '')})"
    return None


def check_hooks(config: Config) -> None:
    """Every configured hook can be started on this machine. `devplugin run`
    checks before starting, so a hook that can never run is a configuration
    error, not a device advertised Healthy that then fails every Allocate."""
    for info in KINDS:
        resource = config.resources.of(info.kind)
        if not resource.enabled:
            continue
        for phase in ("init", "cleanup"):
            argv = getattr(resource.hooks, phase)
            problem = _program_problem(argv[0]) if argv else None
            if problem:
                raise ConfigError(f"resources.{info.key}.hooks.{phase}", problem)


def node_name(config: Config) -> str:
    """The node this daemon runs on: the config (or --node-name), else NODE_NAME."""
    return config.kubernetes.node_name or os.environ.get("NODE_NAME", "")


def lease_namespace(config: Config) -> str:
    return config.kubernetes.lease_namespace or os.environ.get("POD_NAMESPACE", "") or "default"


def check_kubernetes(config: Config) -> None:
    """With API access on, the daemon must know its node and, when given, the
    kubeconfig must exist (the service account is checked when connecting)."""
    kube = config.kubernetes
    if not kube.enabled:
        return
    if not node_name(config):
        raise ConfigError(
            "kubernetes.node_name", "required when kubernetes.enabled (or set NODE_NAME)"
        )
    if kube.kubeconfig and not os.path.isfile(kube.kubeconfig):
        raise ConfigError("kubernetes.kubeconfig", f"{kube.kubeconfig} is not a file")


def check_roots(config: Config) -> None:
    """The sysfs and /dev roots exist (a typo would look like an empty node)."""
    for field_name in ("sysfs_root", "dev_root"):
        root = getattr(config.paths, field_name)
        if not os.path.isdir(root):
            raise ConfigError(f"paths.{field_name}", f"{root} is not a directory")


def load_config(path: Path | None) -> Config:
    """Read and validate a config file; None means all defaults."""
    if path is None:
        return Config()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("", f"{path}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError("", f"{path}: not UTF-8 (byte {exc.start})") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError("", f"{path}: {problem}{where}") from exc
    return parse_config(data)


def override(config: Config, **changes: Any) -> Config:
    """Apply dotted-path overrides (CLI flags): override(c, **{"paths.dev_root": "/x"})."""
    for dotted, value in changes.items():
        if value is None:
            continue
        config = _replace_path(config, dotted.split("."), value, dotted)
    validate(config)
    return config


def _replace_path(node: Any, parts: list[str], value: Any, dotted: str) -> Any:
    head, rest = parts[0], parts[1:]
    hints = typing.get_type_hints(type(node))
    if head not in hints:
        raise ConfigError(dotted, "unknown key")
    if rest:
        new_value = _replace_path(getattr(node, head), rest, value, dotted)
    else:
        new_value = _convert(value, hints[head], dotted)
        spec = next(f for f in dataclasses.fields(node) if f.name == head)
        check = spec.metadata.get("check")
        if check is not None and new_value is not None:
            problem = check(new_value)
            if problem:
                raise ConfigError(dotted, f"{problem}, got {new_value!r}")
    return dataclasses.replace(node, **{head: new_value})


# Keys the Helm chart sets itself (container paths, the metrics listeners,
# the checkpoint location); everything else is settable from values.
CHART_MANAGED = (
    "version", "paths", "nvml", "metrics", "lifecycle.checkpoint_file", "cdi.spec_dirs",
    "kubelet.config_file",
)  # fmt: skip


def json_schema(cls: Any = Config, where: str = "") -> dict[str, Any]:
    """The JSON Schema of a config section (the chart's values.schema.json
    embeds it for `config`, minus CHART_MANAGED keys)."""
    hints = typing.get_type_hints(cls)
    properties: dict[str, Any] = {}
    for spec in dataclasses.fields(cls):
        path = _join(where, spec.name)
        if path in CHART_MANAGED:
            continue
        schema = _type_schema(hints[spec.name], path)
        check = spec.metadata.get("check")
        if check in _CHECK_SCHEMA:
            extra = _CHECK_SCHEMA[check]
            if "items" in extra and "items" in schema:
                schema["items"] = {**schema["items"], **extra["items"]}
            else:
                schema.update(extra)
        properties[spec.name] = schema
    return {"type": "object", "additionalProperties": False, "properties": properties}


_BASIC: dict[Any, dict[str, Any]] = {
    bool: {"type": "boolean"},
    int: {"type": "integer"},
    float: {"type": "number"},
    str: {"type": "string"},
}

# The single-field checks, as JSON Schema (Go's regexp has no lookahead, so
# the resource-name pattern drops the 253-character prefix limit).
_CHECK_SCHEMA: dict[Any, dict[str, Any]] = {
    _positive: {"exclusiveMinimum": 0},
    _at_least_one: {"minimum": 1},
    _resource_name: {
        "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
    },
    _env_name: {"pattern": _ENV_NAME.pattern},
    _absolute: {"pattern": "^/"},
    _argv: {"items": {"minLength": 1}},
    _xids: {"items": {"minimum": 1, "maximum": 999}},
    _addresses: {"items": {"pattern": r"^.*:[0-9]{1,5}$"}},
    _strategies: {"minItems": 1, "uniqueItems": True},
    _cdi_kind: {
        "pattern": r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?/[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$"
    },
    _dirs: {"minItems": 1, "items": {"pattern": "^/"}},
}


def _type_schema(kind: Any, path: str) -> dict[str, Any]:
    origin = typing.get_origin(kind)
    if origin is Literal:
        return {"enum": list(typing.get_args(kind))}
    if origin in (typing.Union, types.UnionType):
        options = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        return {"anyOf": [_type_schema(options[0], path), {"type": "null"}]}
    if origin is tuple:
        return {"type": "array", "items": _type_schema(typing.get_args(kind)[0], path)}
    if dataclasses.is_dataclass(kind):
        return json_schema(kind, path)
    return dict(_BASIC[kind])
