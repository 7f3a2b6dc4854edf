"""Churn: a seeded stream of pods arriving and leaving, against first fit."""

from __future__ import annotations

import pytest

from devplugin.testing.churn import ChurnOutcome, run_churn
from devplugin.testing.layouts import LAYOUTS

SEEDS = range(3)
CHURN_LAYOUTS = ["16-gpu", "dgx-a100", "hgx-h100", "pcie-server"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", CHURN_LAYOUTS)
def test_churn_beats_first_fit_on_every_seed(
    layout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ours_total, base_total = ChurnOutcome(), ChurnOutcome()
    rows = []
    for seed in SEEDS:
        ours = run_churn(LAYOUTS[layout](), seed, preferred=True)
        base = run_churn(LAYOUTS[layout](), seed, preferred=False)
        # The same events reach both: whether a pod fits depends on counts
        # only (unless a device failed closed meanwhile on a loaded machine).
        if not (ours.faults or base.faults):
            assert ours.containers == base.containers > 0
        assert ours.optimal_share >= base.optimal_share, (seed, ours, base)
        assert ours.ideal_share >= base.ideal_share, (seed, ours, base)
        for total, one in ((ours_total, ours), (base_total, base)):
            total.containers += one.containers
            total.optimal += one.optimal
            total.ideal += one.ideal
        rows.append(
            f"{layout:12} seed {seed}: {ours.containers:3} GPU+HCA containers; optimal given "
            f"free: ours {ours.optimal_share:6.1%} first-fit {base.optimal_share:6.1%}; "
            f"ideal: ours {ours.ideal_share:6.1%} first-fit {base.ideal_share:6.1%}"
        )
    assert ours_total.optimal > base_total.optimal
    with capsys.disabled():
        print("\n" + "\n".join(rows))
