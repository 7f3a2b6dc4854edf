"""The extender's metrics (one registry, served on /metrics)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry

from devplugin.families import (
    WATCH_AGE,
    WATCH_CURRENT,
    WATCH_LISTS,
    CounterFamily,
    GaugeFamily,
    HistogramFamily,
)


def verb_name(path: str) -> str:
    """A verb's label: its path after /scheduler/ (the claims verbs counted
    apart: claims_filter, claims_prioritize)."""
    return path.removeprefix("/scheduler/").replace("/", "_")


REQUESTS = CounterFamily(
    "devplugin_extender_requests", "Extender calls by verb and result", ("verb", "result")
)
SECONDS = HistogramFamily(
    "devplugin_extender_seconds",
    "Extender call handling time",
    (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
    ("verb",),
)
MEMO = CounterFamily("devplugin_extender_memo", "Placement lookups (hit / miss)", ("result",))
RECORDS = GaugeFamily(
    "devplugin_extender_records", "NodeDevices records by state (fresh / stale)", ("state",)
)
WATCH_REFUSED = GaugeFamily(
    "devplugin_watch_refused_objects",
    "Objects an API watch cache refused (a malformed record, a forged Lease) since start",
    ("cache",),
)
PREEMPT_UNPROVEN = CounterFamily(
    "devplugin_extender_preempt_unproven",
    (
        "Preemption answers not proven best: a node's search ended by its budget, or "
        "nodes left unsearched when the call's deadline came"
    ),
    ("why",),
)
PREEMPT_ANSWERS = CounterFamily(
    "devplugin_extender_preempt_answers",
    (
        "Preemption answers for pods with devices: victims (some node frees an aligned "
        "set), untold (only nodes without a record, passed on as proposed), none (no "
        "eviction gives the pod its devices anywhere proposed), waiting (the room an "
        "earlier answer or the scheduler's nomination holds for it fits it: nobody more goes)"
    ),
    ("outcome",),
)
CONNECTIONS = GaugeFamily("devplugin_extender_connections", "HTTP connections open")


class ExtenderMetrics:
    def __init__(self) -> None:
        registry = self.registry = CollectorRegistry()
        self.requests = REQUESTS.make(registry)
        self.seconds = SECONDS.make(registry)
        self.memo = MEMO.make(registry)
        self.records = RECORDS.make(registry)
        self.watch_current = WATCH_CURRENT.make(registry)
        self.watch_age = WATCH_AGE.make(registry)
        self.watch_lists = WATCH_LISTS.make(registry)
        self.watch_refused = WATCH_REFUSED.make(registry)
        self.preempt_unproven = PREEMPT_UNPROVEN.make(registry)
        self.preempt_answers = PREEMPT_ANSWERS.make(registry)
        self.connections = CONNECTIONS.make(registry)

    def prime(self, paths: Iterable[str]) -> None:
        """Every series whose label values are known at start, at zero (a
        query or an alert sees 0 before the first call, not nothing)."""
        for path in paths:
            name = verb_name(path)
            self.seconds.labels(name)
            for result in ("ok", "error", "bad-request"):
                self.requests.labels(name, result)
        for result in ("hit", "miss"):
            self.memo.labels(result)
        for why in ("deadline", "budget"):
            self.preempt_unproven.labels(why)
        for outcome in ("victims", "untold", "none", "waiting"):
            self.preempt_answers.labels(outcome)
        for state in ("fresh", "stale"):
            self.records.labels(state)
