"""The node core, assembled: what every front-end serves from.

Discovery with its deadlines, the check loop, the judging pipeline, the
holdings ledger, the coordinator, health, the custody book and its ports, the XID
watcher and the PodResources monitor, wired from the configuration. The
front-ends and the cluster side connect to it afterwards (sinks on the
pipeline, listeners on the ledger); nothing here knows which are there.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from devplugin.config import CDI_STRATEGIES, Config, ConfigError, dra_kinds
from devplugin.kinds.gpu import GPU
from devplugin.kinds.hca import HCA
from devplugin.kinds.registry import KINDS
from devplugin.model import DeviceKind, Inventory
from devplugin.node.alignment import AlignmentMonitor
from devplugin.node.checks import CheckLoop, Requests
from devplugin.node.coordination import Coordinator
from devplugin.node.deadline import Deadlines
from devplugin.node.discovery import CdiReader, Discoverer, NvmlGpuSource, Roots
from devplugin.node.discovery.udev import HotplugWatcher, udev_monitor
from devplugin.node.gpu import resource as gpu_resource
from devplugin.node.hca import resource as hca_resource
from devplugin.node.hca.resource import HcaResource
from devplugin.node.kubelet_facts import KubeletFacts
from devplugin.node.ledger import Ledger
from devplugin.node.lifecycle.assembly import CleanupPolicy, Hooks, Lifecycle
from devplugin.node.lifecycle.cdi_spec import HcaSpecWriter
from devplugin.node.lifecycle.checkpoint import Checkpoint, ReadHold, no_holds
from devplugin.node.lifecycle.devices import describe
from devplugin.node.lifecycle.health import HealthTracker, Recovery
from devplugin.node.lifecycle.hooks import HookRunner, HookSpec, run_hook
from devplugin.node.lifecycle.metrics import CustodyCollector, timed_hooks
from devplugin.node.lifecycle.releases import PodWitness
from devplugin.node.lifecycle.xid import XidWatcher
from devplugin.node.metrics import Metrics
from devplugin.node.pipeline import Pipeline, log_inventory
from devplugin.node.podresources import PodResourcesClient
from devplugin.node.resources import Capabilities, Resource
from devplugin.rpc import check_server_path

log = logging.getLogger(__name__)

# How long start waits for the XID watcher to register the first GPU set.
XID_ARM_WAIT = 5.0

# What the cluster side may lend the core (the pod watch's view), made
# once the ledger and the metrics exist.
Witness = Callable[[Ledger, Metrics, Mapping[DeviceKind, str]], PodWitness | None]


def check_socket_field(field: str, path: Path) -> None:
    """A socket path the kernel cannot bind is the configured directory's
    fault: a config error naming it, not a failure at start."""
    try:
        check_server_path(path)
    except ValueError as exc:
        raise ConfigError(field, str(exc)) from exc


# How each kind is served: its node side's builder, one line per kind.
RESOURCE_BUILDERS: dict[DeviceKind, Callable[[Config, Capabilities], Resource]] = {
    GPU.kind: gpu_resource.build,
    HCA.kind: hca_resource.build,
}


def build_resources(config: Config) -> list[Resource]:
    """One served resource per enabled kind, in the kinds' order."""
    resources: list[Resource] = []
    for info in KINDS:
        section = config.resources.of(info.kind)
        if not section.enabled:
            continue
        capabilities = Capabilities(
            preferred_allocation=config.allocation.preferred,
            pre_start=bool(section.hooks.init) and section.hooks.init_phase == "pre_start",
        )
        resources.append(RESOURCE_BUILDERS[info.kind](config, capabilities))
    return resources


def hook_runner(config: Config, metrics: Metrics) -> HookRunner:
    # Hooks see the roots the daemon reads (in the chart, /host/sys and
    # /host/dev), so the example hooks check the same devices it does.
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "DEVPLUGIN_SYSFS_ROOT": config.paths.sysfs_root,
        "DEVPLUGIN_DEV_ROOT": config.paths.dev_root,
    }
    return timed_hooks(partial(run_hook, base_env=env), metrics.hook_runs, metrics.hook_seconds)


