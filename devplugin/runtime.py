"""The composition root (`build`) and the supervisor of one node's daemon.

`build` asks each part to assemble itself in its own room (the node core,
the cluster side, each front-end) and hands the loops to a `Daemon`; no
part reaches back into it. Data flows one way: the check loop reads the
hardware (with deadlines) and hands each snapshot to the pipeline, which
judges and publishes to each front-end; the front-ends answer the kubelet
from what was published and record holdings in the ledger that the
coordinator and the custody book's releases read.

`Daemon` starts its loops in order and stops them in reverse: every one is
told to stop before any is waited for, each wait bounded by the loop's own
join timeout, so no stop waits out another's interval.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import sys
from functools import partial
from typing import TYPE_CHECKING, Any

from devplugin.cluster.assembly import ClusterSide, StatusInputs
from devplugin.config import Config, ConfigError
from devplugin.frontends.deviceplugin.frontend import DevicePluginFrontend
from devplugin.frontends.deviceplugin.kubelet import Registrar
from devplugin.frontends.deviceplugin.server import DevicePluginServicer, PluginServer
from devplugin.frontends.dra.claim_record import ClaimRecord
from devplugin.frontends.dra.driver import DraFrontend
from devplugin.loops import Loop
from devplugin.model import Inventory
from devplugin.node.alignment import holders_report
from devplugin.node.core import NodeCore, build_core
from devplugin.node.discovery.udev import HotplugWatcher
from devplugin.node.status import Record, StatusServer
from devplugin.policy.allocator import native_fold_available
from devplugin.policy.mig import mig_problem, profiles_of

if TYPE_CHECKING:
    from devplugin.cluster.pods import PodCache

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


def refreeze_heap() -> None:
    """Later in a long-serving process: collect the young generation only (a
    few milliseconds), then freeze what is left. Full passes over objects
    that live for the process's life are what make its pauses long; the
    price is that a reference cycle alive now is never collected, and the
    extender's objects (views, records, answers) hold none."""
    gc.collect(1)
    gc.freeze()
    # With everything frozen the old generation counts as empty, and the
    # collector's rule (a full pass once it grew by a quarter) then runs one
    # every ten young passes; these make full passes rare again.
    gc.set_threshold(*LONG_SERVING_THRESHOLDS)


# gc thresholds for a process that refreezes (the defaults are 700, 10, 10).
LONG_SERVING_THRESHOLDS = (5_000, 20, 100)


