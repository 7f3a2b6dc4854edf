"""Reading Prometheus' text exposition, as the tiers and benches need it:
one histogram, summed over the series that carry given labels, and read
the way PromQL's histogram_quantile reads buckets."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of the series `name`: (labels, value)."""
    found = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match.group(1) != name:
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        found.append((labels, float(match.group(3))))
    return found


def total(text: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """The sum of the samples of `name` carrying `labels`."""
    wanted = labels or {}
    return sum(
        value
        for have, value in samples(text, name)
        if all(have.get(k) == v for k, v in wanted.items())
    )


@dataclass(frozen=True)
class Histogram:
    buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count)
    sum: float
    count: float

    def minus(self, before: Histogram) -> Histogram:
        """The observations made since `before` was read."""
        then = dict(before.buckets)
        pairs = tuple((bound, now - then.get(bound, 0.0)) for bound, now in self.buckets)
        return Histogram(pairs, self.sum - before.sum, self.count - before.count)

    def quantile(self, q: float) -> float:
        """Linear within the bucket the rank falls in, from 0 for the
        first; the highest finite bound for ranks in +Inf (histogram_quantile)."""
        rank = q * self.count
        lower, below = 0.0, 0.0
        for bound, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower
                inside = cumulative - below
                return lower + (bound - lower) * ((rank - below) / inside if inside else 0.0)
            lower, below = bound, cumulative
        return lower

    def at_most(self) -> float:
        """The lowest bucket bound every observation is under."""
        for bound, cumulative in self.buckets:
            if cumulative >= self.count:
                return bound
        return math.inf

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else math.nan


def histogram(text: str, name: str, labels: Mapping[str, str] | None = None) -> Histogram:
    """The histogram `name`, its series carrying `labels` summed."""
    wanted = labels or {}

    def mine(have: dict[str, str]) -> bool:
        return all(have.get(k) == v for k, v in wanted.items())

    buckets: dict[float, float] = {}
    for have, value in samples(text, f"{name}_bucket"):
        if mine(have):
            bound = math.inf if have["le"] == "+Inf" else float(have["le"])
            buckets[bound] = buckets.get(bound, 0.0) + value
    return Histogram(
        tuple(sorted(buckets.items())),
        total(text, f"{name}_sum", wanted),
        total(text, f"{name}_count", wanted),
    )
