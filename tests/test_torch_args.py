"""torch's DataLoader argument spellings, and len(dataset) read again every epoch."""

from __future__ import annotations

import inspect
import multiprocessing as mp
import warnings
from typing import Any

import numpy as np
import pytest

import aioloader

from ._datasets import PidDataset, RangeDataset
from .conftest import _cmdline


def ids_of(batches: list[Any]) -> list[list[int]]:
    return [b[1].tolist() for b in batches]


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


# ------------------------------------------------------------------ batch_sampler
def test_batch_sampler_says_to_leave_drop_last_out() -> None:
    # drop_last=False is torch's default and accepted beside a batch sampler; True is not
    with aioloader.DataLoader(RangeDataset(4), batch_sampler=[[0, 1], [2, 3]], drop_last=False) as loader:
        assert len(loader) == 2
    with pytest.raises(ValueError, match="batch_sampler is mutually exclusive with drop_last=True") as info:
        aioloader.DataLoader(RangeDataset(4), batch_sampler=[[0, 1], [2, 3]], drop_last=True)
    assert "leave it out" in str(info.value)
    with pytest.raises(ValueError, match=r"with batch_size, drop_last=True: .* leave them out"):
        aioloader.DataLoader(RangeDataset(4), 2, batch_sampler=[[0, 1]], drop_last=True)


# ------------------------------------------------------------------ prefetch_factor
@pytest.mark.parametrize("num_workers,factor", [(1, 3), (2, 2)], ids=["1x3", "2x2"])
def test_prefetch_factor_is_per_worker(collect, num_workers: int, factor: int) -> None:
    with aioloader.DataLoader(RangeDataset(10), 4, num_workers=num_workers, prefetch_factor=factor) as loader:
        assert loader.prefetch == num_workers * factor
        assert ids_of(collect(loader)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_prefetch_factor_needs_workers_and_excludes_prefetch() -> None:
    with pytest.raises(ValueError, match=r"prefetch_factor=2 needs num_workers > 0"):
        aioloader.DataLoader(RangeDataset(4), prefetch_factor=2)
    with pytest.raises(ValueError, match="prefetch or prefetch_factor"):
        aioloader.DataLoader(RangeDataset(4), num_workers=1, prefetch=2, prefetch_factor=2)
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="prefetch_factor"):
            aioloader.DataLoader(RangeDataset(4), num_workers=1, prefetch_factor=bad)


# --------------------------------------------------------------- persistent_workers
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "not-persistent"])
def test_persistent_workers_is_accepted_and_workers_persist(collect, persistent: bool) -> None:
    with aioloader.DataLoader(PidDataset(4), 2, num_workers=1, persistent_workers=persistent) as loader:
        first = {int(p) for b in collect(loader) for p in b[0]}
        second = {int(p) for b in collect(loader) for p in b[0]}
    assert first == second and len(first) == 1  # the same worker process, epoch after epoch


def test_persistent_workers_without_workers_is_refused_as_in_torch() -> None:
    with pytest.raises(ValueError, match="persistent_workers=True needs num_workers > 0"):
        aioloader.DataLoader(RangeDataset(4), 2, num_workers=0, persistent_workers=True)
    aioloader.DataLoader(RangeDataset(4), 2, num_workers=0, persistent_workers=False).close()
    # a shared pool's workers are what count (num_workers is ignored with pool=)
    with aioloader.WorkerPool(1) as pool:
        loader = aioloader.DataLoader(
            RangeDataset(4), 2, pool=pool, persistent_workers=True, prefetch_factor=3
        )
        assert loader.prefetch == 3
        loader.close()


def test_persistent_workers_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="persistent_workers"):
        aioloader.DataLoader(RangeDataset(4), persistent_workers="yes")


