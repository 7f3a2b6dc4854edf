"""Reading the scheduler's histograms from its text exposition: labels
matched exactly (`le` is not found inside `profile`), series summed, and
quantiles read as PromQL's histogram_quantile reads them."""

from __future__ import annotations

import math

from devplugin.testing.promtext import histogram, total

TEXT = """\
# HELP attempts_seconds Scheduling attempt latency
# TYPE attempts_seconds histogram
attempts_seconds_bucket{profile="default-scheduler",result="scheduled",le="0.001"} 0
attempts_seconds_bucket{profile="default-scheduler",result="scheduled",le="0.002"} 2
attempts_seconds_bucket{profile="default-scheduler",result="scheduled",le="0.004"} 6
attempts_seconds_bucket{profile="default-scheduler",result="scheduled",le="0.008"} 10
attempts_seconds_bucket{profile="default-scheduler",result="scheduled",le="+Inf"} 10
attempts_seconds_sum{profile="default-scheduler",result="scheduled"} 0.035
attempts_seconds_count{profile="default-scheduler",result="scheduled"} 10
attempts_seconds_bucket{profile="other",result="scheduled",le="0.001"} 0
attempts_seconds_bucket{profile="other",result="scheduled",le="0.002"} 0
attempts_seconds_bucket{profile="other",result="scheduled",le="0.004"} 0
attempts_seconds_bucket{profile="other",result="scheduled",le="0.008"} 0
attempts_seconds_bucket{profile="other",result="scheduled",le="+Inf"} 2
attempts_seconds_sum{profile="other",result="scheduled"} 1.0
attempts_seconds_count{profile="other",result="scheduled"} 2
attempts_seconds_count{profile="other",result="error"} 7
requests_total{verb="claims_filter",result="ok"} 3
requests_total{verb="filter",result="ok"} 5
"""


def test_a_profile_histogram_gives_quantiles_within_their_buckets() -> None:
    found = histogram(TEXT, "attempts_seconds", {"profile": "default-scheduler"})
    assert found.count == 10
    assert math.isclose(found.mean, 0.0035)
    # Rank 5 of 10 falls in (2 ms, 4 ms] holding ranks 3..6: three quarters in.
    assert math.isclose(found.quantile(0.5), 0.0035)
    assert math.isclose(found.quantile(1.0), 0.008)
    assert found.at_most() == 0.008


def test_series_are_summed_and_an_inf_rank_reads_the_highest_finite_bound() -> None:
    both = histogram(TEXT, "attempts_seconds", {"result": "scheduled"})
    assert both.count == 12
    assert both.quantile(0.99) == 0.008  # in +Inf: the highest finite bound
    assert math.isinf(both.at_most())


def test_observations_since_an_earlier_reading() -> None:
    now = histogram(TEXT, "attempts_seconds", {"profile": "default-scheduler"})
    earlier = histogram(
        TEXT.replace('le="0.008"} 10', 'le="0.008"} 6')
        .replace('le="+Inf"} 10', 'le="+Inf"} 6')
        .replace('result="scheduled"} 10', 'result="scheduled"} 6'),
        "attempts_seconds",
        {"profile": "default-scheduler"},
    )
    since = now.minus(earlier)
    assert since.count == 4
    assert since.at_most() == 0.008
    assert dict(since.buckets)[0.004] == 0


def test_counters_are_matched_on_whole_label_values() -> None:
    assert total(TEXT, "requests_total", {"verb": "filter"}) == 5
    assert total(TEXT, "requests_total", {"verb": "claims_filter"}) == 3
    assert total(TEXT, "requests_total") == 8
