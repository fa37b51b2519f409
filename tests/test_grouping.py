"""Several batches in one pool task (``batches_per_task``): invisible to the user.

Grouped or not, the batches are the same values in the same order, an error fails only
its own batch, a worker death charges only the batch that killed it, and stats say what
was chosen. ``batches_per_task=1`` (one batch a task, as before grouping) is the oracle.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
from typing import Any

import numpy as np
import pytest

import aioloader
from aioloader._engine.group import GROWTH, MAX_GROUP, TARGET_NS, WINDOW_BUDGET, GroupPolicy, policy_for
from aioloader._pool import WorkerPool

from ._datasets import AugmentedDataset, CrashDataset, FailingDataset, HangDataset, RangeDataset
from ._shm_datasets import shm_backed


def as_bytes(batches: list[Any]) -> list[bytes]:
    return [np.asarray(b[0]).tobytes() + np.asarray(b[1]).tobytes() for b in batches]


def loader(ds: Any, per_task: Any, **kw: Any) -> aioloader.DataLoader[Any]:
    kw = {"num_workers": 2, "prefetch": 6, "seed": 7, "shuffle": True, **kw}
    return aioloader.DataLoader(ds, 4, batches_per_task=per_task, **kw)


@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "unordered"])
def test_grouped_batches_are_the_batches_of_one_batch_tasks(collect: Any, ordered: bool) -> None:
    ds = AugmentedDataset(90)  # draws from random, numpy and sample_rng in every sample
    with loader(ds, 1, ordered=ordered) as one:
        want = [as_bytes(collect(one)) for _ in range(2)]
    with loader(ds, 3, ordered=ordered) as grouped:
        got = [as_bytes(collect(grouped)) for _ in range(2)]
        stats = grouped.stats()
    if ordered:
        assert got == want
    else:
        assert [sorted(e) for e in got] == [sorted(e) for e in want]
    assert stats.batches_per_task == 3 and "fixed at 3" in stats.grouping
    # 23 batches an epoch: most tasks held three (a group ends early only where the
    # producer had fewer ready: the first units, an epoch's end)
    assert stats.batches == 46 and stats.tasks < 30


def test_a_batch_that_raises_in_a_group_fails_alone(collect: Any) -> None:
    ds = FailingDataset(40, bad={21})
    with loader(ds, 4, shuffle=False) as grouped:
        with pytest.raises(KeyError, match="sample 21 is bad") as info:
            collect(grouped)
    notes = "\n".join(info.value.__notes__)
    assert "dataset[21] (sample index 21)" in notes and "batch 5 of epoch 0" in notes
    # every batch before it in the order arrives first (batches 4 and 6 shared its task)
    with loader(ds, 4, shuffle=False) as grouped:
        got = []
        with pytest.raises(KeyError):
            for batch in grouped:
                got.append(batch[1].tolist())
    assert got == [list(range(4 * k, 4 * k + 4)) for k in range(5)]


def test_a_worker_dying_in_a_group_charges_only_the_batch_that_killed_it(tmp_path: Any) -> None:
    # Sample 13 kills its worker every time. Its group is resubmitted one batch a task,
    # and only batch 3 (samples 12-15) is charged: with max_retries=0 it fails after
    # its first death of its own, named alone.
    ds = CrashDataset(40, {13}, str(tmp_path), always=True)
    with loader(ds, 4, shuffle=False, max_retries=0) as grouped:
        with pytest.raises(aioloader.WorkerCrashedError, match="batch 3 of epoch 0") as info:
            list(grouped)
    assert info.value.indices == [12, 13, 14, 15]
    assert info.value.attempts == 1


def test_a_worker_killed_once_in_a_group_loses_nothing(collect: Any, tmp_path: Any) -> None:
    ds = CrashDataset(60, {30}, str(tmp_path))  # dies the first time only
    with loader(RangeDataset(60), 1, shuffle=False) as one:
        want = as_bytes(collect(one))
    # No speculative next epoch: its loads could reach the crash-once sample first.
    with loader(ds, 3, shuffle=False, max_retries=1, prefetch_next_epoch=False) as grouped:
        assert as_bytes(collect(grouped)) == want
        assert grouped.stats().restarts == 1


def test_a_group_over_its_timeout_runs_again_and_names_the_batch_that_overran() -> None:
    ds = HangDataset(40, hang_at=9)  # blocks until its worker is killed, every time
    got = []
    with loader(ds, 4, shuffle=False, timeout=1.0) as grouped:
        with pytest.raises(aioloader.LoaderTimeout, match="batch 2 of epoch 0") as info:
            for batch in grouped:
                got.append(batch[1].tolist())
    assert info.value.indices == [8, 9, 10, 11]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7]]  # built in its group, delivered before it


def test_a_borrowed_executor_gets_groups_with_the_dataset(collect: Any) -> None:
    ds = AugmentedDataset(50)
    with loader(ds, 1) as one:
        want = as_bytes(collect(one))
    with cf.ProcessPoolExecutor(2) as ex:
        # The executor's workers have not seen the loader: the first group comes back
        # asking for the dataset and is sent again with it.
        with aioloader.DataLoader(
            ds, 4, shuffle=True, seed=7, prefetch=6, executor=ex, batches_per_task=3
        ) as g:
            assert as_bytes(collect(g)) == want
            assert g.stats().retries >= 1


def test_auto_groups_cheap_batches_and_leaves_costly_ones_alone() -> None:
    policy = GroupPolicy(None, window=8, workers=2)
    assert policy.size == 1  # nothing measured yet
    policy.observe(1, TARGET_NS // 10)  # a tenth of the target a batch: group to the limit
    assert policy.size == 4 == policy.limit
    for _ in range(40):  # batches became costly: back to one a task
        policy.observe(2, 2 * 3 * TARGET_NS)
    assert policy.size == 1
    assert "auto, at most 4" in policy.describe()
    fixed = GroupPolicy(3, window=8)
    fixed.observe(1, 100 * TARGET_NS)
    assert fixed.size == 3


def test_where_grouping_applies_and_its_argument_is_checked() -> None:
    with WorkerPool(2) as procs, WorkerPool(0) as thread:
        auto = policy_for("auto", 8, procs, False)
        assert auto is not None and auto.limit == 4  # prefetch // workers: each has work
        assert policy_for(3, 8, procs, False) is not None
        assert policy_for(1, 8, procs, False) is None
        assert policy_for("auto", 8, thread, False) is None  # a thread has no IPC to spare
        with cf.ThreadPoolExecutor(2) as ex, WorkerPool(executor=ex) as borrowed:
            assert policy_for("auto", 8, borrowed, False) is None
        assert policy_for("auto", 8, procs, True) is None  # fetch= dispatches per batch
        for bad in (0, -1, True, 2.0, "always"):
            with pytest.raises(ValueError, match="batches_per_task"):
                policy_for(bad, 8, procs, False)
    with pytest.raises(ValueError, match="batches_per_task"):
        aioloader.DataLoader(AugmentedDataset(4), 2, batches_per_task=0)


def test_breaking_out_of_a_grouped_epoch_releases_everything(collect: Any) -> None:
    with loader(AugmentedDataset(200), 3) as grouped:
        assert len(collect(grouped, limit=3)) == 3
        assert len(collect(grouped)) == 50  # the next pass is whole
        assert grouped.stats().in_flight <= grouped.prefetch


def test_a_growing_window_grows_for_cheap_batches_only() -> None:
    cheap = GroupPolicy(None, window=4, workers=2, grow=True)
    cheap.observe(1, TARGET_NS // 20)  # 20 such batches make one target-long task
    assert cheap.window == 4  # no batch weighed yet: their size is unknown, the window waits
    cheap.observe_bytes(1024)
    cheap.observe(1, TARGET_NS // 20)
    assert (cheap.window, cheap.size) == (4 * GROWTH, MAX_GROUP)  # two groups of 16 a worker
    cheap.observe_bytes(WINDOW_BUDGET // 6)  # big batches: the byte budget caps the window
    cheap.observe(1, TARGET_NS // 20)
    assert cheap.window == 6 and cheap.size == 3
    cheap.observe_bytes(WINDOW_BUDGET)  # one batch fills the budget: back to where it began
    cheap.observe(1, TARGET_NS // 20)
    assert cheap.window == 4
    costly = GroupPolicy(None, window=4, workers=2, grow=True)
    costly.observe(1, 10 * TARGET_NS)
    assert (costly.window, costly.size) == (4, 1)
    assert not GroupPolicy(3, window=4, grow=True).grow  # a fixed size keeps the window


@pytest.mark.parametrize("prefetch", [None, "auto"], ids=["default", "auto"])
def test_a_growing_window_delivers_the_batches_of_a_fixed_one(collect: Any, prefetch: Any) -> None:
    ds = AugmentedDataset(400)
    with loader(ds, 1, prefetch=4) as fixed:
        want = [as_bytes(collect(fixed)) for _ in range(2)]
        assert fixed.stats().window_note == ""  # an int fixes the window
    with loader(ds, "auto", prefetch=prefetch) as auto:
        got = [as_bytes(collect(auto)) for _ in range(2)]
        stats = auto.stats()
    assert got == want
    assert auto.prefetch == 4 <= stats.window <= 4 * GROWTH
    assert stats.in_flight <= 4 * GROWTH  # a window that shrank lets what is in flight finish
    assert f"{stats.window} batches (from 4, grows while batches are cheap)" == stats.window_note
    assert f"window: {stats.window_note}" in str(stats)


class SameArray:
    """``n`` samples that are one array of ``nbytes``, made once a worker: each costs its
    worker next to nothing, however large."""

    def __init__(self, n: int, nbytes: int) -> None:
        self.n, self.nbytes = n, nbytes
        self.array: np.ndarray | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if self.array is None:
            self.array = np.zeros(self.nbytes, np.uint8)
        return self.array

    def __getstate__(self) -> dict[str, Any]:
        return {"n": self.n, "nbytes": self.nbytes, "array": None}


def only(samples: list[Any]) -> Any:
    return samples[0]


def each_batch(dl: Any, face: str, look: Any) -> None:
    """Call ``look(batch)`` on each batch of an epoch, through ``for`` or ``async for``:
    the loader's stats are read while it runs."""
    if face == "for":
        for b in dl:
            look(b)
        return

    async def main() -> None:
        async for b in dl:
            look(b)

    asyncio.run(main())


