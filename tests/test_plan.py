"""Epoch plans: the index bijection (exact, and statistically a uniform shuffle), lazy
plans that cost the same for 10 samples and for 10**12, and checked user samplers."""

from __future__ import annotations

import hashlib
import math
import os
import re
import subprocess
import sys
import tracemalloc
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aioloader
from aioloader._plan.indices import dataset_length
from aioloader._plan.permute import FEISTEL_ROUNDS, IndexShuffle, _walk, permute, round_keys
from aioloader._plan.sampler import (
    BatchPlanner,
    RemainingPositions,
    epoch_permutation,
    shard_count,
    shard_indices,
)

from ._datasets import RangeDataset

EDGE_SIZES = sorted({1, 2, 3, 10, 100, 1000, 10007} | {2**k + d for k in range(1, 17) for d in (-1, 0, 1)})


def planner(length: int, batch_size: int = 4, **kw: Any) -> BatchPlanner:
    opts: dict[str, Any] = {
        "shuffle": False,
        "sampler": None,
        "batch_sampler": None,
        "last_batch": "keep",
        "seed": 0,
        "shard": (0, 1),
        "shard_policy": "pad",
    }
    opts.update(kw)
    return BatchPlanner(length, batch_size=batch_size, **opts)


# ------------------------------------------------------------------------- the bijection
@pytest.mark.parametrize("n", EDGE_SIZES)
def test_permutation_is_a_bijection_on_every_edge_size(n) -> None:
    for seed, epoch in [(0, 0), (1, 3), (2**63 - 1, 10**9)]:
        shuffle = IndexShuffle(n, seed, epoch)
        order = shuffle(np.arange(n))
        assert np.array_equal(np.sort(order), np.arange(n))
        assert np.array_equal(shuffle.inverse(order), np.arange(n))


@pytest.mark.parametrize("n", [10**9 + 7, 10**12, 2**40, 2**40 + 1, 2**62 + 12345, 2**63 - 1])
def test_permutation_is_a_bijection_on_samples_of_large_sizes(n) -> None:
    rng = np.random.default_rng(n % 1000)
    shuffle = IndexShuffle(n, 7, 1)
    positions = np.concatenate([[0, 1, n - 2, n - 1], rng.integers(0, n, 50_000, dtype=np.int64)])
    values = shuffle(positions)
    assert values.min() >= 0 and values.max() < n
    assert np.array_equal(shuffle.inverse(values), positions)  # injective on the sample
    targets = rng.integers(0, n, 50_000, dtype=np.int64)
    assert np.array_equal(shuffle(shuffle.inverse(targets)), targets)  # and onto


def test_order_is_a_pure_function_of_seed_epoch_and_length() -> None:
    pos = np.arange(64)
    a = IndexShuffle(1000, 5, 2)(pos)
    assert np.array_equal(a, IndexShuffle(1000, 5, 2)(pos))
    for other in (IndexShuffle(1000, 6, 2), IndexShuffle(1000, 5, 3), IndexShuffle(1001, 5, 2)):
        assert not np.array_equal(a, other(pos))
    # Pinned so that a change of algorithm is noticed: it reorders every saved run, and a
    # state_dict from before such a change no longer resumes where it stopped.
    assert IndexShuffle(10**12, 0, 0)(np.arange(4)).tolist() == PINNED_10_12


PINNED_10_12 = [21456689193, 8948254198, 266746803066, 814963531390]


@pytest.mark.parametrize(
    ("n", "seed", "epoch", "digest"),
    [
        (7, 0, 0, "8c57d23249c8de8d"),
        (200_000, 3, 1, "f772d96f2c615567"),  # cycle-walks (a * b > n)
        (1_000_003, 11, 4, "13a01e08ab353d5f"),
    ],
)
def test_whole_orders_are_pinned_and_inverted(n, seed, epoch, digest) -> None:
    # Whole epochs, pinned as computed before the Feistel rounds carried their halves apart
    # (no division per round): a faster formulation must give the very same order.
    shuffle = IndexShuffle(n, seed, epoch)
    pos = np.arange(n)
    order = shuffle(pos)
    assert hashlib.sha256(order.tobytes()).hexdigest()[:16] == digest
    assert np.array_equal(shuffle.inverse(order), pos)


