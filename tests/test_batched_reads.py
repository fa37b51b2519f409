"""A dataset with ``__getitems__`` is read one call per batch, as torch's DataLoader reads it."""

from __future__ import annotations

import numpy as np
import pytest

import aioloader

from ._datasets import BatchedDraws, BatchedNoIndex, BatchedRange, Draws, ShortBatches

WORKERS = [pytest.param(0, id="thread"), pytest.param(2, id="processes")]


def draw_again(sample: np.ndarray) -> np.ndarray:
    return sample + np.array([0, 0, aioloader.sample_rng().integers(5), 0])


def notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


@pytest.mark.parametrize("per_task", [1, 4], ids=["one-batch-a-task", "grouped"])
@pytest.mark.parametrize("num_workers", WORKERS)
def test_one_getitems_call_per_batch_and_no_getitem(collect, num_workers, per_task) -> None:
    # BatchedRange's __getitem__ raises: one per-sample read would fail the epoch.
    with aioloader.DataLoader(
        BatchedRange(50), 8, shuffle=True, seed=3, num_workers=num_workers, batches_per_task=per_task
    ) as loader:
        batches = collect(loader)
    sizes = [len(b) for b in batches]
    assert sizes == [8] * 6 + [2]
    for b in batches:
        assert b[:, 1].tolist() == [len(b)] * len(b)  # every sample read by one call of the batch's size
    assert sorted(np.concatenate([b[:, 0] for b in batches]).tolist()) == list(range(50))


@pytest.mark.parametrize("num_workers", WORKERS)
def test_a_failing_batched_read_under_skip_names_and_skips_the_one_bad_sample(collect, num_workers) -> None:
    with aioloader.DataLoader(
        BatchedRange(12, bad={5}, single=True), 4, num_workers=num_workers, on_error="skip"
    ) as loader:
        batches = collect(loader)
        assert loader.stats().skipped == 1
    assert [b[:, 0].tolist() for b in batches] == [[0, 1, 2, 3], [4, 6, 7], [8, 9, 10, 11]]
    # The good batches were read whole; only the failing one was read again sample by sample.
    assert [b[:, 1].tolist() for b in batches] == [[4] * 4, [1] * 3, [4] * 4]
    with aioloader.DataLoader(
        BatchedRange(12, bad={5, 6}, single=True), 4, num_workers=num_workers, on_error="skip", max_skipped=1
    ) as loader:
        with pytest.raises(aioloader.TooManySkippedError) as info:
            collect(loader)
    assert [i for i, _ in info.value.skipped] == [5, 6]
    assert "sample 5 is bad" in info.value.skipped[0][1]


@pytest.mark.parametrize("num_workers", WORKERS)
def test_a_failing_batched_read_names_the_call_and_the_batch(collect, num_workers) -> None:
    with aioloader.DataLoader(BatchedRange(12, bad={5}), 4, num_workers=num_workers) as loader:
        with pytest.raises(KeyError, match="one sample of this batch is bad") as info:
            collect(loader)
    assert "raised by dataset.__getitems__([4, 5, 6, 7]) in batch 1 of epoch 0" in notes(info.value)


@pytest.mark.parametrize("num_workers", WORKERS)
def test_a_getitems_that_returns_too_few_samples_is_named(collect, num_workers) -> None:
    with aioloader.DataLoader(ShortBatches(8), 4, num_workers=num_workers) as loader:
        with pytest.raises(ValueError, match=r"returned 3 samples for 4 indices \[0, 1, 2, 3\] in batch 0"):
            collect(loader)


