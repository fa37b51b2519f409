"""Statistics and Chrome traces (the bench command is tested in test_cli.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

import aioloader

from ._datasets import RangeDataset, SlowDataset


def test_trace_file_has_worker_tracks_and_consumer_waits(collect, tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    loader = aioloader.DataLoader(RangeDataset(24), 4, num_workers=2, trace=path)
    with loader:
        collect(loader)
        pids = set(loader.worker_pids())
    doc = json.loads(path.read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    batches = [e for e in spans if e["tid"] == "batches"]
    waits = [e for e in spans if e["tid"] == "consumer"]
    # epoch 0's six batches, plus the first of epoch 1 built speculatively at the boundary
    assert sorted(e["name"] for e in batches if e["name"].endswith("epoch 0")) == [f"batch {k} of epoch 0" for k in range(6)]
    assert {e["pid"] for e in batches} <= pids
    assert sorted(e["name"] for e in batches)[0].startswith("batch 0 of epoch 0")
    assert len(waits) == 6 and all(e["dur"] >= 0 for e in waits)
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert "consumer (main process)" in names and any(n.startswith("worker pid") for n in names)


def test_tracing_context_manager_covers_only_its_block(tmp_path: Path) -> None:
    # (no speculative prefetch: it would build epoch 1's first batch before the block)
    with aioloader.DataLoader(RangeDataset(12), 4, num_workers=1, prefetch_next_epoch=False) as loader:
        list(loader)
        with loader.tracing(tmp_path / "second.json"):
            list(loader)
        list(loader)
    doc = json.loads((tmp_path / "second.json").read_text())
    epochs = {e["name"] for e in doc["traceEvents"] if e.get("tid") == "batches"}
    assert epochs == {f"batch {k} of epoch 1" for k in range(3)}


def test_stats_epoch_boundary_and_stall() -> None:
    async def main() -> aioloader.LoaderStats:
        async with aioloader.DataLoader(SlowDataset(32, 0.001), 4, num_workers=2, shuffle=True, seed=0) as loader:
            for _ in range(3):
                async for _b in loader:
                    pass
            return loader.stats()

    st = asyncio.run(main())
    assert [e.epoch for e in st.epochs] == [0, 1, 2]
    assert all(e.batches == 8 for e in st.epochs)
    assert all(e.first_batch_s is not None for e in st.epochs)
    assert st.stall_s == pytest.approx(sum(e.stall_s for e in st.epochs))
    assert 0 < st.worker_busy <= 1
    assert st.retries == st.restarts == st.skipped == 0