def _trim_malloc() -> None:
    """Give the C heap's free pages back to the system (glibc only): a start-up
    that decoded large lists leaves them resident otherwise."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Daemon:
    """Starts, supervises and stops the loops `build` assembled for one node."""

    def __init__(
        self,
        core: NodeCore,
        *,
        plugins: DevicePluginFrontend,
        cluster: ClusterSide,
        dra: DraFrontend | None = None,
        hotplug_monitor: Any | None = None,
        record: Record | None = None,
    ) -> None:
        self.core = core
        self.config = core.config
        self.plugins = plugins
        self.cluster = cluster
        self.dra = dra
        # Opened at start (udev's netlink socket, the watcher's wake pipe):
        # a daemon built and never started holds neither.
        self._hotplug_monitor = hotplug_monitor
        self.hotplug: HotplugWatcher | None = None
        self.status: StatusServer | None = None
        if self.config.metrics.enabled:
            self.status = StatusServer(
                list(self.config.metrics.addresses),
                core.metrics.registry,
                healthy=self.healthy,
                ready=self.ready,
                record=record,
            )
        self._running: list[Loop] = []
        self._started = False

    # -- views for operators and tests -------------------------------------------
    @property
    def loops(self) -> list[Loop]:
        """In start order. After the first scan: owed cleanups find their
        devices described; the servers before the registrar (the kubelet
        dials back inside Register); the check loop last."""
        found: list[Loop | None] = [self.core.lifecycle, self.plugins, self.dra, self.status]
        if self.plugins.records:
            # PodResources lists device-plugin holdings only.
            found.append(self.core.monitor)
        found += [*self.cluster.loops, self.hotplug, self.core.checks]
        return [loop for loop in found if loop is not None]

    @property
    def inventory(self) -> Inventory:
        return self.core.pipeline.inventory

    @property
    def checks(self) -> int:
        """Completed scans."""
        return self.core.checks.checks

    @property
    def pods(self) -> PodCache | None:
        return self.cluster.pods

    @property
    def cluster_loops(self) -> list[Loop]:
        """The cluster side's writers (events, the record, the Lease)."""
        return [loop for loop in self.cluster.loops if loop is not self.cluster.pods]

    @property
    def registrar(self) -> Registrar:
        return self.plugins.registrar

    @property
    def servers(self) -> list[PluginServer]:
        return self.plugins.servers

    def servicer(self, resource_name: str) -> DevicePluginServicer:
        return self.plugins.servicer(resource_name)

    def rescan(self) -> Inventory:
        return self.core.checks.check(full=True)

    def judge(self) -> None:
        self.core.pipeline.rejudge()

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        """Scan, then start every loop in order; a loop that fails to start
        stops the ones before it."""
        config = self.config
        log.info(
            "devplugin starting: resources %s, plugin dir %s, sysfs %s, dev %s",
            ", ".join(resource.name for resource in self.core.resources),
            config.paths.device_plugin_dir,
            config.paths.sysfs_root,
            config.paths.dev_root,
        )
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
        self.core.prepare()
        self.hotplug = self.core.hotplug(self._hotplug_monitor)
        self._running = [self.core.xid] if self.core.xid is not None else []
        try:
            for loop in self.loops:
                loop.start()
                self._running.append(loop)
        except Exception:
            self.stop()
            raise
        self._started = True

    def healthy(self) -> tuple[bool, str]:
        """/healthz: gRPC servers and loops alive, and health checks not stale."""
        ok, why = self.plugins.healthy()
        if not ok:
            return ok, why
        if self.dra is not None and not self.dra.plugin.service.running:
            return False, "DRA gRPC server not running"
        thread = self.core.checks.thread
        if thread is not None and not thread.is_alive():
            return False, f"{thread.name} loop has stopped"
        return self.core.checks.healthy()

    def ready(self) -> tuple[bool, str]:
        """/readyz: every resource is registered with the current kubelet."""
        if not self._started:
            return False, "not started"
        ok, why = self.plugins.ready()
        if ok and self.dra is not None:
            ok, why = self.dra.ready()
        if not ok:
            return False, why
        error = self.core.lifecycle.book.checkpoint_error()
        if error is not None:
            return False, f"checkpoint not written: {error}"
        pods = self.cluster.pods
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

        Every loop is told to stop (the last started first) before any is
        waited for, so the waits overlap instead of adding up."""
        running = list(reversed(self._running))
        self._running = []
        for loop in running:
            loop.signal_stop()
        if self.dra is not None:
            self.dra.stop_serving()
        for loop in running:
            loop.join()
        # The HCA CDI spec stays: containers that hold an HCA may restart
        # while no daemon runs (a rollout, a crash loop) and need it then.
        self.cluster.close()
        self.core.discoverer.close()
        if self._started:
            log.info("devplugin stopped; sockets removed")
        self._started = False


def build(config: Config, nvml_lib: Any | None, *, hotplug_monitor: Any | None = None) -> Daemon:
    """Wire one node's daemon from its configuration (nothing starts here)."""
    cluster = ClusterSide.connect(config)
    core = build_core(config, nvml_lib, witness=cluster.witness, read_hold=ClaimRecord.from_json)
    try:
        profiles = _mig_profiles(config, core)
    except ConfigError:
        core.discoverer.close()
        cluster.close()
        raise
    cluster.attach(core)
    awareness = cluster.awareness
    plugins = DevicePluginFrontend.build(
        config,
        core,
        partners=awareness,
        identify=awareness.holder_of if awareness is not None else None,
        profiles=profiles,
    )
    dra = None
    if core.dra_kinds:
        dra = DraFrontend.build(
            config,
            core,
            reader=cluster.claim_reader(),
            publisher=lambda desired: cluster.slice_publisher(desired, core.metrics),
        )
        _follow_allocations(cluster, dra)
    inputs = _status_inputs(core, plugins, dra)
    cluster.publish_record(inputs, core)
    cluster.label_node(lambda: core.pipeline.inventory, core)
    return Daemon(
        core,
        plugins=plugins,
        cluster=cluster,
        dra=dra,
        hotplug_monitor=hotplug_monitor,
        record=partial(cluster.record, inputs),
    )


def _follow_allocations(cluster: ClusterSide, dra: DraFrontend) -> None:
    """The slices' free counts move when the scheduler allocates a claim
    here, not only when the kubelet prepares it (cluster/allocated.py)."""
    publisher = dra.publisher
    if publisher is None:
        return
    follow = cluster.follow_allocations(
        cluster.claim_reader(), driver=dra.preparer.driver, pool=dra.pool, changed=publisher.poke
    )
    if follow is not None:
        dra.allocated = follow.devices


def _mig_profiles(config: Config, core: NodeCore) -> list[str]:
    """With a MIG strategy: look at the GPUs once before serving. A strategy
    they cannot serve (no MIG-capable GPU; single over whole GPUs or mixed
    profiles) is a configuration error; the profiles found are what the
    mixed strategy serves."""
    strategy = config.resources.gpu.mig.strategy
    if strategy == "none" or not config.resources.gpu.enabled:
        return []
    inventory = core.discoverer.scan(full=True)
    if not inventory.nvml.ok:
        # NVML not up yet (a driver container still loading): nothing can be
        # judged; the GPUs are served once it answers, none of them whole.
        error = inventory.nvml.error
        log.warning("MIG strategy %s: NVML not available at start (%s)", strategy, error)
        return []
    problem = mig_problem(inventory.gpus, strategy)
    if problem is not None:
        raise ConfigError("resources.gpu.mig.strategy", problem)
    found = profiles_of(inventory.gpus)
    listed = ", ".join(f"{n} x {p}" for p, n in sorted(found.items()))
    log.info("MIG strategy %s: %s", strategy, listed or "no MIG devices")
    return sorted(found)


def _status_inputs(
    core: NodeCore, plugins: DevicePluginFrontend, dra: DraFrontend | None
) -> StatusInputs:
    def registered() -> dict[str, bool]:
        found = plugins.registrar.registered()
        if dra is not None:
            found[f"DRA driver {dra.preparer.driver}"] = dra.plugin.registered()
        return found

    return StatusInputs(
        inventory=lambda: core.pipeline.inventory,
        states=plugins.states,
        holders=lambda: holders_report(core.coordinator.topology, core.ledger.holders()),
        registered=registered,
        served=plugins.served_as,
        kubelet=core.facts.kubelet,
        numa=core.facts.numa,
    )
