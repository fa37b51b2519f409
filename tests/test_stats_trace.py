"""Statistics and Chrome traces (the bench command is tested in test_cli.py).

Perfetto's Python package cannot load a trace here: its ``TraceProcessor`` downloads a
``trace_processor_shell`` binary on first use, and the test machines are offline. So the
traces are checked by :func:`validate_trace`, a strict reading of the Trace Event Format
(https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import aioloader
from aioloader._trace import Tracer
from aioloader.stream import StreamLoader

from ._datasets import FailingDataset, RangeDataset, SlowDataset
from ._stream_helpers import square

# ------------------------------------------------------------------ the format
_COMMON = {"name", "cat", "ph", "ts", "tts", "pid", "tid", "args", "cname"}
_KEYS = {
    "X": _COMMON | {"dur", "tdur", "sf", "stack", "esf", "estack"},
    "B": _COMMON | {"sf", "stack"},
    "E": _COMMON | {"sf", "stack"},
    "i": _COMMON | {"s"},
    "I": _COMMON | {"s"},
    "C": _COMMON | {"id"},
    "M": {"name", "ph", "pid", "tid", "args", "cat"},
}
_METADATA = {
    "process_name": "name",
    "process_labels": "labels",
    "thread_name": "name",
    "process_sort_index": "sort_index",
    "thread_sort_index": "sort_index",
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def validate_trace(text: str) -> dict[tuple[int, int], str]:
    """Check a trace file's text against the Trace Event Format; returns each track's
    ``thread_name`` by ``(pid, tid)``. Raises AssertionError naming the first bad event."""

    def no_constants(name: str) -> Any:
        raise AssertionError(f"{name} is not JSON")

    doc = json.loads(text, parse_constant=no_constants)
    if isinstance(doc, dict):
        assert set(doc) <= {"traceEvents", "displayTimeUnit", "otherData", "stackFrames", "samples"}, (
            doc.keys()
        )
        assert doc.get("displayTimeUnit", "ms") in ("ms", "ns")
        assert isinstance(doc.get("otherData", {}), dict)
        events = doc["traceEvents"]
    else:
        events = doc
    assert isinstance(events, list)
    threads: dict[tuple[int, int], str] = {}
    processes: set[int] = set()
    used: set[tuple[int, int]] = set()
    last_ts: dict[tuple[int, int], float] = {}
    open_b: dict[tuple[int, int], list[str]] = {}
    for k, ev in enumerate(events):
        where = f"event {k}: {ev!r}"
        assert isinstance(ev, dict), where
        ph = ev.get("ph")
        assert ph in _KEYS, where
        assert set(ev) <= _KEYS[ph], f"{where}: keys {set(ev) - _KEYS[ph]} not allowed for ph={ph}"
        assert isinstance(ev.get("name"), str) and ev["name"], where
        # process-level metadata may leave the thread out; every other event names both
        process_level = ph == "M" and ev["name"].startswith("process_") and "tid" not in ev
        assert _is_int(ev.get("pid")) and (process_level or _is_int(ev.get("tid"))), (
            f"{where}: pid and tid must be integers"
        )
        assert isinstance(ev.get("args", {}), dict), where
        track = (ev["pid"], ev.get("tid", 0))
        if ph == "M":
            assert ev["name"] in _METADATA, where
            value = ev["args"][_METADATA[ev["name"]]]
            assert _is_int(value) if ev["name"].endswith("sort_index") else isinstance(value, str), where
            if ev["name"] == "thread_name":
                threads[track] = value
            elif ev["name"] == "process_name":
                processes.add(ev["pid"])
            continue
        assert _is_num(ev.get("ts")) and ev["ts"] >= 0, f"{where}: ts must be a number of microseconds"
        assert ev["ts"] >= last_ts.get(track, 0), f"{where}: ts goes back on track {track}"
        last_ts[track] = ev["ts"]
        used.add(track)
        if ph == "X":
            assert _is_num(ev.get("dur")) and ev["dur"] >= 0, f"{where}: X needs a non-negative dur"
        elif ph == "B":
            open_b.setdefault(track, []).append(ev["name"])
        elif ph == "E":
            stack = open_b.get(track)
            assert stack, f"{where}: E without a B"
            assert stack.pop() == ev["name"], f"{where}: E closes another span"
        elif ph in ("i", "I"):
            assert ev.get("s", "t") in ("g", "p", "t"), where
    assert not any(open_b.values()), f"B without E: {open_b}"
    assert used <= set(threads), f"tracks without thread_name: {used - set(threads)}"
    assert {p for p, _ in used} <= processes, "processes without process_name"
    return threads


def _spans(doc: dict[str, Any], threads: dict[tuple[int, int], str], track: str) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X" and threads[e["pid"], e["tid"]] == track]


def test_validator_rejects_what_tools_reject() -> None:
    span = {"name": "a", "ph": "X", "pid": 1, "tid": 2, "ts": 5.0, "dur": 1.0}
    names = [
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 2, "args": {"name": "t"}},
        {"name": "process_name", "ph": "M", "pid": 1, "tid": 2, "args": {"name": "p"}},
    ]
    assert validate_trace(json.dumps({"traceEvents": [*names, span]})) == {(1, 2): "t"}
    bad = [
        ({**span, "tid": "batches"}, "integers"),
        ({**span, "dur": -1.0}, "dur"),
        ({k: v for k, v in span.items() if k != "dur"}, "dur"),
        ({**span, "ts": "5"}, "ts"),
        ({**span, "tid": 3}, "without thread_name"),
        ({**span, "colour": 1}, "not allowed"),
    ]
    for ev, message in bad:
        with pytest.raises(AssertionError, match=message):
            validate_trace(json.dumps({"traceEvents": [*names, ev]}))
    with pytest.raises(AssertionError, match="goes back"):
        validate_trace(json.dumps([*names, span, {**span, "ts": 4.0}]))
    with pytest.raises(AssertionError, match="B without E"):
        validate_trace(json.dumps([*names, {"name": "a", "ph": "B", "pid": 1, "tid": 2, "ts": 1}]))


# ------------------------------------------------------------------ the traces
def test_trace_file_has_worker_tracks_and_consumer_waits(collect, tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    # One batch a task: batches this cheap would otherwise go several to a task, as soon as
    # the workers' first batches showed them cheap (one span per group, tested below).
    loader = aioloader.DataLoader(RangeDataset(24), 4, num_workers=2, trace=path, batches_per_task=1)
    with loader:
        collect(loader)
        pids = set(loader.worker_pids())
    text = path.read_text()
    threads = validate_trace(text)
    doc = json.loads(text)
    batches = _spans(doc, threads, "batches")
    waits = _spans(doc, threads, "consumer")
    # epoch 0's six batches, plus the first of epoch 1 built speculatively at the boundary
    assert sorted(e["name"] for e in batches if e["name"].endswith("epoch 0")) == [
        f"batch {k} of epoch 0" for k in range(6)
    ]
    assert {e["pid"] for e in batches} <= pids
    assert len(waits) == 6 and len({(e["pid"], e["tid"]) for e in waits}) == 1
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert "consumer (main process)" in names and any(n.startswith("worker pid") for n in names)


def test_a_group_of_batches_is_one_span_naming_its_batches(tmp_path: Path) -> None:
    path = tmp_path / "groups.json"
    with aioloader.DataLoader(
        RangeDataset(16), 4, num_workers=1, prefetch=4, batches_per_task=2, prefetch_next_epoch=False, trace=path
    ) as loader:
        assert [y.tolist() for _, y in loader] == [list(range(k, k + 4)) for k in range(0, 16, 4)]
    threads = validate_trace(path.read_text())
    names = sorted(e["name"] for e in _spans(json.loads(path.read_text()), threads, "batches"))
    assert names == ["the group of batches 0-1 of epoch 0", "the group of batches 2-3 of epoch 0"]


def test_stream_trace_is_valid(collect, tmp_path: Path) -> None:
    path = tmp_path / "stream.json"
    with StreamLoader(list(range(10)), square, batch_size=4, num_workers=2, trace=path) as stream:
        got = collect(stream)
    assert len(got) == 3
    text = path.read_text()
    threads = validate_trace(text)
    doc = json.loads(text)
    assert len(_spans(doc, threads, "batches")) == 3
    assert len(_spans(doc, threads, "consumer")) == 3


def test_in_process_batches_and_waits_get_their_own_tracks(tmp_path: Path) -> None:
    # num_workers=0: batches are built in the main process, beside the consumer's waits
    with aioloader.DataLoader(RangeDataset(12), 4, num_workers=0, trace=tmp_path / "t.json") as loader:
        list(loader)
    threads = validate_trace((tmp_path / "t.json").read_text())
    assert sorted(threads.values()) == ["batches", "consumer"]
    assert len({pid for pid, _ in threads}) == 1


def test_overlapping_spans_of_a_track_are_spread_over_tracks(tmp_path: Path) -> None:
    tracer = Tracer(tmp_path / "t.json")
    tracer.span("late", 7, "batches", 3_000, 9_000)  # recorded before one that started earlier
    tracer.span("a", 7, "batches", 1_000, 5_000)
    tracer.span("b", 7, "batches", 5_000, 6_000)  # starts as "a" ends: same track
    threads = validate_trace(tracer.write().read_text())
    assert sorted(threads.values()) == ["batches", "batches (2)"]
    spans = {e["name"]: e for e in tracer.events() if e["ph"] == "X"}
    assert spans["a"]["tid"] == spans["b"]["tid"] != spans["late"]["tid"]
    assert (spans["a"]["ts"], spans["a"]["dur"]) == (1.0, 4.0)  # microseconds


def test_tracing_context_manager_covers_only_its_block(tmp_path: Path) -> None:
    # (no speculative prefetch: it would build epoch 1's first batch before the block; one
    # batch a task, so that each batch has a span of its own)
    with aioloader.DataLoader(
        RangeDataset(12), 4, num_workers=1, prefetch_next_epoch=False, batches_per_task=1
    ) as loader:
        list(loader)
        with loader.tracing(tmp_path / "second.json"):
            list(loader)
        list(loader)
    text = (tmp_path / "second.json").read_text()
    threads = validate_trace(text)
    epochs = {e["name"] for e in _spans(json.loads(text), threads, "batches")}
    assert epochs == {f"batch {k} of epoch 1" for k in range(3)}


# ------------------------------------------------------------------ statistics
def test_stats_epoch_boundary_and_stall() -> None:
    async def main() -> aioloader.LoaderStats:
        async with aioloader.DataLoader(
            SlowDataset(32, 0.001), 4, num_workers=2, shuffle=True, seed=0
        ) as loader:
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
    assert st.active_s > 0 and st.batches_per_s == pytest.approx(24 / st.active_s)


def _lines(st: aioloader.LoaderStats) -> dict[str, str]:
    text = str(st)
    lines = text.splitlines()
    assert 1 < len(lines) <= 20 and all(len(line) <= 100 for line in lines), text
    return {line.strip().split(":")[0]: line for line in lines}


def test_printed_stats_name_the_counts(collect: Callable[..., list[Any]]) -> None:
    # two of the three batches per epoch survive; six samples a pass are skipped
    ds = FailingDataset(12, {1, 2, 8, 9, 10, 11})
    with aioloader.DataLoader(ds, 4, num_workers=1, on_error="skip") as loader:
        empty = _lines(loader.stats())
        for _ in range(2):
            collect(loader)
        st = loader.stats()
    assert empty["Loader"].startswith("Loader: 0 batches, 0 samples, 0 epochs")
    assert "- batches/s, - samples/s" in empty["throughput"] and empty["first batch ms by epoch"].endswith(
        ": -"
    )
    by = _lines(st)
    assert by["Loader"].startswith("Loader: 4 batches, 12 samples, 2 epochs, ")
    assert f"{st.batches_per_s:,.1f} batches/s, {st.samples_per_s:,.1f} samples/s" in by["throughput"]
    assert by["first batch ms by epoch"].count(": ") == 3 and " 1: " in by["first batch ms by epoch"]
    assert "retries 0, pool restarts 0, skipped samples 12" in by
    for key in ("consumer stalled", "batch latency ms p50/p99", "workers busy"):
        assert key in by
    assert repr(st).startswith("LoaderStats(batches=4, samples=12, ") and "skipped=12" in repr(st)


def test_printed_stats_stay_short_after_many_epochs() -> None:
    with aioloader.DataLoader(RangeDataset(4), 2, num_workers=0) as loader:
        for _ in range(12):
            list(loader)
        st = loader.stats()
    by = _lines(st)
    assert by["Loader"].startswith("Loader: 24 batches, 48 samples, 12 epochs")
    firsts = by["first batch ms by epoch"]
    assert firsts.count(": ") == 6 and " 11: " in firsts and firsts.endswith("(last 5 of 12 epochs)")
    assert "<10 more>" in repr(st) and len(repr(st)) < 1000


def test_work_left_by_an_event_loop_that_closed_is_not_counted_in_flight() -> None:
    # Each asyncio.run() ends while the run has gone on into the next epoch (up to
    # `prefetch` batches in flight); that loop is gone, and so is its work.
    async def epoch(loader: aioloader.DataLoader[Any]) -> int:
        return sum([1 async for _ in loader])

    with aioloader.DataLoader(RangeDataset(40), 4, num_workers=2, prefetch=4, batches_per_task=1) as loader:
        for _ in range(3):
            assert asyncio.run(epoch(loader)) == 10
            assert loader.stats().in_flight <= loader.prefetch
