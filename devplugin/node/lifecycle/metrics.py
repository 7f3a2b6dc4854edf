"""The lifecycle's own metrics, read where its facts are kept: the custody
census at each scrape (devplugin_custody_devices,
devplugin_cleanup_oldest_seconds) and every hook run as it ends
(devplugin_hook_runs_total, devplugin_hook_duration_seconds)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from devplugin.model import DeviceKind
from devplugin.node.lifecycle.custody import Census
from devplugin.node.lifecycle.hooks import HookDevice, HookResult, HookRunner, HookSpec, Tracker


def timed_hooks(runner: HookRunner, runs: Counter, seconds: Histogram) -> HookRunner:
    """Wrap a hook runner so every run is counted (by outcome) and timed."""

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
        runs.labels(resource, phase, outcome).inc()
        seconds.labels(resource, phase).observe(result.duration)
        return result

    return run


class CustodyCollector:
    """devplugin_custody_devices and devplugin_cleanup_oldest_seconds, read
    from the custody book when scraped (nothing to keep in step)."""

    def __init__(
        self, census: Callable[[frozenset[DeviceKind]], Census], names: Mapping[DeviceKind, str]
    ) -> None:
        self._census = census
        self._names = dict(names)
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
