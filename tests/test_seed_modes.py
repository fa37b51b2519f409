"""The three ``seed_samples`` modes: what each one makes identical, and what it costs
(counted in calls to the global generators' ``seed``, never timed)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioloader
from aioloader import _seeding

from ._datasets import AugmentedCrashDataset, AugmentedDataset, RangeDataset

MODES = ["batch", "sample"]


def mode_opts(mode: Any) -> dict[str, Any]:
    """``"default"`` passes no ``seed_samples`` at all (it must behave as ``"batch"``)."""
    return {} if mode == "default" else {"seed_samples": mode}


def by_batch(batches: list[Any]) -> dict[tuple[int, ...], bytes]:
    """Each batch's data, keyed by its indices in order."""
    return {tuple(idx.tolist()): np.asarray(data).tobytes() for data, idx in batches}


def enter(seeds: _seeding.BatchSeeds, k: int) -> None:
    """What the worker's loop does before the ``k``-th sample of a batch."""
    seeds.k = k
    if seeds.hook is not None:
        seeds.hook(k)


def contract(
    mode: _seeding.SeedMode, seed: int, epoch: int, batches: list[list[int]], n: int
) -> dict[tuple[int, ...], bytes]:
    """What the documented contract says each batch holds, computed here with the public
    pieces of ``_seeding`` (no loader, no worker)."""
    state = random.getstate(), np.random.get_state()
    ds = AugmentedDataset(n)
    out = {}
    try:
        for indices in batches:
            seeds = _seeding.start_batch(mode, seed, epoch, indices, indices)
            rows = []
            for k, i in enumerate(indices):
                enter(seeds, k)
                rows.append(ds[i][0])
            _seeding.clear_sample()
            out[tuple(indices)] = np.stack(rows).tobytes()
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
    return out


# ------------------------------------------------------------------------ the seeding API
def test_sample_seeds_are_sample_seed_of_every_index() -> None:
    idx = [0, 1, 7, 10**6, 2**62, -1, -(2**63)]
    want = [_seeding.sample_seed(5, 3, i) for i in idx]
    assert _seeding.sample_seeds(5, 3, np.array(idx, dtype=np.int64)).tolist() == want
    assert _seeding.sample_seeds(5, 3, np.array(idx, dtype=np.int64).tobytes()).tolist() == want
    assert _seeding.sample_seeds(5, 3, idx).tolist() == want
    assert _seeding.sample_seeds(5, 3, [2**64 - 1]).tolist() == [_seeding.sample_seed(5, 3, -1)]
    assert _seeding.sample_seeds(5, 3, []).tolist() == []


def test_batch_key_is_a_function_of_seed_epoch_and_the_indices_in_order() -> None:
    key = _seeding.batch_key(1, 2, [4, 8, 15])
    assert (
        key
        == _seeding.batch_key(1, 2, np.array([4, 8, 15]))
        == _seeding.batch_key(1, 2, np.array([4, 8, 15]).tobytes())
    )
    others = [
        _seeding.batch_key(1, 2, [8, 4, 15]),  # order
        _seeding.batch_key(1, 2, [4, 8]),  # fewer
        _seeding.batch_key(1, 2, [4, 8, 15, 0]),  # more
        _seeding.batch_key(1, 3, [4, 8, 15]),  # epoch
        _seeding.batch_key(2, 2, [4, 8, 15]),  # seed
    ]
    assert len({key, *others}) == 6
    assert 0 <= key < 2**64
    # Longer than the cached powers at first use: the cache grows and agrees with itself.
    long = list(range(5000))
    assert _seeding.batch_key(0, 0, long) == _seeding.batch_key(0, 0, np.arange(5000))


def test_sample_mode_seeds_as_seed_sample_did() -> None:
    """``"sample"`` (and ``True``) is the old default, value for value."""
    idx = [9, 2, 33]
    seeds = _seeding.start_batch("sample", 4, 1, idx, idx)
    got = []
    for k in range(len(idx)):
        enter(seeds, k)
        got.append((random.random(), float(np.random.rand()), _seeding.sample_key()))
    want = []
    for i in idx:
        _seeding.seed_sample(4, 1, i)
        want.append((random.random(), float(np.random.rand()), _seeding.sample_key()))
    _seeding.clear_sample()
    assert got == want