@dataclass
class NodeCore:
    """The parts every front-end shares, wired; `prepare` and the loops
    start them (in `Daemon`)."""

    config: Config
    discoverer: Discoverer
    resources: list[Resource]
    # Kinds served through DRA: judged like the others, served by the DRA
    # front-end instead of a device-plugin server.
    dra_kinds: frozenset[DeviceKind]
    ledger: Ledger
    metrics: Metrics
    coordinator: Coordinator
    runner: HookRunner
    lifecycle: Lifecycle
    pipeline: Pipeline
    checks: CheckLoop
    monitor: AlignmentMonitor
    facts: KubeletFacts
    xid: XidWatcher | None
    # The HCA as the GPU front-end's attach option and the pipeline see it.
    hca_view: HcaResource

    def init_hook(self, kind: DeviceKind) -> HookSpec | None:
        hooks = self.config.resources.of(kind).hooks
        return HookSpec(hooks.init, hooks.timeout_seconds) if hooks.init else None

    def hotplug(self, monitor: object | None) -> HotplugWatcher | None:
        """The udev watcher that asks for a rescan, where udev is there."""
        if monitor is None and self.config.hotplug.udev:
            monitor = udev_monitor()
        if monitor is None:
            return None
        requests = self.checks.requests
        return HotplugWatcher(monitor, lambda what: requests.rescan())

    def prepare(self) -> Inventory:
        """Before anything serves: the checkpoint (so devices in use before a
        restart are judged Unhealthy by the very first scan), the XID
        watcher, and the first full scan."""
        self.lifecycle.load()
        if self.xid is not None:
            self.xid.start()
        inventory = self.checks.check(full=True)
        log_inventory(inventory)
        if self.xid is not None and not self.xid.wait_armed(XID_ARM_WAIT):
            log.warning("XID watcher not armed after %.0fs; continuing", XID_ARM_WAIT)
        return inventory


def _discoverer(config: Config, gpu_lib: object | None) -> Discoverer:
    paths, gpu = config.paths, config.resources.gpu
    deadlines = Deadlines(config.health.read_timeout_seconds)
    # The node's GPU spec is read only when GPUs are handed out by CDI name.
    reads_cdi = gpu.enabled and bool(CDI_STRATEGIES & set(gpu.device_list_strategy))
    return Discoverer(
        Roots(Path(paths.sysfs_root), Path(paths.dev_root)),
        NvmlGpuSource(gpu_lib, deadlines) if gpu_lib is not None else None,
        deadlines,
        cdi=CdiReader(config.cdi.spec_dirs) if reads_cdi else None,
        mig_strategy=gpu.mig.strategy,
        caps_root=Path(paths.nvidia_caps_root),
    )


def _xid(
    config: Config, gpu_lib: object | None, health: HealthTracker, requests: Requests
) -> XidWatcher | None:
    if gpu_lib is None:
        return None
    return XidWatcher(
        gpu_lib,
        ignore=config.health.xid_ignore,
        health=health,
        good_checks=config.health.xid_good_checks,
        on_fault=requests.rejudge,
    )


def _custody(
    config: Config,
    resources: Sequence[Resource],
    discoverer: Discoverer,
    ledger: Ledger,
    health: HealthTracker,
    metrics: Metrics,
    rejudge: Callable[[], None],
    runner: HookRunner,
    witness: PodWitness | None,
    dra: frozenset[DeviceKind],
    read_hold: ReadHold,
) -> Lifecycle:
    """Who holds which device, and the cleanups owed before reuse: hooks
    from the config, descriptions from the last scan, the checkpoint."""
    lifecycle = config.lifecycle
    return Lifecycle(
        hooks=Hooks(
            specs={
                resource.kind: HookSpec(hooks.cleanup, hooks.timeout_seconds)
                for resource in resources
                if (hooks := config.resources.of(resource.kind).hooks).cleanup
            },
            describe=lambda kind, ids: describe(discoverer.last, kind, ids),
            runner=runner,
        ),
        names={resource.kind: resource.name for resource in resources},
        checkpoint=Checkpoint(Path(lifecycle.checkpoint_file), read_hold),
        ledger=ledger,
        health=health,
        policy=CleanupPolicy(
            confirmations=lifecycle.release_confirmations,
            retry_initial=lifecycle.cleanup_retry_initial_seconds,
            retry_max=lifecycle.cleanup_retry_max_seconds,
            explicit=dra,
        ),
        on_change=rejudge,
        on_save=metrics.checkpoint_written,
        witness=witness,
    )


