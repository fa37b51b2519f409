"""The benchmarks that no other test runs, each run for real at its smallest so that it
cannot rot: the shared-memory throughput one (``bench_ipc.py``) and the StreamLoader
latency one (``bench_stream_latency.py``). The figures are not checked (no timing
thresholds in tests), only that every configuration ran and reported them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
