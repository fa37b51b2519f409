"""DataLoader over a torch IterableDataset: each worker iterates its own copy, as in
torch, and the batches come round-robin from the workers (issue 17, part 3).

torch's own DataLoader is the oracle for the order, the batching and ``len``."""

from __future__ import annotations

import asyncio
import glob
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

import aioloader
from aioloader._engine import dispatch

pytestmark = pytest.mark.torch

torch = pytest.importorskip("torch")

from ._torch_datasets import HangsOnceUnpickled, ShardedRange, WorkerReport, record_init  # noqa: E402
from .conftest import _collect_async, _collect_sync, wait_until  # noqa: E402


def labels(batches: list[Any]) -> list[list[int]]:
    return [b[1].tolist() for b in batches]


def torch_order(dataset: Any, **kwargs: Any) -> list[list[int]]:
    return labels(list(torch.utils.data.DataLoader(dataset, **kwargs)))


def shard_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "aioloader-shards-*")))


def drain_into(got: list[Any], loader: Any, collect: Any) -> None:
    """One epoch into ``got``, through the face ``collect`` stands for, so that the
    batches taken before an error are kept when it raises."""
    if collect is _collect_sync:
        for b in loader:
            got.append(b)
        return

    async def main() -> None:
        async for b in loader:
            got.append(b)

    asyncio.run(main())


def round_robin(n: int, batch_size: int, workers: int, drop_last: bool = False) -> list[list[int]]:
    """torch's order for ShardedRange(n): worker w holds w, w + workers, ...; its batches
    alternate with the other workers' while they last (checked against torch below)."""
    per = [[list(range(w, n, workers))[k : k + batch_size] for k in range(0, len(range(w, n, workers)), batch_size)]
           for w in range(workers)]  # fmt: skip
    if drop_last:
        per = [[b for b in bs if len(b) == batch_size] for bs in per]
    out = []
    for k in range(max(map(len, per))):
        out.extend(bs[k] for bs in per if k < len(bs))
    return out


@pytest.mark.parametrize(
    ("face", "num_workers", "batching"),
    [
        ("for", 2, {"batch_size": 4}),
        ("async-for", 2, {"batch_size": 4}),
        ("for", 2, {"batch_size": 4, "drop_last": True}),
        ("async-for", 0, {"batch_size": 4}),
        ("for", 2, {"batch_size": 1}),
    ],
)
def test_same_batches_in_the_same_order_as_torch(
    face: str, num_workers: int, batching: dict[str, Any]
) -> None:
    collect = _collect_sync if face == "for" else _collect_async
    ds = ShardedRange(23)
    expected = torch_order(ds, num_workers=num_workers, **batching)
    assert expected == round_robin(
        23, batching["batch_size"], max(num_workers, 1), batching.get("drop_last", False)
    )
    dirs = shard_dirs()
    with aioloader.DataLoader(ds, num_workers=num_workers, **batching) as loader:
        assert isinstance(loader, aioloader.DataLoader)
        assert len(loader) == len(torch.utils.data.DataLoader(ds, **batching))
        first = collect(loader)
        assert labels(first) == expected
        assert all(isinstance(b[0], torch.Tensor) and isinstance(b[1], torch.Tensor) for b in first)
        assert labels(collect(loader)) == expected  # the next epoch iterates again
    assert shard_dirs() == dirs  # each run's socket directory is removed


def test_batch_size_none_gives_samples_as_torch() -> None:
    ds = ShardedRange(7)
    expected = [int(s[1]) for s in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)]
    with aioloader.DataLoader(ds, batch_size=None, num_workers=2) as loader:
        got = list(loader)
    assert [int(s[1]) for s in got] == expected
    assert all(isinstance(s[0], torch.Tensor) and s[0].shape == (1,) for s in got)


def test_unordered_delivers_every_batch_once() -> None:
    ds = ShardedRange(40)

    async def main() -> list[Any]:
        async with aioloader.DataLoader(ds, batch_size=3, num_workers=2, ordered=False) as loader:
            return [b async for b in loader]

    got = labels(asyncio.run(main()))
    assert sorted(map(tuple, got)) == sorted(map(tuple, round_robin(40, 3, 2)))