def build_core(
    config: Config, nvml_lib: object | None, *, witness: Witness, read_hold: ReadHold = no_holds
) -> NodeCore:
    """Wire the node core (nothing starts here). `read_hold`: how the
    checkpoint's DRA claims are read (the DRA front-end's record type)."""
    paths, health_config = config.paths, config.health
    hca_config = config.resources.hca
    gpu_lib = nvml_lib if config.resources.gpu.enabled else None
    discoverer = _discoverer(config, gpu_lib)
    writes_cdi = hca_config.enabled and bool(CDI_STRATEGIES & set(hca_config.device_list_strategy))
    hca_spec = (
        HcaSpecWriter(Path(config.cdi.spec_dirs[-1]), config.cdi.hca_kind) if writes_cdi else None
    )
    resources = build_resources(config)
    names = {resource.kind: resource.name for resource in resources}
    pods = config.pod_resources
    ledger = Ledger(grace=pods.bookkeeping_grace_seconds, max_age=pods.unconfirmed_max_age_seconds)
    metrics = Metrics()
    metrics.prime(names.values())
    metrics.holdings_age.set_function(ledger.age)
    coordinator = Coordinator(
        ledger,
        pairing_window=config.allocation.pairing_window_seconds,
        search_budget=config.allocation.search_budget_ms / 1000.0,
        on_budget=metrics.budget_hits.inc,
    )
    runner = hook_runner(config, metrics)
    health = HealthTracker(Recovery(health_config.recovery), health_config.good_checks)
    requests = Requests()
    dra = frozenset(DeviceKind(kind) for kind in dra_kinds(config))
    watched = witness(ledger, metrics, names)
    lifecycle = _custody(
        config,
        resources,
        discoverer,
        ledger,
        health,
        metrics,
        requests.rejudge,
        runner,
        watched,
        dra,
        read_hold,
    )
    # The census is read at each scrape, one snapshot of the served kinds.
    metrics.registry.register(CustodyCollector(lifecycle.view.census, names))
    hca_view = HcaResource(name=hca_config.name, env_var=hca_config.env_var)
    pipeline = Pipeline(
        resources,
        health=health,
        custody=lifecycle.view,
        coordinator=coordinator,
        metrics=metrics,
        after_cleanup=health_config.recovery == "after_cleanup",
        hca_view=hca_view,
        hca_spec=hca_spec,
    )
    xid = _xid(config, gpu_lib, health, requests)
    checks = CheckLoop(
        discoverer,
        pipeline,
        interval=health_config.interval_seconds,
        port_interval=health_config.port_interval_seconds,
        rescan=config.discovery.rescan_interval_seconds,
        stale_after=health_config.stale_after_seconds,
        requests=requests,
        on_scan=xid.track if xid is not None else lambda inventory: None,
        metrics=metrics,
    )
    facts = KubeletFacts(config.kubelet, Path(paths.sysfs_root))
    monitor = AlignmentMonitor(
        PodResourcesClient(Path(paths.pod_resources_socket)),
        coordinator,
        ledger,
        names,
        interval=pods.poll_interval_seconds,
        min_interval=pods.min_interval_seconds,
        quiet_interval=pods.quiet_interval_seconds,
        listeners=[lifecycle.releases.observe],
        metrics=metrics,
        facts=facts,
    )
    ledger.listen_freed(monitor.quicken)
    return NodeCore(
        config=config,
        discoverer=discoverer,
        resources=resources,
        dra_kinds=dra,
        ledger=ledger,
        metrics=metrics,
        coordinator=coordinator,
        runner=runner,
        lifecycle=lifecycle,
        pipeline=pipeline,
        checks=checks,
        monitor=monitor,
        facts=facts,
        xid=xid,
        hca_view=hca_view,
    )
