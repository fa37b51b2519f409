"""aioloader against torch's DataLoader under PyTorch Lightning: a short fit, start included.

Each run is a fresh process that runs ``_train_lightning.py``: a linear
``LightningModule`` whose ``train_dataloader()`` and ``val_dataloader()`` each return a
loader over 2,048 samples of 16 floats (a torch ``Dataset`` defined in the script),
batch 64, 2 workers, fitted by::

    Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)

and again with ``enable_progress_bar=True`` (Lightning's tqdm bar, which starts tqdm's
monitor thread). The loaders:

- ``aioloader``: ``aioloader.DataLoader(dataset, 64, shuffle=..., num_workers=2)``;
- ``torch-persistent``: ``torch.utils.data.DataLoader(..., num_workers=2,
  persistent_workers=True)``, fork start, default collate. Both give tensors.

Reported, medians of ``--runs`` fresh processes (default 3), interleaved with the order
rotating: the wall time of ``fit``, and the time from the call to ``fit`` to the first
training batch (a callback's ``on_train_batch_start``) and to the first val batch
(Lightning's sanity check, which runs first). Then aioloader's time over torch's, against
issue 49's goal: ``fit`` within 1.2x torch's.

The dataset is built with a torch op over 32,768 elements, which starts torch's intra-op
(OpenMP) threads before the loaders start, as in most training scripts.
``--intra-op-threads 1`` calls ``torch.set_num_threads(1)`` first in each script, so
that those threads never start: the figure without them.

Usage (with aioloader's start today, 3 runs take about 90 s on 2 cores, 5 about 150 s)::

    python examples/benchmarks/bench_lightning.py
    python examples/benchmarks/bench_lightning.py --runs 5 --json lightning.json
    python examples/benchmarks/bench_lightning.py --intra-op-threads 1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import _bench_proc  # noqa: E402  (beside this script)

SCRIPT = HERE / "_train_lightning.py"
LOADERS = {"aioloader": "aioloader", "torch-persistent": "torch"}  # label: the script's --loader
VARIANTS = {"no bar": False, "progress bar": True}
GOAL = 1.2  # issue 49: aioloader's fit within 1.2x torch's
FIGURES = ("fit_s", "first_train_batch_s", "first_val_batch_s")


def run_one(
    loader: str, progress_bar: bool, samples: int | None, intra_op: int | None = None, timeout: float = 300
) -> dict[str, Any]:
    # With bytecode caching, as users run scripts.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    cmd = [sys.executable, str(SCRIPT), "--loader", loader]
    if progress_bar:
        cmd.append("--progress-bar")
    if samples:
        cmd += ["--samples", str(samples)]
    if intra_op:
        cmd += ["--intra-op-threads", str(intra_op)]
    proc = _bench_proc.run(cmd, env=env, timeout=timeout)  # returns once its helpers are gone
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return result
    raise RuntimeError(
        f"Lightning run failed ({loader}, bar {progress_bar}), exit code {proc.returncode}:\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )


def _median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def _s(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def summarize(raw: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Medians by variant and loader, and aioloader's over torch's."""
    out: dict[str, Any] = {}
    for variant, by_loader in raw.items():
        rows: dict[str, Any] = {}
        for label, runs in by_loader.items():
            if runs:
                rows[label] = {f: _median([r[f] for r in runs]) for f in FIGURES}
                rows[label]["runs"] = len(runs)
        if "aioloader" in rows and "torch-persistent" in rows:
            aio, ref = rows["aioloader"], rows["torch-persistent"]
            rows["aioloader"]["vs_torch"] = {f: _ratio(aio[f], ref[f]) for f in FIGURES}
            rows["aioloader"]["meets_goal"] = aio["fit_s"] <= GOAL * ref["fit_s"]
        out[variant] = rows
    return out


def fmt(summary: dict[str, Any]) -> str:
    lines = [
        "## Lightning: fit(2 epochs), a fresh process each",
        "",
        "| variant | loader | fit (s) | fit() to first train batch (s) | fit() to first val batch (s) "
        "| fit vs torch | first train batch vs torch |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for variant, rows in summary.items():
        for label, row in rows.items():
            ratios = row.get("vs_torch", {})
            fit_x, first_x = (ratios.get(f) for f in ("fit_s", "first_train_batch_s"))
            lines.append(
                f"| {variant} | {label} | {_s(row['fit_s'])} | {_s(row['first_train_batch_s'])} "
                f"| {_s(row['first_val_batch_s'])} | {'' if fit_x is None else f'{fit_x:.2f}x'} "
                f"| {'' if first_x is None else f'{first_x:.2f}x'} |"
            )
    lines.append("")
    for variant, rows in summary.items():
        if "meets_goal" in rows.get("aioloader", {}):
            ratio = rows["aioloader"]["vs_torch"]["fit_s"]
            verdict = "meets" if rows["aioloader"]["meets_goal"] else "misses"
            lines.append(
                f"{variant}: aioloader's fit is {ratio:.2f}x torch's; {verdict} the goal (within {GOAL}x)"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="fresh processes per loader and variant")
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated: {', '.join(VARIANTS)} (default both)",
    )
    ap.add_argument("--samples", type=int, default=None, help="samples per loader (default 2,048)")
    ap.add_argument(
        "--intra-op-threads",
        type=int,
        default=None,
        help="torch.set_num_threads first (1: no OpenMP threads)",
    )
    ap.add_argument("--json", type=Path, default=None, help="write the runs and medians here")
    args = ap.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        ap.error(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    missing = [m for m in ("torch", "lightning") if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"{' and '.join(missing)} not installed: pip install torch lightning, and rerun.")
    labels = list(LOADERS)
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {v: {k: [] for k in labels} for v in variants}
    started = time.perf_counter()
    for rep in range(args.runs):
        order = labels[rep % len(labels) :] + labels[: rep % len(labels)]
        for variant in variants:
            for label in order:
                res = run_one(LOADERS[label], VARIANTS[variant], args.samples, args.intra_op_threads)
                raw[variant][label].append(res)
                print(
                    f"[{time.perf_counter() - started:6.1f} s] run {rep + 1}/{args.runs} {variant:<12} {label:<16} "
                    f"fit {res['fit_s']:.3f} s, first train batch {res['first_train_batch_s']:.3f} s",
                    flush=True,
                )
    summary = summarize(raw)
    print()
    print(fmt(summary))
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"summary": summary, "raw": raw}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
