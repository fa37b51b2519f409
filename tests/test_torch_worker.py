"""torch users get torch behaviour: torch batches all through, worker info, no auto-batching."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import aioloader
from aioloader._collate import collate_torch

pytestmark = pytest.mark.torch


def _same_as_torch(got: Any, want: Any, path: str = "batch") -> None:
    """Leaf by leaf equal to torch's default_collate; sequences may be tuple or list
    (torch turns a batch of tuples into a list, aioloader keeps the tuple)."""
    import torch

    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: {type(got).__name__} is not a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape, f"{path}: {got.dtype} {got.shape}"
        assert torch.equal(got, want), path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), path
        for k in want:
            _same_as_torch(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)) and not all(isinstance(w, str) for w in want):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), path
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            _same_as_torch(g, w, f"{path}[{k}]")
    else:
        assert got == want, path


def test_tensor_samples_collate_as_torch_does() -> None:
    import torch
    from torch.utils.data import default_collate as torch_collate

    from ._torch_datasets import MixedSamples, NumpyTorchDataset

    mixed = [MixedSamples(8)[i] for i in range(5)]
    got = aioloader.default_collate(mixed)
    _same_as_torch(got, torch_collate(mixed))
    assert got[2].dtype == torch.int64 and got[3].dtype == torch.float64
    numpy_only = [NumpyTorchDataset(8)[i] for i in range(5)]
    _same_as_torch(collate_torch(numpy_only), torch_collate(numpy_only))
    scalars = [(np.float32(i), np.int8(i), True) for i in range(3)]
    _same_as_torch(collate_torch(scalars), torch_collate(scalars))


def test_numpy_samples_stay_numpy_with_torch_imported() -> None:
    import torch  # noqa: F401 (torch imported is not torch mode)

    from ._torch_datasets import NumpyTorchDataset

    batch = aioloader.default_collate([NumpyTorchDataset(4)[i] for i in range(4)])
    assert type(batch["x"]) is np.ndarray and type(batch["y"]) is np.ndarray
    assert batch["y"].dtype == np.int64 and batch["name"] == ["s0", "s1", "s2", "s3"]


@pytest.mark.parametrize("size", [3, 64 * 64], ids=["pickled", "shm"])
def test_torch_dataset_gives_torch_batches(collect: Callable[..., list[Any]], size: int) -> None:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import default_collate as torch_collate

    from ._torch_datasets import NumpyTorchDataset

    ds = NumpyTorchDataset(10, size)
    with aioloader.DataLoader(ds, 4, num_workers=2, seed=0) as loader:
        got = collect(loader)
        if size > 3:  # while the workers live, the consumer still maps their slabs
            from ._shm_datasets import shm_backed

            assert shm_backed(got[0]["x"]), "large numpy leaves still travel through shared memory"
    assert len(got) == 3
    for b, batch in enumerate(got):
        _same_as_torch(batch, torch_collate([ds[i] for i in range(4 * b, min(4 * b + 4, 10))]))
    logits = torch.zeros(4, 4)
    assert float(F.cross_entropy(logits, got[0]["y"])) > 0  # int labels are an int64 tensor


def test_plain_dataset_with_tensors_gives_torch_batches(collect: Callable[..., list[Any]]) -> None:
    from torch.utils.data import default_collate as torch_collate

    from ._torch_datasets import MixedSamples

    ds = MixedSamples(6)
    with aioloader.DataLoader(ds, 3, num_workers=2, seed=0) as loader:
        got = collect(loader)
    for b, batch in enumerate(got):
        _same_as_torch(batch, torch_collate([ds[i] for i in range(3 * b, 3 * b + 3)]))


class TorchImported:
    """Whether torch is imported where the sample loads (this module imports no torch)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> bool:
        return "torch" in sys.modules


def test_workers_report_torch_worker_info(collect: Callable[..., list[Any]]) -> None:
    from aioloader._seeding import worker_seed

    from ._torch_datasets import WorkerInfoDataset

    with aioloader.DataLoader(WorkerInfoDataset(12), 3, num_workers=2, seed=7) as loader:
        got = collect(loader)
    assert [int(i) for b in got for i in b["i"]] == list(range(12))
    for b in got:
        for wid, n, seed, same in zip(
            b["id"].tolist(), b["num_workers"].tolist(), b["seed"].tolist(), b["same"].tolist(), strict=True
        ):
            assert wid in (0, 1) and n == 2 and same
            assert seed == worker_seed(7, wid)


def test_worker_init_fn_sees_worker_info(collect: Callable[..., list[Any]]) -> None:
    from ._torch_datasets import InitSeenDataset, record_worker_info

    with aioloader.DataLoader(
        InitSeenDataset(6), 2, num_workers=2, worker_init_fn=record_worker_info
    ) as loader:
        got = collect(loader)
    for b in got:
        for wid, info_id, n in zip(*(t.tolist() for t in b), strict=True):
            assert info_id == wid and wid in (0, 1) and n == 2


