"""A worker's ring of spilled replies: small spills share one mapping per worker."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

import aioloader
from aioloader import _spill

from ._datasets import RangeDataset

pytestmark = pytest.mark.timeout(120)


def _ring(tmp_path: Path) -> _spill._Ring:
    return _spill._Ring(str(tmp_path / f"aioloader_{os.getpid()}_{os.getpid()}_spilltest_ring"))


def test_the_ring_reuses_what_the_consumer_read_and_refuses_what_it_has_not(tmp_path: Path) -> None:
    ring = _ring(tmp_path)
    path = ring.path
    rng = np.random.default_rng(0)
    cap = _spill.SIZE - _spill.HEADER
    sent: list[tuple[int, bytes]] = []
    # Fill it without reading: replies of 100 KiB, so the fifth wraps to the start.
    while True:
        data = rng.integers(0, 255, 100 * 1024, dtype=np.uint8).tobytes()
        pos = ring.put([data], [len(data)], _spill.aligned(len(data)))
        if pos is None:
            break
        sent.append((pos, data))
    assert len(sent) == cap // _spill.aligned(100 * 1024)  # refused once full, not overwritten
    # Read them back in order (the consumer's side, which unlinks the name on first use).
    for pos, data in sent:
        got = _spill.copy_out(path, pos, _spill.aligned(len(data)), os.getpid())
        assert got[: len(data)].tobytes() == data
    assert not os.path.exists(path)
    # Read space is reused: the next reply wraps round, at the start of the ring.
    data = b"x" * 200_000
    pos = ring.put([data], [len(data)], _spill.aligned(len(data)))
    assert pos is not None and pos % cap == 0 and pos > 0
    assert _spill.copy_out(path, pos, _spill.aligned(len(data)), os.getpid())[: len(data)].tobytes() == data
    # A reply over a quarter of the ring goes to a file instead.
    big = b"y" * (cap // 4 + 1)
    assert ring.put([big], [len(big)], _spill.aligned(len(big))) is None
    _spill.drop({os.getpid()})
    assert path not in _spill._mapped


class Wide(RangeDataset):
    """Samples of 600 int64s: a batch of 8 pickles to about 38 KiB, past the pipe's
    atomic limit, under the ring's quarter."""

    def __getitem__(self, index: int) -> np.ndarray:
        return np.full(600, index, dtype=np.int64)


@pytest.mark.parametrize("face", ["for", "async-for"])
def test_pickled_batches_travel_through_one_ring_per_worker(face: str) -> None:
    loader = aioloader.DataLoader(Wide(96), 8, num_workers=2, transport="pickle")

    async def run() -> list[np.ndarray]:
        return [b async for b in loader]

    try:
        batches = [b for b in loader] if face == "for" else asyncio.run(run())
        pids = set(loader.worker_pids())
        rings = {path: pid for path, (pid, _) in _spill._mapped.items() if pid in pids}
    finally:
        loader.close()
    assert [b[:, 0].tolist() for b in batches] == [list(range(s, s + 8)) for s in range(0, 96, 8)]
    # The workers' replies came through their rings (one each, for the workers that got
    # batches: the scheduler may give them all to one)...
    assert rings and set(rings.values()) <= pids
    assert not [p for p in rings if os.path.exists(p)]  # ...whose name was removed at once
    ours = [n for n in os.listdir("/dev/shm") if n.startswith(f"aioloader_{os.getpid()}_") and "spill" in n]
    assert ours == []  # and no spill file was left


class Huge(RangeDataset):
    """Samples of 320 KiB: each reply is over a quarter of the ring, so it goes to a file."""

    def __getitem__(self, index: int) -> np.ndarray:
        return np.full(40_000, index, dtype=np.int64)


def test_a_worker_whose_replies_are_all_too_large_for_the_ring_leaves_no_name_behind() -> None:
    """Regression: the ring was created before its first reply was found too large, and
    kept its name while the worker lived (nothing named it, so no consumer unlinked it)."""
    # No next-epoch prefetch: nothing is in flight (a spill file of one would be named).
    with aioloader.DataLoader(Huge(6), 1, num_workers=2, transport="pickle", prefetch_next_epoch=False) as loader:
        assert [int(b[0, 0]) for b in loader] == list(range(6))
        assert loader.worker_pids()  # the workers are alive, and still nothing is named
        assert [n for n in os.listdir("/dev/shm") if n.startswith(f"aioloader_{os.getpid()}_")] == []
