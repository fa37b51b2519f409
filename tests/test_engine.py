"""The one engine under both facades: groups kept apart in unordered mode, loaders freed
after a complete epoch, SystemExit from user code, and configuration that cannot drift."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioloader
from aioloader import DataLoader, StreamLoader

from ._datasets import RangeDataset
from ._engine_datasets import ExitingDataset, RendezvousDataset


def _ids(batches: list[Any]) -> list[int]:
    return sorted(int(i) for _, ys in batches for i in ys)


def test_unordered_epochs_keep_their_own_batches(tmp_path: Path, collect: Callable[..., list[Any]]) -> None:
    """A batch of epoch 1 that finishes before epoch 0's last one is held for epoch 1."""
    ds = RendezvousDataset(8, wait_at=7, release_at=0, folder=str(tmp_path))
    with DataLoader(ds, 2, num_workers=2, ordered=False, prefetch=4, seed=0) as loader:
        first = collect(loader)
        assert (tmp_path / "release").exists()  # epoch 1 really started during epoch 0
        second = collect(loader)
        stats = loader.stats()
    assert _ids(first) == list(range(8))
    assert _ids(second) == list(range(8))
    assert [e.batches for e in stats.epochs] == [4, 4]


@pytest.fixture
def no_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_sync_loader_freed_without_gc_after_a_complete_epoch(no_gc: None) -> None:
    loader = DataLoader(RangeDataset(8), 4, num_workers=1)
    assert len(list(loader)) == 2
    pool = loader.pool
    ref = weakref.ref(loader)
    del loader
    assert ref() is None, gc.get_referrers(ref())  # pragma: no cover - the message
    assert pool.closed


def test_async_loader_freed_without_gc_after_a_complete_epoch(no_gc: None) -> None:
    async def main() -> weakref.ref[DataLoader]:
        loader = DataLoader(RangeDataset(8), 4, num_workers=1)
        assert len([b async for b in loader]) == 2
        ref = weakref.ref(loader)
        del loader
        return ref

    ref = asyncio.run(main())
    assert ref() is None


@pytest.mark.parametrize("workers", [0, 1], ids=["thread", "process"])
def test_system_exit_in_getitem_reaches_the_caller_and_the_loader_lives_on(workers: int) -> None:
    with DataLoader(ExitingDataset(8, bad=5), 4, num_workers=workers) as loader:
        it = iter(loader)
        next(it)
        with pytest.raises(SystemExit, match="sample 5"):
            next(it)
        # The private loop survived: a new epoch runs (and fails the same way).
        it = iter(loader)
        np.testing.assert_array_equal(next(it)[1], [0, 1, 2, 3])
        with pytest.raises(SystemExit):
            next(it)


def test_system_exit_in_getitem_async() -> None:
    async def main() -> None:
        async with DataLoader(ExitingDataset(8, bad=1), 4, num_workers=0) as loader:
            async for _ in loader:
                pass

    with pytest.raises(SystemExit, match="sample 1"):
        asyncio.run(main())


@pytest.mark.parametrize(
    "name", ["dataset", "batch_size", "sampler", "batch_sampler", "drop_last", "shuffle"]
)
def test_planning_attributes_cannot_be_changed_after_construction(name: str) -> None:
    with DataLoader(RangeDataset(8), 4) as loader:
        with pytest.raises(ValueError, match=name):
            setattr(loader, name, getattr(loader, name))
        loader.timeout = 5.0  # options read per run may change


@pytest.mark.parametrize(
    ("factory", "name"),
    [
        (lambda: DataLoader(RangeDataset(4), shuffle="false"), "shuffle"),  # type: ignore[arg-type]
        (lambda: DataLoader(RangeDataset(4), ordered="no"), "ordered"),  # type: ignore[arg-type]
        (lambda: DataLoader(RangeDataset(4), drop_last=1), "drop_last"),  # type: ignore[arg-type]
        (lambda: DataLoader(RangeDataset(4), seed_samples=0), "seed_samples"),  # type: ignore[arg-type]
        (lambda: DataLoader(RangeDataset(4), prefetch_next_epoch="yes"), "prefetch_next_epoch"),  # type: ignore[arg-type]
        (lambda: StreamLoader(range(4), ordered="no"), "ordered"),  # type: ignore[arg-type]
        (lambda: StreamLoader(range(4), str, batched_fn=1), "batched_fn"),  # type: ignore[arg-type]
    ],
    ids=[
        "shuffle",
        "ordered",
        "drop_last",
        "seed_samples",
        "prefetch_next_epoch",
        "stream-ordered",
        "batched_fn",
    ],
)
def test_boolean_parameters_take_only_bools(factory: Callable[[], Any], name: str) -> None:
    with pytest.raises(TypeError, match=name):
        factory()


def test_numpy_bools_are_bools() -> None:
    with DataLoader(RangeDataset(4), 2, shuffle=np.bool_(True), ordered=np.True_) as loader:
        assert loader.shuffle is True and loader.ordered is True
        assert len(list(loader)) == 2


def test_stream_loader_traces(tmp_path: Path) -> None:
    path = tmp_path / "stream.json"
    with StreamLoader(range(6), batch_size=2, trace=path) as stream:
        assert len(list(stream)) == 3
        with stream.tracing(tmp_path / "part.json"):
            assert len(list(stream)) == 3
    assert path.exists() and (tmp_path / "part.json").exists()


def test_lifecycle_states_are_named() -> None:
    loader = DataLoader(RangeDataset(4), 2)
    assert loader._state.value == "new"
    list(loader)
    assert loader._state.value == "open"
    loader.close()
    assert loader._state.value == "closed"
    with pytest.raises(aioloader.LoaderClosedError, match="DataLoader is closed"):
        iter(loader)


def test_loaders_are_generic_for_typed_code() -> None:
    """``DataLoader[T]`` and ``StreamLoader[T]`` subscript at run time; that they type-check
    under ``mypy --strict`` is shown by the "Typing batches" snippet of docs/api.md, which
    tests/test_docs.py checks with mypy (one mypy run for all typed pages)."""
    assert aioloader.DataLoader[int] is not None and aioloader.StreamLoader[list[int]] is not None
    assert "DataLoader[npt.NDArray[np.int64]]" in (Path(__file__).parents[1] / "docs" / "api.md").read_text()