@pytest.mark.parametrize("face", ["for", "async-for"])
@pytest.mark.parametrize("nbytes", [1 << 10, 8 << 20], ids=["1KiB", "8MiB"])
def test_the_default_window_is_bounded_in_batches_and_in_bytes(face: str, nbytes: int) -> None:
    # Batches that cost nothing: the cost alone would grow the window to its most, 16x.
    # Small ones get there; 8 MiB ones stop at the 64 MiB budget (8 of them), and never
    # pass it: the window does not grow before the first batch was weighed.
    seen: list[tuple[int, int]] = []  # (window, in flight) after each batch
    with aioloader.DataLoader(
        SameArray(64, nbytes), 1, num_workers=2, collate_fn=only, transport="pickle"
    ) as dl:

        def look(batch: np.ndarray) -> None:
            assert batch.nbytes == nbytes
            st = dl.stats()
            seen.append((st.window, st.in_flight))

        each_batch(dl, face, look)
        assert dl.prefetch == 4 and len(seen) == 64
    most = 4 * GROWTH if nbytes < WINDOW_BUDGET // (4 * GROWTH) else WINDOW_BUDGET // nbytes
    assert max(w for w, _ in seen) == most
    assert max(f for _, f in seen) <= most  # in flight: submitted, running or not yet taken


