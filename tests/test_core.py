"""The core loader: batches, order, persistence of the pool, the in-flight bound,
the two faces of iteration, lifecycle."""

from __future__ import annotations

import asyncio
import collections
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioloader
from aioloader._plan.sampler import epoch_permutation

from ._datasets import PidDataset, RangeDataset, RecordingDataset
from .conftest import descendant_workers, oversubscribed, wait_until, wait_until_async


def reference_epochs(
    n: int, bs: int, shuffle: bool, last_batch: str, seed: int, epochs: int
) -> list[list[list[int]]]:
    """An independent, single-process statement of what each epoch must contain."""
    carry: list[int] = []
    out = []
    for e in range(epochs):
        order = [int(i) for i in epoch_permutation(n, seed, e)] if shuffle else list(range(n))
        order = carry + order
        carry = []
        batches = [order[k : k + bs] for k in range(0, len(order), bs)]
        if batches and len(batches[-1]) < bs:
            if last_batch == "discard":
                batches.pop()
            elif last_batch == "rollover":
                carry = batches.pop()
        out.append(batches)
    return out


def check_batch(batch: Any, indices: list[int]) -> None:
    arrays, idx = batch
    assert idx.tolist() == indices
    expected = np.array([[i, 2 * i, 3 * i] for i in indices], dtype=np.float32)
    np.testing.assert_array_equal(arrays, expected)
    assert arrays.dtype == np.float32


@pytest.mark.parametrize("num_workers", [0, 1, 2], ids=lambda n: f"workers={n}")
@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "unordered"])
@pytest.mark.parametrize("last_batch", ["keep", "discard", "rollover"])
@pytest.mark.parametrize("shuffle", [False, True], ids=["seq", "shuffle"])
def test_batches_match_reference(collect, num_workers, ordered, last_batch, shuffle) -> None:
    n, bs, seed = 23, 4, 7
    expected = reference_epochs(n, bs, shuffle, last_batch, seed, epochs=2)
    with aioloader.DataLoader(
        RangeDataset(n),
        bs,
        shuffle=shuffle,
        last_batch=last_batch,
        num_workers=num_workers,
        ordered=ordered,
        seed=seed,
    ) as loader:
        for epoch in range(2):
            assert len(loader) == len(expected[epoch])
            got = collect(loader)
            if ordered:
                assert len(got) == len(expected[epoch])
                for batch, indices in zip(got, expected[epoch], strict=True):
                    check_batch(batch, indices)
            else:
                as_lists = sorted(b[1].tolist() for b in got)
                assert as_lists == sorted(expected[epoch])
                for batch in got:
                    check_batch(batch, batch[1].tolist())


@pytest.mark.parametrize("num_workers", [0, 2], ids=lambda n: f"workers={n}")
@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "unordered"])
def test_batch_sampler_matches_reference(collect, num_workers, ordered) -> None:
    plan = [[5, 1], [2, 2, 9], [0], [7, 8, 3, 4]]
    with aioloader.DataLoader(
        RangeDataset(10), batch_sampler=plan, num_workers=num_workers, ordered=ordered
    ) as loader:
        got = collect(loader)
    if ordered:
        for batch, indices in zip(got, plan, strict=True):
            check_batch(batch, indices)
    else:
        assert sorted(b[1].tolist() for b in got) == sorted(plan)


def test_zero_workers_equals_workers_with_shuffle_and_sampler() -> None:
    results = []
    for nw in (0, 2):
        with aioloader.DataLoader(RangeDataset(50), 8, shuffle=True, seed=3, num_workers=nw) as loader:
            results.append([[b[1].tolist() for b in loader] for _ in range(3)])
    assert results[0] == results[1]
    # different epochs really are shuffled differently
    assert results[0][0] != results[0][1]


