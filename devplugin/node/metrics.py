"""Prometheus metrics, one registry per daemon.

Names and labels (all prefixed `devplugin_`):

    devices{resource, health}                        gauge
    allocations_total{resource, result}              counter  (ok | refused)
    preferred_allocation_requests_total{resource, role, result}
                                                     counter  (role: first | second)
    preferred_allocation_seconds{resource}           histogram
    allocate_seconds{resource}                       histogram (hooks included)
    alignment_level                                  histogram of the worst GPU-to-HCA
                                                     level per container (PIX 1 .. SYS 5)
    containers_by_alignment{level}                   gauge, containers holding GPUs
                                                     and HCAs now, by worst level
    hook_runs_total{resource, phase, result}         counter  (ok | failed | timeout)
    hook_duration_seconds{resource, phase}           histogram
    registrations_total{resource}                    counter  (first and re-registrations)
    pod_aware_choices_total{resource, outcome}       counter  (exact | fallback-no-pod |
                                                     fallback-ambiguous)
    allocator_budget_exhausted_total                 counter  (searches answered at the budget)
    node_devices_writes_total{result}                counter  (ok | conflict | error)
    pod_events_total{result}                         counter  (ok | failed | dropped)
    holdings_age_seconds                             gauge, seconds since an event or poll
                                                     last confirmed who holds what
    holdings_corrections_total{resource}             counter, plans whose holdings the
                                                     kubelet's available list corrected
    watch_current{cache}                             gauge, 1 while an API watch cache is
                                                     current (listed, heard from in time)
    watch_age_seconds{cache}                         gauge, seconds since the cache last
                                                     heard from the API server
    watch_lists{cache}                               gauge, full lists the cache made (the
                                                     first, then one per 410 or broken watch)
    cdi_undeclared_devices{resource}                 gauge, devices not offered because no
                                                     CDI spec on the node declares them
    cdi_refused_specs                                gauge, CDI spec files a runtime would
                                                     refuse (they declare nothing)
    dra_claims_total{call, result}                   counter  (call: prepare | unprepare;
                                                     result: ok | again | error)
    dra_prepare_seconds                              histogram, one claim's prepare (hooks
                                                     and the claim read included)
    dra_prepared_claims                              gauge, claims prepared on this node
    resource_slice_writes_total{result}              counter  (ok | error): pool updates
    custody_devices{resource, phase}                 gauge, devices not free by custody
                                                     phase (taking, held, owed, cleaning,
                                                     quarantined, unverified)
    cleanup_oldest_seconds{resource}                 gauge, seconds the longest-waiting
                                                     device owing a cleanup has been in
                                                     its phase (0: none owed)
    lease_age_seconds                                gauge, seconds since the node's Lease
                                                     was last renewed (with the API only)
    lease_duration_seconds                           gauge, what each renewal promises
                                                     (0 without the API)
    alignment_below_required_total{required}         counter, containers given a worst
                                                     GPU-HCA level past the level their
                                                     pod requires (with the pod watch)
"""

from __future__ import annotations

import threading
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from devplugin.model import DeviceKind, Health
from devplugin.node.admission import Outcome
from devplugin.node.lifecycle.custody import Census
from devplugin.node.lifecycle.hooks import HookDevice, HookResult, HookRunner, HookSpec, Tracker
from devplugin.policy.topology import Level

FAST = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5)
SLOW = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0)


