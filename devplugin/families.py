"""Prometheus metric families declared as data: a name, its help and its
labels, made into a registry's collector by whoever serves it.

The daemon and the extender each keep one registry; families both serve
(the API watch caches') are declared once here so the two programs cannot
drift apart in name, help or labels.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Buckets for calls answered from memory, and for calls that run hooks.
FAST = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5)
SLOW = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0)


@dataclass(frozen=True)
class CounterFamily:
    name: str  # without the `_total` prometheus_client adds
    help: str
    labels: tuple[str, ...] = ()

    def make(self, registry: CollectorRegistry) -> Counter:
        return Counter(self.name, self.help, list(self.labels), registry=registry)


@dataclass(frozen=True)
class GaugeFamily:
    name: str
    help: str
    labels: tuple[str, ...] = ()

    def make(self, registry: CollectorRegistry) -> Gauge:
        return Gauge(self.name, self.help, list(self.labels), registry=registry)


@dataclass(frozen=True)
class HistogramFamily:
    name: str
    help: str
    buckets: tuple[float, ...]
    labels: tuple[str, ...] = ()

    def make(self, registry: CollectorRegistry) -> Histogram:
        return Histogram(
            self.name, self.help, list(self.labels), buckets=self.buckets, registry=registry
        )


WATCH_CURRENT = GaugeFamily(
    "devplugin_watch_current",
    "1 while an API watch cache is current (listed, and heard from within its bound)",
    ("cache",),
)
WATCH_AGE = GaugeFamily(
    "devplugin_watch_age_seconds",
    "Seconds since an API watch cache last heard from the API server",
    ("cache",),
)
WATCH_LISTS = GaugeFamily(
    "devplugin_watch_lists",
    "Full lists an API watch cache made since start: the first, then one after each"
    " 410 Gone or broken watch (climbing fast: the API server or the path to it churns)",
    ("cache",),
)