@pytest.mark.parametrize("num_workers", WORKERS)
def test_batched_reads_draw_what_per_sample_reads_draw(collect, num_workers) -> None:
    # The default seeding: the global generators once per batch, then sample_rng(i) per
    # sample. A __getitems__ that draws in order gets exactly what __getitem__ would.
    def epoch(dataset: Draws, **kw: object) -> np.ndarray:
        with aioloader.DataLoader(dataset, 5, shuffle=True, seed=11, num_workers=num_workers, **kw) as loader:
            return np.concatenate(collect(loader))

    plain, batched = epoch(Draws(40)), epoch(BatchedDraws(40))
    assert batched[:, 3].tolist() == [1] * 40  # read by __getitems__
    assert np.array_equal(plain[:, :3], batched[:, :3])
    # A transform draws on from the sample's own stream, both ways.
    with_transform = epoch(BatchedDraws(40), transform=draw_again)
    assert np.array_equal(epoch(Draws(40), transform=draw_again)[:, :3], with_transform[:, :3])


@pytest.mark.parametrize("num_workers", WORKERS)
def test_sample_mode_reads_sample_by_sample(collect, num_workers) -> None:
    # "sample" mode seeds the global generators before every sample: one call cannot.
    def epoch(dataset: Draws) -> np.ndarray:
        with aioloader.DataLoader(
            dataset, 5, shuffle=True, seed=11, num_workers=num_workers, seed_samples="sample"
        ) as loader:
            return np.concatenate(collect(loader))

    plain, batched = epoch(Draws(20)), epoch(BatchedDraws(20))
    assert np.array_equal(plain, batched)  # the last column 0: __getitem__ read each one


@pytest.mark.parametrize("num_workers", WORKERS)
def test_sample_rng_without_index_inside_getitems_says_what_to_do(collect, num_workers) -> None:
    with aioloader.DataLoader(BatchedNoIndex(8), 4, num_workers=num_workers) as loader:
        with pytest.raises(RuntimeError, match=r"Pass the sample's index, sample_rng\(i\)") as info:
            collect(loader)
    assert "raised by dataset.__getitems__([0, 1, 2, 3]) in batch 0 of epoch 0" in notes(info.value)


@pytest.mark.torch
def test_torch_wrappers_read_in_batches_only_where_what_they_wrap_does(collect) -> None:
    from torch.utils.data import StackDataset, Subset

    from aioloader._worker.tasks import reads_batches

    assert reads_batches(BatchedRange(4))
    assert not reads_batches(Draws(4))
    assert reads_batches(Subset(BatchedRange(10), [1, 2]))
    assert not reads_batches(Subset(Subset(Draws(10), [1, 2]), [0]))
    assert not reads_batches(StackDataset(a=Draws(4), b=Draws(4)))
    assert reads_batches(StackDataset(Draws(4), BatchedRange(4)))
    # A Subset of a per-sample dataset keeps per-sample randomness (sample_rng() works).
    with aioloader.DataLoader(Subset(Draws(20), list(range(0, 20, 2))), 5, seed=1, num_workers=2) as loader:
        got = np.concatenate(collect(loader))
    assert got[:, 0].tolist() == list(range(0, 20, 2))
    # torch's own loader reads a Subset of a batched dataset through its __getitems__.
    with aioloader.DataLoader(Subset(BatchedRange(20), [3, 1, 4, 1, 5]), 5, num_workers=2) as loader:
        (batch,) = collect(loader)
    assert batch[:, 0].tolist() == [3, 1, 4, 1, 5] and batch[:, 1].tolist() == [5] * 5


def test_sample_rng_with_an_index_outside_a_batched_read() -> None:
    from aioloader import _seeding

    _seeding.enter_sample(7, 0, 3)
    try:
        assert _seeding.sample_rng(3) is _seeding.sample_rng()  # the sample being loaded: one stream
        a = _seeding.sample_rng(4).integers(1 << 30, size=3)
    finally:
        _seeding.clear_sample()
    _seeding.enter_sample(7, 0, 9)
    try:
        assert np.array_equal(_seeding.sample_rng(4).integers(1 << 30, size=3), a)  # (seed, epoch, 4) alone
    finally:
        _seeding.clear_sample()
