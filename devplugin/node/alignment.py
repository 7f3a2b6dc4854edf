"""What each container really holds, from the kubelet, and how well aligned it is.

The monitor polls the PodResources API from its own thread, never from an
RPC handler (on some kubelet versions a List issued while an Allocate is in
flight races with the kubelet's own bookkeeping). Polls happen every
`interval` seconds and shortly after an Allocate (`poke`), never closer than
`min_interval` apart, far below the kubelet's limit of 100 requests/s.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc

from devplugin.kinds.registry import ANCHOR, PARTNER
from devplugin.loops import ThreadLoop
from devplugin.model import DeviceKind
from devplugin.node.coordination import Coordinator
from devplugin.node.kubelet_facts import KubeletFacts
from devplugin.node.ledger import Held, Holdings, Ledger
from devplugin.node.metrics import Metrics
from devplugin.node.podresources import PodResourcesClient
from devplugin.node.sharing import physical_ids
from devplugin.policy.topology import Level, Topology
from devplugin.rpc import rpc_failure

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ContainerAlignment:
    namespace: str
    pod: str
    container: str
    gpus: tuple[str, ...]
    hcas: tuple[str, ...]
    # Worst and summed level from each GPU to its nearest HCA; None unless
    # the container holds both kinds.
    worst: Level | None
    total: int | None
    # The pod's uid, when the pod cache identified the container.
    uid: str | None = None

    @property
    def name(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"


def holders_report(topology: Topology, holders: Iterable[Held]) -> list[ContainerAlignment]:
    """The ledger's planning view as containers with their alignment (a
    holder not known yet by name has empty names)."""
    found = []
    for held in holders:
        namespace, pod, container = held.container or ("", "", "")
        gpus, hcas = held.devices[ANCHOR], held.devices[PARTNER]
        measured = alignment(topology, gpus, hcas)
        found.append(
            ContainerAlignment(
                namespace,
                pod,
                container,
                gpus,
                hcas,
                measured[0] if measured else None,
                measured[1] if measured else None,
                held.uid,
            )
        )
    return found


def alignment(
    topology: Topology, gpus: Sequence[str], hcas: Sequence[str]
) -> tuple[Level, int] | None:
    """The worst and summed GPU-to-nearest-HCA level of a device set."""
    known_gpus = [g for g in gpus if g in topology.kind]
    known_hcas = [h for h in hcas if h in topology.kind]
    if not known_gpus or not known_hcas:
        return None
    levels = [min(topology.level(g, h) for h in known_hcas) for g in known_gpus]
    return Level(max(levels)), sum(levels)


# Answers in a row that changed nothing before polls slow down, and how far.
QUIET_POLLS = 5
QUIET_FACTOR = 5


class AlignmentMonitor(ThreadLoop):
    """Polls PodResources; feeds held devices to the coordinator; reports levels."""

    def __init__(
        self,
        client: PodResourcesClient,
        coordinator: Coordinator,
        ledger: Ledger,
        resource_names: dict[DeviceKind, str],
        *,
        interval: float,
        min_interval: float,
        quiet_interval: float,
        # Told after each answer reached the ledger (the custody book's releases).
        listeners: Sequence[Callable[[], None]] = (),
        # Told of each container that newly holds devices (pod events); not
        # for those already holding at the first answer after a start.
        on_new: Sequence[Callable[[ContainerAlignment], None]] = (),
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        # Refreshed after each poll, on this loop: what the kubelet aligns.
        facts: KubeletFacts | None = None,
    ) -> None:
        super().__init__("alignment")
        self._facts = facts
        self._metrics = metrics
        self._listeners = list(listeners)
        self._on_new = list(on_new)
        self._answered = False
        self._client = client
        self._coordinator = coordinator
        self._ledger = ledger
        self._kinds = {name: kind for kind, name in resource_names.items()}
        # The mixed MIG strategy serves each profile as `<domain>/mig-<profile>`:
        # what containers hold of those is held GPU devices too.
        gpu = resource_names.get(ANCHOR)
        self._mig_prefix = gpu.split("/", 1)[0] + "/mig-" if gpu else None
        self._interval = interval
        self._min_interval = min_interval
        # After QUIET_POLLS answers in a row that changed nothing: the safety
        # net's pace (events, Allocate pokes and changes bring `interval` back).
        self._quiet_interval = max(interval, min(quiet_interval, interval * QUIET_FACTOR))
        self._unchanged = 0
        self._holdings: object = None
        self._clock = clock
        self._lock = threading.Lock()
        self._report: dict[str, ContainerAlignment] = {}
        self._last_call = float("-inf")
        self._failing: str | None = None
        self.polls = 0

    def on_new(self, notify: Callable[[ContainerAlignment], None]) -> None:
        """Also tell `notify` of each container that newly holds devices
        (before start)."""
        self._on_new.append(notify)

    def report(self) -> dict[str, ContainerAlignment]:
        with self._lock:
            return dict(self._report)

    def starting(self) -> None:
        log.info("alignment monitor started (PodResources every %.1fs)", self._interval)

    def step(self) -> float:
        # Pokes come with every Allocate: at most one List per min_interval.
        wait = self._min_interval - (self._clock() - self._last_call)
        if wait > 0 and self.sleep(wait):
            return 0.0
        self._wake.clear()
        self.poll_once()
        if self._facts is not None:
            self._facts.refresh(self._client)
        return self.next_interval()

    def next_interval(self) -> float:
        """The poll interval, or the quiet one once nothing has changed for
        QUIET_POLLS answers and no Allocate awaits its container."""
        if self._unchanged >= QUIET_POLLS and not self._ledger.settling():
            return self._quiet_interval
        return self._interval

    def poke(self) -> None:
        """Poll soon (an Allocate, a pod event): and at the poll interval
        until things are quiet again."""
        self._unchanged = 0
        super().poke()

    def quicken(self) -> None:
        """The pod watch says a pod holding devices ended: poll soon to
        confirm the release (an Allocate pokes by itself)."""
        if threading.current_thread() is not self._thread:
            self.poke()

    def finished(self) -> None:
        self._client.close()

    def _kind_of(self, resource: str) -> DeviceKind | None:
        kind = self._kinds.get(resource)
        if kind is None and self._mig_prefix and resource.startswith(self._mig_prefix):
            return ANCHOR
        return kind

    def poll_once(self) -> bool:
        started = self._clock()
        self._last_call = started
        self.polls += 1
        try:
            entries = self._client.list()
        except grpc.RpcError as exc:
            code, details = rpc_failure(exc)
            message = f"{code.name if code else 'error'}: {details}"
            if message != self._failing:
                log.warning("PodResources List failed (%s); retrying", message)
                self._failing = message
            return False
        if self._failing is not None:
            log.info("PodResources List works again")
            self._failing = None
        holdings: dict[tuple[str, str, str], dict[DeviceKind, list[str]]] = {}
        for entry in entries:
            kind = self._kind_of(entry.resource)
            if kind is None:
                continue
            physical = physical_ids(entry.device_ids)
            key = (entry.namespace, entry.pod, entry.container)
            holdings.setdefault(key, {k: [] for k in DeviceKind})[kind].extend(physical)
        self._unchanged = self._unchanged + 1 if holdings == self._holdings else 0
        self._holdings = holdings
        self._ledger.observe(
            Holdings(
                {key: {k: tuple(v) for k, v in kinds.items()} for key, kinds in holdings.items()}
            ),
            started,
        )
        for listener in self._listeners:
            listener()
        topology = self._coordinator.topology
        report: dict[str, ContainerAlignment] = {}
        for (namespace, pod, container), devices in sorted(holdings.items()):
            gpus, hcas = devices[ANCHOR], devices[PARTNER]
            measured = alignment(topology, gpus, hcas)
            entry_report = ContainerAlignment(
                namespace,
                pod,
                container,
                tuple(gpus),
                tuple(hcas),
                measured[0] if measured else None,
                measured[1] if measured else None,
            )
            report[entry_report.name] = entry_report
        with self._lock:
            previous, self._report = self._report, report
        first, self._answered = not self._answered, True
        if not first:
            for name, item in report.items():
                old = previous.get(name)
                if (item.gpus or item.hcas) and (
                    old is None or (old.gpus, old.hcas) != (item.gpus, item.hcas)
                ):
                    for notify in self._on_new:
                        notify(item)
        if self._metrics is not None:
            self._metrics.set_alignment(item.worst for item in report.values() if item.worst)
        for name, item in report.items():
            if self._metrics is not None and item.worst and name not in previous:
                self._metrics.alignment.observe(int(item.worst))
            if previous.get(name) != item:
                level = (
                    f"worst GPU-HCA level {item.worst.name} (sum {item.total})"
                    if item.worst
                    else "no GPU-HCA pair"
                )
                log.info(
                    "container %s holds %d GPUs, %d HCAs: %s",
                    name,
                    len(item.gpus),
                    len(item.hcas),
                    level,
                )
        return True


def best_worst_level(
    topology: Topology,
    free_gpus: Iterable[str],
    free_hcas: Iterable[str],
    gpus: int,
    hcas: int,
    *,
    must_gpus: Iterable[str] = (),
    must_hcas: Iterable[str] = (),
) -> Level:
    """The best worst GPU-to-nearest-HCA level any choice of `gpus` GPUs and
    `hcas` HCAs could reach, taking the `must_` devices (which the kubelet
    reuses from the pod's init containers) and the rest from the free ones:
    the worst level of `best_alignment`, whose lexicographic optimum has
    the best worst level there is."""
    return best_alignment(
        topology, free_gpus, free_hcas, gpus, hcas, must_gpus=must_gpus, must_hcas=must_hcas
    )[0]


def best_alignment(
    topology: Topology,
    free_gpus: Iterable[str],
    free_hcas: Iterable[str],
    gpus: int,
    hcas: int,
    *,
    must_gpus: Iterable[str] = (),
    must_hcas: Iterable[str] = (),
) -> tuple[Level, int]:
    """The exhaustive optimum of (worst, then summed) GPU-to-nearest-HCA level
    over every choice of `gpus` GPUs and `hcas` HCAs (the `must_` devices
    included, the rest from the free ones). For a fixed HCA set the GPUs
    nearest to it minimise both terms at once, so only HCA sets are
    enumerated."""
    fixed_g, fixed_h = sorted(set(must_gpus)), sorted(set(must_hcas))
    candidates = [g for g in free_gpus if g not in fixed_g]
    others = sorted(h for h in free_hcas if h not in fixed_h)
    best: tuple[int, int] | None = None
    for extra in itertools.combinations(others, hcas - len(fixed_h)):
        chosen = (*fixed_h, *extra)
        fixed = [min(topology.level(g, h) for h in chosen) for g in fixed_g]
        rest = sorted(min(topology.level(g, h) for h in chosen) for g in candidates)
        levels = fixed + rest[: gpus - len(fixed_g)]
        key = (max(levels), sum(levels))
        if best is None or key < best:
            best = key
    if best is None:
        raise ValueError("no choice of that size")
    return Level(best[0]), best[1]
