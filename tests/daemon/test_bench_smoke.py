"""`make bench` keeps working: a quick run on the 8-GPU node and the DGX-1
NVLink layout, quality included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m <args>` from the repository root; it must exit 0."""
    result = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


# Runs `bench --quick` whole (8 s): with the slow tests, which CI runs.
@pytest.mark.slow
def test_bench_quick_run_reports_optimal_answers() -> None:
    result = run_bench("bench", "--quick", "--node", "hgx-h100", "--nvlink", "dgx-1")
    preferred, allocate, summary, cluster, nvlink = result.stdout.split("\n\n")
    rows = [line for line in preferred.splitlines() if line.startswith("hgx-h100 ")]
    assert len(rows) == 16  # every size of both resources
    assert all(line.rstrip().endswith("optimal") for line in rows)
    assert any(
        line.startswith("== hgx-h100: median p50/floor ratio") for line in preferred.splitlines()
    )
    # With 250 pods in the cache: every GPU size, each preference identified
    # the waiting container (the bench fails otherwise).
    cached = [line for line in preferred.splitlines() if line.startswith("hgx-h100+pods")]
    assert len(cached) == 8
    assert "== hgx-h100 with 250 pods in the cache: median p50/floor ratio" in preferred
    # Allocate: sizes 1, 2, 4, 8 of both resources, each with a floor ratio.
    assert len([line for line in allocate.splitlines() if line.startswith("hgx-h100")]) == 8
    # With PodResources gone the ledger holds one entry per device at most.
    assert "ledger 16 entries (bound 16)" in summary
    # The cluster placement: both placers on one seed, and the verdict.
    rows = [line.split() for line in cluster.splitlines() if line.startswith("   0 ")]
    assert [row[1] for row in rows] == ["default", "extender"]
    assert rows[1][4] == "100.0%"  # the extender: best level free anywhere, every time
    assert "== cluster:" in cluster
    # NVLink layouts: every size of both resources on DGX-1, exact, no
    # search past its budget, the p99 verdict printed.
    rows = [line for line in nvlink.splitlines() if line.startswith("dgx-1 ")]
    assert len(rows) == 12
    assert all(line.rstrip().endswith("optimal") for line in rows)
    assert "== dgx-1 (linked search): worst p99" in nvlink
    assert "searches past the budget 0" in nvlink


@pytest.mark.slow
def test_bench_extender_quick_run_measures_every_line() -> None:
    result = run_bench("bench", "--quick", "--extender")
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("   100 ")]
    assert len(rows) == 2  # extended-resource pods, then claim-only pods
    startup, rss, peak = float(rows[0][1]), float(rows[0][2]), float(rows[0][-1])
    assert 0 < startup < 60
    assert 0 < rss <= peak < 512
    claims = [float(cell.removesuffix("ms")) for cell in rows[1][1:]]
    assert len(claims) == 5
    assert all(value > 0 for value in claims)
    assert "a 1,024-device record parses in" in result.stdout
    assert "== extender:" in result.stdout


@pytest.mark.slow
def test_bench_dra_quick_run_meets_the_alignment_goals() -> None:
    result = run_bench("bench", "--quick", "--dra")
    # The alignment table, then the device-tries table (issue 30).
    alignment, _, tries = result.stdout.partition("DRA device tries")
    layouts = ("hgx-h100", "dgx-a100", "pcie-server", "asymmetric", "16-gpu")
    rows = [line.split() for line in alignment.splitlines() if line[:12].strip() in layouts]
    assert len(rows) == 20  # five layouts, four shapes
    measured = [row for row in rows if row[2] != "-"]
    assert len(measured) == 16  # pcie-server and asymmetric have too few HCAs for 4 and 8 pairs
    assert all(row[3] == "100.0%" for row in measured if row[1] == "1")
    assert "== DRA: 1-pair claims at the best level 100.0%" in alignment
    assert alignment.rstrip().endswith("met")
    counted = [line.split() for line in tries.splitlines() if line[:16].strip() in layouts]
    assert {row[0] for row in counted} == set(layouts)
    # A free node fits a 1-pair claim within a handful of tries everywhere.
    assert all(int(row[2].replace(",", "")) < 10 for row in counted if row[1] == "1-pair")
    assert "== DRA tries: worst " in tries


@pytest.mark.slow
def test_bench_dra_live_quick_run_places_claims_with_real_daemons() -> None:
    result = run_bench("bench.dra_live", "--quick")
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    # Three cadences, the extender's row then the default's.
    assert [row[1] for row in rows] == ["extender", "default"] * 3
    assert all(int(row[2]) > 0 for row in rows)
    assert all(float(row[3].rstrip("%")) >= 98.0 for row in rows if row[1] == "extender")
    assert "== DRA live:" in result.stdout


# Runs the preemption bench (6 s): with the slow tests, which CI runs.
@pytest.mark.slow
def test_bench_preemption_quick_run_frees_the_best_level_with_the_fewest_victims() -> None:
    result = run_bench("bench", "--quick", "--preemption")
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [row[1] for row in rows] == ["count-only", "extender"]
    assert all(int(row[2]) > 0 for row in rows)  # preemptors that needed eviction
    extender = rows[1]
    assert extender[3:5] == ["100.0%", "100.0%"]
    assert "== preemption: through the extender 100.0%" in result.stdout
    assert result.stdout.rstrip().endswith("met")


@pytest.mark.slow
def test_bench_mig_quick_run_pairs_every_mig_device_at_the_best_level() -> None:
    result = run_bench("bench", "--quick", "--mig")
    lines = result.stdout.splitlines()
    rows = [line.split() for line in lines if "pod watch" in line and not line.startswith("==")]
    assert len(rows) == 2  # two layouts, one seed each
    for row in rows:
        assert int(row[-3]) > 0  # containers admitted
        assert row[-1] == "100.0%"
    assert "kubelet only" in result.stdout
    assert "== MIG: with the pod watch 100.0%" in result.stdout
    assert result.stdout.rstrip().endswith("met")
