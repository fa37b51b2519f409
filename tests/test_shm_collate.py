"""default_collate under transport="shm": the batch default_collate makes, with its large
leaves in shared memory. The collate runs in a real worker process; the batch arrives
here through the executor's pipe, as a loader's would."""

from __future__ import annotations

import concurrent.futures as cf
import gc
import multiprocessing as mp
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioloader import CollateError, _shm, default_collate

from . import _shm_datasets as D

pytestmark = pytest.mark.skipif(_shm.unavailable_reason() is not None, reason="needs a usable /dev/shm")

MIN = 256  # bytes: lowered from 64 KiB so that small examples reach the slab
PLAIN = (dict, OrderedDict, list, tuple, D.Pair, D.PairWithDict)  # built without user code
DTYPES = ["<f4", "<f8", "|u1", "<i2", "|b1", "<c8", ">i4"]
TENSOR_DTYPES = ["float32", "int64", "uint8", "float16", "bfloat16"]


@pytest.fixture
def worker() -> Iterator[Callable[..., Any]]:
    """``run(fn, *args)``: ``fn(encoder, *args)`` in a worker process, decoded here."""
    enc = _shm.ShmEncoder(
        _shm.ShmConfig(
            consumer_pid=os.getpid(), host=_shm.host_key(), window=2, max_slabs=4, min_leaf_bytes=MIN
        )
    )
    dec = _shm.ShmDecoder()
    ex = cf.ProcessPoolExecutor(1, mp_context=mp.get_context("forkserver"))

    def run(fn: Callable[..., Any], *args: Any) -> Any:
        return dec(ex.submit(fn, enc, *args).result(timeout=60))

    try:
        yield run
    finally:
        ex.shutdown(wait=True)
        gc.collect()
        _shm.sweep(force=True)  # forget the dead worker's slabs


def check_placement(got: Any, plain: bool = True, path: str = "batch") -> int:
    """Large stacks inside containers built without user code view a slab, nothing else
    does. Returns how many leaves do."""
    torch_leaf = type(got).__name__ == "Tensor"
    if isinstance(got, np.ndarray) or torch_leaf:
        nbytes = got.element_size() * got.nelement() if torch_leaf else got.nbytes
        placeable = not torch_leaf or str(got.dtype) != "torch.bfloat16"
        want = plain and placeable and nbytes >= MIN and got.dtype != object
        assert D.shm_backed(got) == want, f"{path}: in shared memory {D.shm_backed(got)}, expected {want}"
        return int(want)
    plain = plain and type(got) in PLAIN
    if isinstance(got, Mapping):
        return sum(check_placement(v, plain, f"{path}[{k!r}]") for k, v in got.items())
    if isinstance(got, (list, tuple)):
        return sum(check_placement(v, plain, f"{path}[{k}]") for k, v in enumerate(got))
    return 0


def compare(run: Callable[..., Any], schema: Any, n: int, mutation: Any) -> int:
    """The shm collate of the samples, in a worker, against default_collate here."""
    samples = D.build_samples(schema, n, mutation)
    try:
        want = default_collate(samples)
    except Exception as exc:
        with pytest.raises(type(exc)) as info:
            run(D.collate_built, schema, n, mutation)
        assert str(info.value) == str(exc)
        if isinstance(exc, CollateError):
            assert info.value.positions == exc.positions
        return 0
    got = run(D.collate_built, schema, n, mutation)
    D.assert_same(got, want)
    return check_placement(got)