def test_sample_rng_is_per_sample_in_every_mode() -> None:
    draws = {}
    for mode in ("batch", "sample", False):
        enter(_seeding.start_batch(mode, 4, 1, [9, 2], [9, 2]), 1)
        draws[mode] = aioloader.sample_rng().random(3).tobytes()
    _seeding.clear_sample()
    assert len(set(draws.values())) == 1


# --------------------------------------------------------------------------- the loader
def test_default_is_batch_and_the_parameter_is_checked() -> None:
    with aioloader.DataLoader(RangeDataset(4), 2) as loader:
        assert loader.seed_samples == "batch"
    assert aioloader.DataLoader(RangeDataset(4), 2, seed_samples=True).seed_samples == "sample"
    assert aioloader.DataLoader(RangeDataset(4), 2, seed_samples=np.False_).seed_samples is False
    with pytest.raises(ValueError, match="seed_samples"):
        aioloader.DataLoader(RangeDataset(4), 2, seed_samples="per-batch")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seed_samples"):
        aioloader.DataLoader(RangeDataset(4), 2, seed_samples=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["default", *MODES])
def test_batches_follow_the_contract_for_any_worker_count_and_order(mode: Any, collect: Any) -> None:
    n, seed = 30, 11
    runs = []
    for nw, ordered in ((0, True), (2, True), (2, False)):
        opts = {"shuffle": True, "seed": seed, "num_workers": nw, "ordered": ordered, **mode_opts(mode)}
        with aioloader.DataLoader(AugmentedDataset(n), 4, **opts) as loader:
            runs.append(by_batch(collect(loader)))
    assert runs[0] == runs[1] == runs[2]
    want = contract("batch" if mode == "default" else mode, seed, 0, [list(k) for k in runs[0]], n)
    assert runs[0] == want


def test_batch_mode_does_not_depend_on_a_batchs_position() -> None:
    """The key is the batch's indices, not where it sits in the epoch: the same batches in
    another order hold the same data."""
    batches = [[3, 1, 4], [1, 5, 9], [2, 6], [5, 3, 5]]
    got = []
    for order in (batches, batches[::-1]):
        with aioloader.DataLoader(AugmentedDataset(10), batch_sampler=order, seed=2, num_workers=2) as loader:
            got.append(by_batch(list(loader)))
    assert got[0] == got[1] == contract("batch", 2, 0, batches, 10)
    assert len(set(got[0].values())) == 4


@pytest.mark.parametrize("mode", MODES)
def test_identical_after_a_crash(mode: str, tmp_path: Path) -> None:
    opts: dict[str, Any] = {"batch_size": 5, "shuffle": True, "seed": 9, "seed_samples": mode}
    with aioloader.DataLoader(AugmentedDataset(30), **opts) as loader:
        clean = by_batch(list(loader))
    # No speculative next epoch: its loads could reach the crash-once sample first.
    with aioloader.DataLoader(
        AugmentedCrashDataset(30, 11, str(tmp_path / "crashed")), num_workers=2, prefetch_next_epoch=False, **opts
    ) as loader:
        crashed = by_batch(list(loader))
        assert loader.stats().restarts == 1
    assert crashed == clean


def _resume_sync(opts: dict[str, Any], head: int) -> list[bytes]:
    with aioloader.DataLoader(AugmentedDataset(30), **opts) as loader:
        it = iter(loader)
        got = [np.asarray(next(it)[0]).tobytes() for _ in range(head)]
        state = loader.state_dict()
        it.close()
    with aioloader.DataLoader(AugmentedDataset(30), **opts) as loader:
        loader.load_state_dict(state)
        for _ in range(2):  # the rest of epoch 0, then epoch 1
            got.extend(np.asarray(b[0]).tobytes() for b in loader)
    return got


