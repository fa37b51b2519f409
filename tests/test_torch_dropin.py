"""torch code, unchanged, on aioloader.DataLoader: torch's positional order and defaults,
an iterator that goes on after a failed batch, a sampler of bulk keys without batching,
torch's warning for too many workers, and torch's phrases in errors."""

from __future__ import annotations

import asyncio
import inspect
import signal
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioloader
from aioloader._cpus import available_cpus

from ._datasets import CrashDataset, FailingDataset, RangeDataset

WORKERS = [pytest.param(0, id="thread"), pytest.param(2, id="processes")]


def ids_of(batches: list[Any]) -> list[list[int]]:
    return [b[1].tolist() for b in batches]


def go_on_after_errors(loader: Any, face: str) -> tuple[list[Any], list[BaseException]]:
    """torch's error-skipping loop: ``next()`` again after a batch raised, to the end."""
    got: list[Any] = []
    errors: list[BaseException] = []
    if face == "for":
        it = iter(loader)
        while True:
            try:
                got.append(next(it))
            except StopIteration:
                return got, errors
            except Exception as exc:
                errors.append(exc)

    async def main() -> None:
        it = loader.__aiter__()
        while True:
            try:
                got.append(await it.__anext__())
            except StopAsyncIteration:
                return
            except Exception as exc:
                errors.append(exc)

    asyncio.run(main())
    return got, errors


# ------------------------------------------------------------ positional order, defaults
@pytest.mark.torch
def test_positional_parameters_are_torchs() -> None:
    import torch.utils.data

    def positional(fn: Any) -> list[str]:
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        return [p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds]

    ours = positional(aioloader.DataLoader.__init__)[1:]  # past self
    assert ours == positional(torch.utils.data.DataLoader.__init__)[1:]
    keyword = {p.name for p in inspect.signature(torch.utils.data.DataLoader.__init__).parameters.values()}
    assert keyword <= set(inspect.signature(aioloader.DataLoader.__init__).parameters)


@pytest.mark.parametrize("face", ["for", "async-for"])
def test_torch_positional_call(collect, face: str) -> None:
    # DataLoader(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers,
    # collate_fn, pin_memory, drop_last, timeout, worker_init_fn)
    with aioloader.DataLoader(RangeDataset(10), 4, True, None, None, 0, None, False, True, 0, None) as loader:
        assert loader.shuffle is True and loader.drop_last and loader.timeout == 0
        got = ids_of(collect(loader))
    assert [len(b) for b in got] == [4, 4]
    assert sorted(i for b in got for i in b) != list(range(8)) or got != [[0, 1, 2, 3], [4, 5, 6, 7]]
    with aioloader.DataLoader(RangeDataset(6), 3, None) as loader:  # shuffle=None: torch's default
        assert loader.shuffle is False
        assert ids_of(collect(loader)) == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.torch
def test_an_iterable_dataset_takes_torchs_positional_call(collect) -> None:
    import torch.utils.data

    from ._torch_datasets import ShardedRange

    # dataset, batch_size, shuffle=None, sampler, batch_sampler, num_workers, collate_fn,
    # pin_memory, drop_last
    args = (ShardedRange(9), 2, None, None, None, 2, None, False, True)
    with aioloader.DataLoader(*args) as loader:
        assert loader.drop_last
        got = [b[1].tolist() for b in collect(loader)]
    assert got == [b[1].tolist() for b in torch.utils.data.DataLoader(*args)]
    with pytest.raises(ValueError, match="shuffle=True cannot be used with an iterable dataset"):
        aioloader.DataLoader(ShardedRange(9), 2, True)


def test_shuffle_none_and_drop_last_false_mean_what_they_mean_in_torch(collect) -> None:
    with aioloader.DataLoader(RangeDataset(5), batch_size=2, shuffle=None, drop_last=False) as loader:
        assert ids_of(collect(loader)) == [[0, 1], [2, 3], [4]]
    # torch accepts drop_last=False beside a batch_sampler (only True conflicts with it)
    with aioloader.DataLoader(RangeDataset(5), batch_sampler=[[4, 0], [2]], shuffle=None, drop_last=False) as loader:
        assert ids_of(collect(loader)) == [[4, 0], [2]]
    with pytest.raises(ValueError, match="batch_sampler is mutually exclusive with drop_last=True"):
        aioloader.DataLoader(RangeDataset(5), batch_sampler=[[0]], drop_last=True)
    with pytest.raises(TypeError, match="shuffle must be a bool"):
        aioloader.DataLoader(RangeDataset(5), shuffle="yes")