# ------------------------------------------------------------------------- in_order
@pytest.mark.parametrize("in_order", [True, False], ids=["in-order", "as-completed"])
def test_in_order_is_ordered(collect, in_order: bool) -> None:
    with aioloader.DataLoader(RangeDataset(10), 2, num_workers=2, in_order=in_order) as loader:
        assert loader.ordered is in_order
        got = ids_of(collect(loader))
    expected = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert (got if in_order else sorted(got)) == expected


def test_in_order_conflicts_with_ordered_and_must_be_a_bool() -> None:
    for ordered in (True, False):
        with pytest.raises(ValueError, match="ordered or in_order"):
            aioloader.DataLoader(RangeDataset(4), ordered=ordered, in_order=True)
    with pytest.raises(TypeError, match="in_order"):
        aioloader.DataLoader(RangeDataset(4), in_order="no")
    with pytest.raises(TypeError, match="ordered"):
        aioloader.DataLoader(RangeDataset(4), ordered=1)


# ---------------------------------------------------------- multiprocessing_context
@pytest.mark.parametrize("how", ["name", "context"])
def test_multiprocessing_context_spawn_really_spawns(collect, how: str) -> None:
    ctx: Any = "spawn" if how == "name" else mp.get_context("spawn")
    # transport="pickle": this test is about the start method, not shared memory (once, a
    # spawned worker's slab outlived close() in the async face: reported, not fixed here).
    with aioloader.DataLoader(
        PidDataset(4), 2, num_workers=1, multiprocessing_context=ctx, transport="pickle"
    ) as loader:
        assert loader.pool.start_method == "spawn"
        pids = {int(p) for b in collect(loader) for p in b[0]}
        assert pids == set(loader.worker_pids())
        # A spawned worker is a fresh interpreter running spawn_main (a forkserver or fork
        # child would carry its parent's command line instead).
        assert all("spawn_main" in _cmdline(pid) for pid in pids), [_cmdline(p) for p in pids]


def test_multiprocessing_context_conflicts_and_bad_values() -> None:
    with pytest.raises(ValueError, match="mp_context or multiprocessing_context"):
        aioloader.DataLoader(
            RangeDataset(4), num_workers=1, mp_context="spawn", multiprocessing_context="spawn"
        )
    with pytest.raises(ValueError, match="multiprocessing_context: unknown start method 'bogus'"):
        aioloader.DataLoader(RangeDataset(4), num_workers=1, multiprocessing_context="bogus")
    with pytest.raises(TypeError, match="multiprocessing_context"):
        aioloader.DataLoader(RangeDataset(4), num_workers=1, multiprocessing_context=5)


# -------------------------------------------------------------------------- timeout
def test_timeout_zero_means_no_timeout_as_in_torch(collect) -> None:
    with aioloader.DataLoader(RangeDataset(6), 3, timeout=0) as loader:
        assert loader.timeout == 0 and type(loader.timeout) is int
        assert ids_of(collect(loader)) == [[0, 1, 2], [3, 4, 5]]
    for bad in (-1, float("nan"), False):
        with pytest.raises(ValueError, match="timeout"):
            aioloader.DataLoader(RangeDataset(4), timeout=bad)


# ------------------------------------------------------------------------ generator
@pytest.mark.torch
def test_generator_seeds_the_order(collect) -> None:
    import torch

    def order(seed: int) -> tuple[int, list[list[int]]]:
        g = torch.Generator().manual_seed(seed)
        with aioloader.DataLoader(RangeDataset(40), 8, shuffle=True, generator=g) as loader:
            return loader.seed, ids_of(collect(loader))

    expected_seed = int(
        torch.empty((), dtype=torch.int64).random_(generator=torch.Generator().manual_seed(5))
    )
    seed_a, a = order(5)
    seed_b, b = order(5)
    seed_c, c = order(6)
    assert seed_a == seed_b == expected_seed and seed_c != seed_a
    assert a == b and a != c
    assert sorted(flat(c)) == list(range(40))