class Metrics:
    def __init__(self) -> None:
        registry = CollectorRegistry()
        self.registry = registry
        self.devices = Gauge(
            "devplugin_devices",
            "Devices served, by resource and health",
            ["resource", "health"],
            registry=registry,
        )
        self.allocations = Counter(
            "devplugin_allocations",
            "Allocate calls per container request",
            ["resource", "result"],
            registry=registry,
        )
        self.preferred = Counter(
            "devplugin_preferred_allocation_requests",
            "GetPreferredAllocation container requests",
            ["resource", "role", "result"],
            registry=registry,
        )
        self.preferred_seconds = Histogram(
            "devplugin_preferred_allocation_seconds",
            "GetPreferredAllocation handling time",
            ["resource"],
            buckets=FAST,
            registry=registry,
        )
        self.allocate_seconds = Histogram(
            "devplugin_allocate_seconds",
            "Allocate handling time, hooks included",
            ["resource"],
            buckets=SLOW,
            registry=registry,
        )
        self.alignment = Histogram(
            "devplugin_alignment_level",
            "Worst GPU-to-nearest-HCA level per container (PIX 1, PXB 2, PHB 3, NODE 4, SYS 5)",
            buckets=(1, 2, 3, 4, 5),
            registry=registry,
        )
        self.containers_by_alignment = Gauge(
            "devplugin_containers_by_alignment",
            "Containers now holding GPUs and HCAs, by worst GPU-to-HCA level",
            ["level"],
            registry=registry,
        )
        self.hook_runs = Counter(
            "devplugin_hook_runs",
            "Init and cleanup hook runs",
            ["resource", "phase", "result"],
            registry=registry,
        )
        self.hook_seconds = Histogram(
            "devplugin_hook_duration_seconds",
            "Hook run time",
            ["resource", "phase"],
            buckets=SLOW,
            registry=registry,
        )
        self.registrations = Counter(
            "devplugin_registrations",
            "Successful registrations with the kubelet",
            ["resource"],
            registry=registry,
        )
        self.checkpoint_failures = Counter(
            "devplugin_checkpoint_write_failures",
            "Lifecycle checkpoint writes that failed (read-only or full disk)",
            registry=registry,
        )
        self.checkpoint_ok = Gauge(
            "devplugin_checkpoint_ok",
            "1 when the last checkpoint write succeeded",
            registry=registry,
        )
        self.checkpoint_ok.set(1)
        self.pod_aware = Counter(
            "devplugin_pod_aware_choices",
            "First-resource choices by how the container's whole request was known "
            "(exact / fallback-no-pod / fallback-ambiguous)",
            ["resource", "outcome"],
            registry=registry,
        )
        self.budget_hits = Counter(
            "devplugin_allocator_budget_exhausted",
            "GPU searches that ran out of allocation.search_budget_ms and answered their best",
            registry=registry,
        )
        self.record_writes = Counter(
            "devplugin_node_devices_writes",
            "NodeDevices record writes (ok / conflict / error)",
            ["result"],
            registry=registry,
        )
        self.dra_claims = Counter(
            "devplugin_dra_claims",
            "DRA claims prepared and unprepared (ok / again: answered from the checkpoint / "
            "error: the claim's error)",
            ["call", "result"],
            registry=registry,
        )
        self.dra_prepare_seconds = Histogram(
            "devplugin_dra_prepare_seconds",
            "One DRA claim's prepare, its claim read and init hooks included",
            registry=registry,
            buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60),
        )
        self.dra_prepared = Gauge(
            "devplugin_dra_prepared_claims", "DRA claims prepared on this node", registry=registry
        )
        self.slice_writes = Counter(
            "devplugin_resource_slice_writes",
            "Updates of this node's ResourceSlice pool (ok / error)",
            ["result"],
            registry=registry,
        )
        self.pod_events = Counter(
            "devplugin_pod_events",
            "Events posted on pods (ok / failed / dropped)",
            ["result"],
            registry=registry,
        )
        self.stuck_reads = Gauge(
            "devplugin_stuck_reads",
            "Hardware reads (per GPU, per HCA, NVML, PCI tree) past their deadline",
            registry=registry,
        )
        self.holdings_age = Gauge(
            "devplugin_holdings_age_seconds",
            "Seconds since an Allocate, pod event, available list or poll last confirmed "
            "who holds which device",
            registry=registry,
        )
        self.corrections = Counter(
            "devplugin_holdings_corrections",
            "GetPreferredAllocation requests whose available list corrected the holdings",
            ["resource"],
            registry=registry,
        )
        self.watch_current = Gauge(
            "devplugin_watch_current",
            "1 while an API watch cache is current (listed, and heard from within its bound)",
            ["cache"],
            registry=registry,
        )
        self.watch_age = Gauge(
            "devplugin_watch_age_seconds",
            "Seconds since an API watch cache last heard from the API server",
            ["cache"],
            registry=registry,
        )
        self.watch_lists = Gauge(
            "devplugin_watch_lists",
            "Full lists an API watch cache made since start: the first, then one after each"
            " 410 Gone or broken watch (climbing fast: the API server or the path to it churns)",
            ["cache"],
            registry=registry,
        )
        self.cdi_undeclared = Gauge(
            "devplugin_cdi_undeclared_devices",
            "Devices not offered because no CDI spec on the node declares them",
            ["resource"],
            registry=registry,
        )
        self.cdi_refused_specs = Gauge(
            "devplugin_cdi_refused_specs",
            "CDI spec files in the spec directories a runtime would refuse",
            registry=registry,
        )
        self.check_age = Gauge(
            "devplugin_check_age_seconds",
            "Seconds since the last check that read every device in time",
            registry=registry,
        )

        self.lease_age = Gauge(
            "devplugin_lease_age_seconds",
            "Seconds since this node's Lease was last renewed",
            registry=registry,
        )
        self.lease_duration = Gauge(
            "devplugin_lease_duration_seconds",
            "How long each renewal promises the Lease holds (the extender's staleness bound)",
            registry=registry,
        )
        self.below_required = Counter(
            "devplugin_alignment_below_required",
            "Containers given a worst GPU-HCA level past the level their pod requires",
            ["required"],
            registry=registry,
        )

    def prime(self, resources: Iterable[str]) -> None:
        """Every series whose label values are known at start, at zero: a
        query or an alert sees 0 before the first event instead of nothing
        (and `rate` has a starting point)."""
        for name in resources:
            for result in ("ok", "refused"):
                self.allocations.labels(name, result)
            for role in ("first", "second"):
                self.preferred.labels(name, role, "ok")
            self.preferred.labels(name, "-", "refused")
            self.preferred_seconds.labels(name)
            self.allocate_seconds.labels(name)
            for phase in ("init", "cleanup"):
                self.hook_seconds.labels(name, phase)
                for result in ("ok", "failed", "timeout", "stopped"):
                    self.hook_runs.labels(name, phase, result)
            self.registrations.labels(name)
            self.corrections.labels(name)
            self.cdi_undeclared.labels(name)
            for outcome in Outcome:
                self.pod_aware.labels(name, outcome.value)
        for result in ("ok", "conflict", "error"):
            self.record_writes.labels(result)
        for call in ("prepare", "unprepare"):
            for result in ("ok", "again", "error"):
                self.dra_claims.labels(call, result)
        for result in ("ok", "error"):
            self.slice_writes.labels(result)
        for result in ("ok", "failed", "dropped"):
            self.pod_events.labels(result)
        for level in (Level.PIX, Level.PXB, Level.PHB, Level.NODE):
            self.below_required.labels(level.name)

    def watch_custody(
        self, census: Callable[[frozenset[DeviceKind]], Census], names: Mapping[DeviceKind, str]
    ) -> None:
        """Serve the custody census of the served kinds, read at each scrape
        (one snapshot)."""
        self.registry.register(_CustodyCollector(census, dict(names)))

    def checkpoint_written(self, ok: bool) -> None:
        self.checkpoint_ok.set(1 if ok else 0)
        if not ok:
            self.checkpoint_failures.inc()

    def set_devices(self, resource: str, healths: Iterable[Health]) -> None:
        counts = Tally(health.value for health in healths)
        for health in Health:
            self.devices.labels(resource, health.value).set(counts.get(health.value, 0))

    def set_alignment(self, levels: Iterable[Level]) -> None:
        counts = Tally(level.name for level in levels)
        for level in Level:
            self.containers_by_alignment.labels(level.name).set(counts.get(level.name, 0))

    def timed_hooks(self, runner: HookRunner) -> HookRunner:
        """Wrap a hook runner so every run is counted and timed."""

        def run(
            spec: HookSpec,
            phase: str,
            resource: str,
            devices: Sequence[HookDevice],
            *,
            track: Tracker | None = None,
            cancel: threading.Event | None = None,
        ) -> HookResult:
            result = runner(spec, phase, resource, devices, track=track, cancel=cancel)
            outcome = (
                "ok"
                if result.ok
                else "timeout"
                if result.timed_out
                else "stopped"
                if result.cancelled
                else "failed"
            )
            self.hook_runs.labels(resource, phase, outcome).inc()
            self.hook_seconds.labels(resource, phase).observe(result.duration)
            return result

        return run


