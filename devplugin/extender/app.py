"""`devplugin extender`: a kube-scheduler extender that sends pods where an
aligned GPU+HCA set is free.

It watches every NodeDevices record and every pod bound to a node (pods a
record does not show yet are placed on their node first, as its daemon
will), and answers the kube-scheduler's extender calls
(`k8s.io/kube-scheduler/extender/v1`; the Go types carry no JSON tags, so
the field names are the Go names):

* POST /scheduler/filter: ExtenderArgs {Pod, Nodes | NodeNames} ->
  ExtenderFilterResult {Nodes | NodeNames, FailedNodes,
  FailedAndUnresolvableNodes, Error}.
* POST /scheduler/prioritize: ExtenderArgs -> HostPriorityList
  [{Host, Score}], Score 0..10.
* POST /scheduler/claims/filter and /scheduler/claims/prioritize: the same
  for pods that ask for devices through ResourceClaims (with --dra). The
  scheduler calls an extender whose `managedResources` is set only for
  pods that request one of them (HTTPExtender.IsInterested), so the chart
  names this one without: it is asked about every pod and answers at once
  (everything passes, every score 0) for one without claims. For a pod
  with claims it predicts, node by node, what the allocator will pick
  (dra_views.py), filters out nodes where that is nothing, and ranks the
  rest by the worst GPU+HCA pair of that choice.

A node without a record, whose daemon's Lease has run out, or whose large
layout is still being built, is never filtered (scheduling must not stop
because a daemon is down) and scores 0. Work follows events, not requests
(`views.py`): a record or pod change makes that node's view be rebuilt on
its next use, each pod shape placed once. Each kind of question (a pod
shape and requirement, or a set of claim specs) keeps every node's answer
across calls (`answers.py`): a call works out only the nodes the watches
touched since the last one (or whose Lease ran out meanwhile) and reads
the rest. Nothing here waits on the network: the caches are read.

* POST /scheduler/preempt: ExtenderPreemptionArgs ->
  ExtenderPreemptionResult, the victims that free an aligned set
  (preempt.py).

The HTTP front, with its request limits, is extender_http.py.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial
from itertools import compress
from operator import itemgetter
from typing import Any

from lightkube import Client
from lightkube import operators as op

from devplugin.cluster.client import Heartbeat, make_client
from devplugin.cluster.lease import NODE_LABEL, Lease, lease_name, parse_micro_time
from devplugin.cluster.pods import PodCache
from devplugin.cluster.publisher import NodeDevices
from devplugin.cluster.watch import Incomplete, WatchCache, WatchTiming
from devplugin.config import KubernetesConfig
from devplugin.extender.answers import Answers, ChangeLog
from devplugin.extender.budgets import DisruptionBudget, budget_cache
from devplugin.extender.dra_views import DraCaches, DraViews, dra_caches, pod_claims
from devplugin.extender.scores_json import HostScores
from devplugin.extender.serving import (
    BadRequest,
    ExtenderMetrics,
    ExtenderServer,
    Verb,
)
from devplugin.extender.victims import (
    answer,
    candidates,
    counts_fit,
    evictable,
    proposed_victims,
    unchanged,
)
from devplugin.extender.views import Layouts, NodeViews, parse_record
from devplugin.policy.dra_predict import Prediction
from devplugin.policy.labels import (
    EXCLUDE_ANNOTATION,
    PRODUCT_ANNOTATION,
    product_choice,
    product_refusal,
)
from devplugin.policy.placement import (
    Holding,
    ParsedRecord,
    Requirement,
    Shape,
    check,
    place,
    requirement_of,
    shape_of,
)
from devplugin.policy.podinfo import ContainerInfo, PodInfo, parse_pod
from devplugin.policy.preemption import Eviction, choose_victims
from devplugin.policy.ranking import rank_list

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Record:
    """One node's record as the extender uses it."""

    parsed: ParsedRecord
    version: str  # the record's resourceVersion: which one the extender holds
    updated: float | None  # wall-clock seconds of status.updated