@pytest.mark.torch
def test_generator_conflicts_with_seed_and_must_be_a_torch_generator() -> None:
    import torch

    with pytest.raises(ValueError, match="seed or generator"):
        aioloader.DataLoader(RangeDataset(4), seed=1, generator=torch.Generator())
    for bad in (5, np.random.default_rng(0)):
        with pytest.raises(TypeError, match=r"generator must be a torch\.Generator"):
            aioloader.DataLoader(RangeDataset(4), generator=bad)


# ----------------------------------------------------------------------- pin_memory
@pytest.mark.torch
def test_pin_memory_pins_tensors_or_warns_once(collect) -> None:
    import torch

    from ._torch_datasets import TorchAugmentedDataset

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = aioloader.DataLoader(TorchAugmentedDataset(6), 3, pin_memory=True, num_workers=1)
    pin_warnings = [w for w in caught if "pin_memory" in str(w.message)]
    with loader:
        assert loader.pin_memory is True
        with warnings.catch_warnings(record=True) as later:
            warnings.simplefilter("always")
            got = collect(loader)
        assert not [w for w in later if "pin_memory" in str(w.message)]  # warned once, at construction
    assert [b[1].tolist() for b in got] == [[0, 1, 2], [3, 4, 5]]
    assert all(isinstance(b[0], torch.Tensor) and b[0].shape == (3, 3) for b in got)
    if torch.cuda.is_available():
        assert not pin_warnings
        assert all(b[0].is_pinned() for b in got)
    else:
        assert len(pin_warnings) == 1 and pin_warnings[0].category is UserWarning
        assert "CUDA is not available" in str(pin_warnings[0].message)
        assert not any(b[0].is_pinned() for b in got)


def test_pin_memory_device_without_pin_memory_warns_and_bad_values_raise() -> None:
    with pytest.warns(UserWarning, match="pin_memory_device='cuda' has no effect without pin_memory=True"):
        aioloader.DataLoader(RangeDataset(4), pin_memory_device="cuda").close()
    with pytest.raises(TypeError, match="pin_memory must be a bool"):
        aioloader.DataLoader(RangeDataset(4), pin_memory="yes")
    with pytest.raises(TypeError, match="pin_memory_device must be a str"):
        aioloader.DataLoader(RangeDataset(4), pin_memory_device=0)


# ------------------------------------------------------------- the whole signature
@pytest.mark.torch
def test_every_torch_keyword_is_accepted() -> None:
    from torch.utils.data import DataLoader as TorchLoader

    torch_names = set(inspect.signature(TorchLoader.__init__).parameters) - {"self"}
    ours = set(inspect.signature(aioloader.DataLoader.__init__).parameters)
    assert torch_names <= ours, torch_names - ours


@pytest.mark.torch
def test_torch_style_call_with_every_argument(collect) -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # pin_memory without CUDA
        loader = aioloader.DataLoader(
            RangeDataset(10),
            batch_size=4,
            shuffle=True,
            num_workers=1,
            pin_memory=True,
            drop_last=True,
            timeout=0,
            multiprocessing_context="forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn",
            generator=g,
            prefetch_factor=2,
            persistent_workers=True,
            pin_memory_device="",
            in_order=True,
        )
    with loader:
        got = ids_of(collect(loader))
    assert len(got) == 2 and all(len(b) == 4 for b in got) and len(set(flat(got))) == 8


# ------------------------------------------------------------ a growing dataset
class Growing(RangeDataset):
    """A dataset whose length is changed by the test between epochs (the same object is
    used by the thread worker; process workers index past their copy's n just as well)."""