def test_workers_see_torch_worker_info_and_worker_init_fn() -> None:
    """``get_worker_info()`` has the shard's id, the worker count, a per-worker seed and
    the worker's copy of the dataset; ``worker_init_fn`` runs in every worker with the id,
    once per epoch (torch's default, non-persistent workers do the same)."""
    ds = WorkerReport(per_worker=2)
    with aioloader.DataLoader(
        ds, batch_size=None, num_workers=2, seed=5, worker_init_fn=record_init
    ) as loader:
        first = list(loader)
        second = list(loader)
    assert [s["id"] for s in first] == [0, 1, 0, 1]
    assert {s["num_workers"] for s in first} == {2}
    assert all(s["dataset_is_self"] for s in first)
    assert {s["init_ids"][-1] for s in first} == {0, 1} and all(s["init_ids"][-1] == s["id"] for s in first)
    seeds = {(s["id"], s["seed"]) for s in first}
    assert len({seed for _, seed in seeds}) == 2  # one seed per worker, distinct
    assert {s["seed"] for s in second}.isdisjoint({s["seed"] for s in first})  # and per epoch
    # The global generators are seeded from it: a worker's draws differ from the other's,
    # from one epoch to the next, and are the same again for the same seed.
    assert first[0]["draws"] != first[1]["draws"]
    assert [s["draws"] for s in first] != [s["draws"] for s in second]
    assert len(ds.init_ids) == 0  # the consumer's own copy is never initialised
    with aioloader.DataLoader(WorkerReport(2), batch_size=None, num_workers=2, seed=5) as again:
        assert [(s["id"], s["seed"], s["draws"]) for s in again] == [
            (s["id"], s["seed"], s["draws"]) for s in first
        ]


def test_len_without_a_dataset_len_is_a_type_error() -> None:
    with aioloader.DataLoader(ShardedRange(5, has_len=False), batch_size=2) as loader:
        with pytest.raises(TypeError, match="no len"):
            len(loader)
        assert labels(list(loader)) == [[0, 1], [2, 3], [4]]


def test_an_error_in_iteration_keeps_its_type_names_the_worker_and_comes_after_the_batches_before_it(
    collect,
) -> None:
    """Worker 1 (odd samples) fails at sample 9, its third batch of two: the consumer
    gets every batch that comes before that one in torch's order, then the error."""
    ds = ShardedRange(24, fail_at=9)
    with aioloader.DataLoader(ds, batch_size=2, num_workers=2) as loader:
        got: list[Any] = []
        with pytest.raises(ValueError, match="sample 9 is bad") as info:
            drain_into(got, loader, collect)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "iterating the dataset" in notes and "batch 2 of worker 1 in epoch 0" in notes
    # Worker 0: [0,2] [4,6] [8,10] ...; worker 1: [1,3] [5,7] then fails at 9.
    assert labels(got) == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10]]


def test_a_killed_worker_is_replaced_and_the_epoch_is_the_same(tmp_path: Path) -> None:
    """SIGKILL in worker 0 at sample 10: its replacement replays the iteration past the
    batches the consumer already has; the epoch equals a clean one, and the restart is
    counted."""
    clean = round_robin(40, 2, 2)
    marker = tmp_path / "killed"
    ds = ShardedRange(40, kill_at=10, marker=str(marker))
    with aioloader.DataLoader(ds, batch_size=2, num_workers=2) as loader:
        got = labels(list(loader))
        restarts = loader.stats().restarts
    assert marker.exists()
    assert got == clean
    assert restarts >= 1


def test_a_worker_that_keeps_dying_ends_in_worker_crashed_error(tmp_path: Path) -> None:
    ds = ShardedRange(
        20, kill_at=4, marker=str(tmp_path / "never-made" / "x")
    )  # the marker cannot be written
    with aioloader.DataLoader(ds, batch_size=2, num_workers=2, max_retries=1) as loader:
        with pytest.raises((aioloader.WorkerCrashedError, FileNotFoundError)) as info:
            list(loader)
    # The marker's directory does not exist, so the worker fails to write it: an
    # exception from the dataset, with its own type and note.
    assert isinstance(info.value, FileNotFoundError)
    assert "worker 0" in " ".join(getattr(info.value, "__notes__", []))


