"""examples/benchmarks/bench_serve.py, run for real at its smallest: one low rate, a short
sweep per contender, one repetition. The latencies are not checked (no timing thresholds
in tests), only that every part ran and that its counts add up."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def _bench_serve() -> Any:
    sys.path.insert(0, str(BENCH.parent))
    try:
        import bench_serve
    finally:
        sys.path.remove(str(BENCH.parent))
    return bench_serve


def test_the_default_ladder_climbs_to_twice_the_compute_bound() -> None:
    """A ladder that stops short of the knees would cap them at its top rate."""
    rates = _bench_serve().auto_rates(2974.0)
    assert rates[:3] == [100.0, 200.0, 400.0]
    assert rates[-1] == 6000.0 and rates[-2] < 2 * 2974.0 <= rates[-1]
    assert all(b - a == 200.0 for a, b in itertools.pairwise(rates[1:]))


def test_a_contender_stops_climbing_after_two_misses_and_medians_count_what_it_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sweep's give-up rule and the medians over repetitions, without timing: the
    open-loop run is replaced by one whose p99 is a function of the rate."""
    bs = _bench_serve()
    offered: list[float] = []

    async def fake_open_loop(call: Any, jpegs: Any, rate: float, n: int) -> dict[str, Any]:
        offered.append(rate)
        p99 = 10.0 if rate <= 300 or rate == 500 else 80.0  # a miss, then a pass, then two misses
        return {"rate": rate, "p50_ms": p99 / 2, "p99_ms": p99, "errors": 0}

    class Idle:
        def __init__(self, workers: int) -> None:
            pass

        async def start(self) -> None:
            pass

        async def call(self, body: bytes) -> None:
            pass

        async def stop(self) -> None:
            pass

    monkeypatch.setattr(bs, "open_loop", fake_open_loop)
    monkeypatch.setitem(bs.MAKERS, "idle", Idle)
    rates = [100.0, 200.0, 300.0, 400.0, 500.0, 600.0, 700.0, 800.0]
    rows = asyncio.run(bs.sweep("idle", 2, [b""], rates, 0.1))
    assert offered == [100.0, 200.0, 300.0, 400.0, 500.0, 600.0, 700.0]  # 600 and 700 missed: stop
    assert [r["offered"] for r in rows] == [True] * 7 + [False]
    assert rows[-1]["p99_ms"] is None and bs.best_rate(rows) == 500.0
    # Medians: a repetition that stopped before a rate counts as slower than any that ran it.
    fast = [{"rate": 800.0, "p50_ms": 5.0, "p99_ms": 20.0, "errors": 0, "offered": True}]
    (row,) = bs._median_rows([fast, rows[-1:], fast])
    assert row["p99_ms"] == 20.0 and row["offered"] == 2
    (row,) = bs._median_rows([fast, rows[-1:], rows[-1:]])
    assert row["p99_ms"] is None and row["offered"] == 1
