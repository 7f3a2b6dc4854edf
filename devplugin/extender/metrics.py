"""The extender's metrics (one registry, served on /metrics)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


def verb_name(path: str) -> str:
    """A verb's label: its path after /scheduler/ (the claims verbs counted
    apart: claims_filter, claims_prioritize)."""
    return path.removeprefix("/scheduler/").replace("/", "_")


class ExtenderMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "devplugin_extender_requests",
            "Extender calls by verb and result",
            ["verb", "result"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            "devplugin_extender_seconds",
            "Extender call handling time",
            ["verb"],
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
            registry=self.registry,
        )
        self.memo = Counter(
            "devplugin_extender_memo",
            "Placement lookups (hit / miss)",
            ["result"],
            registry=self.registry,
        )
        self.records = Gauge(
            "devplugin_extender_records",
            "NodeDevices records by state (fresh / stale)",
            ["state"],
            registry=self.registry,
        )
        self.watch_current = Gauge(
            "devplugin_watch_current",
            "1 while an API watch cache is current (listed, and heard from within its bound)",
            ["cache"],
            registry=self.registry,
        )
        self.watch_age = Gauge(
            "devplugin_watch_age_seconds",
            "Seconds since an API watch cache last heard from the API server",
            ["cache"],
            registry=self.registry,
        )
        self.watch_lists = Gauge(
            "devplugin_watch_lists",
            "Full lists an API watch cache made since start: the first, then one after each"
            " 410 Gone or broken watch (climbing fast: the API server or the path to it churns)",
            ["cache"],
            registry=self.registry,
        )
        self.watch_refused = Gauge(
            "devplugin_watch_refused_objects",
            "Objects an API watch cache refused (a malformed record, a forged Lease) since start",
            ["cache"],
            registry=self.registry,
        )
        self.preempt_unproven = Counter(
            "devplugin_extender_preempt_unproven",
            "Preemption answers not proven best: a node's search ended by its budget, or "
            "nodes left unsearched when the call's deadline came",
            ["why"],
            registry=self.registry,
        )
        self.preempt_answers = Counter(
            "devplugin_extender_preempt_answers",
            "Preemption answers for pods with devices: victims (some node frees an aligned "
            "set), untold (only nodes without a record, passed on as proposed), none (no "
            "eviction gives the pod its devices anywhere proposed), waiting (the room an "
            "earlier answer or the scheduler's nomination holds for it fits it: nobody more goes)",
            ["outcome"],
            registry=self.registry,
        )
        self.connections = Gauge(
            "devplugin_extender_connections",
            "HTTP connections open",
            registry=self.registry,
        )

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