def test_timeout_stops_a_stuck_worker_and_names_the_batch() -> None:
    ds = ShardedRange(20, block_at=6)  # worker 0's batch 1 ([4, 6]) never comes
    with aioloader.DataLoader(ds, batch_size=2, num_workers=2, timeout=1.0) as loader:
        got: list[Any] = []
        with pytest.raises(
            aioloader.LoaderTimeout, match=r"worker 0 in epoch 0 \(batch 1 due\).*timeout=1.0"
        ):
            for b in loader:
                got.append(b)
    assert labels(got) == [[0, 2], [1, 3]]


def test_a_worker_stuck_unpickling_the_dataset_times_out(
    collect: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker stuck in its start (here: unpickling the dataset) holds the shard sent to
    it; with a timeout it is killed after max(timeout, START_FLOOR_S) (the floor lifted
    here) and the shard's batches raise LoaderTimeout; the next epoch is whole."""
    monkeypatch.setattr(dispatch, "START_FLOOR_S", 0.0)
    marker = tmp_path / "stuck"
    with aioloader.DataLoader(
        HangsOnceUnpickled(12, str(marker)), batch_size=2, num_workers=2, timeout=3.0
    ) as loader:
        with pytest.raises(aioloader.LoaderTimeout, match="had not finished starting"):
            collect(loader)
        assert marker.exists()
        got = sorted(i for b in collect(loader) for i in b[1].tolist())
        assert got == list(range(12))


def test_the_window_bounds_the_batches_built(tmp_path: Path) -> None:
    """Workers build a batch only with credit from the window: after the consumer took
    k batches, exactly min(k + prefetch, total) batches were built."""
    log = tmp_path / "built"
    log.touch()
    prefetch, bs, n = 3, 2, 48

    def built() -> int:
        return len(log.read_text().split()) // bs

    with aioloader.DataLoader(
        ShardedRange(n, log=str(log)), batch_size=bs, num_workers=2, prefetch=prefetch
    ) as loader:
        it = iter(loader)
        total = n // bs
        for taken in range(1, total + 1):
            next(it)
            bound = min(taken + prefetch, total)
            wait_until(lambda b=bound: built() >= b, 20.0, f"{bound} batches built")
            assert built() == bound
        it.close()


def test_the_default_window_grows_for_cheap_batches_and_still_bounds_them(tmp_path: Path) -> None:
    """With the default prefetch the window grows while batches are cheap, as a map-style
    DataLoader's does, and stays a bound: never more than its largest size (16x its
    start) built and not taken."""
    log = tmp_path / "built"
    log.touch()
    bs, n = 2, 1200

    def built() -> int:
        return len(log.read_text().split()) // bs

    with aioloader.DataLoader(ShardedRange(n, log=str(log)), batch_size=bs, num_workers=2) as loader:
        start, most = loader.prefetch, 16 * loader.prefetch
        widest = start
        got = []
        for taken, batch in enumerate(loader, 1):
            got.extend(batch[1].tolist())
            widest = max(widest, loader.stats().window)
            assert built() - taken <= most
        assert sorted(got) == list(range(n))
        assert start < widest <= most
        assert "grows while batches are cheap" in str(loader.stats())


def test_break_and_iterate_again(collect) -> None:
    ds = ShardedRange(30)
    expected = round_robin(30, 2, 2)
    with aioloader.DataLoader(ds, batch_size=2, num_workers=2) as loader:
        assert labels(collect(loader, limit=3)) == expected[:3]
        assert labels(collect(loader)) == expected  # the workers were freed for the new epoch


def test_a_second_iterator_ends_the_first() -> None:
    ds = ShardedRange(30)
    with aioloader.DataLoader(ds, batch_size=2, num_workers=2) as loader:
        first = iter(loader)
        next(first)
        second = iter(loader)
        assert labels(list(second)) == round_robin(30, 2, 2)
        assert list(first) == []  # ended when the second began (the workers are the second's)


@pytest.mark.parametrize("ordered", [True, False])
def test_state_dict_resumes_mid_epoch(ordered: bool) -> None:
    ds = ShardedRange(41)
    expected = round_robin(41, 3, 2)
    with aioloader.DataLoader(ds, batch_size=3, num_workers=2, seed=3, ordered=ordered) as loader:
        it = iter(loader)
        head = labels([next(it) for _ in range(5)])
        state = loader.state_dict()
        it.close()
    assert state["delivered"] == [3, 2] if ordered else sum(state["delivered"]) == 5
    with aioloader.DataLoader(ds, batch_size=3, num_workers=2, ordered=ordered) as resumed:
        resumed.load_state_dict(state)
        assert resumed.seed == 3
        tail = labels(list(resumed))
        assert resumed.epoch == 1
    if ordered:
        assert head + tail == expected
    else:
        assert sorted(map(tuple, head + tail)) == sorted(map(tuple, expected))


def test_state_dict_from_another_loader_is_refused() -> None:
    with aioloader.DataLoader(ShardedRange(8), batch_size=2, num_workers=2) as loader:
        state = loader.state_dict()
    with aioloader.DataLoader(ShardedRange(8), batch_size=2, num_workers=0) as other:
        with pytest.raises(aioloader.StateDictError, match="num_workers"):
            other.load_state_dict(state)
        with pytest.raises(aioloader.StateDictError, match="iterable dataset"):
            other.load_state_dict({"epoch": 0})


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"shuffle": True}, "shuffle=True"),
        ({"sampler": [0, 1]}, "sampler="),
        ({"on_error": "skip"}, "on_error='skip'"),
        ({"shard": (0, 2)}, "shard="),
        ({"last_batch": "rollover"}, "last_batch='rollover'"),
        ({"pool": aioloader.WorkerPool(0)}, "pool="),
    ],
)
def test_arguments_without_meaning_for_an_iterable_dataset_are_refused(
    kwargs: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=f"{named}.*iterable dataset"):
        aioloader.DataLoader(ShardedRange(4), **kwargs)
    pool = kwargs.get("pool")
    if pool is not None:
        pool.close()