def record_entry(layouts: Layouts, data: Mapping[str, Any]) -> tuple[str, Record]:
    """Parse a record (linear in its devices) and see its layout built."""
    if not data.get("status"):
        # Created, its first status not written yet (the daemon does both).
        raise Incomplete("no status yet")
    parsed = parse_record(data)
    status = data.get("status") or {}
    updated = None
    stamp = status.get("updated") if isinstance(status, dict) else None
    if isinstance(stamp, str):
        try:
            updated = datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
        except ValueError:
            updated = None
    meta = data.get("metadata") or {}
    version = str(meta.get("resourceVersion") or "")
    return parsed.name, Record(layouts.want(parsed), version, updated)


# A Lease promising more than this is held to it (the chart's daemons
# promise 40 s).
MAX_LEASE_SECONDS = 300.0
# How far ahead of the extender's clock a renewTime may be at first sight.
CLOCK_SKEW = 5.0


@dataclass(frozen=True)
class NodeLease:
    """A node daemon's heartbeat (cluster/lease.py), timed by the extender."""

    # When (the extender's monotonic clock) this version of the Lease was
    # first seen: a renewal is a new version, whatever time it says it is.
    seen: float
    duration: float


class LeaseClock:
    """The Lease watch's entry function, with memory: each node's Lease
    counts from when the extender saw its version change, never from the
    time it carries (a forged or skewed renewTime in 2099 buys nothing).
    At first sight (a start, a re-list) its renewTime may only make it
    older: one that says it was renewed long ago, or later than now (past
    CLOCK_SKEW), is stale until it changes. Only the
    Lease the daemon writes for a node (`devplugin-<node>`) counts for it."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._clock, self._wall = clock, wall
        self._seen: dict[str, tuple[str, float]] = {}

    def __call__(self, data: Mapping[str, Any]) -> tuple[str, NodeLease]:
        meta, spec = data.get("metadata"), data.get("spec")
        if not isinstance(meta, dict) or not isinstance(spec, dict):
            raise ValueError("metadata and spec must be objects")
        labels = meta.get("labels")
        node = labels.get(NODE_LABEL) if isinstance(labels, dict) else None
        duration = spec.get("leaseDurationSeconds")
        if not isinstance(node, str) or not node:
            raise ValueError(f"no {NODE_LABEL} label")
        if meta.get("name") != lease_name(node):
            raise ValueError(
                f"labelled for node {node[:100]} but not named {lease_name(node)[:120]}"
            )
        if not isinstance(duration, int) or isinstance(duration, bool) or duration < 1:
            raise ValueError("spec.leaseDurationSeconds must be a positive integer")
        renewed = parse_micro_time(spec.get("renewTime"))
        if renewed is None:
            raise ValueError("spec.renewTime is not a time")
        version = str(meta.get("resourceVersion") or "")
        now = self._clock()
        known = self._seen.get(node)
        if known is not None and known[0] == version:
            seen = known[1]
        elif known is None:
            age = self._wall() - renewed
            # Claiming a renewal in the future is no renewal at all.
            seen = now - age if age >= -CLOCK_SKEW else float("-inf")
        else:
            seen = now
        self._seen[node] = (version, seen)
        return node, NodeLease(seen, min(float(duration), MAX_LEASE_SECONDS))


class Extender:
    """The decisions, over the caches (no HTTP here)."""

    def __init__(
        self,
        records: WatchCache[Record],
        pods: PodCache,
        *,
        leases: WatchCache[NodeLease] | None = None,
        gpu: str = "nvidia.com/gpu",
        hca: str = "rdma/hca",
        stale_after: float = 120.0,
        metrics: ExtenderMetrics | None = None,
        wall: Callable[[], float] = time.time,
        layouts: Layouts | None = None,
        clock: Callable[[], float] = time.monotonic,
        dra: tuple[DraViews, DraCaches] | None = None,
        budgets: WatchCache[DisruptionBudget] | None = None,
    ) -> None:
        self.records = records
        self.budgets = budgets
        self.pods = pods
        self.leases = leases
        self.dra = dra
        self.gpu, self.hca = gpu, hca
        self.stale_after = stale_after
        self.metrics = metrics or ExtenderMetrics()
        for cache in self._caches():
            self.metrics.watch_current.labels(cache.name).set_function(partial(_current, cache))
            self.metrics.watch_age.labels(cache.name).set_function(cache.age)
            self.metrics.watch_refused.labels(cache.name).set_function(
                partial(lambda c: float(c.skipped), cache)
            )
        self._wall = wall
        self._clock = clock
        self.layouts = layouts if layouts is not None else Layouts()
        self.views = NodeViews(
            self.layouts,
            on_node=pods.on_node,
            generation=pods.generation,
            has_ended=pods.has_ended,
            gpu=gpu,
            hca=hca,
        )
        self.host_scores = HostScores()
        self._hit = self.metrics.memo.labels("hit")
        self._miss = self.metrics.memo.labels("miss")
        # Per pod shape and requirement, each node's answer (answers.py):
        # what the record, Lease and pod watches touch is worked out again.
        changes = ChangeLog()
        self.answers: Answers[Entry] = Answers(changes, clock)
        records.listen_keys(lambda node, before, after: changes.changed(node))
        if leases is not None:
            leases.listen_keys(lambda node, before, after: changes.changed(node))
        pods.listen_keys(partial(_pod_nodes, changes))
        self.layouts.listen(changes.changed)
        self.claim_answers: Answers[ClaimEntry] | None = None
        if dra is not None:
            self.claim_answers = Answers(dra[0].changes, clock)

    # -- the verbs ---------------------------------------------------------------
    def verbs(self) -> dict[str, Verb]:
        """Path -> verb, as the HTTP front serves them."""
        return {
            "/scheduler/filter": self.filter,
            "/scheduler/prioritize": self.prioritize,
            "/scheduler/claims/filter": self.claims_filter,
            "/scheduler/claims/prioritize": self.claims_prioritize,
            "/scheduler/preempt": self.preempt,
        }

    def filter(self, args: Mapping[str, Any]) -> dict[str, Any]:
        pod, names, nodes = self._args(args)
        shape, requirement = self._pod(pod)
        # A GPU model no eviction changes: those nodes are unresolvable.
        names, unresolvable = self._chosen_models(pod, names)
        if not shape.wants_devices:
            return _filter_result(list(names), {}, unresolvable, nodes)
        found = self._resource_answers(pod, shape, requirement, names)
        # Grouped by map() and compress() over the entries in the names' order:
        # a comprehension per group over 500 nodes was a fifth of a call.
        entries = list(map(found.__getitem__, names))
        verdicts = list(map(itemgetter(0), entries))
        passing = list(compress(names, map(PASS.__eq__, verdicts)))
        failed = _reasons(names, entries, list(map(FAILED.__eq__, verdicts)))
        unresolvable.update(_reasons(names, entries, list(map(NEVER.__eq__, verdicts))))
        return _filter_result(passing, failed, unresolvable, nodes)

    def prioritize(self, args: Mapping[str, Any]) -> bytes:
        """The HostPriorityList, encoded (scores_json.py)."""
        pod, names, _ = self._args(args)
        shape, requirement = self._pod(pod)
        if not shape.wants_devices:
            return self.host_scores.encode(names, [0] * len(names))
        found = self._resource_answers(pod, shape, requirement, names)
        keys = list(map(itemgetter(2), map(found.__getitem__, names)))
        return self.host_scores.encode(names, rank_list(keys))

    def claims_filter(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """Filter for pods with ResourceClaims: a node passes unless the
        allocator's walk there finds nothing for the pod's claims."""
        pod, names, nodes = self._args(args)
        names, unresolvable = self._chosen_models(pod, names)
        found = self._claim_answers(args, names)
        failed = {name: CLAIMS_REFUSED for name in names if found.get(name, UNTOLD)[0] == FAILED}
        passing = [name for name in names if name not in failed]
        return _filter_result(passing, failed, unresolvable, nodes)

    def claims_prioritize(self, args: Mapping[str, Any]) -> bytes:
        """Scores for pods with ResourceClaims: by the worst pair, then the
        sum over pairs, of what the allocator will pick on each node."""
        _, names, _ = self._args(args)
        found = self._claim_answers(args, names)
        keys = [found.get(name, UNTOLD)[1] for name in names]
        return self.host_scores.encode(names, rank_list(keys))

    def preempt(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """ExtenderPreemptionArgs -> ExtenderPreemptionResult: per node, the
        victims that free the best aligned set (extender/victims.py)."""
        pod = self._pod_arg(args)
        try:
            proposed = proposed_victims(args)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        shape, requirement = self._pod(pod)
        if not shape.wants_devices:
            return unchanged(proposed)
        fresh = self._freshness()
        budgets = self.budgets.items().values() if self.budgets is not None else ()
        evictions: dict[str, Eviction] = {}
        untold: dict[str, tuple[list[str], int]] = {}
        refused = self._model_refusals(pod, list(proposed))
        for node in proposed:
            if node in refused:
                continue  # no eviction gives it the GPU model the pod chose
            record = fresh(node)
            state = self.views.state(record.parsed, record) if record is not None else None
            if state is None:
                untold[node] = proposed[node]
                continue
            found, allowed = candidates(state[0], self.pods.on_node(node), pod.priority, budgets)
            eviction = choose_victims(state[0], shape, state[1], found, allowed)
            if eviction is None or not eviction.victims:
                continue  # no eviction lets it fit, or none is needed
            if (
                requirement.required
                and requirement.level is not None
                and eviction.level is not None
                and eviction.level > requirement.level
            ):
                continue
            evictions[node] = eviction
        return answer(evictions, untold)

    # -- per-node answers ------------------------------------------------------------
    def _resource_answers(
        self, pod: PodInfo, shape: Shape, requirement: Requirement, names: list[str]
    ) -> dict[str, Entry]:
        """Each node's answer for a pod of this shape and requirement: kept
        ones read, the others (new, changed, gone stale) worked out."""
        level = int(requirement.level) if requirement.level is not None else 0
        # The priority decides which failures preemption can resolve.
        key = (self.views.shape_id(shape), level, requirement.required, pod.priority)
        # A pod already bound to a node (a retry) is placed there without itself.
        bound = self.pods.get(pod.uid)
        unkept = (bound.node,) if bound is not None and bound.node else ()
        compute = partial(self._resource_entries, shape, requirement, pod)
        found, kept = self.answers.read(key, names, compute, unkept=unkept)
        self._count(kept, kept)
        return found

    def _resource_entries(
        self, shape: Shape, requirement: Requirement, pod: PodInfo, names: Sequence[str]
    ) -> dict[str, tuple[Entry, float]]:
        uid = pod.uid
        until: dict[str, float] = {}
        fresh = self._freshness(until)
        records: dict[str, Record | None] = {}
        outcomes, hits = self.views.outcomes(names, fresh, shape, uid, seen=records)
        self._count(hits, len(names))
        relaxed = not requirement.required or requirement.level is None
        entries: dict[str, tuple[Entry, float]] = {}
        failing: dict[str, str] = {}
        for name in names:
            outcome = outcomes[name]
            if outcome is None:
                # No usable record: never block scheduling on it.
                entries[name] = (PASSING, until.get(name, math.inf))
                continue
            rank = outcome.rank_key if outcome.fits else None
            if relaxed and outcome.fits:
                reason = None  # what check() would say, without the call
            else:
                reason = outcome.reason if not outcome.fits else check(outcome, requirement)
            if reason is None:
                entries[name] = ((PASS, "", rank), until.get(name, math.inf))
            else:
                failing[name] = reason
                entries[name] = ((FAILED, reason, rank), until.get(name, math.inf))
        answers = self.views.failures(failing, records, shape, requirement, uid)
        for name, (message, empty_fails) in answers.items():
            never = empty_fails or not self._resolvable(records[name], shape, requirement, pod)
            rank = entries[name][0][2]
            entries[name] = ((NEVER if never else FAILED, message, rank), entries[name][1])
        return entries

    def _resolvable(
        self,
        record: Record | None,
        shape: Shape,
        requirement: Requirement,
        pod: PodInfo,
    ) -> bool:
        """Whether the scheduler's preemption could make the pod pass: the
        pod does not fit the node by counts (where it does, no victim is
        ever proposed there), and evicting every pod of lower priority
        bound to the node would let it pass. The scheduler tries
        preemption only on nodes whose failure is not marked unresolvable."""
        priority, uid = pod.priority, pod.uid
        state = self.views.state(record.parsed, record) if record is not None else None
        if state is None:
            return True
        node, allocator, pending = state
        bound = self.pods.on_node(node.name)
        if node.healthy is not None and counts_fit(node, bound, shape, uid, (self.gpu, self.hca)):
            return False  # the scheduler's dry run would reprieve every victim
        if any(pod.uid in pending and pod.priority < priority for pod in bound):
            return True  # its devices are not known yet: unsure, let it try
        back = evictable(node, bound, priority)
        after = node.without([Holding("", "", None, back)])
        return check(place(after, shape, allocator), requirement) is None

    def _claim_answers(self, args: Mapping[str, Any], names: list[str]) -> dict[str, ClaimEntry]:
        """Per node, whether the allocator's pick for the pod's claims fits
        and its rank key; nothing (every node passes, score 0) for a pod
        without claims or with one not known."""
        if self.dra is None or self.claim_answers is None:
            return {}
        views, caches = self.dra
        claims = pod_claims(args["Pod"], caches.claims)
        if not claims:
            return {}
        key = "\n".join(claim.spec_key for claim in claims)

        def compute(missing: Sequence[str]) -> dict[str, tuple[ClaimEntry, float]]:
            predictions = views.predictions(missing, claims)
            return {name: (_claim_entry(p), math.inf) for name, p in predictions.items()}

        found, _ = self.claim_answers.read(key, names, compute)
        return found

    def _count(self, hits: int, asked: int) -> None:
        # Counted once per call: a counter per node would cost more than the lookup.
        if hits:
            self._hit.inc(hits)
        if asked - hits:
            self._miss.inc(asked - hits)

    # -- pieces ------------------------------------------------------------------------
    def _args(
        self, args: Mapping[str, Any]
    ) -> tuple[PodInfo, list[str], list[dict[str, Any]] | None]:
        pod = self._pod_arg(args)
        names = args.get("NodeNames")
        nodes = args.get("Nodes")
        if names is not None:
            # type() mapped in C: a generator per name cost a millisecond at 5,000.
            if not isinstance(names, list) or not set(map(type, names)) <= {str}:
                raise BadRequest("NodeNames: must be a list of names")
            return pod, list(names), None
        if isinstance(nodes, dict):
            items = nodes.get("items") or []
            if not isinstance(items, list) or not all(isinstance(n, dict) for n in items):
                raise BadRequest("Nodes.items: must be a list of nodes")
            found = [_node_name(n) for n in items]
            if not all(found):
                raise BadRequest("Nodes.items: a node without metadata.name")
            return pod, [str(n) for n in found], items
        raise BadRequest("one of NodeNames or Nodes is required")

    def _pod_arg(self, args: Mapping[str, Any]) -> PodInfo:
        if not isinstance(args, dict):
            raise BadRequest("the body must be a JSON object")
        raw_pod = args.get("Pod")
        if not isinstance(raw_pod, dict):
            raise BadRequest("Pod: required, an object")
        data = dict(raw_pod)
        meta = data.get("metadata")
        if isinstance(meta, dict) and not meta.get("uid"):
            data["metadata"] = {**meta, "uid": f"{meta.get('namespace')}/{meta.get('name')}"}
        try:
            return parse_pod(data)
        except ValueError as exc:
            raise BadRequest(f"Pod: {exc}") from exc

    def _pod(self, pod: PodInfo) -> tuple[Shape, Requirement]:
        shape = shape_of(pod, self.gpu, self.hca)
        try:
            requirement = requirement_of(pod.annotations)
        except ValueError as exc:
            raise BadRequest(f"Pod annotations: {exc}") from exc
        return shape, requirement

    def _chosen_models(self, pod: PodInfo, names: list[str]) -> tuple[list[str], dict[str, str]]:
        """The nodes left once the pod's choice of GPU model is applied, and
        those it rules out with why (a filter's unresolvable nodes)."""
        refused = self._model_refusals(pod, names)
        if not refused:
            return names, refused
        return [name for name in names if name not in refused], refused

    def _model_refusals(self, pod: PodInfo, names: Sequence[str]) -> dict[str, str]:
        """The nodes whose GPU models the pod's devplugin.io/gpu-product(-exclude)
        annotations rule out, with why; a node without a live record cannot
        show what it has, so a pod that chose fails there too."""
        try:
            choice = product_choice(pod.annotations)
        except ValueError as exc:
            raise BadRequest(f"Pod annotations: {exc}") from exc
        if choice.empty:
            return {}
        fresh = self._freshness()
        which = PRODUCT_ANNOTATION if choice.include else EXCLUDE_ANNOTATION
        unknown = f"{which}: no live NodeDevices record says which GPUs the node has"
        judged: dict[tuple[str, ...], str | None] = {}
        refused: dict[str, str] = {}
        for name in names:
            record = fresh(name)
            if record is None:
                refused[name] = unknown
                continue
            products = record.parsed.products
            if products not in judged:
                judged[products] = product_refusal(choice, products)
            reason = judged[products]
            if reason is not None:
                refused[name] = reason
        return refused

    def _freshness(self, until: dict[str, float] | None = None) -> Callable[[str], Record | None]:
        """Per node, its record while its daemon is alive: its Lease renewed
        within the duration it promised (a daemon without a Lease, an older
        one, rewrites its record instead: then `updated` is judged, and one
        dated in the future counts as written now). The clocks are read once
        and the maps bound: for a loop over every node of a call. `until`,
        when given, gets for each fresh node when (on the monotonic clock)
        it goes stale unless an event comes first."""
        now, mono, stale_after = self._wall(), self._clock(), self.stale_after
        records = self.records.getter()
        leases = self.leases.getter() if self.leases is not None else None

        def fresh(name: str) -> Record | None:
            record = records(name)
            if record is None:
                return None
            lease = leases(name) if leases is not None else None
            if lease is not None:
                if mono - lease.seen > lease.duration:
                    return None
                if until is not None:
                    until[name] = lease.seen + lease.duration
                return record
            updated = record.updated
            if updated is None or now - min(updated, now) > stale_after:
                return None
            if until is not None:
                until[name] = mono + stale_after - (now - min(updated, now))
            return record

        return fresh

    def _caches(self) -> list[WatchCache[Any]]:
        caches: list[WatchCache[Any]] = [self.records, self.pods]
        if self.leases is not None:
            caches.append(self.leases)
        if self.budgets is not None:
            caches.append(self.budgets)
        if self.dra is not None:
            caches.extend(self.dra[1].all())
        return caches

    def ready(self) -> tuple[bool, str]:
        """Ready while both caches are current: a frozen view must not steer
        pods (with `ignorable: true` the scheduler goes on without us)."""
        named = {
            "nodedevices": "NodeDevices records",
            "pods": "pods",
            "leases": "node Leases",
            "resourceclaims": "ResourceClaims",
            "resourceslices": "ResourceSlices",
            "deviceclasses": "DeviceClasses",
            "poddisruptionbudgets": "PodDisruptionBudgets",
        }
        for cache in self._caches():
            what = named.get(cache.name, cache.name)
            if not cache.synced.is_set():
                return False, f"{what} not listed yet"
            if not cache.current:
                return False, (
                    f"{what} cache not current: nothing from the API server for {cache.age():.0f}s"
                )
        return True, ""

    def count_records(self) -> None:
        records = self.records.items()
        is_fresh = self._freshness()
        fresh = sum(1 for name in records if is_fresh(name) is not None)
        self.metrics.records.labels("fresh").set(fresh)
        self.metrics.records.labels("stale").set(len(records) - fresh)


# A node's answer for a pod: whether it passes (PASS, FAILED, or NEVER: not
# even with nothing held there), the filter's message, and the key its
# score is ranked by (None: scores 0).
PASS, FAILED, NEVER = 0, 1, 2
Entry = tuple[int, str, tuple[int, int, int] | None]
PASSING: Entry = (PASS, "", None)
# For claims: PASS or FAILED, and the rank key of the allocator's pick.
ClaimEntry = tuple[int, tuple[Any, ...] | None]
UNTOLD: ClaimEntry = (PASS, None)
CLAIMS_REFUSED = "devplugin: the pod's ResourceClaims cannot be allocated here"


def _claim_entry(prediction: Prediction | None) -> ClaimEntry:
    if prediction is None:
        return UNTOLD  # never block on what cannot be told
    if not prediction.fits:
        return (FAILED, None)
    return (PASS, prediction.key())


def _pod_nodes(changes: ChangeLog, uid: str, before: PodInfo | None, after: PodInfo | None) -> None:
    for pod in (before, after):
        if pod is not None and pod.node:
            changes.changed(pod.node)


def _current(cache: WatchCache[Any]) -> float:
    return 1.0 if cache.current else 0.0


def _filter_result(
    passing: list[str],
    failed: dict[str, str],
    unresolvable: dict[str, str],
    nodes: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    """ExtenderFilterResult, in the form it was asked in (names, or the
    passing Node objects)."""
    result: dict[str, Any] = {"FailedNodes": failed, "FailedAndUnresolvableNodes": unresolvable}
    result["Error"] = ""
    if nodes is not None:
        keep = set(passing)
        items = [n for n in nodes if _node_name(n) in keep]
        result["Nodes"] = {"apiVersion": "v1", "kind": "NodeList", "items": items}
        result["NodeNames"] = None
    else:
        result["NodeNames"] = passing
        result["Nodes"] = None
    return result


def _reasons(
    names: Sequence[str], entries: Sequence[Entry], chosen: Sequence[bool]
) -> dict[str, str]:
    """Name -> reason of the entries `chosen` marks."""
    reasons = map(itemgetter(1), compress(entries, chosen))
    return dict(zip(compress(names, chosen), reasons, strict=True))


def _node_name(node: Mapping[str, Any]) -> str | None:
    meta = node.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) and name else None


def placement_pod(names: Sequence[str], pod: PodInfo) -> PodInfo | None:
    """What placement reads of a pod: None for a pod without device requests;
    else its containers' requests for the two resources only, no annotations."""
    wanted = set(names)

    def trim(containers: tuple[ContainerInfo, ...]) -> tuple[ContainerInfo, ...]:
        return tuple(
            ContainerInfo(c.name, {k: v for k, v in c.requests.items() if k in wanted}, c.sidecar)
            for c in containers
        )

    every = pod.init_containers + pod.containers
    if not any(v for c in every for k, v in c.requests.items() if k in wanted):
        return None
    return replace(
        pod,
        init_containers=trim(pod.init_containers),
        containers=trim(pod.containers),
        annotations={},
    )


def record_cache(
    client: Client,
    kube: KubernetesConfig | None = None,
    heartbeat: Heartbeat | None = None,
    layouts: Layouts | None = None,
) -> WatchCache[Record]:
    kube = kube or KubernetesConfig()
    return WatchCache(
        client,
        NodeDevices,
        partial(record_entry, layouts or Layouts()),
        name="nodedevices",
        namespaced=False,
        timing=WatchTiming.of(kube),
        heartbeat=heartbeat,
    )


def lease_cache(
    client: Client,
    namespace: str,
    kube: KubernetesConfig | None = None,
    heartbeat: Heartbeat | None = None,
) -> WatchCache[NodeLease]:
    kube = kube or KubernetesConfig()
    return WatchCache(
        client,
        Lease,
        LeaseClock(),
        name="leases",
        namespaced=True,
        namespace=namespace,
        labels={NODE_LABEL: op.exists()},
        timing=WatchTiming.of(kube),
        heartbeat=heartbeat,
    )


def pod_cache(
    client: Client,
    kube: KubernetesConfig | None = None,
    heartbeat: Heartbeat | None = None,
    names: Sequence[str] = ("nvidia.com/gpu", "rdma/hca"),
) -> PodCache:
    kube = kube or KubernetesConfig()
    return PodCache(
        client,
        None,
        timing=WatchTiming.of(kube),
        heartbeat=heartbeat,
        keep=partial(placement_pod, names),
    )


def serve(
    kube: KubernetesConfig,
    address: tuple[str, int],
    *,
    stale_after: float,
    tls: tuple[str, str] | None = None,
    names: Sequence[str] = ("nvidia.com/gpu", "rdma/hca"),
    lease_namespace: str = "default",
    dra: bool = False,
    device_taints: bool = True,
) -> tuple[Extender, ExtenderServer, list[WatchCache[Any]]]:
    """Wire and start the caches (each on its own client, whose transport
    tells it when the server last answered) and the HTTP server (the CLI's
    and tests' entry)."""

    def connect(heartbeat: Heartbeat) -> Client:
        client = make_client(kube, heartbeat=heartbeat)
        if client is None:
            raise RuntimeError("no Kubernetes API access")
        return client

    beats = Heartbeat(), Heartbeat(), Heartbeat(), Heartbeat()
    layouts = Layouts()
    records = record_cache(connect(beats[0]), kube, beats[0], layouts)
    pods = pod_cache(connect(beats[1]), kube, beats[1], names)
    leases = lease_cache(connect(beats[2]), lease_namespace, kube, beats[2])
    budgets = budget_cache(connect(beats[3]), WatchTiming.of(kube), beats[3])
    claims: tuple[DraViews, DraCaches] | None = None
    if dra:
        views = DraViews(device_taints=device_taints)
        dra_beats = Heartbeat(), Heartbeat(), Heartbeat()
        clients = [connect(beat) for beat in dra_beats]
        claims = views, dra_caches(views, clients, WatchTiming.of(kube), dra_beats)
    extender = Extender(
        records,
        pods,
        leases=leases,
        gpu=names[0],
        hca=names[1],
        stale_after=stale_after,
        layouts=layouts,
        dra=claims,
        budgets=budgets,
    )
    server = ExtenderServer(extender, address, tls=tls)
    caches: list[WatchCache[Any]] = [records, pods, leases, budgets]
    if claims is not None:
        caches.extend(claims[1].all())
    for cache in caches:
        cache.start()
    server.start()
    return extender, server, caches