# ------------------------------------------------------- the iterator goes on after an error
@pytest.mark.parametrize("num_workers", WORKERS)
@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "as-completed"])
def test_every_later_batch_arrives_after_a_failed_one(num_workers: int, ordered: bool) -> None:
    # batches 1 and 2 (samples 5 and 9) raise; the loop sees both errors and every other batch
    with aioloader.DataLoader(
        FailingDataset(24, {5, 9}), 4, num_workers=num_workers, prefetch=2, ordered=ordered,
        prefetch_next_epoch=False,  # so that nothing is in flight once the epoch ended
    ) as loader:
        got, errors = go_on_after_errors(loader, "for")
        assert [type(e) for e in errors] == [KeyError, KeyError]
        assert any("sample index 5" in n for n in errors[0].__notes__ + errors[1].__notes__)
        want = [[0, 1, 2, 3], [12, 13, 14, 15], [16, 17, 18, 19], [20, 21, 22, 23]]
        assert (ids_of(got) if ordered else sorted(ids_of(got))) == want
        # the epoch ran to its end: the next one begins at its start, and is whole again
        assert loader.epoch == 1 and loader.state_dict()["batches_delivered"] == 0
        assert loader.stats().in_flight == 0  # the failed batches' slots were freed too
        again, errors = go_on_after_errors(loader, "for")
        assert len(errors) == 2 and (ids_of(again) if ordered else sorted(ids_of(again))) == want


@pytest.mark.parametrize("num_workers", WORKERS)
def test_async_for_ends_at_an_error_with_its_run_finished(num_workers: int) -> None:
    # An async generator that raised is over; its run must end before the error reaches
    # the caller, or its cleanup would race asyncio.run closing the loop.
    with aioloader.DataLoader(FailingDataset(24, {5}), 4, num_workers=num_workers, prefetch=4) as loader:
        got, errors = go_on_after_errors(loader, "async-for")
        assert [type(e) for e in errors] == [KeyError]
        assert ids_of(got) == [[0, 1, 2, 3]]
        assert loader.stats().in_flight == 0  # nothing left running on the closed loop
        again, errors = go_on_after_errors(loader, "async-for")  # a new pass runs as usual
        assert ids_of(again) == [[0, 1, 2, 3]] and len(errors) == 1


@pytest.mark.parametrize("num_workers", WORKERS)
def test_state_dict_after_a_failed_batch_resumes_after_it(num_workers: int) -> None:
    with aioloader.DataLoader(FailingDataset(16, {5}), 4, num_workers=num_workers, seed=1) as loader:
        it = iter(loader)
        assert next(it)[1].tolist() == [0, 1, 2, 3]
        with pytest.raises(KeyError):
            next(it)
        state = loader.state_dict()  # the failed batch is passed, as the iterator passed it
        assert state["batches_delivered"] == 2
        it.close()
    with aioloader.DataLoader(RangeDataset(16), 4, num_workers=num_workers, seed=1) as resumed:
        resumed.load_state_dict(state)
        assert ids_of(list(resumed)) == [[8, 9, 10, 11], [12, 13, 14, 15]]


@pytest.mark.parametrize("num_workers", WORKERS)
@pytest.mark.parametrize("face", ["for", "async-for"])
def test_break_or_close_after_an_error_leaves_nothing(face: str, num_workers: int) -> None:
    # the autouse no_leaks fixture checks that no worker, thread or segment is left
    with aioloader.DataLoader(FailingDataset(40, {5}), 4, num_workers=num_workers, prefetch=4) as loader:
        if face == "for":
            it = iter(loader)
            next(it)
            with pytest.raises(KeyError):
                next(it)
            assert next(it)[1].tolist() == [8, 9, 10, 11]
            it.close()
            with pytest.raises(StopIteration):
                next(it)
        else:

            async def main() -> None:
                it = loader.__aiter__()
                await it.__anext__()
                with pytest.raises(KeyError):
                    await it.__anext__()
                with pytest.raises(StopAsyncIteration):  # the error ended it
                    await it.__anext__()

            asyncio.run(main())
        assert loader.stats().in_flight == 0
        # a plain for loop still ends at the error, as torch's does
        with pytest.raises(KeyError):
            for _ in loader:
                pass
    assert loader.closed