def test_one_position_as_a_scalar() -> None:
    # An int position goes through the same rounds as an array of one.
    shuffle = IndexShuffle(10, 0, 0)
    assert shuffle(3).tolist() == [6] and shuffle.inverse(6).tolist() == [3]
    big = IndexShuffle(10**12, 0, 0)
    for p in (0, 5, 10**12 - 1):
        assert big(p).tolist() == big(np.array([p])).tolist()
        assert big.inverse(big(p)[0]).tolist() == [p]


def test_bad_positions_are_refused() -> None:
    shuffle = IndexShuffle(10, 0, 0)
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        shuffle(np.array([3, 10]))
    with pytest.raises(TypeError, match="integers"):
        shuffle(np.array([1.5]))
    with pytest.raises(ValueError, match="2\\*\\*63"):
        IndexShuffle(2**63, 0, 0)


# ---------------------------------------------------------------------------- statistics
SEEDS = 20_000
Z_LIMIT = 4.5  # a chi-square this far above its mean (p ~ 3e-6) fails


def permutations(n: int, seeds: Iterable[int], stages: str = "all") -> np.ndarray:
    """One permutation of range(n) per seed, computed in one vectorised call per chunk
    (each element gets its own seed's round keys); ``stages="feistel"`` skips the
    swap-or-not rounds, to show what they are for."""
    out = []
    seeds = list(seeds)
    for lo in range(0, len(seeds), 2000):
        chunk = seeds[lo : lo + 2000]
        keys = np.repeat(np.stack([round_keys(s, 0, n) for s in chunk], axis=1), n, axis=1)
        x = np.tile(np.arange(n, dtype=np.uint64), len(chunk))
        y = permute(x, n, keys) if stages == "all" else _walk(x, n, keys[:FEISTEL_ROUNDS], False)
        out.append(y.reshape(len(chunk), n).astype(np.int64))
    return np.concatenate(out)


def chi2_z(observed: np.ndarray, expected: float, dof: int) -> float:
    """How many standard deviations the chi-square statistic lies above its mean
    (Wilson-Hilferty: (chi2 / dof) ** (1/3) is close to normal)."""
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    v = 2 / (9 * dof)
    return ((chi2 / dof) ** (1 / 3) - (1 - v)) / math.sqrt(v)


def position_z(perms: np.ndarray) -> float:
    """Each value is equally likely at each position."""
    s, n = perms.shape
    counts = np.stack([np.bincount(perms[:, p], minlength=n) for p in range(n)])
    return chi2_z(counts, s / n, (n - 1) ** 2)


def pairwise_p(perms: np.ndarray) -> float:
    """Each value precedes each other value in half of the permutations: the smallest
    two-sided p-value over all pairs, times the number of pairs (Bonferroni)."""
    s, n = perms.shape
    where = np.argsort(perms, axis=1)  # where[k, v]: position of value v
    worst = 0.0
    for i in range(n - 1):
        before = (where[:, i : i + 1] < where[:, i + 1 :]).sum(axis=0)
        worst = max(worst, float(np.abs(before - s / 2).max()) / math.sqrt(s / 4))
    return math.erfc(worst / math.sqrt(2)) * n * (n - 1) / 2


def whole_z(perms: np.ndarray) -> float:
    """Each of the n! permutations is equally likely (small n only)."""
    s, n = perms.shape
    codes = perms @ (n ** np.arange(n))
    counts = np.unique(codes, return_counts=True)[1]
    cells = math.factorial(n)
    counts = np.concatenate([counts, np.zeros(cells - len(counts))])
    return chi2_z(counts, s / cells, cells - 1)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7, 8, 9, 16, 17, 33])
def test_permutation_is_statistically_a_uniform_shuffle(n) -> None:
    perms = permutations(n, range(SEEDS))
    assert np.array_equal(perms[:3], [IndexShuffle(n, s, 0)(np.arange(n)) for s in range(3)])
    assert position_z(perms) < Z_LIMIT
    assert pairwise_p(perms) > 1e-4
    if n <= 5:
        assert whole_z(perms) < Z_LIMIT


