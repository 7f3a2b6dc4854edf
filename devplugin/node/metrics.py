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

from collections import Counter as Tally
from collections.abc import Iterable

from prometheus_client import CollectorRegistry

from devplugin.families import (
    FAST,
    SLOW,
    WATCH_AGE,
    WATCH_CURRENT,
    WATCH_LISTS,
    CounterFamily,
    GaugeFamily,
    HistogramFamily,
)
from devplugin.model import Health
from devplugin.node.admission import Outcome
from devplugin.policy.topology import Level

DEVICES = GaugeFamily(
    "devplugin_devices", "Devices served, by resource and health", ("resource", "health")
)
ALLOCATIONS = CounterFamily(
    "devplugin_allocations", "Allocate calls per container request", ("resource", "result")
)
PREFERRED = CounterFamily(
    "devplugin_preferred_allocation_requests",
    "GetPreferredAllocation container requests",
    ("resource", "role", "result"),
)
PREFERRED_SECONDS = HistogramFamily(
    "devplugin_preferred_allocation_seconds",
    "GetPreferredAllocation handling time",
    FAST,
    ("resource",),
)
ALLOCATE_SECONDS = HistogramFamily(
    "devplugin_allocate_seconds", "Allocate handling time, hooks included", SLOW, ("resource",)
)
ALIGNMENT = HistogramFamily(
    "devplugin_alignment_level",
    "Worst GPU-to-nearest-HCA level per container (PIX 1, PXB 2, PHB 3, NODE 4, SYS 5)",
    (1, 2, 3, 4, 5),
)
CONTAINERS_BY_ALIGNMENT = GaugeFamily(
    "devplugin_containers_by_alignment",
    "Containers now holding GPUs and HCAs, by worst GPU-to-HCA level",
    ("level",),
)
HOOK_RUNS = CounterFamily(
    "devplugin_hook_runs", "Init and cleanup hook runs", ("resource", "phase", "result")
)
HOOK_SECONDS = HistogramFamily(
    "devplugin_hook_duration_seconds", "Hook run time", SLOW, ("resource", "phase")
)
REGISTRATIONS = CounterFamily(
    "devplugin_registrations", "Successful registrations with the kubelet", ("resource",)
)
CHECKPOINT_FAILURES = CounterFamily(
    "devplugin_checkpoint_write_failures",
    "Lifecycle checkpoint writes that failed (read-only or full disk)",
)
CHECKPOINT_OK = GaugeFamily("devplugin_checkpoint_ok", "1 when the last checkpoint write succeeded")
POD_AWARE = CounterFamily(
    "devplugin_pod_aware_choices",
    (
        "First-resource choices by how the container's whole request was known "
        "(exact / fallback-no-pod / fallback-ambiguous)"
    ),
    ("resource", "outcome"),
)
BUDGET_HITS = CounterFamily(
    "devplugin_allocator_budget_exhausted",
    "GPU searches that ran out of allocation.search_budget_ms and answered their best",
)
RECORD_WRITES = CounterFamily(
    "devplugin_node_devices_writes",
    "NodeDevices record writes (ok / conflict / error)",
    ("result",),
)
DRA_CLAIMS = CounterFamily(
    "devplugin_dra_claims",
    (
        "DRA claims prepared and unprepared (ok / again: answered from the checkpoint / "
        "error: the claim's error)"
    ),
    ("call", "result"),
)
DRA_PREPARE_SECONDS = HistogramFamily(
    "devplugin_dra_prepare_seconds",
    "One DRA claim's prepare, its claim read and init hooks included",
    (0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60),
)
DRA_PREPARED = GaugeFamily("devplugin_dra_prepared_claims", "DRA claims prepared on this node")
SLICE_WRITES = CounterFamily(
    "devplugin_resource_slice_writes",
    "Updates of this node's ResourceSlice pool (ok / error)",
    ("result",),
)
POD_EVENTS = CounterFamily(
    "devplugin_pod_events", "Events posted on pods (ok / failed / dropped)", ("result",)
)
STUCK_READS = GaugeFamily(
    "devplugin_stuck_reads", "Hardware reads (per GPU, per HCA, NVML, PCI tree) past their deadline"
)
HOLDINGS_AGE = GaugeFamily(
    "devplugin_holdings_age_seconds",
    (
        "Seconds since an Allocate, pod event, available list or poll last confirmed "
        "who holds which device"
    ),
)
CORRECTIONS = CounterFamily(
    "devplugin_holdings_corrections",
    "GetPreferredAllocation requests whose available list corrected the holdings",
    ("resource",),
)
CDI_UNDECLARED = GaugeFamily(
    "devplugin_cdi_undeclared_devices",
    "Devices not offered because no CDI spec on the node declares them",
    ("resource",),
)
CDI_REFUSED_SPECS = GaugeFamily(
    "devplugin_cdi_refused_specs", "CDI spec files in the spec directories a runtime would refuse"
)
CHECK_AGE = GaugeFamily(
    "devplugin_check_age_seconds", "Seconds since the last check that read every device in time"
)
LEASE_AGE = GaugeFamily(
    "devplugin_lease_age_seconds", "Seconds since this node's Lease was last renewed"
)
LEASE_DURATION = GaugeFamily(
    "devplugin_lease_duration_seconds",
    "How long each renewal promises the Lease holds (the extender's staleness bound)",
)
BELOW_REQUIRED = CounterFamily(
    "devplugin_alignment_below_required",
    "Containers given a worst GPU-HCA level past the level their pod requires",
    ("required",),
)