def test_custom_sampler_gets_set_epoch(collect) -> None:
    class EpochSampler:
        def __init__(self) -> None:
            self.epochs: list[int] = []

        def set_epoch(self, e: int) -> None:
            self.epochs.append(e)

        def __iter__(self):
            return iter(range(9, -1, -1))

        def __len__(self) -> int:
            return 10

    sampler = EpochSampler()
    with aioloader.DataLoader(RangeDataset(10), 3, sampler=sampler) as loader:
        first = collect(loader)
        collect(loader)
    assert sampler.epochs == [0, 1]
    assert [b[1].tolist() for b in first] == [[9, 8, 7], [6, 5, 4], [3, 2, 1], [0]]


def test_worker_pids_persist_across_epochs_and_iterators() -> None:
    with aioloader.DataLoader(PidDataset(64), 4, num_workers=2, shuffle=True, seed=1) as loader:
        pool_pids = []
        sample_pids: set[int] = set()
        for _ in range(3):
            for pids, _idx in loader:
                sample_pids.update(pids.tolist())
            pool_pids.append(loader.worker_pids())
        # two iterators alive at once
        it1, it2 = iter(loader), iter(loader)
        a, b = next(it1), next(it2)
        rest1, rest2 = list(it1), list(it2)
        for pids, _idx in [a, b, *rest1, *rest2]:
            sample_pids.update(pids.tolist())
        pool_pids.append(loader.worker_pids())

        async def one_async_epoch() -> None:
            async for pids, _idx in loader:
                sample_pids.update(pids.tolist())

        asyncio.run(one_async_epoch())
        pool_pids.append(loader.worker_pids())
        assert len(rest1) + 1 == len(loader) and len(rest2) + 1 == len(loader)
    assert len(pool_pids[0]) == 2
    assert all(p == pool_pids[0] for p in pool_pids), pool_pids
    assert sample_pids <= set(pool_pids[0])
    assert os.getpid() not in sample_pids


def test_the_pool_starts_exactly_num_workers_processes() -> None:
    # Every worker starts at once, however quick the first tasks are, and no more.
    for _ in range(3):
        with oversubscribed(4):  # more than this machine may have: torch's warning then
            loader = aioloader.DataLoader(PidDataset(24), 1, num_workers=4)
        with loader:
            seen = {int(b[0][0]) for b in loader}
            pids = loader.worker_pids()
            assert len(pids) == 4 and seen <= set(pids)
            assert descendant_workers() == set(pids)