def test_bad_arguments_still_name_themselves() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        aioloader.DataLoader(ShardedRange(4), batch_size=0)
    with pytest.raises(ValueError, match="num_workers"):
        aioloader.DataLoader(ShardedRange(4), num_workers=-1)


@pytest.mark.parametrize("workers", [2, 0])
def test_shards_talk_over_their_jobs_and_the_run_makes_no_socket(collect: Any, workers: int) -> None:
    """A shard's batches and credits travel with its job, over the worker's channel (or
    the loader's thread): no socket, no directory for one, even while the run is on."""
    ds = ShardedRange(23)
    expected = round_robin(23, 4, max(workers, 1))
    dirs = shard_dirs()
    with aioloader.DataLoader(ds, batch_size=4, num_workers=workers) as loader:
        it = iter(loader)
        first = [next(it)]
        during = shard_dirs() - dirs
        it.close()
        got = collect(loader)
    assert labels(first) == expected[:1] and labels(got) == expected
    assert not during


def test_a_batch_that_cannot_be_unpickled_in_the_main_process_is_named(collect: Any) -> None:
    """Worker 0's third batch holds a sample that only the main process fails to
    rebuild: the batches before it arrive, then its error, with a note naming the batch,
    the worker and the epoch."""
    from ._torch_datasets import UnreadableAt

    with aioloader.DataLoader(UnreadableAt(20, at=8), batch_size=2, num_workers=2, collate_fn=list) as loader:
        got: list[Any] = []
        with pytest.raises(ValueError, match="sample 8 cannot be rebuilt") as info:
            drain_into(got, loader, collect)
        notes = " ".join(getattr(info.value, "__notes__", []))
        assert "batch 2 of worker 0 in epoch 0 in the main process" in notes, notes
        assert got[:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
        assert [i for b in collect(loader, limit=3) for i in b] == [0, 2, 1, 3, 4, 6]  # the next epoch starts