class _CustodyCollector:
    """devplugin_custody_devices and devplugin_cleanup_oldest_seconds, read
    from the custody book when scraped (nothing to keep in step)."""

    def __init__(
        self, census: Callable[[frozenset[DeviceKind]], Census], names: dict[DeviceKind, str]
    ) -> None:
        self._census = census
        self._names = names
        self._kinds = frozenset(names)

    def describe(self) -> Iterator[Metric]:
        # Named here so registering does not read the book (collect would).
        yield GaugeMetricFamily("devplugin_custody_devices", "", labels=["resource", "phase"])
        yield GaugeMetricFamily("devplugin_cleanup_oldest_seconds", "", labels=["resource"])

    def collect(self) -> Iterator[Metric]:
        census = self._census(self._kinds)
        phases = GaugeMetricFamily(
            "devplugin_custody_devices",
            "Devices not free, by custody phase",
            labels=["resource", "phase"],
        )
        for (kind, phase), count in sorted(
            census.phases.items(), key=lambda item: (item[0][0].value, item[0][1].value)
        ):
            phases.add_metric([self._names[kind], phase.value], count)
        yield phases
        oldest = GaugeMetricFamily(
            "devplugin_cleanup_oldest_seconds",
            "Seconds the longest-waiting device owing a cleanup has been in its phase",
            labels=["resource"],
        )
        for kind, seconds in sorted(census.oldest_owing.items(), key=lambda item: item[0].value):
            oldest.add_metric([self._names[kind]], seconds)
        yield oldest