def test_the_statistics_catch_a_biased_shuffle() -> None:
    # A random rotation puts every value at every position equally often, but keeps the
    # cyclic order: the pairwise test sees it.
    n = 8
    offsets = np.random.default_rng(0).integers(0, n, SEEDS)
    rotations = (np.arange(n) + offsets[:, None]) % n
    assert position_z(rotations) < Z_LIMIT
    assert pairwise_p(rotations) < 1e-100
    # The Feistel stage alone, on a tiny domain, reaches only some permutations unevenly:
    # this is what the swap-or-not rounds are for.
    assert whole_z(permutations(5, range(SEEDS), stages="feistel")) > 20


# --------------------------------------------------------------------------------- plans
def reference_plan(
    n: int,
    bs: int,
    shuffle: bool,
    seed: int,
    epoch: int,
    rank: int,
    world: int,
    policy: str,
    last_batch: str,
    carry: list[int],
) -> tuple[list[list[int]], list[int]]:
    """The plan spelled out on whole arrays: shuffle, shard, prepend, cut."""
    order = epoch_permutation(n, seed, epoch) if shuffle else np.arange(n)
    mine = carry + shard_indices(order, rank, world, policy).tolist()  # type: ignore[arg-type]
    batches = [mine[k : k + bs] for k in range(0, len(mine), bs)]
    tail: list[int] = []
    if batches and len(batches[-1]) < bs and last_batch != "keep":
        tail = batches.pop()
    return batches, tail if last_batch == "rollover" else []


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(0, 70),
    bs=st.integers(1, 9),
    shuffle=st.booleans(),
    world=st.integers(1, 5),
    data=st.data(),
    policy=st.sampled_from(["pad", "drop", "uneven"]),
    last_batch=st.sampled_from(["keep", "discard", "rollover"]),
    epoch=st.integers(0, 3),
)
def test_lazy_plan_equals_the_plan_on_arrays(n, bs, shuffle, world, data, policy, last_batch, epoch) -> None:
    rank = data.draw(st.integers(0, world - 1))
    carry = (
        data.draw(st.lists(st.integers(0, n - 1), max_size=bs - 1)) if n and last_batch == "rollover" else []
    )
    p = planner(
        n, bs, shuffle=shuffle, seed=3, shard=(rank, world), shard_policy=policy, last_batch=last_batch
    )
    plan = p.plan(epoch, np.asarray(carry, dtype=np.int64))
    batches, tail = reference_plan(n, bs, shuffle, 3, epoch, rank, world, policy, last_batch, carry)
    assert [b.tolist() for b in plan.batches] == batches
    assert len(plan) == p.num_batches(len(carry)) == len(batches)
    assert plan.carry_out.tolist() == tail and plan.carry_in.tolist() == carry
    assert shard_count(n, rank, world, policy) == len(shard_indices(np.arange(n), rank, world, policy))


def test_lazy_batches_behave_like_a_sequence() -> None:
    plan = planner(10, 4, shuffle=True).plan(0)
    batches = plan.batches
    assert len(batches) == 3 and [len(b) for b in batches] == [4, 4, 2]
    assert np.array_equal(batches[-1], batches[2]) and [b.tolist() for b in batches[1:]] == [
        b.tolist() for b in list(batches)[1:]
    ]
    with pytest.raises(IndexError, match="3 batches"):
        batches[3]
    first = batches[0]
    first[:] = -1  # a caller's copy: the plan is not changed
    assert (batches[0] >= 0).all() and batches[0].dtype == np.int32
    assert planner(2**31, 4).plan(0).batches[0].dtype == np.int64


