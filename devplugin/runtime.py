"""The composition root (`build`) and the supervisor of one node's daemon.

`build` wires the parts and returns a `Daemon`; no part reaches back into
it. Data flows one way: the check loop reads the hardware (with deadlines)
and hands each snapshot to the pipeline, which judges and publishes to each
resource's servicer; servicers answer RPCs from what was published, call
their `AllocationHooks` around an Allocate, and the hooks record holdings in
the ledger that the coordinator and the cleanup manager read.

`Daemon` starts the parts in dependency order and stops them by signalling
every one first, then joining each: no stop waits out another's interval.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import sys
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from lightkube import Client

from devplugin.cluster.awareness import PodAwareness
from devplugin.cluster.claims import ApiClaimReader
from devplugin.cluster.client import Heartbeat, make_client
from devplugin.cluster.events import EventRecorder
from devplugin.cluster.lease import LeaseKeeper
from devplugin.cluster.pods import PodCache
from devplugin.cluster.publisher import RecordPublisher
from devplugin.cluster.record import Registration, build_status
from devplugin.cluster.slices import SlicePublisher, slice_cache
from devplugin.cluster.watch import WatchTiming
from devplugin.config import (
    CDI_STRATEGIES,
    Config,
    ConfigError,
    HooksConfig,
    dra_cdi_kind,
    dra_kinds,
    lease_namespace,
    node_name,
)
from devplugin.frontends.deviceplugin.kubelet import Registrar
from devplugin.frontends.deviceplugin.server import DevicePluginServicer, PluginServer, socket_name
from devplugin.frontends.dra.driver import DraFrontend
from devplugin.frontends.dra.plugin import DraPlugin, socket_paths
from devplugin.frontends.dra.prepare import Preparer
from devplugin.frontends.dra.slices import names as slice_names
from devplugin.frontends.dra.slices import node_devices
from devplugin.model import DeviceKind, Inventory
from devplugin.node.alignment import AlignmentMonitor, holders_report
from devplugin.node.checks import CheckLoop, Requests
from devplugin.node.coordination import Coordinator
from devplugin.node.deadline import Deadlines
from devplugin.node.discovery import CdiReader, Discoverer, NvmlGpuSource, Roots
from devplugin.node.discovery.udev import HotplugWatcher, udev_monitor
from devplugin.node.ledger import Ledger
from devplugin.node.lifecycle.boot import read_boot_id
from devplugin.node.lifecycle.cdi_spec import ClaimSpecs, HcaSpecWriter
from devplugin.node.lifecycle.checkpoint import Checkpoint
from devplugin.node.lifecycle.cleanup import CleanupManager
from devplugin.node.lifecycle.devices import describe
from devplugin.node.lifecycle.health import HealthTracker, Recovery
from devplugin.node.lifecycle.hooks import HookSpec, run_hook
from devplugin.node.lifecycle.xid import XidWatcher
from devplugin.node.metrics import Metrics
from devplugin.node.node_hooks import ResourceHooks
from devplugin.node.pipeline import Pipeline, log_inventory
from devplugin.node.podresources import PodResourcesClient
from devplugin.node.resources import (
    Capabilities,
    Delivery,
    GpuResource,
    HcaResource,
    Resource,
    ResourceState,
)
from devplugin.node.sharing import SharedResource
from devplugin.node.status import StatusServer
from devplugin.policy.allocator import native_fold_available
from devplugin.policy.claims import ClaimReader, ClaimReadError
from devplugin.policy.podinfo import PodInfo
from devplugin.rpc import check_server_path

log = logging.getLogger(__name__)

SWITCH_INTERVAL = 0.0005


def settle_heap() -> None:
    """Once a process has started serving: collect what start-up left behind,
    then freeze the survivors (modules, the topology, the servers), so the
    cycle collector's full passes no longer walk them. Such a pass holds the
    GIL for as long as it walks; over a started daemon's heap that was
    20-30 ms, paid by whichever kubelet call it landed in."""
    gc.collect()
    gc.freeze()
    _trim_malloc()


def _trim_malloc() -> None:
    """Give the C heap's free pages back to the system (glibc only): a start-up
    that decoded large lists leaves them resident otherwise."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


