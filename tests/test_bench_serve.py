"""examples/benchmarks/bench_serve.py, run for real at its smallest: one low rate, a short
sweep per contender, one repetition. The latencies are not checked (no timing thresholds
in tests), only that every part ran and that its counts add up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "examples" / "benchmarks" / "bench_serve.py"

pytestmark = pytest.mark.timeout(120)


def test_bench_serve_smallest_run_writes_every_part(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = tmp_path / "serve.json"
    cmd = [sys.executable, str(BENCH), "--rates", "50", "--seconds", "0.4", "--repeat", "1", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for name in ("batcher", "naive", "stream"):
        (row,) = result["sweeps"][name]
        assert row["rate"] == 50 and row["errors"] == 0 and row["p99_ms"] is not None
    # the compute bound is measured in each repetition, and each knee is a share of it
    (bound,) = result["compute_bound_by_rep"]
    assert bound > 0 and result["compute_bound"] == bound
    for name in ("batcher", "naive", "stream"):
        (share,) = result["share_of_bound_by_rep"][name]
        assert share == pytest.approx(result["best_rate_by_rep"][name][0] / bound)
    low = result["low_load"]
    for name in ("batcher", "naive"):
        # each request's added time is its round trip less its own fn time in the worker
        assert 0 < low[f"{name}_fn_p50_ms"] < low[f"{name}_p50_ms"]
    ovl = result["overload"]
    # every offered request was either admitted or refused at submit(), and each admitted one
    # either completed or expired at its deadline; only admitted requests (and the 32 of the
    # warm-up) were dispatched in micro-batches: a refused one never went to a worker
    assert ovl["admitted"] + ovl["rejected"] == ovl["offered"]
    assert ovl["completed"] + ovl["expired"] == ovl["admitted"]
    assert ovl["worker_items"] <= ovl["admitted"] + 32


def test_the_default_ladder_climbs_past_the_compute_bound() -> None:
    """A ladder that stops short of the bound would cap every knee at its top rate."""
    sys.path.insert(0, str(BENCH.parent))
    try:
        import bench_serve
    finally:
        sys.path.remove(str(BENCH.parent))
    rates = bench_serve.auto_rates(2974.0)
    assert rates[:3] == [100.0, 200.0, 400.0]
    assert rates[-1] == 3600.0 and rates[-2] < 1.2 * 2974.0 <= rates[-1]
    assert all(b - a == 200.0 for a, b in zip(rates[1:], rates[2:], strict=False))
