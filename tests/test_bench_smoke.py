"""`make bench` keeps working: a quick run on the 8-GPU node, quality included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_quick_run_reports_optimal_answers() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--node", "hgx-h100"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    rows = [line for line in lines if line.startswith("hgx-h100")]
    assert len(rows) == 16  # every size of both resources
    assert all(line.rstrip().endswith("optimal") for line in rows)
    assert any(line.startswith("== hgx-h100: worst p99") for line in lines)