@pytest.mark.parametrize("face", ["for", "async-for"])
def test_a_grown_window_keeps_its_batches_in_shared_memory(face: str) -> None:
    # Cheap 256 KiB batches grow the window past 10, the slabs a worker of a window of 4
    # has (2 * 4 + 2): a worker may then hold more batches than that, and none is pickled.
    shared: list[bool] = []
    windows: list[int] = []
    with aioloader.DataLoader(SameArray(400, 256 << 10), 1, num_workers=2, collate_fn=only) as dl:

        def look(batch: np.ndarray) -> None:
            shared.append(shm_backed(batch))
            windows.append(dl.stats().window)

        each_batch(dl, face, look)
    assert len(shared) == 400 and max(windows) > 2 * 4 + 2, max(windows)
    assert all(shared), f"{shared.count(False)} of 400 batches were pickled"


def test_shared_memory_room_counts_the_window_a_growing_one_may_reach() -> None:
    from aioloader._shm._names import ShmConfig

    fixed = ShmConfig(consumer_pid=1, host=("h", 0, 0, 0), window=5, max_slabs=10)
    grows = ShmConfig(
        consumer_pid=1, host=("h", 0, 0, 0), window=5, max_slabs=130, grown=64, grown_bytes=64 << 20
    )
    assert [fixed.window_for(c) for c in (1 << 20, 8 << 20)] == [5, 5]
    assert grows.window_for(512 << 10) == 65  # small batches: the whole grown window
    assert grows.window_for(8 << 20) == 9  # 8 MiB: as far as 64 MiB lets it grow, plus one
    assert grows.window_for(32 << 20) == 5  # never below the start
