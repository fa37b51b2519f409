"""Determinism: per-sample seeds, exact resume, sharding."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aioloader
from aioloader._plan.permute import IndexShuffle
from aioloader._plan.sampler import shard_indices

from ._datasets import (
    AugmentedCrashDataset,
    AugmentedDataset,
    RangeDataset,
    RecordingDataset,
    StatefulSampler,
)
from .conftest import oversubscribed


def by_index(batches: list[Any]) -> dict[int, bytes]:
    out = {}
    for data, idx in batches:
        arr = np.asarray(data)
        for k, i in enumerate(idx.tolist()):
            out[i] = arr[k].tobytes()
    return out


def epochs(loader: aioloader.DataLoader, n: int) -> list[list[Any]]:
    return [list(loader) for _ in range(n)]


@pytest.mark.parametrize("dataset_name", ["numpy+random", pytest.param("torch", marks=pytest.mark.torch)])
def test_augmentations_identical_for_any_worker_count(dataset_name) -> None:
    if dataset_name == "torch":
        from ._torch_datasets import TorchAugmentedDataset as dataset_cls
    else:
        dataset_cls = AugmentedDataset
    results = {}
    for nw in (0, 1, 2, 4):
        with oversubscribed(nw):  # 4 may be more workers than CPUs: torch's warning then
            loader = aioloader.DataLoader(dataset_cls(40), 6, shuffle=True, seed=5, num_workers=nw)
        with loader:
            results[nw] = [[np.asarray(b[0]).tobytes() for b in ep] for ep in epochs(loader, 2)]
    assert results[0] == results[1] == results[2] == results[4]
    assert results[0][0] != results[0][1]  # epochs differ
    with aioloader.DataLoader(
        dataset_cls(40), 6, shuffle=True, seed=5, num_workers=2, ordered=False
    ) as loader:
        unordered = [by_index(ep) for ep in epochs(loader, 2)]
    with aioloader.DataLoader(dataset_cls(40), 6, shuffle=True, seed=5) as loader:
        ordered = [by_index(ep) for ep in epochs(loader, 2)]
    assert unordered == ordered


def test_augmentations_identical_after_a_crash(tmp_path: Path) -> None:
    with aioloader.DataLoader(AugmentedDataset(30), 5, shuffle=True, seed=9) as loader:
        clean = by_index(list(loader))
    # No speculative next epoch: its loads could reach the crash-once sample first.
    ds = AugmentedCrashDataset(30, 11, str(tmp_path / "crashed"))
    with aioloader.DataLoader(ds, 5, shuffle=True, seed=9, num_workers=2, prefetch_next_epoch=False) as loader:
        crashed = by_index(list(loader))
        assert loader.stats().restarts == 1
    assert crashed == clean


def test_sample_rng_outside_a_loader_follows_numpy_seed() -> None:
    np.random.seed(3)
    a = aioloader.sample_rng().random(3)
    np.random.seed(3)
    b = aioloader.sample_rng().random(3)
    assert np.array_equal(a, b)


class _InterleavedDraws(RangeDataset):
    """Draws from the global generators, yielding the GIL between draws, so that
    threads building batches at once would interleave on the shared generators."""

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        import random
        import time

        a = random.random()
        time.sleep(0.001)  # not synchronisation: it lets other threads run in between
        return np.array([a, np.random.rand()]), i


def test_thread_executor_keeps_global_generators_per_sample(collect: Any) -> None:
    """Four threads build batches at once; each sample's draws from ``random`` and
    numpy's global generator still equal a single-threaded run's."""
    import concurrent.futures as cf

    with aioloader.DataLoader(_InterleavedDraws(48), 4, shuffle=True, seed=5, num_workers=0) as loader:
        want = by_index(list(loader))
    with cf.ThreadPoolExecutor(4) as ex:
        with aioloader.DataLoader(_InterleavedDraws(48), 4, shuffle=True, seed=5, executor=ex) as loader:
            got = by_index(collect(loader))
    assert got == want


_BARRIERS: dict[str, Any] = {}


class _MeetInPairs(RangeDataset):
    """Samples 0 and 1 each wait until the other is being loaded too (they are in
    different batches), which only threads loading in parallel can satisfy."""

    def __init__(self, n: int, key: str) -> None:
        super().__init__(n)
        self.key = key  # the dataset reaches the threads as a copy; the barrier stays here

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        if i < 2:
            _BARRIERS[self.key].wait()
        return np.array([aioloader.sample_rng().random()]), i


def test_unseeded_threads_load_in_parallel_and_sample_rng_stays_per_sample(collect: Any) -> None:
    """``seed_samples=False`` leaves the global generators alone, so threads need no
    turn-taking; ``sample_rng()`` is still a function of the sample."""
    import concurrent.futures as cf
    import threading

    # (no next-epoch start: its samples 0 and 1 would wait at a barrier no one else reaches)
    opts: dict[str, Any] = {"batch_size": 1, "seed": 2, "seed_samples": False, "prefetch_next_epoch": False}
    runs = []
    try:
        with cf.ThreadPoolExecutor(2) as ex:
            for run in ("first", "second"):
                _BARRIERS[run] = threading.Barrier(2, timeout=30)
                with aioloader.DataLoader(_MeetInPairs(6, run), executor=ex, **opts) as loader:
                    runs.append(by_index(collect(loader)))
    finally:
        _BARRIERS.clear()
    assert runs[0] == runs[1] and len(set(runs[0].values())) == 6


def test_num_workers_zero_does_not_disturb_callers_global_rng() -> None:
    import random

    random.seed(1)
    np.random.seed(1)
    expected = (random.random(), np.random.rand())
    random.seed(1)
    np.random.seed(1)
    with aioloader.DataLoader(AugmentedDataset(10), 5, num_workers=0) as loader:
        list(loader)
    assert (random.random(), np.random.rand()) == expected


def test_order_is_a_function_of_seed_and_epoch() -> None:
    with aioloader.DataLoader(RangeDataset(50), 7, shuffle=True, seed=21) as a:
        first = [[b[1].tolist() for b in ep] for ep in epochs(a, 3)]
    with aioloader.DataLoader(RangeDataset(50), 7, shuffle=True, seed=21) as b:
        b.set_epoch(2)
        assert [x[1].tolist() for x in b] == first[2]


# --------------------------------------------------------------------------------- resume
def run_plan(kwargs: dict[str, Any], n_epochs: int) -> list[tuple[int, list[int]]]:
    """(epoch, indices) of every batch of an uninterrupted run."""
    out = []
    with aioloader.DataLoader(RangeDataset(kwargs.pop("n")), **kwargs) as loader:
        for e in range(n_epochs):
            out.extend((e, b[1].tolist()) for b in loader)
    return out


def resumed_run(kwargs: dict[str, Any], n_epochs: int, stop_after: list[int]) -> list[list[int]]:
    """Stop after ``stop_after[k]`` batches (counted from the start of the run), save the
    state, JSON round-trip it, and continue in a fresh loader; repeat."""
    n = kwargs["n"]
    base = {k: v for k, v in kwargs.items() if k != "n"}
    got: list[list[int]] = []
    state = None
    total = None
    for limit in [*stop_after, None]:
        loader = aioloader.DataLoader(RangeDataset(n), **base)
        with loader:
            if state is not None:
                loader.load_state_dict(json.loads(json.dumps(state)))
            while loader.epoch < n_epochs and (limit is None or len(got) < limit):
                it = iter(loader)
                for b in it:
                    got.append(b[1].tolist())
                    if limit is not None and len(got) >= limit:
                        break
                else:
                    continue
                state = loader.state_dict()
                it.close()
                break
            else:
                state = loader.state_dict()
    del total
    return got


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 30),
    bs=st.integers(1, 7),
    last_batch=st.sampled_from(["keep", "discard", "rollover"]),
    shuffle=st.booleans(),
    data=st.data(),
)
def test_resume_at_any_batch_equals_uninterrupted(n, bs, last_batch, shuffle, data) -> None:
    kwargs = {"n": n, "batch_size": bs, "last_batch": last_batch, "shuffle": shuffle, "seed": 4}
    expected = [b for _e, b in run_plan(dict(kwargs), 3)]
    if not expected:
        return
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(expected)), min_size=1, max_size=2))))
    assert resumed_run(kwargs, 3, cuts) == expected


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_with_workers_and_twice_in_a_row(num_workers) -> None:
    kwargs = {
        "n": 37,
        "batch_size": 4,
        "last_batch": "rollover",
        "shuffle": True,
        "seed": 8,
        "num_workers": num_workers,
    }
    expected = [b for _e, b in run_plan(dict(kwargs), 3)]
    assert resumed_run(kwargs, 3, [3, 4, 12, 20]) == expected


@pytest.mark.parametrize("policy", ["pad", "uneven"])
def test_resume_with_shards_and_rollover(policy) -> None:
    kwargs = {
        "n": 41,
        "batch_size": 4,
        "last_batch": "rollover",
        "shuffle": True,
        "seed": 3,
        "shard": (1, 3),
        "shard_policy": policy,
    }
    expected = [b for _e, b in run_plan(dict(kwargs), 3)]
    assert resumed_run(kwargs, 3, [2, 3, 7]) == expected


def test_resume_unordered_loses_and_repeats_nothing() -> None:
    base = {"batch_size": 3, "shuffle": True, "seed": 2, "num_workers": 2, "ordered": False}
    with aioloader.DataLoader(RangeDataset(30), **base) as loader:
        it = iter(loader)
        first = [next(it)[1].tolist() for _ in range(4)]
        state = loader.state_dict()
        it.close()
    with aioloader.DataLoader(RangeDataset(30), **base) as loader:
        loader.load_state_dict(state)
        rest = [b[1].tolist() for b in loader]
    flat = sorted(i for b in first + rest for i in b)
    assert flat == list(range(30))
    assert len(first) + len(rest) == 10


def test_resume_loads_no_sample_to_skip_ahead(tmp_path: Path) -> None:
    log = tmp_path / "log"
    with aioloader.DataLoader(RangeDataset(40), 4, shuffle=True, seed=1) as loader:
        order = [b[1].tolist() for b in loader]
        loader.set_epoch(0)
        it = iter(loader)
        for _ in range(7):
            next(it)
        state = loader.state_dict()
        it.close()
    with aioloader.DataLoader(RecordingDataset(40, str(log)), 4, shuffle=True, seed=1, prefetch=1) as loader:
        loader.load_state_dict(state)
        it = iter(loader)
        assert next(it)[1].tolist() == order[7]
        it.close()
    loaded = {int(line.split()[0]) for line in log.read_text().splitlines()}
    assert loaded <= set(order[7]) | set(order[8])  # the next batch, plus at most one prefetched


def test_state_dict_is_small_json_and_refuses_mismatches() -> None:
    with aioloader.DataLoader(RangeDataset(20), 4, shuffle=True, seed=3) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        it.close()
    assert len(json.dumps(state)) < 1000
    assert state["epoch"] == 0 and state["batches_delivered"] == 1 and state["seed"] == 3
    for kwargs, word in [
        ({"batch_size": 5}, "batch_size"),
        ({"shard": (0, 2)}, "shard"),
        ({"last_batch": "discard"}, "last_batch"),
    ]:
        other = aioloader.DataLoader(RangeDataset(20), **{"batch_size": 4, "shuffle": True, **kwargs})
        with pytest.raises(aioloader.StateDictError, match=word):
            other.load_state_dict(state)
        other.close()
    # Mid-epoch, the epoch resumes with its recorded length: a dataset that grew is fine,
    # one that shrank below it is not.
    with pytest.raises(aioloader.StateDictError, match="length"):
        aioloader.DataLoader(RangeDataset(19), 4, shuffle=True).load_state_dict(state)
    with pytest.raises(aioloader.StateDictError, match="version"):
        aioloader.DataLoader(RangeDataset(20), 4, shuffle=True).load_state_dict({**state, "version": 99})


def test_custom_sampler_state_is_saved_and_restored() -> None:
    with aioloader.DataLoader(RangeDataset(12), 3, sampler=StatefulSampler(12, seed=7)) as loader:
        full = [[b[1].tolist() for b in loader] for _ in range(3)]
    with aioloader.DataLoader(RangeDataset(12), 3, sampler=StatefulSampler(12, seed=7)) as loader:
        list(loader)
        it = iter(loader)
        part = [next(it)[1].tolist()]
        state = loader.state_dict()
        it.close()
    assert state["sampler"] is not None
    with aioloader.DataLoader(RangeDataset(12), 3, sampler=StatefulSampler(12, seed=999)) as loader:
        loader.load_state_dict(state)
        rest = [b[1].tolist() for b in loader]
        nxt = [b[1].tolist() for b in loader]
    assert part + rest == full[1]
    assert nxt == full[2]


def test_resume_async_face() -> None:
    async def main() -> tuple[list[list[int]], list[list[int]]]:
        async with aioloader.DataLoader(RangeDataset(20), 3, shuffle=True, seed=6, num_workers=2) as a:
            full = [b[1].tolist() async for b in a]
        async with aioloader.DataLoader(RangeDataset(20), 3, shuffle=True, seed=6, num_workers=2) as a:
            agen = a.__aiter__()
            head = [(await agen.__anext__())[1].tolist() for _ in range(2)]
            state = a.state_dict()
            await agen.aclose()
        async with aioloader.DataLoader(RangeDataset(20), 3, shuffle=True, seed=6, num_workers=2) as b:
            b.load_state_dict(state)
            tail = [x[1].tolist() async for x in b]
        return full, head + tail

    full, resumed = asyncio.run(main())
    assert full == resumed


def test_async_epochs_back_to_back_in_the_loader_thread() -> None:
    """num_workers=0, next-epoch prefetch on: an ``async for`` that begins the next epoch
    before the run asked for its first unit used to fail with ``KeyError: 1``."""

    async def main() -> list[list[list[int]]]:
        async with aioloader.DataLoader(RangeDataset(30), 4, shuffle=True, seed=3) as loader:
            out = []
            for _ in range(3):
                out.append([b[1].tolist() async for b in loader])
            return out

    with aioloader.DataLoader(RangeDataset(30), 4, shuffle=True, seed=3) as loader:
        want = [[b[1].tolist() for b in ep] for ep in epochs(loader, 3)]
    assert asyncio.run(main()) == want


# ------------------------------------------------------------------------------- sharding
@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 60),
    world=st.integers(1, 6),
    policy=st.sampled_from(["pad", "drop", "uneven"]),
    seed=st.integers(0, 5),
)
def test_shards_cover_exactly_once_and_are_disjoint(n, world, policy, seed) -> None:
    order = np.random.default_rng(seed).permutation(n)
    parts = [shard_indices(order, r, world, policy).tolist() for r in range(world)]
    counts = [len(p) for p in parts]
    flat = [i for p in parts for i in p]
    if policy == "uneven":
        assert sorted(flat) == list(range(n))
        assert max(counts) - min(counts) <= 1
    elif policy == "drop":
        assert len(set(counts)) == 1 and counts[0] == n // world
        assert len(flat) == len(set(flat)) and set(flat) <= set(range(n))
        assert len(flat) == n - n % world
    else:
        assert len(set(counts)) == 1 and counts[0] == -(-n // world)
        assert set(flat) == set(range(n))  # everything covered
        assert len(flat) - n == (-n) % world if n else True  # plus the documented padding
        if n:
            assert len(flat) - len(set(flat)) == (-n) % world


@pytest.mark.parametrize("policy", ["pad", "drop", "uneven"])
def test_sharded_loaders_partition_each_epoch(policy) -> None:
    n, world = 23, 3
    per_epoch: list[list[int]] = [[], []]
    for rank in range(world):
        with aioloader.DataLoader(
            RangeDataset(n), 4, shuffle=True, seed=1, shard=(rank, world), shard_policy=policy
        ) as loader:
            for e in range(2):
                per_epoch[e].extend(int(i) for b in loader for i in b[1])
    for flat in per_epoch:
        if policy == "uneven":
            assert sorted(flat) == list(range(n))
        elif policy == "drop":
            assert len(flat) == len(set(flat)) == n - n % world
        else:
            assert set(flat) == set(range(n)) and len(flat) == 24
    assert per_epoch[0] != per_epoch[1]


def test_distributed_sampler_for_other_loaders() -> None:
    samplers = [aioloader.DistributedSampler(10, r, 3, shuffle=True, seed=2) for r in range(3)]
    for s in samplers:
        s.set_epoch(4)
    parts = [list(s) for s in samplers]
    assert all(len(p) == len(s) == 4 for p, s in zip(parts, samplers, strict=True))
    assert set().union(*map(set, parts)) == set(range(10))
    with pytest.raises(ValueError, match="rank"):
        aioloader.DistributedSampler(10, 3, 3)


def test_any_epoch_is_the_index_shuffle_strided_by_rank() -> None:
    # Epoch e of rank r is positions r, r + w, ... of IndexShuffle(n, seed, e): nothing
    # depends on the epochs before it, so set_epoch can jump anywhere at no cost.
    n, seed, world = 45, 12, 3
    for rank in range(world):
        with aioloader.DataLoader(RangeDataset(n), 8, shuffle=True, seed=seed, shard=(rank, world)) as loader:
            for epoch in (0, 7, 10**6):
                loader.set_epoch(epoch)
                got = [int(i) for b in loader for i in b[1]]
                assert got == IndexShuffle(n, seed, epoch)(np.arange(rank, n, world)).tolist()


def test_state_dict_after_break_points_at_the_next_epoch() -> None:
    # Like torch: breaking out ends the epoch for this loader; the saved state agrees.
    with aioloader.DataLoader(RangeDataset(20), 4, shuffle=True, seed=2) as loader:
        for i, _ in enumerate(loader):
            if i == 1:
                break
        state = loader.state_dict()
        live_next = next(iter(loader))[1].tolist()
    assert state["epoch"] == 1 and state["batches_delivered"] == 0
    with aioloader.DataLoader(RangeDataset(20), 4, shuffle=True, seed=2) as resumed:
        resumed.load_state_dict(state)
        assert next(iter(resumed))[1].tolist() == live_next


def test_set_epoch_to_the_next_epoch_keeps_the_speculative_start() -> None:
    with aioloader.DataLoader(RangeDataset(32), 4, num_workers=2, shuffle=True, seed=0) as loader:
        for epoch in range(3):
            loader.set_epoch(epoch)  # the torch idiom, once per epoch
            if epoch:
                # the previous epoch's run went on into this one and is kept for it
                assert loader._parked is not None and loader._parked.successor.epoch == epoch
                assert epoch in loader._parked.source.plans
            list(loader)
        loader.set_epoch(7)  # a jump: the run that went on into epoch 3 is dropped
        assert loader._parked is None
        assert [e.epoch for e in loader.stats().epochs] == [0, 1, 2]