# How long start waits for the XID watcher to register the first GPU set.
XID_ARM_WAIT = 5.0


def _hooks_config(config: Config, kind: DeviceKind) -> HooksConfig:
    return config.resources.gpu.hooks if kind is DeviceKind.GPU else config.resources.hca.hooks


def check_socket_field(field: str, path: Path) -> None:
    """A socket path the kernel cannot bind is the configured directory's
    fault: a config error naming it, not a failure at start."""
    try:
        check_server_path(path)
    except ValueError as exc:
        raise ConfigError(field, str(exc)) from exc


def build_resources(config: Config) -> list[Resource]:
    def caps(hooks: HooksConfig) -> Capabilities:
        return Capabilities(
            preferred_allocation=config.allocation.preferred,
            pre_start=bool(hooks.init) and hooks.init_phase == "pre_start",
        )

    resources: list[Resource] = []
    gpu, hca = config.resources.gpu, config.resources.hca
    sharing, cdi = config.sharing, config.cdi
    if gpu.enabled:
        gpu_delivery = Delivery(
            strategy=frozenset(gpu.device_list_strategy), cdi_kind=cdi.gpu_kind,
            gpu_names=cdi.gpu_device_name, plugin="devplugin.gpu",
        )  # fmt: skip
        gpu_resource: Resource = GpuResource(
            name=gpu.name, capabilities=caps(gpu.hooks), delivery=gpu_delivery
        )
        if sharing.gpu.replicas > 1:
            gpu_resource = SharedResource(
                gpu_resource,
                sharing.gpu.replicas,
                policy=sharing.gpu.policy,
                refuse_multiple=sharing.gpu.refuse_multiple_per_gpu,
                renamed=sharing.gpu.resource_name,
            )
        resources.append(gpu_resource)
    if hca.enabled:
        hca_delivery = Delivery(
            strategy=frozenset(hca.device_list_strategy), cdi_kind=cdi.hca_kind,
            plugin="devplugin.hca",
        )  # fmt: skip
        hca_resource: Resource = HcaResource(
            name=hca.name, env_var=hca.env_var, capabilities=caps(hca.hooks),
            delivery=hca_delivery,
        )  # fmt: skip
        if sharing.hca.units > 1:
            hca_resource = SharedResource(
                hca_resource, sharing.hca.units, policy=sharing.hca.policy
            )
        resources.append(hca_resource)
    return resources


@dataclass
class ResourceRecord:
    """Everything that belongs to one served resource."""

    resource: Resource
    hooks: ResourceHooks
    servicer: DevicePluginServicer
    server: PluginServer


