"""The start workload, parent side: run ``_train_start.py`` in fresh processes, take
medians, and set them against torch and the goal of issue 49.

Used by ``bench_suite.py --workloads start`` and ``bench_ab.py --workload start``. Each
run is a new interpreter (a training script started afresh), timed from the loader's
construction to its first batch. See ``_train_start.py`` for the cases.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import _bench_proc

SCRIPT = Path(__file__).resolve().parent / "_train_start.py"
# What runs by default. ``tqdm`` (the idle thread is tqdm's monitor), ``omp`` (torch's
# intra-op pool of native threads is up) and ``early`` (the idle thread starts before
# ``import aioloader``) are asked for by name.
DEFAULT_CASES = ("thread", "second", "plain")
ALL_CASES = ("thread", "second", "plain", "tqdm", "omp", "early")
CASE_TEXT = {
    "thread": "an idle thread started first",
    "second": "a second loader (val) while the first (train) lives",
    "plain": "the script's only loader, no thread",
    "tqdm": "tqdm's monitor thread running",
    "omp": "torch's intra-op (OpenMP) threads running",
    "early": "an idle thread started before import aioloader",
}
# Issue 49's goal: each case within 1.5x torch's time plus 50 ms.
GOAL_TEXT = "within 1.5x torch + 50 ms"


def goal_s(torch_s: float) -> float:
    return 1.5 * torch_s + 0.05


def parse_cases(text: str) -> tuple[str, ...]:
    cases = tuple(c.strip() for c in text.split(",") if c.strip())
    unknown = [c for c in cases if c not in ALL_CASES]
    if unknown or not cases:
        raise ValueError(f"unknown start cases {unknown}: choose from {', '.join(ALL_CASES)}")
    return cases


def run_one(
    loader: str, case: str, *, pythonpath: str | None = None, samples: int | None = None, timeout: float = 180
) -> dict[str, Any]:
    """One fresh process: ``loader`` is ``aioloader`` or ``torch``. ``pythonpath`` puts a
    checkout of aioloader first on the path. Returns the script's RESULT."""
    # With bytecode caching, as users run scripts.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, str(SCRIPT), "--loader", loader, "--case", case]
    if samples:
        cmd += ["--samples", str(samples)]
    proc = _bench_proc.run(cmd, env=env, timeout=timeout)  # returns once its helpers are gone
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return result
    raise RuntimeError(
        f"start run failed ({loader}, {case}), exit code {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )


def summarize(times: dict[str, dict[str, list[float]]], torch_side: str | None) -> dict[str, Any]:
    """``times[side][case]``: seconds of each run. Medians, ranges, and each side against
    ``torch_side`` (its ratio, the goal and whether it is met)."""
    out: dict[str, Any] = {"goal": GOAL_TEXT, "cases": {}}
    cases = [c for c in ALL_CASES if any(c in by_case for by_case in times.values())]
    for case in cases:
        row: dict[str, Any] = {}
        for side, by_case in times.items():
            runs = by_case.get(case, [])
            if runs:
                row[side] = {
                    "median_s": statistics.median(runs),
                    "min_s": min(runs),
                    "max_s": max(runs),
                    "runs": len(runs),
                }
        if torch_side and torch_side in row:
            torch_s = row[torch_side]["median_s"]
            for side, cell in row.items():
                if side != torch_side:
                    cell["vs_torch"] = cell["median_s"] / torch_s
                    cell["goal_s"] = goal_s(torch_s)
                    cell["meets_goal"] = cell["median_s"] <= goal_s(torch_s)
        out["cases"][case] = row
    return out


def fmt(title: str, summary: dict[str, Any], torch_side: str | None) -> str:
    """One row per (case, side): median, range, and against torch."""
    lines = [
        title,
        "",
        "| case | loader | construction to first batch, median (ms) | range (ms) | vs torch | goal (ms) | meets |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for case, row in summary["cases"].items():
        for side, cell in row.items():
            ratio = f"{cell['vs_torch']:.2f}x" if "vs_torch" in cell else ""
            goal = f"{cell['goal_s'] * 1e3:.0f}" if "goal_s" in cell else ""
            meets = ("yes" if cell["meets_goal"] else "no") if "meets_goal" in cell else ""
            lines.append(
                f"| {case} | {side} | {cell['median_s'] * 1e3:.1f} | {cell['min_s'] * 1e3:.1f}-{cell['max_s'] * 1e3:.1f} "
                f"| {ratio} | {goal} | {meets} |"
            )
    lines += ["", "cases: " + "; ".join(f"{c}: {CASE_TEXT[c]}" for c in summary["cases"])]
    if torch_side:
        lines.append(f"goal (issue 49): {GOAL_TEXT}, medians of fresh processes")
    return "\n".join(lines)
