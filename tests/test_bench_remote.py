"""examples/benchmarks/bench_remote.py, run for real at its smallest: 16 JPEGs over the
benchmark's HTTP server and on moto's S3 server, the aioloader contenders only (no torch), one repetition. The
numbers are not checked, only that every cell ran, fetched over HTTP, and was written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "examples" / "benchmarks" / "bench_remote.py"


@pytest.mark.parametrize("store", ["http", "s3"])
def test_bench_remote_smallest_run_writes_every_cell(tmp_path: Path, store: str) -> None:
    if store == "s3":
        pytest.importorskip("moto")
        pytest.importorskip("obstore")
    # the in-memory source (no client, no server) once, beside the HTTP store
    contenders = ["aioloader-fetch", "aioloader-local"] + (["aioloader-fetch-mem"] if store == "http" else [])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = tmp_path / "remote.json"
    cmd = [
        sys.executable, str(BENCH), "--images", "16", "--repeat", "1", "--latency", "0", "--store", store,
        "--contenders", ",".join(contenders), "--batch-size", "4", "--max-seconds", "1",
        "--cache", str(tmp_path), "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    rows = results["rows"]
    assert set(rows) == {"aioloader-fetch@0ms", "aioloader-local"} | (
        {"aioloader-fetch-mem@0ms"} if store == "http" else set()
    )
    fetch = rows["aioloader-fetch@0ms"]
    assert fetch["images_per_s"] > 0 and fetch["peak_pss_mb"] > 0
    assert fetch["fetch_peak_in_flight"] >= 1  # the bytes really came over HTTP (or S3)
    assert results["config"]["store"] == store
    assert fetch["processes"] >= 3  # the main process and its 2 workers were sampled
    assert set(results["ratios"]["aioloader-fetch@0ms"]) == {"vs_local"}
    assert "| aioloader-fetch | 0 ms |" in proc.stdout
    if store == "http":
        mem = rows["aioloader-fetch-mem@0ms"]
        assert mem["images_per_s"] > 0 and mem["fetch_peak_in_flight"] >= 1
        assert set(results["ratios"]["aioloader-fetch-mem@0ms"]) == {"vs_local"}