class Daemon:
    """Starts, supervises and stops the parts `build` wired for one node."""

    def __init__(
        self,
        config: Config,
        *,
        discoverer: Discoverer,
        pipeline: Pipeline,
        checks: CheckLoop,
        records: list[ResourceRecord],
        registrar: Registrar,
        coordinator: Coordinator,
        ledger: Ledger,
        cleanup: CleanupManager,
        monitor: AlignmentMonitor,
        metrics: Metrics,
        xid: XidWatcher | None,
        hotplug_monitor: Any | None,
        pods: PodCache | None = None,
        cluster_loops: list[Any] | None = None,
        writer: Client | None = None,
        dra: DraFrontend | None = None,
    ) -> None:
        self.config = config
        self.dra = dra
        self.discoverer = discoverer
        self.pipeline = pipeline
        self.check_loop = checks
        self.records = records
        self.registrar = registrar
        self.coordinator = coordinator
        self.ledger = ledger
        self.cleanup = cleanup
        self.monitor = monitor
        self.metrics = metrics
        self.xid = xid
        self.pods = pods
        # The NodeDevices publisher and the event recorder, when on.
        self.cluster_loops = list(cluster_loops or [])
        self._writer = writer
        self._hotplug_monitor = hotplug_monitor
        self.hotplug: HotplugWatcher | None = None
        self.status: StatusServer | None = None
        self._started = False

    # -- views for operators and tests -------------------------------------------
    @property
    def inventory(self) -> Inventory:
        return self.pipeline.inventory

    @property
    def checks(self) -> int:
        """Completed scans."""
        return self.check_loop.checks

    @property
    def servers(self) -> list[PluginServer]:
        return [record.server for record in self.records]

    def servicer(self, resource_name: str) -> DevicePluginServicer:
        for record in self.records:
            if record.resource.name == resource_name:
                return record.servicer
        raise KeyError(resource_name)

    def rescan(self) -> Inventory:
        return self.check_loop.check(full=True)

    def judge(self) -> None:
        self.pipeline.rejudge()

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        """Scan, serve, then register: the kubelet dials back inside Register."""
        config = self.config
        log.info(
            "devplugin starting: resources %s, plugin dir %s, sysfs %s, dev %s",
            ", ".join(record.resource.name for record in self.records),
            config.paths.device_plugin_dir, config.paths.sysfs_root, config.paths.dev_root,
        )  # fmt: skip
        if not native_fold_available():
            log.warning(
                "the allocator's compiled fold (devplugin/policy/_foldc.c) is not built, so "
                "preferred allocations use the Python fold: the same answers, several "
                "times slower (install with a C compiler present to build it)"
            )
        # RPC handlers share the interpreter with the check loop; a short GIL
        # switch interval keeps a scan from delaying a kubelet call by more
        # than half a millisecond (the default slice is 5 ms).
        sys.setswitchinterval(SWITCH_INTERVAL)
        # The checkpoint first, so devices in use before a restart are judged
        # Unhealthy by the very first scan.
        self.cleanup.load()
        if self.xid is not None:
            self.xid.start()
        log_inventory(self.check_loop.check(full=True))
        if self.xid is not None and not self.xid.wait_armed(XID_ARM_WAIT):
            log.warning("XID watcher not armed after %.0fs; continuing", XID_ARM_WAIT)
        # After the first scan: owed cleanups find their devices described.
        self.cleanup.start()
        try:
            for record in self.records:
                record.server.start()
            if self.dra is not None:
                self.dra.start()
        except Exception:
            self.stop()
            raise
        self.registrar.start()
        if config.metrics.enabled:
            self.status = StatusServer(
                list(config.metrics.addresses),
                self.metrics.registry,
                healthy=self.healthy,
                ready=self.ready,
            )
            self.status.start()
        if self.records:
            # PodResources lists device-plugin holdings only.
            self.monitor.start()
        if self.pods is not None:
            self.pods.start()
        for loop in self.cluster_loops:
            loop.start()
        monitor = self._hotplug_monitor
        if monitor is None and config.hotplug.udev:
            monitor = udev_monitor()
        if monitor is not None:
            self.hotplug = HotplugWatcher(monitor, lambda what: self.check_loop.requests.rescan())
            self.hotplug.start()
        self.check_loop.start()
        self._started = True

    def healthy(self) -> tuple[bool, str]:
        """/healthz: gRPC servers and loops alive, and health checks not stale."""
        down = [r.resource.name for r in self.records if not r.server.running]
        if down:
            return False, f"gRPC server not running: {', '.join(down)}"
        if self.dra is not None and not self.dra.plugin.service.running:
            return False, "DRA gRPC server not running"
        for thread in (self.check_loop.thread, self.registrar.thread):
            if thread is not None and not thread.is_alive():
                return False, f"{thread.name} loop has stopped"
        return self.check_loop.healthy()

    def ready(self) -> tuple[bool, str]:
        """/readyz: every resource is registered with the current kubelet."""
        if not self._started:
            return False, "not started"
        missing = [name for name, ok in self.registrar.registered().items() if not ok]
        if missing:
            return False, f"not registered with the kubelet: {', '.join(missing)}"
        if self.dra is not None:
            ok, why = self.dra.ready()
            if not ok:
                return False, why
        error = self.cleanup.checkpoint_error()
        if error is not None:
            return False, f"checkpoint not written: {error}"
        pods = self.pods
        if pods is not None and not pods.current:
            # Allocation goes on without the pods (as without API access);
            # the operator should know the view is not the cluster's.
            return False, (
                f"pod cache not current: nothing from the API server for {pods.age():.0f}s "
                "(planning from the kubelet alone)"
            )
        return True, ""

    def stop(self) -> None:
        """Stop serving and remove our sockets. Safe to call more than once.

        Every part is told to stop before any is waited for, so the waits
        overlap instead of adding up."""
        loops: list[Any] = [self.check_loop, self.registrar, self.monitor, self.cleanup]
        if self.hotplug is not None:
            loops.append(self.hotplug)
        if self.xid is not None:
            loops.append(self.xid)
        if self.pods is not None:
            loops.append(self.pods)
        loops.extend(self.cluster_loops)
        if self.dra is not None:
            loops.append(self.dra)
        for loop in loops:
            loop.signal_stop()
        for record in self.records:
            record.servicer.close_streams()
        if self.dra is not None:
            self.dra.stop_serving()
        if self.status is not None:
            self.status.stop()
            self.status = None
        for record in self.records:
            record.server.stop(grace=0.2)
        for loop in loops:
            if loop is not self.cleanup:
                # A watch blocked on the network ends by itself, and a write
                # gives up at its request timeout: never wait on them long.
                network = loop is self.pods or loop in self.cluster_loops or loop is self.dra
                loop.join(timeout=0.5 if network else 10)
        self.cleanup.join()
        # The HCA CDI spec stays: containers that hold an HCA may restart
        # while no daemon runs (a rollout, a crash loop) and need it then.
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception:
                log.debug("closing the API writer failed", exc_info=True)
        self.discoverer.close()
        if self._started:
            log.info("devplugin stopped; sockets removed")
        self._started = False


