"""examples/benchmarks/bench_serve.py, run for real at its smallest: one low rate, a short
sweep per contender, one repetition. The latencies are not checked (no timing thresholds
in tests), only that every part ran and that its counts add up."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "examples" / "benchmarks" / "bench_serve.py"

pytestmark = pytest.mark.timeout(120)


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(BENCH), *args, "--json", str(tmp_path / "out.json")]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)


def _result(tmp_path: Path, *args: str) -> Any:
    proc = _run(tmp_path, *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / "out.json").read_text())


def test_bench_serve_smallest_run_writes_every_part(tmp_path: Path) -> None:
    result = _result(tmp_path, "--rates", "50", "--seconds", "0.4", "--repeat", "1")
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
    # each refusal over 1 ms is put down to exactly one cause
    (run,) = result["overload_by_rep"]
    assert sum(run["rejected_over_1ms_by_cause"].values()) == run["rejected_over_1ms"] <= run["rejected"]
    slow = result["overload_slow_refusals"]
    assert slow["over_1ms"] == run["rejected_over_1ms"] and slow["by_cause"] == run["rejected_over_1ms_by_cause"]


def test_bench_serve_overload_only_runs_the_overload_part_alone(tmp_path: Path) -> None:
    result = _result(tmp_path, "--overload-only", "200", "--seconds", "0.3", "--repeat", "2")
    assert "sweeps" not in result and "low_load" not in result
    runs = result["overload_by_rep"]
    assert len(runs) == 2 and all(r["rate"] == 200 and r["offered"] == 60 for r in runs)
    slow = result["overload_slow_refusals"]
    assert slow["refusals"] == sum(r["rejected"] for r in runs)
    assert slow["over_1ms"] == sum(slow["by_cause"].values()) == sum(r["rejected_over_1ms"] for r in runs)
    # a run of less than one request, or a chart of sweeps it does not run, is refused up front
    for args in (("--overload-only", "0.4", "--seconds", "2"), ("--overload-only", "200", "--png", "x.png")):
        proc = _run(tmp_path, *args)
        assert proc.returncode == 2 and "--overload-only" in proc.stderr

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


def test_a_slow_refusal_is_put_down_to_its_cause() -> None:
    """``Stretches`` classifies a stretch over 1 ms by what its start mark says changed in
    it. The marks are made by hand: a start 2 ms ago (or 1 s ahead, for a fast one), and
    context-switch counts far above the thread's own (nothing switched) or below zero
    (switched), so no stretch has to be slow and no switch has to happen."""
    bs = _bench_serve()
    s = bs.Stretches()
    with s:  # the collector's runs are counted while installed
        gc.collect()
    assert s.collections >= 1 and s.pauses[-1][0] == 2  # gc.collect() is a full collection
    s.pauses.clear()

    def stop(*, ago: float = 0.002, cpu: float = 0.0, vol: int = 10**9, invol: int = 10**9, gcs: int = 0) -> None:
        clock, _, _, _, _ = s.start()
        s.stop((clock - ago, time.thread_time() - cpu, vol, invol, gcs))

    stop(ago=-1.0)  # fast: timed, not classified
    s.pauses.append((0, 0.0))
    stop(gcs=0, vol=-1, invol=-1)  # a collection ran in it (the first of the causes checked)
    s.pauses.clear()
    stop(vol=-1, invol=-1)  # the thread waited in the kernel
    stop(invol=-1)  # the kernel preempted it
    stop()  # no CPU used, nothing switched: not accounted to the thread
    stop(cpu=1.0)  # a whole second of its own CPU
    assert len(s.wall) == 6
    summary = s.summary("rejected")
    assert summary["rejected_over_1ms"] == 5
    assert summary["rejected_over_1ms_by_cause"] == dict.fromkeys(bs.Stretches.CAUSES, 1)
    assert set(summary["rejected_over_1ms_max_by_cause"]) == set(bs.Stretches.CAUSES)
    assert all(v >= 2.0 for v in summary["rejected_over_1ms_max_by_cause"].values())
    detail = summary["rejected_over_1ms_detail"]
    assert [d["cause"] for d in detail] == list(bs.Stretches.CAUSES)
    assert detail[0]["collections"] == 1 and detail[1]["voluntary_switches"] > 0
    assert detail[2]["involuntary_switches"] > 0 and detail[4]["cpu_ms"] >= 1000


def test_overload_repetitions_merge_into_medians_and_summed_causes() -> None:
    bs = _bench_serve()

    def run(rejected: int, p99: float | None, causes: dict[str, int], slowest: dict[str, float]) -> dict[str, Any]:
        return {
            "rate": 6400.0, "rejected": rejected, "rejected_p99_ms": p99,
            "rejected_over_1ms": sum(causes.values()),
            "rejected_over_1ms_by_cause": {c: causes.get(c, 0) for c in bs.Stretches.CAUSES},
            "rejected_over_1ms_max_by_cause": slowest,
            "rejected_over_1ms_detail": [{"cause": c} for c, n in causes.items() for _ in range(n)],
        }  # fmt: skip

    runs = [
        run(100, 0.03, {"switched_out": 2}, {"switched_out": 3.0}),
        run(300, 0.05, {}, {}),
        run(200, None, {"collector": 1, "switched_out": 1}, {"collector": 1.2, "switched_out": 4.0}),
    ]
    merged = bs.merge_overloads(runs)
    assert merged["overload"]["rejected"] == 200 and merged["overload"]["rate"] == 6400.0
    assert merged["overload"]["rejected_p99_ms"] is None  # one repetition had none to give
    assert "rejected_over_1ms_by_cause" not in merged["overload"]
    assert "rejected_over_1ms_detail" not in merged["overload"]
    slow = merged["overload_slow_refusals"]
    assert slow["refusals"] == 600 and slow["over_1ms"] == 4
    assert slow["by_cause"] == {**dict.fromkeys(bs.Stretches.CAUSES, 0), "collector": 1, "switched_out": 3}
    assert slow["max_ms_by_cause"] == {"collector": 1.2, "switched_out": 4.0}
    assert list(slow["max_ms_by_cause"]) == ["collector", "switched_out"]  # in the causes' order