def test_no_worker_info_in_thread_mode(collect: Callable[..., list[Any]]) -> None:
    from ._torch_datasets import WorkerInfoDataset

    with aioloader.DataLoader(WorkerInfoDataset(4), 2, num_workers=0) as loader:
        got = collect(loader)
    assert all(int(x) == -1 for b in got for x in b["id"])


def test_numpy_workers_do_not_import_torch(collect: Callable[..., list[Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    import torch  # noqa: F401 (the consumer has torch; its workers need not)

    # Workers that start afresh: one forked from a copy of this process would have torch already.
    monkeypatch.setenv("AIOLOADER_FORKSERVER", "spawn")

    with aioloader.DataLoader(TorchImported(), 2, num_workers=2) as loader:
        got = collect(loader)
    assert [bool(x) for b in got for x in b] == [False] * 4


def test_batch_size_none_yields_samples_as_torch_converts_them(collect: Callable[..., list[Any]]) -> None:
    import torch
    from torch.utils.data import default_convert as torch_convert

    from ._torch_datasets import NumpyTorchDataset

    ds = NumpyTorchDataset(5)
    with aioloader.DataLoader(ds, batch_size=None, num_workers=2, shuffle=True, seed=3) as loader:
        assert loader.batch_size is None and len(loader) == 5
        got = collect(loader)
    names = [s["name"] for s in got]
    with aioloader.DataLoader(ds, 1, shuffle=True, seed=3) as batched:
        assert names == [b["name"][0] for b in batched]  # the order batch_size=1 shuffles to
    for s in got:
        i = int(s["name"][1:])
        want = torch_convert(ds[i])
        assert isinstance(s["x"], torch.Tensor) and torch.equal(s["x"], want["x"])
        assert s["y"] == want["y"] and type(s["y"]) is int and s["w"] == want["w"]


def test_batch_size_none_keeps_numpy_samples(collect: Callable[..., list[Any]]) -> None:
    from ._datasets import RangeDataset

    with aioloader.DataLoader(RangeDataset(4), batch_size=None, num_workers=2) as loader:
        got = collect(loader)
    assert [i for _, i in got] == [0, 1, 2, 3]
    assert all(type(x) is np.ndarray and x.shape == (3,) for x, _ in got)


def test_batch_size_none_gives_collate_fn_the_sample(collect: Callable[..., list[Any]]) -> None:
    from ._datasets import RangeDataset
    from ._torch_datasets import describe_sample

    with aioloader.DataLoader(
        RangeDataset(3), batch_size=None, collate_fn=describe_sample, num_workers=2
    ) as loader:
        assert collect(loader) == [("tuple", 2)] * 3


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"drop_last": True}, "drop_last=True"),
        ({"last_batch": "rollover"}, "last_batch='rollover'"),
        ({"batch_sampler": [[0, 1]]}, "batch_sampler"),
    ],
)
def test_batch_size_none_refuses_batching_arguments(kwargs: dict[str, Any], named: str) -> None:
    from ._datasets import RangeDataset

    with pytest.raises(ValueError, match=f"batch_size=None .* {named}"):
        aioloader.DataLoader(RangeDataset(3), batch_size=None, **kwargs)


def test_iterable_dataset_with_len_is_iterated_not_indexed() -> None:
    """Regression: one with __len__ passed validation, then failed at sample 0 with
    NotImplementedError (the __getitem__ torch's Dataset defines). It is iterated now
    (tests/test_iterable_dataset.py has the rest)."""
    from ._torch_datasets import CountingIterable

    with aioloader.DataLoader(CountingIterable(), 2) as loader:
        assert len(loader) == 2
        assert [b.tolist() for b in loader] == [[0, 1], [2]]


def test_batch_size_none_resumes_mid_epoch() -> None:
    from ._datasets import RangeDataset

    with aioloader.DataLoader(
        RangeDataset(6), batch_size=None, num_workers=2, shuffle=True, seed=1
    ) as loader:
        whole = [i for _, i in loader]
        it = iter(loader)
        head = [next(it)[1] for _ in range(3)]
        state = loader.state_dict()
        it.close()
    with aioloader.DataLoader(RangeDataset(6), batch_size=None, shuffle=True, seed=1) as resumed:
        resumed.load_state_dict(state)
        tail = [i for _, i in resumed]
    with aioloader.DataLoader(RangeDataset(6), batch_size=None, shuffle=True, seed=1) as fresh:
        fresh.set_epoch(1)
        assert head + tail == [i for _, i in fresh] and sorted(whole) == list(range(6))