@pytest.mark.parametrize("num_workers", [0, 1], ids=["thread", "process"])
@pytest.mark.parametrize("shuffle", [False, True], ids=["sequential", "shuffled"])
def test_a_grown_dataset_is_seen_whole_at_the_next_epoch(collect, num_workers: int, shuffle: bool) -> None:
    ds = Growing(10)
    with aioloader.DataLoader(ds, 4, shuffle=shuffle, num_workers=num_workers, seed=1) as loader:
        assert len(loader) == 3
        first = ids_of(collect(loader))
        ds.n = 14  # the previous run may already have planned epoch 1 for 10 samples
        assert len(loader) == 4
        second = ids_of(collect(loader))
        ds.n = 6
        third = ids_of(collect(loader))
    assert sorted(flat(first)) == list(range(10)) and len(first) == 3
    assert sorted(flat(second)) == list(range(14)) and len(second) == 4
    assert sorted(flat(third)) == list(range(6)) and len(third) == 2
    if not shuffle:
        assert second == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13]]


def test_a_mid_epoch_state_resumes_with_its_recorded_length(collect) -> None:
    ds = Growing(12)
    with aioloader.DataLoader(ds, 4, shuffle=True, seed=3) as loader:
        full = ids_of(collect(loader))
    with aioloader.DataLoader(ds, 4, shuffle=True, seed=3) as loader:
        it = iter(loader)
        head = [next(it)[1].tolist()]
        state = loader.state_dict()
        it.close()
    assert state["length"] == 12 and head == full[:1]
    ds.n = 20  # grew since the state was taken
    with aioloader.DataLoader(ds, 4, shuffle=True) as loader:
        loader.load_state_dict(state)
        assert len(loader) == 3  # the resumed epoch keeps its 12 samples
        rest = ids_of(collect(loader))
        assert state["length"] == 12 and loader.state_dict()["length"] == 20
        assert len(loader) == 5
        following = ids_of(collect(loader))
    assert head + rest == full
    assert sorted(flat(following)) == list(range(20))
    ds.n = 11  # shrank below the recorded length: that epoch cannot be resumed
    with aioloader.DataLoader(ds, 4, shuffle=True) as loader:
        with pytest.raises(aioloader.StateDictError, match="length 12"):
            loader.load_state_dict(state)


def test_a_state_between_epochs_reads_the_length_again() -> None:
    ds = Growing(8)
    with aioloader.DataLoader(ds, 4, shuffle=True, seed=2) as loader:
        list(loader)
        state = loader.state_dict()
    assert state["epoch"] == 1 and state["length"] == 8
    ds.n = 5  # smaller is fine too: epoch 1 had not begun
    with aioloader.DataLoader(ds, 4, shuffle=True) as loader:
        loader.load_state_dict(state)
        got = ids_of(list(loader))
    assert sorted(flat(got)) == list(range(5))


class DictSamples(RangeDataset):
    """Samples that are dicts holding a tensor and a numpy array."""

    def __getitem__(self, i: int) -> Any:
        import torch

        return {"t": torch.full((2,), float(i)), "a": np.full(2, i), "i": i}


@pytest.mark.torch
def test_pin_memory_reaches_every_tensor_of_a_batch(collect, monkeypatch: pytest.MonkeyPatch) -> None:
    # Without CUDA here, a stand-in for Tensor.pin_memory that marks its result shows that
    # every tensor of every batch, and nothing else, passes through it in both faces.
    import torch

    calls: list[str] = []

    def fake_pin(self: Any, *device: str) -> Any:
        calls.append(device[0] if device else "")
        out = self.clone()
        out.pinned_by_test = True
        return out

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    with aioloader.DataLoader(DictSamples(5), 2, pin_memory=True, pin_memory_device="cuda:0") as loader:
        got = collect(loader)
    assert [b["i"].tolist() for b in got] == [[0, 1], [2, 3], [4]]
    # Samples holding a tensor make torch batches: the numpy array and the ints arrive as
    # tensors too, and all three are pinned.
    assert all(getattr(b[k], "pinned_by_test", False) for b in got for k in ("t", "a", "i"))
    assert calls == ["cuda:0"] * 9
    assert aioloader._torch_compat.pin_tensors((torch.zeros(1), [torch.ones(1)], "x"), "")[1][
        0
    ].pinned_by_test