def _resume_async(opts: dict[str, Any], head: int) -> list[bytes]:
    async def main() -> list[bytes]:
        async with aioloader.DataLoader(AugmentedDataset(30), **opts) as loader:
            agen = loader.__aiter__()
            got = [np.asarray((await agen.__anext__())[0]).tobytes() for _ in range(head)]
            state = loader.state_dict()
            await agen.aclose()
        async with aioloader.DataLoader(AugmentedDataset(30), **opts) as loader:
            loader.load_state_dict(state)
            for _ in range(2):
                got.extend([np.asarray(b[0]).tobytes() async for b in loader])
        return got

    return asyncio.run(main())


@pytest.mark.parametrize("face", [_resume_sync, _resume_async], ids=["for", "async-for"])
def test_batch_mode_identical_after_resume(face: Callable[[dict[str, Any], int], list[bytes]]) -> None:
    opts: dict[str, Any] = {"batch_size": 4, "shuffle": True, "seed": 3, "num_workers": 2}
    with aioloader.DataLoader(AugmentedDataset(30), **opts) as loader:
        full = [np.asarray(b[0]).tobytes() for _ in range(2) for b in loader]
    assert face(opts, 3) == full


@pytest.mark.parametrize("mode", MODES)  # (False leaves the generators alone: draws move them)
def test_num_workers_zero_puts_the_callers_state_back(mode: Any) -> None:
    random.seed(1)
    np.random.seed(1)
    expected = (random.random(), np.random.rand())
    random.seed(1)
    np.random.seed(1)
    with aioloader.DataLoader(AugmentedDataset(10), 5, seed_samples=mode) as loader:
        list(loader)
    assert (random.random(), np.random.rand()) == expected


# ------------------------------------------------------------------------------ the cost
_SEED_CALLS = {"random": 0, "numpy": 0}


def _counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def seed(*args: Any, **kwargs: Any) -> Any:
        _SEED_CALLS[name] += 1
        return fn(*args, **kwargs)

    return seed


def count_seed_calls(_worker_id: int = 0) -> None:
    """worker_init_fn: count this worker's calls to ``random.seed`` and ``np.random.seed``."""
    random.seed = _counting("random", random.seed)  # type: ignore[assignment]
    np.random.seed = _counting("numpy", np.random.seed)


class SeedCallsSoFar(RangeDataset):
    """Sample i is the number of times its process's generators were seeded so far."""

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return np.array([_SEED_CALLS["random"], _SEED_CALLS["numpy"]]), i


@pytest.mark.parametrize("mode", ["default", *MODES, False])
def test_seeding_calls_per_batch_in_workers(mode: Any, collect: Any) -> None:
    """Every sample of a batch sees the same count in ``"batch"`` mode (the generators
    were seeded once, before the batch); one more per sample in ``"sample"`` mode."""
    opts = {
        "shuffle": True,
        "seed": 1,
        "num_workers": 2,
        "worker_init_fn": count_seed_calls,
        **mode_opts(mode),
    }
    with aioloader.DataLoader(SeedCallsSoFar(48), 8, **opts) as loader:
        batches = collect(loader)
    assert len(batches) == 6
    for data, _idx in batches:
        steps = np.diff(np.asarray(data), axis=0)
        assert (steps == (1 if mode == "sample" else 0)).all(), np.asarray(data)
        if mode is False:
            assert not np.asarray(data).any()


@pytest.mark.parametrize("mode", ["default", *MODES, False])
def test_seeding_calls_in_the_loader_thread(mode: Any, collect: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """num_workers=0: the generators are seeded once a batch by default (the old default
    seeded them before every sample: 48 times here, not 6)."""
    monkeypatch.setitem(_SEED_CALLS, "random", 0)
    monkeypatch.setitem(_SEED_CALLS, "numpy", 0)
    monkeypatch.setattr(random, "seed", _counting("random", random.seed))
    monkeypatch.setattr(np.random, "seed", _counting("numpy", np.random.seed))
    opts: dict[str, Any] = {"shuffle": True, "seed": 1, "prefetch_next_epoch": False, **mode_opts(mode)}
    with aioloader.DataLoader(RangeDataset(48), 8, **opts) as loader:
        assert len(collect(loader)) == 6
    want = {"default": 6, "batch": 6, "sample": 48, False: 0}[mode]
    assert _SEED_CALLS == {"random": want, "numpy": want}
