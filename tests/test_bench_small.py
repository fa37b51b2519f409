"""The benchmarks that no other test runs, each run for real at its smallest so that it
cannot rot: the shared-memory throughput one (``bench_ipc.py``), the StreamLoader
latency one (``bench_stream_latency.py``), and issue 49's start workloads (the suite's
and bench_ab's ``start``, ``bench_lightning.py``). The figures are not checked (no timing
thresholds in tests), only that every configuration ran and reported them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import TORCH_REQUIRED_ON

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "examples" / "benchmarks"

pytestmark = pytest.mark.timeout(150)


def _run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=140
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_bench_ipc_smallest_run_reports_every_configuration(tmp_path: Path) -> None:
    out = tmp_path / "ipc.json"
    _run("bench_ipc.py", "--no-torch", "--rounds", "1", "--batches", "2", "--batch-size", "4", "--json", str(out),
         cwd=tmp_path)  # fmt: skip
    result = json.loads(out.read_text())
    names = {r["name"] for r in result["results"]}
    assert {"aioloader shm", "aioloader pickle", "produce only (bound)"} <= names, names
    assert not any(n.startswith("torch") for n in names)
    for r in result["results"]:
        assert r["median"]["gb_s"] > 0 and len(r["runs"]) == 1, r


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_bench_stream_latency_smallest_run_reports_both_scenarios(tmp_path: Path, mode: str) -> None:
    proc = _run("bench_stream_latency.py", "--seconds", "0.4", "--warmup", "0.2", "--mode", mode, cwd=tmp_path)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["mode"] == mode
    assert result["added"]["items"] > 0 and result["deadline"]["items"] > 0
    assert result["deadline"]["mean_batch"] >= 1
    assert {"p50", "p99"} <= set(result["added"]["added_ms"])


@pytest.mark.torch
def test_bench_suite_start_workload_reports_each_case_against_torch(tmp_path: Path) -> None:
    """One fresh training script per case and loader: each case has a time for aioloader
    and torch, and aioloader's is set against torch's and the goal. Two cases, to keep
    it short: a second loader (two loaders in one script) and tqdm's thread."""
    out = tmp_path / "start.json"
    proc = _run("bench_suite.py", "--workloads", "start", "--start-runs", "1",
                "--start-cases", "second,tqdm", "--json", str(out), cwd=tmp_path)  # fmt: skip
    cases = json.loads(out.read_text())["workloads"]["start"]["cases"]
    assert list(cases) == ["second", "tqdm"], cases
    for case, row in cases.items():
        assert set(row) == {"aioloader", "torch-numpy"}, (case, row)
        assert row["torch-numpy"]["median_s"] > 0 and row["aioloader"]["vs_torch"] > 0, (case, row)
        assert "meets_goal" in row["aioloader"], row
    assert "within 1.5x torch + 50 ms" in proc.stdout, proc.stdout


@pytest.mark.torch
def test_bench_ab_start_workload_times_both_checkouts_and_torch(tmp_path: Path) -> None:
    proc = _run("bench_ab.py", str(ROOT), str(ROOT), "torch", "--workload", "start", "--pairs", "1",
                "--cases", "plain", cwd=tmp_path)  # fmt: skip
    runs = [line for line in proc.stdout.splitlines() if "first batch" in line and line[:2] in ("A ", "B ", "C ")]
    assert sorted(line[0] for line in runs) == ["A", "B", "C"], proc.stdout
    assert all(float(line.split()[-2]) > 0 for line in runs), runs
    assert "plain: B/A" in proc.stdout and "goal (issue 49)" in proc.stdout, proc.stdout


@pytest.mark.torch
def test_bench_lightning_smallest_run_fits_with_both_loaders(tmp_path: Path) -> None:
    """One fit per loader, with the progress bar (the variant with more in it)."""
    if importlib.util.find_spec("lightning") is None:
        if sys.version_info[:2] == TORCH_REQUIRED_ON:
            pytest.fail('lightning is not installed; on Python 3.11 it must be (pip install -e ".[dev]")')
        pytest.skip("lightning is not installed")
    out = tmp_path / "lightning.json"
    proc = _run("bench_lightning.py", "--runs", "1", "--samples", "128", "--variants", "progress bar",
                "--json", str(out), cwd=tmp_path)  # fmt: skip
    result = json.loads(out.read_text())
    assert list(result["summary"]) == ["progress bar"], result["summary"]
    rows = result["summary"]["progress bar"]
    assert set(rows) == {"aioloader", "torch-persistent"}, rows
    for row in rows.values():
        assert 0 < row["first_train_batch_s"] < row["fit_s"], row
    assert "meets_goal" in rows["aioloader"], rows
    for runs in result["raw"]["progress bar"].values():
        assert [run["train_batches"] for run in runs] == [2 * 2], runs  # 2 epochs of 128 samples, batch 64
    assert "within 1.2x" in proc.stdout, proc.stdout