# ----------------------------------------------------- torch's attributes and habits
@pytest.mark.torch
def test_torchs_attributes_rebuild_a_torch_loader_with_our_batches(collect) -> None:
    # What accelerate's skip_first_batches does: a torch loader from this one's attributes.
    import torch

    with aioloader.DataLoader(RangeDataset(10), 3, shuffle=True, num_workers=1, seed=4) as loader:
        assert loader.timeout == 0 and loader.generator is None and loader.in_order is True
        assert loader.persistent_workers is False and loader.prefetch_factor == 2
        assert loader.multiprocessing_context is None
        assert len(loader.sampler) == 10 and len(loader.batch_sampler) == len(loader) == 4
        assert loader.batch_sampler.batch_size == 3 and loader.batch_sampler.drop_last is False
        planned = list(loader.batch_sampler)  # epoch 0, as the loader will run it
        assert [i for b in planned for i in b] == list(loader.sampler)
        rebuilt = torch.utils.data.DataLoader(
            loader.dataset, batch_sampler=loader.batch_sampler, timeout=loader.timeout,
            num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
            worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
            generator=loader.generator, prefetch_factor=loader.prefetch_factor,
            persistent_workers=loader.persistent_workers, in_order=loader.in_order,
        )  # fmt: skip
        theirs = [b[1].tolist() for b in rebuilt]
        ours = ids_of(collect(loader))
        assert ours == theirs == planned and sorted(flat(ours)) == list(range(10))
        assert list(loader.batch_sampler) != planned  # now it shows epoch 1, the next one
        loader.batch_sampler.set_epoch(0)  # pinned, as DistributedSampler.set_epoch pins it
        assert list(loader.batch_sampler) == planned and loader.epoch == 1
    ctx = mp.get_context("spawn")
    with aioloader.DataLoader(
        RangeDataset(4), 2, num_workers=1, prefetch_factor=3, persistent_workers=True,
        multiprocessing_context="spawn", in_order=False, timeout=5,
    ) as loader:  # fmt: skip
        assert loader.prefetch_factor == 3 and loader.persistent_workers is True
        assert loader.multiprocessing_context is ctx and loader.in_order is False and loader.timeout == 5
    # given samplers are kept; batch_size=None has no batch sampler, as in torch
    sampler = [3, 1, 2, 0]
    with aioloader.DataLoader(RangeDataset(4), 2, sampler=sampler) as loader:
        assert loader.sampler is sampler and list(loader.batch_sampler) == [[3, 1], [2, 0]]
    with aioloader.DataLoader(RangeDataset(4), batch_sampler=[[0], [1, 2]]) as loader:
        assert loader.batch_sampler == [[0], [1, 2]]
    with aioloader.DataLoader(RangeDataset(4), None) as loader:
        assert loader.batch_sampler is None and list(loader.sampler) == [0, 1, 2, 3]


@pytest.mark.torch
def test_torch_manual_seed_fixes_the_shuffle(collect) -> None:
    import torch

    def order(seed: int) -> list[list[int]]:
        torch.manual_seed(seed)
        with aioloader.DataLoader(RangeDataset(30), 5, shuffle=True) as loader:
            return ids_of(collect(loader))

    assert order(0) == order(0) != order(1)


@pytest.mark.torch
@pytest.mark.parametrize("num_workers", [0, 2], ids=["thread", "processes"])
def test_workers_give_torch_one_thread_as_torchs_do(collect, num_workers: int) -> None:
    import torch

    from ._torch_datasets import TorchThreads

    before = torch.get_num_threads()
    with aioloader.DataLoader(TorchThreads(8), 2, num_workers=num_workers) as loader:
        threads = {int(t) for b in collect(loader) for t in b[0]}
    # owned workers: one thread; the loader's own thread shares this process's setting
    assert threads == ({1} if num_workers else {before})
    assert torch.get_num_threads() == before
