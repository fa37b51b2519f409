"""Large numpy arrays in a loader's payload reach the workers through one shared-memory
segment that every worker (and every respawned worker) maps, instead of a private copy
each. Memory is read from /proc, never inferred."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioloader
from aioloader import DataLoader, ShmFallbackWarning, StreamLoader, _shm

from . import _array_datasets as A
from .conftest import descendants, wait_until
from .test_shm import _stop_orphans

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm and /proc (Linux)")


def _one_segment() -> str:
    names = A.segment_names(os.getpid())
    assert len(names) == 1, names
    return names[0]


def _collect(loader: Any, mode: str) -> list[Any]:
    if mode == "for":
        return list(loader)

    async def main() -> list[Any]:
        return [b async for b in loader]

    return asyncio.run(main())


@pytest.mark.parametrize("mode", ["for", "async-for"])
def test_workers_map_one_copy_of_the_array(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Workers started afresh: a zygote forked earlier in this process would give each a
    # shared copy of that moment's heap, which its Pss_Anon counts too.
    monkeypatch.setenv("AIOLOADER_FORKSERVER", "spawn")
    ds = A.ArrayDataset(64, n=16)
    expected = int(ds.data.sum())
    with DataLoader(ds, batch_size=1, num_workers=2) as loader:
        batches = _collect(loader, mode)
        assert sorted(int(b[0][0]) for b in batches) == list(range(16))
        assert {int(b[0][1]) for b in batches} == {expected}
        name = _one_segment()
        st = loader.stats()
        assert st.shared_bytes >= 64 * MIB and st.payload_bytes < MIB, st
        assert "MiB shared" in str(st)
        workers = loader.worker_pids()
        used = {int(b[0][2]) for b in batches}
        assert used <= set(workers)
        for pid in used:  # each read the whole array through the segment
            m = A.mapping_of(pid, name)
            assert m["Rss"] >= 64 * MIB, m
            # the pages are the segment's: nothing private, and shared by every mapper
            assert m["Private_Dirty"] == 0 and m["Private_Clean"] == 0, m
            assert m["Pss"] <= m["Rss"] // len(workers) + MIB, m
            # and no private copy of the array elsewhere in the worker (a fresh
            # interpreter's own heap is some tens of MiB)
            assert A.rollup(pid).get("Pss_Anon", 0) < 48 * MIB
    assert not A.segment_names(os.getpid())


def test_the_consumers_own_copy_becomes_the_shared_one() -> None:
    # An array of 32 MiB or more that numpy allocated is adopted: its pages are replaced
    # in place by a copy-on-write mapping of the segment, so the consumer holds no second
    # copy either. Same object, same address, same values; its writes stay its own.
    # 80 MiB: glibc then always maps the array on its own (a smaller one may come from
    # the heap's free top, which holds up to 64 MiB after earlier tests, and is not adopted).
    ds = A.ArrayDataset(80, n=4)
    address, expected = ds.data.ctypes.data, int(ds.data.sum())
    private_before = A.rollup(os.getpid())["Private_Dirty"]
    with DataLoader(ds, batch_size=1, num_workers=2, prefetch_next_epoch=False) as loader:
        assert {int(b[0][1]) for b in loader} == {expected}
        name = _one_segment()
        assert ds.data.ctypes.data == address and int(ds.data.sum()) == expected
        mine = A.mapping_of(os.getpid(), name)
        assert mine["Size"] >= 80 * MIB - 2 * 4096, mine  # all but the partial end pages
        assert mine["Private_Dirty"] == 0, mine  # read, not copied
        # the 80 MiB it held privately went back (read the same way, from /proc)
        assert A.rollup(os.getpid())["Private_Dirty"] < private_before - 70 * MIB
        ds.data[1_000_000] = -5  # a write in the consumer: one private page
        assert A.mapping_of(os.getpid(), name)["Private_Dirty"] == 4096
        assert {int(b[0][1]) for b in loader} == {expected}  # the workers still see the original
    assert not A.segment_names(os.getpid())
    assert int(ds.data[1_000_000]) == -5 and int(ds.data.sum()) == expected - 1_000_000 - 5
    del ds, loader
    gc.collect()
    with open("/proc/self/maps") as f:
        assert name not in f.read()  # freed with the array


def test_without_sharing_every_worker_holds_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    # The comparison the test above stands against, and the switch it documents.
    monkeypatch.setenv("AIOLOADER_SHARE_ARRAYS", "0")
    with DataLoader(A.ArrayDataset(16, n=8), batch_size=1, num_workers=2) as loader:
        used = {int(b[0][2]) for b in loader}
        assert not A.segment_names(os.getpid())
        assert loader.stats().shared_bytes == 0 and loader.stats().payload_bytes >= 16 * MIB
        for pid in used:
            assert A.rollup(pid)["Pss_Anon"] >= 16 * MIB


def test_writes_stay_in_the_worker_that_makes_them() -> None:
    # Copy-on-write, as with fork: a worker's write is its own, the consumer's array and
    # the other workers' views keep the values the loader was created with.
    ds = A.WritingDataset(4, n=12)
    before = ds.data.copy()
    with DataLoader(ds, batch_size=1, num_workers=2, prefetch_next_epoch=False) as loader:
        rows = [b[0].tolist() for b in loader]
        _one_segment()
    assert all(value == -1 for *_, value in rows)
    counts: dict[int, list[int]] = {}
    for _i, minus_ones, pid, _value in rows:
        counts.setdefault(pid, []).append(minus_ones)
    for pid, seen in counts.items():  # its k samples saw 1, 2, ..., k writes: its own
        assert sorted(seen) == list(range(1, len(seen) + 1)), (pid, seen)
    np.testing.assert_array_equal(ds.data, before)


def test_a_respawned_worker_maps_the_same_segment(tmp_path: Path) -> None:
    ds = A.DieOnceDataset(4, 8, str(tmp_path / "died"), victim=5)
    with DataLoader(ds, batch_size=1, num_workers=2) as loader:
        first = loader.worker_pids()  # empty until the pool starts
        rows = [b[0] for b in loader]
        assert sorted(int(r[0]) for r in rows) == list(range(8))
        assert (tmp_path / "died").exists() and loader.stats().restarts == 1
        name = _one_segment()
        now = loader.worker_pids()
        assert now and not set(now) & set(first)
        # The replacement may still be starting when the epoch ends (the other worker
        # built the rest): it maps the segment as it loads the payload.
        for pid in now:
            wait_until(lambda p=pid: bool(A.mapping_of(p, name)), 30.0, f"worker {pid} to map {name}")
    assert not A.segment_names(os.getpid())


def test_segment_goes_with_the_loader_even_when_dropped() -> None:
    loader = DataLoader(A.ArrayDataset(2, n=2), batch_size=1, num_workers=1)
    assert len(list(loader)) == 2
    assert len(A.segment_names(os.getpid())) == 1
    del loader
    gc.collect()
    assert not A.segment_names(os.getpid())


def test_small_arrays_and_in_process_loaders_make_no_segment() -> None:
    small = A.ArrayDataset(0, n=2)
    small.data = np.arange(1000)  # under the 1 MiB threshold: pickled with the rest
    with DataLoader(small, batch_size=1, num_workers=1) as loader:
        assert len(list(loader)) == 2
        assert not A.segment_names(os.getpid())
    for kw in ({"num_workers": 0}, {"executor": ThreadPoolExecutor(1)}):
        with DataLoader(A.ArrayDataset(2, n=2), batch_size=1, **kw) as loader:
            assert len(list(loader)) == 2
            assert not A.segment_names(os.getpid())
        if "executor" in kw:
            kw["executor"].shutdown()


def test_too_little_room_falls_back_to_copies_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_shm, "capacity_override", MIB)  # the array needs 4 MiB
    monkeypatch.setattr(aioloader._shm._dataseg, "_warned", type(aioloader._shm._dataseg._warned)())
    ds = A.ArrayDataset(4, n=4)
    with pytest.warns(ShmFallbackWarning, match="large arrays could not be put in shared memory"):
        with DataLoader(ds, batch_size=1, num_workers=1) as loader:
            assert {int(b[0][1]) for b in loader} == {int(ds.data.sum())}
            assert not A.segment_names(os.getpid())


def test_a_streams_fn_shares_its_arrays_too() -> None:
    import functools

    table = np.arange(2 * MIB // 8, dtype=np.int64) * 3
    fn = functools.partial(A.add_array, table=table)
    with StreamLoader(range(6), fn, batch_size=2, num_workers=1) as stream:
        _one_segment()
        assert sorted(x for b in stream for x in b) == [0, 3, 6, 9, 12, 15]
    assert not A.segment_names(os.getpid())


def test_a_killed_consumer_leaves_no_segment(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with open(tmp_path / "stderr", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", A.CONSUMER_SCRIPT],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    helpers: set[int] = set()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the consumer is ready: its workers mapped the segment
        assert line.strip(), (tmp_path / "stderr").read_text()
        workers = {int(p) for p in line.split()}
        names = A.segment_names(proc.pid)
        assert len(names) == 1
        helpers = descendants(proc.pid)
        assert workers <= helpers
        proc.kill()
        proc.wait()
        # each orphaned worker unlinks the segment from its orphan watch, then exits
        wait_until(lambda: not A.segment_names(proc.pid), 20.0, "the orphaned workers to unlink the segment")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _stop_orphans(helpers)
        if proc.stdin is not None:
            proc.stdin.close()
        if proc.stdout is not None:
            proc.stdout.close()