class Metrics:
    def __init__(self) -> None:
        registry = CollectorRegistry()
        self.registry = registry
        self.devices = DEVICES.make(registry)
        self.allocations = ALLOCATIONS.make(registry)
        self.preferred = PREFERRED.make(registry)
        self.preferred_seconds = PREFERRED_SECONDS.make(registry)
        self.allocate_seconds = ALLOCATE_SECONDS.make(registry)
        self.alignment = ALIGNMENT.make(registry)
        self.containers_by_alignment = CONTAINERS_BY_ALIGNMENT.make(registry)
        self.hook_runs = HOOK_RUNS.make(registry)
        self.hook_seconds = HOOK_SECONDS.make(registry)
        self.registrations = REGISTRATIONS.make(registry)
        self.checkpoint_failures = CHECKPOINT_FAILURES.make(registry)
        self.checkpoint_ok = CHECKPOINT_OK.make(registry)
        self.checkpoint_ok.set(1)
        self.pod_aware = POD_AWARE.make(registry)
        self.budget_hits = BUDGET_HITS.make(registry)
        self.record_writes = RECORD_WRITES.make(registry)
        self.dra_claims = DRA_CLAIMS.make(registry)
        self.dra_prepare_seconds = DRA_PREPARE_SECONDS.make(registry)
        self.dra_prepared = DRA_PREPARED.make(registry)
        self.slice_writes = SLICE_WRITES.make(registry)
        self.pod_events = POD_EVENTS.make(registry)
        self.stuck_reads = STUCK_READS.make(registry)
        self.holdings_age = HOLDINGS_AGE.make(registry)
        self.corrections = CORRECTIONS.make(registry)
        self.watch_current = WATCH_CURRENT.make(registry)
        self.watch_age = WATCH_AGE.make(registry)
        self.watch_lists = WATCH_LISTS.make(registry)
        self.cdi_undeclared = CDI_UNDECLARED.make(registry)
        self.cdi_refused_specs = CDI_REFUSED_SPECS.make(registry)
        self.check_age = CHECK_AGE.make(registry)
        self.lease_age = LEASE_AGE.make(registry)
        self.lease_duration = LEASE_DURATION.make(registry)
        self.below_required = BELOW_REQUIRED.make(registry)

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