def build(config: Config, nvml_lib: Any | None, *, hotplug_monitor: Any | None = None) -> Daemon:
    """Wire one node's daemon from its configuration (nothing starts here)."""
    paths, health_config = config.paths, config.health
    deadlines = Deadlines(health_config.read_timeout_seconds)
    gpu_lib = nvml_lib if config.resources.gpu.enabled else None
    gpu_config, hca_config = config.resources.gpu, config.resources.hca
    # The node's GPU spec is read only when GPUs are handed out by CDI name.
    reads_cdi = gpu_config.enabled and bool(CDI_STRATEGIES & set(gpu_config.device_list_strategy))
    discoverer = Discoverer(
        Roots(Path(paths.sysfs_root), Path(paths.dev_root)),
        NvmlGpuSource(gpu_lib, deadlines) if gpu_lib is not None else None,
        deadlines,
        cdi=CdiReader(config.cdi.spec_dirs) if reads_cdi else None,
    )
    writes_cdi = hca_config.enabled and bool(CDI_STRATEGIES & set(hca_config.device_list_strategy))
    hca_spec = (
        HcaSpecWriter(Path(config.cdi.spec_dirs[-1]), config.cdi.hca_kind) if writes_cdi else None
    )
    resources = build_resources(config)
    names = {resource.kind: resource.name for resource in resources}
    # Resources the kubelet learns of through DRA: judged like the others,
    # served by the DRA front-end instead of a device-plugin server.
    dra = frozenset(DeviceKind(kind) for kind in dra_kinds(config))
    ledger = Ledger(
        grace=config.pod_resources.bookkeeping_grace_seconds,
        max_age=config.pod_resources.unconfirmed_max_age_seconds,
    )
    metrics = Metrics()
    coordinator = Coordinator(
        ledger,
        pairing_window=config.allocation.pairing_window_seconds,
        search_budget=config.allocation.search_budget_ms / 1000.0,
        on_budget=metrics.budget_hits.inc,
    )
    # Hooks see the roots the daemon reads (in the chart, /host/sys and
    # /host/dev), so the example hooks check the same devices it does.
    hook_env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "DEVPLUGIN_SYSFS_ROOT": paths.sysfs_root,
        "DEVPLUGIN_DEV_ROOT": paths.dev_root,
    }
    runner = metrics.timed_hooks(partial(run_hook, base_env=hook_env))
    health = HealthTracker(Recovery(health_config.recovery), health_config.good_checks)
    hook_specs: dict[DeviceKind, HooksConfig] = {
        resource.kind: _hooks_config(config, resource.kind) for resource in resources
    }
    lifecycle = config.lifecycle
    requests = Requests()
    pods: PodCache | None = None
    writer: Client | None = None
    kube = config.kubernetes
    if kube.enabled:
        heartbeat = Heartbeat()
        client = make_client(kube, heartbeat=heartbeat)
        if client is not None:
            pods = PodCache(
                client, node_name(config), timing=WatchTiming.of(kube), heartbeat=heartbeat
            )
            # Writes (the record, events) on their own connection: the pod
            # watch's is closed to end it at stop.
            writer = make_client(kube)
    metrics.holdings_age.set_function(ledger.age)
    awareness: PodAwareness | None = None
    if pods is not None:
        awareness = PodAwareness(
            pods, ledger, names, wait=config.kubernetes.pod_wait_seconds, metrics=metrics,
            pair_seconds=config.allocation.pairing_window_seconds,
            claim_seconds=config.kubernetes.claim_seconds,
        )  # fmt: skip
    cleanup = CleanupManager(
        hooks={
            kind: HookSpec(hooks.cleanup, hooks.timeout_seconds)
            for kind, hooks in hook_specs.items()
            if hooks.cleanup
        },
        resource_names=names,
        describe=lambda kind, ids: describe(discoverer.last, kind, ids),
        checkpoint=Checkpoint(Path(lifecycle.checkpoint_file)),
        ledger=ledger,
        health=health,
        confirmations=lifecycle.release_confirmations,
        retry_initial=lifecycle.cleanup_retry_initial_seconds,
        retry_max=lifecycle.cleanup_retry_max_seconds,
        on_change=requests.rejudge,
        on_save=metrics.checkpoint_written,
        runner=runner,
        witness=awareness,
        explicit=dra,
    )
    if pods is not None:
        pods.listen(cleanup.reconsider)
        watched = pods
        # The pod watch moves the holdings before any reader sees the change.
        pods.on_ended(partial(_pod_ended, ledger, watched))
        pods.on_started(lambda pod: ledger.pod_started(pod.namespace, pod.name, pod.uid))
        metrics.watch_current.labels("pods").set_function(lambda: float(watched.current))
        metrics.watch_age.labels("pods").set_function(watched.age)
    hca_view = HcaResource(name=config.resources.hca.name, env_var=config.resources.hca.env_var)
    pipeline = Pipeline(
        resources,
        health=health,
        cleanup=cleanup,
        coordinator=coordinator,
        metrics=metrics,
        after_cleanup=health_config.recovery == "after_cleanup",
        hca_view=hca_view,
        hca_spec=hca_spec,
    )
    xid = (
        XidWatcher(
            gpu_lib,
            ignore=health_config.xid_ignore,
            health=health,
            good_checks=health_config.xid_good_checks,
            on_fault=requests.rejudge,
        )
        if gpu_lib is not None
        else None
    )
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
    events: EventRecorder | None = None
    if writer is not None and pods is not None and config.kubernetes.events:
        events = EventRecorder(writer, node_name(config), pods.uid_of, metrics=metrics)
    monitor = AlignmentMonitor(
        PodResourcesClient(Path(paths.pod_resources_socket)),
        coordinator,
        ledger,
        names,
        interval=config.pod_resources.poll_interval_seconds,
        min_interval=config.pod_resources.min_interval_seconds,
        listeners=[cleanup.observe],
        on_new=[events.record] if events is not None else [],
        metrics=metrics,
    )
    plugin_dir = Path(paths.device_plugin_dir)
    records: list[ResourceRecord] = []
    for resource in resources:
        if resource.kind in dra:
            continue
        hooks_config = hook_specs[resource.kind]
        hooks = ResourceHooks(
            resource,
            pipeline=pipeline,
            ledger=ledger,
            coordinator=coordinator,
            cleanup=cleanup,
            runner=runner,
            init=HookSpec(hooks_config.init, hooks_config.timeout_seconds)
            if hooks_config.init
            else None,
            attach=hca_view
            if config.allocation.attach_hcas and resource.kind is DeviceKind.GPU
            else None,
            poke=monitor.poke,
            identify=awareness.holder_of if awareness is not None else None,
        )
        servicer = DevicePluginServicer(
            resource,
            ResourceState(devices=(), allocations={}),
            coordinator=coordinator,
            hooks=hooks,
            partners=awareness,
            metrics=metrics,
        )
        pipeline.connect(resource.kind, servicer.update)
        endpoint = plugin_dir / socket_name(resource.name)
        check_socket_field("paths.device_plugin_dir", endpoint)
        server = PluginServer(servicer, endpoint)
        records.append(ResourceRecord(resource, hooks, servicer, server))
    registrar = Registrar(
        [record.server for record in records],
        plugin_dir,
        interval=config.kubelet.watch_interval_seconds,
        register_timeout=config.kubelet.register_timeout_seconds,
        backoff_initial=config.kubelet.register_backoff_initial_seconds,
        backoff_max=config.kubelet.register_backoff_max_seconds,
        on_register=lambda name: metrics.registrations.labels(name).inc(),
    )
    frontend = (
        _dra_frontend(config, resources, dra, pipeline=pipeline, cleanup=cleanup,
                      runner=runner, writer=writer, metrics=metrics)
        if dra
        else None
    )  # fmt: skip
    publisher: RecordPublisher | None = None
    lease: LeaseKeeper | None = None
    if writer is not None and config.kubernetes.node_devices:
        status = partial(
            _record_status, pipeline, records, ledger=ledger, coordinator=coordinator,
            registrar=registrar, pods=pods, dra=frontend,
        )  # fmt: skip
        publisher = RecordPublisher(
            writer,
            node_name(config),
            status,
            min_interval=config.kubernetes.record_min_interval_seconds,
            resync=config.kubernetes.record_resync_seconds,
            metrics=metrics,
        )
        ledger.listen(publisher.poke)
        lease = LeaseKeeper(
            writer, node_name(config), lease_namespace(config),
            renew=config.kubernetes.lease_renew_seconds,
            duration=config.kubernetes.lease_duration_seconds,
        )  # fmt: skip
    return Daemon(
        config,
        dra=frontend,
        discoverer=discoverer,
        pipeline=pipeline,
        checks=checks,
        records=records,
        registrar=registrar,
        coordinator=coordinator,
        ledger=ledger,
        cleanup=cleanup,
        monitor=monitor,
        metrics=metrics,
        xid=xid,
        hotplug_monitor=hotplug_monitor,
        pods=pods,
        cluster_loops=[loop for loop in (events, publisher, lease) if loop is not None],
        writer=writer,
    )