@pytest.mark.parametrize("prefetch", [1, 3])
def test_in_flight_bound_recorded_in_workers(collect, tmp_path: Path, prefetch: int) -> None:
    """Batches fetched (seen from inside the workers) minus batches taken never exceed
    ``prefetch``: the consumer waits until the workers have done all they are allowed to,
    then checks they did not do more."""
    n, bs = 40, 4
    log = tmp_path / "fetched.log"
    log.touch()

    def fetched_batches() -> int:
        lines = log.read_text().splitlines()
        return len({int(line.split()[0]) // bs for line in lines})

    total = n // bs
    seen: list[int] = []

    with aioloader.DataLoader(RecordingDataset(n, str(log)), bs, num_workers=2, prefetch=prefetch) as loader:
        it = iter(loader)  # the epoch starts at the first next()
        for taken in range(1, total + 1):
            next(it)
            bound = min(taken + prefetch, total)
            wait_until(lambda b=bound: fetched_batches() >= b, 20.0, f"{bound} batches fetched")
            seen.append(fetched_batches())
            assert fetched_batches() <= bound, (taken, fetched_batches(), bound)
        with pytest.raises(StopIteration):
            next(it)
    assert seen == [min(t + prefetch, total) for t in range(1, total + 1)]


def test_in_flight_bound_async(tmp_path: Path) -> None:
    n, bs, prefetch = 24, 3, 2
    log = tmp_path / "fetched.log"
    log.touch()

    def fetched_batches() -> int:
        return len({int(line.split()[0]) // bs for line in log.read_text().splitlines()})

    async def main() -> list[int]:
        seen = []
        async with aioloader.DataLoader(
            RecordingDataset(n, str(log)), bs, num_workers=2, prefetch=prefetch
        ) as loader:
            agen = loader.__aiter__()
            total = n // bs
            for taken in range(1, total + 1):
                await agen.__anext__()  # an async generator starts on its first __anext__
                bound = min(taken + prefetch, total)
                await wait_until_async(lambda b=bound: fetched_batches() >= b, 20, f"{bound} batches fetched")
                seen.append(fetched_batches())
            await agen.aclose()
        return seen

    seen = asyncio.run(main())
    assert seen == [min(t + prefetch, n // bs) for t in range(1, n // bs + 1)]


class _Gate:
    """Lets code that must run off the event loop's thread wait until the loop has turned
    while it waited. Code that ran on the loop's thread would wait for ever (here: 20 s,
    then it raises), because the loop could not turn: no timing is measured."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()

    def pass_through(self, where: str) -> None:
        self.entered.set()
        if not self.opened.wait(20):
            raise AssertionError(
                f"{where} ran on the event loop's thread: the loop never turned while it waited"
            )

    async def open_when_entered(self) -> None:
        await wait_until_async(self.entered.is_set, 20, "the code off the loop to enter the gate")
        self.opened.set()


_GATES: dict[str, _Gate] = {}


class GatedDataset(RangeDataset):
    """Pickling it (the payload, in the consumer) and reading sample 0 in the consumer's
    process (``num_workers=0``) pass through the gate named ``key``."""

    def __init__(self, n: int, key: str) -> None:
        super().__init__(n)
        self.key = key

    def __getstate__(self) -> dict[str, Any]:
        gate = _GATES.get(self.key)
        if gate is not None:
            gate.pass_through("pickling the dataset")
        return dict(self.__dict__)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        gate = _GATES.get(self.key) if i == 0 else None
        if gate is not None:
            gate.pass_through("dataset[0]")
        return super().__getitem__(i)


def _consume_beside_gate(key: str, num_workers: int) -> int:
    gate = _GATES[key] = _Gate()

    async def main() -> int:
        opener = asyncio.create_task(gate.open_when_entered())
        count = 0
        try:
            async with aioloader.DataLoader(
                GatedDataset(48, key), 8, num_workers=num_workers, seed=0
            ) as loader:
                for _ in range(2):
                    async for _batch in loader:
                        count += 1
        finally:
            opener.cancel()
        assert gate.opened.is_set()  # the gated step ran, and the loop turned meanwhile
        return count

    try:
        return asyncio.run(main())
    finally:
        del _GATES[key]


def test_async_for_never_blocks_the_loop() -> None:
    """The slow steps of the first iteration (pickling the dataset for the workers,
    starting them) run off the caller's loop: it keeps turning while the dataset is
    being pickled."""
    assert _consume_beside_gate("workers", num_workers=2) == 12


def test_zero_workers_async_runs_off_the_loop() -> None:
    """With ``num_workers=0`` the samples are read in the loader's thread, not on the
    caller's loop."""
    assert _consume_beside_gate("thread", num_workers=0) == 12


def test_sync_iteration_inside_running_loop(collect) -> None:
    """Like Jupyter: a plain ``for`` from a thread that already runs an event loop."""

    async def main() -> list[list[int]]:
        with aioloader.DataLoader(RangeDataset(10), 4, num_workers=0) as loader:
            return [b[1].tolist() for b in loader]

    assert asyncio.run(main()) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_close_leaves_no_child_process() -> None:
    before = descendant_workers()
    loader = aioloader.DataLoader(RangeDataset(32), 4, num_workers=2)
    assert len(list(loader)) == 8
    assert set(loader.worker_pids()) <= descendant_workers() - before
    loader.close()
    assert not (descendant_workers() - before)
    loader.close()  # idempotent
    with pytest.raises(aioloader.LoaderClosedError, match="closed"):
        iter(loader)

    async def again() -> None:
        async for _ in loader:
            pass

    with pytest.raises(aioloader.LoaderClosedError):
        asyncio.run(again())


def test_dropped_loader_is_cleaned_up_by_finalizer() -> None:
    before = descendant_workers()
    loader = aioloader.DataLoader(RangeDataset(16), 4, num_workers=2)
    next(iter(loader))
    pids = set(loader.worker_pids())
    assert pids
    del loader
    import gc

    gc.collect()
    wait_until(lambda: not (descendant_workers() - before), 10.0, "workers of a dropped loader to exit")


def test_break_keeps_loader_usable(collect) -> None:
    with aioloader.DataLoader(RangeDataset(40), 4, num_workers=2) as loader:
        first = collect(loader, limit=2)
        assert [b[1].tolist() for b in first] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        full = collect(loader)
        assert len(full) == 10


def test_len_is_next_epoch_batches() -> None:
    loader = aioloader.DataLoader(RangeDataset(10), 4, last_batch="rollover")
    with loader:
        assert len(loader) == 2
        list(loader)  # 8 used, 2 carried
        assert len(loader) == 3  # 12 samples
        assert aioloader.DataLoader(RangeDataset(10), 4, drop_last=True).__len__() == 2
        assert len(aioloader.DataLoader(RangeDataset(10), 4)) == 3


def test_seed_none_draws_and_exposes_seed() -> None:
    with aioloader.DataLoader(RangeDataset(30), 5, shuffle=True) as a:
        order = [b[1].tolist() for b in a]
        with aioloader.DataLoader(RangeDataset(30), 5, shuffle=True, seed=a.seed) as b:
            assert [x[1].tolist() for x in b] == order


@pytest.mark.torch
def test_torch_dataset_and_sampler_work_unchanged(collect) -> None:
    import torch
    from torch.utils.data import Dataset, DistributedSampler

    class TorchDS(Dataset):
        def __len__(self) -> int:
            return 12

        def __getitem__(self, i: int):
            return torch.full((2,), float(i)), i

    sampler = DistributedSampler(range(12), num_replicas=2, rank=1, shuffle=True, seed=5)
    with aioloader.DataLoader(TorchDS(), 3, sampler=sampler) as loader:
        got = collect(loader)
    sampler.set_epoch(0)
    expected = list(sampler)
    flat = [int(i) for b in got for i in b[1]]
    assert flat == expected
    assert isinstance(got[0][0], torch.Tensor) and got[0][0].shape == (3, 2)


def test_several_iterators_interleaved_async() -> None:
    async def main() -> tuple[list[int], list[int]]:
        async with aioloader.DataLoader(RangeDataset(20), 5, num_workers=2) as loader:
            a, b = loader.__aiter__(), loader.__aiter__()
            out_a, out_b = [], []
            for _ in range(4):
                out_a.append((await a.__anext__())[1][0])
                out_b.append((await b.__anext__())[1][0])
            await a.aclose()
            await b.aclose()
            return out_a, out_b

    a, b = asyncio.run(main())
    assert a == b == [0, 5, 10, 15]


def test_stats_count_batches_and_samples() -> None:
    with aioloader.DataLoader(RangeDataset(20), 6, num_workers=2) as loader:
        list(loader)
        list(loader)
        st = loader.stats()
    assert st.batches == 8 and st.samples == 40
    assert [e.batches for e in st.epochs] == [4, 4]
    # the next epoch's first batches may already be in flight (speculative prefetch)
    assert 0 <= st.in_flight <= st.window  # the window may have grown (cheap batches)
    assert st.latency_p50_s is not None and st.latency_p99_s >= st.latency_p50_s
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        st.batches = 3  # type: ignore[misc]


def test_uvloop_and_asyncio_loops(collect) -> None:
    import uvloop

    with aioloader.DataLoader(RangeDataset(9), 3, num_workers=1) as loader:

        async def main() -> list[int]:
            return [int(b[1][0]) async for b in loader]

        loop = uvloop.new_event_loop()  # (asyncio.Runner(loop_factory=...) needs 3.11)
        try:
            assert loop.run_until_complete(main()) == [0, 3, 6]
        finally:
            loop.close()
        assert asyncio.run(main()) == [0, 3, 6]
        assert collections.Counter(int(b[1][0]) for b in loader) == {0: 1, 3: 1, 6: 1}