def test_a_plan_over_10_12_samples_costs_no_memory() -> None:
    n, world, bs = 10**12, 8, 256
    tracemalloc.start()
    try:
        plans = [planner(n, bs, shuffle=True, seed=1, shard=(r, world)).plan(5) for r in range(world)]
        firsts = [plan.batches[0] for plan in plans]
        last = plans[3].batches[-1]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20  # an array of the epoch's order would take 8 TB
    assert len(plans[0]) == n // world // bs == planner(n, bs, shard=(0, world)).num_batches()
    flat = np.concatenate(firsts)
    assert len(np.unique(flat)) == world * bs and flat.min() >= 0 and flat.max() < n
    assert len(last) == bs
    # Rank r's first batch holds global positions r, r + 8, ...: check through the inverse.
    pos = IndexShuffle(n, 1, 5).inverse(firsts[3])
    assert pos.tolist() == list(range(3, world * bs, world))


_RSS_SCRIPT = """
import aioloader

def kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

class Huge:
    def __len__(self):
        return 10**12
    def __getitem__(self, i):
        return i

def run(rank):
    loader = aioloader.DataLoader(Huge(), 256, shuffle=True, seed=1, shard=(rank, 8), num_workers=0)
    loader.load_state_dict(dict(loader.state_dict(), batches_delivered=10**6, next_position=10**6))
    first = next(iter(loader))
    assert len(first) == 256
    loader.close()

run(0)  # imports, the first event loop and thread: costs that are not the plan's
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from the current RSS
before = kb("VmRSS")
for rank in range(8):
    run(rank)
print(kb("VmHWM") - before)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_loaders_over_10_12_samples_add_no_resident_memory() -> None:
    # From the kernel's count, in a fresh process: 8 sharded loaders over 10**12 samples,
    # each resumed a million batches in and delivering a batch, raise the resident peak
    # by less than the 10 MB the plan may cost (an array of the order would be 8 TB).
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) < 10 * 1024, out.stdout


@settings(max_examples=100, deadline=None)
@given(total=st.integers(0, 40), prefix=st.integers(0, 45), after=st.sets(st.integers(0, 45), max_size=8))
def test_remaining_positions_equal_the_list_they_replace(total, prefix, after) -> None:
    expected = [p for p in range(total) if p >= prefix and p not in after]
    rest = RemainingPositions(total, prefix, after)
    assert list(rest) == expected and len(rest) == len(expected)
    assert [rest[k] for k in range(len(rest))] == expected == rest[:]
    assert [p for p in range(-2, total + 2) if p in rest] == expected
    if expected:
        assert rest[-1] == expected[-1]
    with pytest.raises(IndexError):
        rest[len(expected)]


def test_sequential_plans_are_arithmetic_too() -> None:
    plan = planner(10**12, 1000, shard=(2, 8), last_batch="rollover").plan(0, np.array([7, 9]))
    assert plan.batches[0].tolist() == [7, 9, *range(2, 2 + 8 * 998, 8)]
    assert plan.carry_out.tolist() == [10**12 - 14, 10**12 - 6]


def test_distributed_sampler_is_lazy_and_matches_the_loader() -> None:
    for drop_last, policy in [(False, "pad"), (True, "drop")]:
        for rank in range(3):
            sampler = aioloader.DistributedSampler(20, rank, 3, seed=4, drop_last=drop_last)
            sampler.set_epoch(2)
            ref = shard_indices(epoch_permutation(20, 4, 2), rank, 3, policy).tolist()
            assert list(sampler) == ref and len(sampler) == len(ref)
            with aioloader.DataLoader(
                RangeDataset(20), 3, shuffle=True, seed=4, shard=(rank, 3), shard_policy=policy
            ) as loader:
                loader.set_epoch(2)
                assert [int(i) for b in loader for i in b[1]] == ref
    big = iter(aioloader.DistributedSampler(10**12, 5, 8, seed=1))
    assert 0 <= next(big) < 10**12


# --------------------------------------------------------------------------- user input
def first_batches(loader_kwargs: dict[str, Any], n: int = 10) -> list[list[int]]:
    with aioloader.DataLoader(RangeDataset(n), **loader_kwargs) as loader:
        return [b[1].tolist() for b in loader]


@pytest.mark.parametrize(
    ("sampler", "error", "words"),
    [
        ([0, 1, 2.0], TypeError, ["sampler", "item 2", "2.0", "float"]),
        (["a", "b"], TypeError, ["sampler", "item 0", "'a'", "str"]),
        ([0, True], TypeError, ["sampler", "item 1", "True", "bool"]),
        (np.array([0.0, 1.0]), TypeError, ["sampler", "item 0", "float64"]),
        (np.array([True, False]), TypeError, ["sampler", "item 0", "bool"]),
        ([3, 10], ValueError, ["sampler", "item 1", "index 10", "[0, 10)", "length 10"]),
        ([-1], ValueError, ["item 0", "index -1", "[0, 10)"]),
        ([0, 2**70], ValueError, ["item 1", str(2**70)]),
    ],
    ids=["float", "strings", "bool", "float-array", "bool-array", "too-large", "negative", "huge"],
)
def test_bad_sampler_items_name_the_sampler_position_and_value(sampler, error, words) -> None:
    with pytest.raises(error) as info:
        first_batches({"batch_size": 2, "sampler": sampler})
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    ("batch_sampler", "error", "words"),
    [
        ([[0, 1], [2, 0.5]], TypeError, ["batch_sampler", "batch 1", "item 1", "0.5", "float"]),
        ([[0], 3], TypeError, ["batch_sampler", "batch 1", "3 (int)", "sequence of ints"]),
        ([[0], "ab"], TypeError, ["batch 1", "'ab'"]),
        ([[0], [False]], TypeError, ["batch 1", "item 0", "False"]),
        ([[0], []], ValueError, ["batch_sampler", "batch 1", "empty"]),
        ([[0, 12]], ValueError, ["batch 0", "item 1", "index 12", "[0, 10)"]),
    ],
    ids=["float", "int-batch", "str-batch", "bool", "empty", "out-of-range"],
)
def test_bad_batch_sampler_items_name_the_batch_position_and_value(batch_sampler, error, words) -> None:
    with pytest.raises(error) as info:
        first_batches({"batch_sampler": batch_sampler})
    for word in words:
        assert word in str(info.value)


@pytest.mark.torch
def test_integer_like_indices_are_accepted() -> None:
    import torch

    assert first_batches({"batch_size": 2, "sampler": [np.int64(3), np.int32(1), np.uint8(2)]}) == [
        [3, 1],
        [2],
    ]
    assert first_batches({"batch_size": 2, "sampler": np.array([4, 0], dtype=np.uint16)}) == [[4, 0]]
    assert first_batches({"batch_sampler": [[np.int16(5), 6], (7,)]}) == [[5, 6], [7]]
    assert first_batches({"batch_size": 3, "sampler": list(torch.tensor([2, 1]))}) == [[2, 1]]
    with pytest.raises(TypeError, match=r"item 0.*bool"):
        first_batches({"batch_size": 3, "sampler": list(torch.tensor([True]))})


def test_bad_lengths_name_the_dataset_and_len() -> None:
    class Sized:
        def __init__(self, n: Any) -> None:
            self.n = n

        def __len__(self) -> Any:
            return self.n

    assert dataset_length(Sized(np.int64(5))) == 5 and dataset_length([1, 2]) == 2
    for value, error, word in [
        (2.5, TypeError, "float"),
        (True, TypeError, "bool"),
        ("9", TypeError, "str"),
        (-1, ValueError, ">= 0"),
        (2**63, ValueError, "2**63 - 1"),
        (10**30, ValueError, "2**63 - 1"),
    ]:
        with pytest.raises(error, match=re.escape(word)) as info:
            dataset_length(Sized(value))
        assert "len(dataset)" in str(info.value) and "Sized.__len__" in str(info.value)
        with pytest.raises(error, match=r"len\(dataset\)"):
            planner(value)
    with pytest.raises(TypeError, match="int has no __len__"):
        dataset_length(3)


def test_rolled_over_indices_from_a_foreign_state_are_refused() -> None:
    with pytest.raises(ValueError, match="rolled-over index 99 is outside \\[0, 10\\)"):
        planner(10, last_batch="rollover").plan(0, np.array([1, 99]))
    with pytest.raises(TypeError, match="1-d array of ints"):
        planner(10, last_batch="rollover").plan(0, np.array([1.5]))