class _NoApi:
    """Claims cannot be read without API access: every prepare fails (and
    the kubelet retries), nothing is handed out unchecked."""

    def get(self, namespace: str, name: str) -> Any:
        raise ClaimReadError("no Kubernetes API access")

    def on_node(self, driver: str, pool: str) -> Any:
        raise ClaimReadError("no Kubernetes API access")


def _dra_frontend(
    config: Config,
    resources: list[Resource],
    kinds: frozenset[DeviceKind],
    *,
    pipeline: Pipeline,
    cleanup: CleanupManager,
    runner: Any,
    writer: Client | None,
    metrics: Metrics,
) -> DraFrontend:
    kube, dra, paths = config.kubernetes, config.dra, config.paths
    node = node_name(config)
    reads = make_client(replace(kube, request_timeout_seconds=dra.claim_timeout_seconds))
    reader: ClaimReader = ApiClaimReader(reads) if reads is not None else _NoApi()
    served = {resource.kind: resource for resource in resources if resource.kind in kinds}
    init = {
        kind: HookSpec(hooks.init, hooks.timeout_seconds)
        for kind in served
        if (hooks := _hooks_config(config, kind)).init
    }
    preparer = Preparer(
        driver=dra.driver, pool=node, resources=served, pipeline=pipeline, cleanup=cleanup,
        runner=runner, init=init,
        specs=ClaimSpecs(Path(config.cdi.spec_dirs[-1]), dra_cdi_kind(config)),
        reader=reader,
        names=lambda: slice_names(node_devices(pipeline.inventory, kinds)),
        metrics=metrics, boot=read_boot_id(Path(paths.boot_id)),
    )  # fmt: skip
    service_path, registration_path = socket_paths(
        Path(paths.kubelet_plugins_dir), Path(paths.kubelet_registry_dir), dra.driver
    )
    check_socket_field("paths.kubelet_plugins_dir", service_path)
    check_socket_field("paths.kubelet_registry_dir", registration_path)
    plugin = DraPlugin(
        preparer,
        plugins_dir=Path(paths.kubelet_plugins_dir),
        registry_dir=Path(paths.kubelet_registry_dir),
        health_timeout=dra.health_timeout_seconds,
    )
    frontend = DraFrontend(
        preparer=preparer, plugin=plugin, pipeline=pipeline, kinds=kinds, publisher=None,
        unhealthy=dra.unhealthy, interval=config.kubelet.watch_interval_seconds,
    )  # fmt: skip
    watcher = make_client(kube)
    if writer is not None and watcher is not None:
        frontend.publisher = SlicePublisher(
            writer,
            slice_cache(watcher, node, WatchTiming.of(kube)),
            driver=dra.driver,
            node=node,
            desired=frontend.desired,
            metrics=metrics,
        )
    for kind in kinds:
        pipeline.connect(kind, partial(frontend.update, kind))
    pipeline.on_judged(frontend.judged)
    return frontend