def test_too_many_skipped_still_ends_the_iteration() -> None:
    # on_error="skip" with max_skipped keeps its meaning: past the limit the epoch ends
    with aioloader.DataLoader(FailingDataset(16, {1, 2, 3}), 4, on_error="skip", max_skipped=1) as loader:
        it = iter(loader)
        with pytest.raises(aioloader.TooManySkippedError):
            next(it)
        with pytest.raises(StopIteration):
            next(it)


# -------------------------------------------------------- batch_size=None with bulk keys
class BulkDataset:
    """torch's bulk-loading pattern: ``dataset[list of indices]`` returns a whole batch."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, keys: list[int]) -> np.ndarray:
        return np.asarray(keys, dtype=np.int64) * 10


class ChunkSampler:
    def __iter__(self) -> Any:
        return iter([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]])

    def __len__(self) -> int:
        return 4


@pytest.mark.parametrize("num_workers", WORKERS)
def test_a_sampler_of_keys_without_batching(collect, num_workers: int) -> None:
    with aioloader.DataLoader(BulkDataset(), batch_size=None, sampler=ChunkSampler(), num_workers=num_workers) as dl:
        assert len(dl) == 4
        assert [b.tolist() for b in collect(dl)] == [[0, 10, 20], [30, 40, 50], [60, 70, 80], [90]]
    # with batching on, a key must still be an int: the sampler is named
    with pytest.raises(TypeError, match=r"sampler .*item 0 is"):
        list(aioloader.DataLoader(BulkDataset(), batch_size=2, sampler=ChunkSampler()))


# ------------------------------------------------------------ more workers than CPUs
def test_warns_as_torch_when_workers_exceed_the_usable_cpus() -> None:
    cpus = available_cpus()[0]
    with pytest.warns(UserWarning, match=f"will create {cpus + 1} worker processes in total") as caught:
        loader = aioloader.DataLoader(RangeDataset(4), 2, num_workers=cpus + 1)
    loader.close()
    assert caught[0].filename == __file__  # it points at the DataLoader(...) call
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        aioloader.DataLoader(RangeDataset(4), 2, num_workers=cpus).close()
        aioloader.DataLoader(RangeDataset(4), 2, num_workers="auto").close()


# ------------------------------------------------------------------ torch's phrases
def test_errors_carry_torchs_phrases() -> None:
    with pytest.raises(ValueError, match="num_workers must be an int >= 0") as info:
        aioloader.DataLoader(RangeDataset(4), num_workers=-1)
    assert "num_workers option should be non-negative" in str(info.value)
    with pytest.raises(ValueError, match=r"Invalid rank 3, rank should be in the interval \[0, 1\]"):
        aioloader.DataLoader(RangeDataset(4), shard=(3, 2))
    with pytest.raises(ValueError, match=r"Invalid rank 3, rank should be in the interval \[0, 2\]"):
        aioloader.DistributedSampler(10, 3, 3)


def test_a_killed_worker_is_named_as_torch_names_it(tmp_path: Path) -> None:
    ds = CrashDataset(8, {2}, str(tmp_path), always=True)
    with aioloader.DataLoader(ds, 4, num_workers=1, max_retries=0) as loader:
        with pytest.raises(aioloader.WorkerCrashedError) as info:
            list(loader)
    text = str(info.value)
    assert "exit code -9, killed by SIGKILL" in text
    assert f"is killed by signal: {signal.strsignal(signal.SIGKILL)}." in text
    assert "DataLoader worker (pid " in text and "pid unknown" not in text


@pytest.mark.torch
def test_nested_tensors_are_refused_in_torchs_words() -> None:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: nested tensors are a prototype
        nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(aioloader.CollateError, match="not currently supported by the default collate_fn"):
        aioloader.default_collate([nt, nt])


@pytest.mark.torch
def test_numpy_strings_collate_to_a_list_as_in_torch() -> None:
    # HF datasets in numpy format give text as np.str_: torch keeps such samples a list.
    import numpy as np
    import torch

    for samples in ([np.str_("a"), np.str_("bc")], [np.bytes_(b"x"), np.bytes_(b"yz")], ["a", "bc"]):
        got = aioloader.default_collate(samples)
        assert got == torch.utils.data.default_collate(samples) == samples and type(got) is list