def schemas(leaves: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    def grow(kids: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        fields = st.dictionaries(st.sampled_from("abcdef"), kids, max_size=3).map(lambda d: list(d.items()))
        return st.one_of(
            st.tuples(st.sampled_from(["list", "tuple", "tlist"]), st.lists(kids, max_size=3)),
            st.tuples(st.sampled_from(D.MAPPINGS), fields),
            st.tuples(st.sampled_from(["pair", "pair_dict", "pair_new"]), st.tuples(kids, kids).map(list)),
        )

    return st.recursive(leaves, grow, max_leaves=10)


shapes = st.one_of(
    st.lists(st.integers(1, 6), max_size=3).map(tuple), st.sampled_from([(16, 17), (2, 9, 11), (130,)])
)
numpy_leaves = st.one_of(
    st.tuples(st.just("array"), shapes, st.sampled_from(DTYPES)),
    st.sampled_from(["int", "float", "bool", "np_float", "fraction", "str", "bytes", "none", "range"]).map(
        lambda k: (k,)
    ),
    st.tuples(st.just("pil"), st.sampled_from([(3, 2), (12, 9)]), st.sampled_from(["L", "RGB"])),
)


@st.composite
def batches(draw: st.DrawFn, leaves: st.SearchStrategy[Any]) -> tuple[Any, int, Any]:
    schema = draw(schemas(leaves))
    n = draw(st.integers(1, 5))
    mutation = None
    if n > 1 and draw(st.booleans()):
        how = draw(st.sampled_from(["shape", "dtype", "type", "structure"]))
        mutation = (draw(st.integers(1, n - 1)), draw(st.sampled_from(D.paths(schema))), how)
    return schema, n, mutation


def property_check(run: Callable[..., Any], leaves: st.SearchStrategy[Any], examples: int) -> None:
    placed: list[int] = []

    @settings(
        max_examples=examples, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
    )
    @given(batches(leaves))
    def check(case: tuple[Any, int, Any]) -> None:
        placed.append(compare(run, *case))

    check()
    assert sum(placed) > 0, "no example put anything into shared memory"


def test_shm_collate_is_default_collate(worker: Callable[..., Any]) -> None:
    """Random nested batches (every container kind, numbers, strings, PIL images,
    mismatches): the same batch or the same error as default_collate."""
    property_check(worker, numpy_leaves, 150)


def test_shm_collate_is_default_collate_with_torch(worker: Callable[..., Any]) -> None:
    pytest.importorskip("torch")
    tensors = st.tuples(st.just("tensor"), shapes, st.sampled_from(TENSOR_DTYPES))
    property_check(worker, st.one_of(numpy_leaves, tensors), 60)


def test_namedtuple_with_dict_goes_through_shm(worker: Callable[..., Any]) -> None:
    """Regression: the shm collate once classified namedtuples by its own rule (no
    ``__dict__``), so a namedtuple subclass's arrays were silently pickled."""
    schema = ("pair_dict", [("array", (64, 64), "<f4"), ("int",)])
    assert compare(worker, schema, 4, None) == 1


def test_user_constructors_see_real_arrays(worker: Callable[..., Any]) -> None:
    """A container class whose constructor runs user code is given the stacked arrays,
    not placeholders (its attributes record what it was given)."""
    big = ("array", (64, 64), "<f4")
    assert compare(worker, ("pair_new", [big, big]), 3, None) == 0
    assert compare(worker, ("list", [("tagged", [("x", big)]), big]), 3, None) == 1


def test_torch_tensors_travel_in_shared_memory(worker: Callable[..., Any]) -> None:
    torch = pytest.importorskip("torch")
    schema = ("dict", [("image", ("tensor", (3, 64, 64), "float32")), ("label", ("int",))])
    got = worker(D.collate_built, schema, 8, None)
    image = got["image"]
    assert type(image) is torch.Tensor and image.shape == (8, 3, 64, 64)
    D.assert_same(got, default_collate(D.build_samples(schema, 8, None)))
    assert D.shm_backed(image)
    slab = next(
        s for s in _shm._decode._slabs.values() if s.addr <= image.data_ptr() < s.addr + s.mapping.size
    )
    ticket = int(slab.state[0])
    assert ticket != 0
    part = image[2:4]  # a view of the tensor keeps the slab busy too
    del got, image
    gc.collect()
    assert int(slab.state[0]) == ticket
    del part
    gc.collect()
    assert int(slab.state[0]) == 0, "the slab is freed with the last tensor viewing it"