def _pod_ended(ledger: Ledger, pods: PodCache, pod: PodInfo) -> None:
    live = pods.uid_of(pod.namespace, pod.name)
    ledger.pod_ended(
        pod.namespace, pod.name, pod.uid, successor=live is not None and live != pod.uid
    )


def _record_status(
    pipeline: Pipeline,
    records: list[ResourceRecord],
    *,
    ledger: Ledger,
    coordinator: Coordinator,
    registrar: Registrar,
    pods: PodCache | None,
    dra: DraFrontend | None = None,
) -> dict[str, Any]:
    """The NodeDevices status from the last judged state and the holdings
    as the events left them (no I/O)."""
    registered = registrar.registered()
    if dra is not None:
        registered[f"DRA driver {dra.preparer.driver}"] = dra.plugin.registered()
    missing = sorted(name for name, ok in registered.items() if not ok)
    registration = Registration(
        registered=bool(registered) and not missing,
        message=(
            f"not registered: {', '.join(missing)}"
            if missing
            else f"registered: {', '.join(sorted(registered))}"
        ),
    )
    states = {record.resource.kind: record.servicer.state for record in records}
    containers = holders_report(coordinator.topology, ledger.holders())
    if pods is not None:
        # Holders only PodResources named: their uid from the pod cache.
        containers = [
            replace(c, uid=pods.uid_of(c.namespace, c.pod)) if c.uid is None and c.pod else c
            for c in containers
        ]
    return build_status(pipeline.inventory, states, containers, registration)
