"""``timeout=`` counts from the moment a unit is due to a worker: a frozen worker, a
``worker_init_fn`` that never returns on a shared pool, and a unit waiting behind a
healthy one each get their fair end."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

import aioloader

from . import _timeout_helpers as H
from ._datasets import RangeDataset
from .conftest import alive, wait_until

pytestmark = pytest.mark.timeout(60)  # a hang on the old code ends here
FACES = ["for", "async-for"]
N, BS = 16, 2
ALL = [list(range(k, k + BS)) for k in range(0, N, BS)]


def _epoch(loader: Any, face: str) -> tuple[list[list[int]], list[aioloader.LoaderTimeout]]:
    """One epoch: the batches, and the timeouts met on the way. ``for`` goes on after a
    failed batch (as torch does); ``async for`` ends there."""
    got: list[list[int]] = []
    errors: list[aioloader.LoaderTimeout] = []
    if face == "for":
        it = iter(loader)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                break
            except aioloader.LoaderTimeout as exc:
                errors.append(exc)
                continue
            got.append(batch[1].tolist())
        return got, errors

    async def main() -> None:
        try:
            async for batch in loader:
                got.append(batch[1].tolist())
        except aioloader.LoaderTimeout as exc:
            errors.append(exc)

    asyncio.run(main())
    return got, errors


@pytest.mark.parametrize("face", FACES)
def test_a_worker_frozen_between_epochs_is_killed_and_replaced(face: str) -> None:
    # One batch a task (no grouping), so that each worker gets some of the next epoch.
    with aioloader.DataLoader(
        RangeDataset(N), BS, num_workers=2, timeout=1.0, prefetch_next_epoch=False, batches_per_task=1
    ) as loader:
        assert _epoch(loader, face) == (ALL, [])
        frozen, other = loader.worker_pids()
        os.kill(frozen, signal.SIGSTOP)  # idle: it holds nothing, so no batch's build can time it
        try:
            got, errors = _epoch(loader, face)
        finally:
            if alive(frozen) and frozen in loader.worker_pids():
                os.kill(frozen, signal.SIGCONT)  # the test failed: let the close end it
        # The batch sent to it first fails as a batch that overran does; the one behind
        # it in its socket goes to the other worker.
        assert len(errors) == 1, got
        text = str(errors[0])
        assert f"worker pid {frozen} had not taken it up" in text and "SIGSTOP" in text, text
        assert errors[0].indices in ALL and errors[0].timeout == 1.0
        if face == "for":  # every other batch came
            assert sorted([*got, errors[0].indices]) == ALL
        wait_until(lambda: not alive(frozen), 30.0, "the frozen worker to be killed")
        wait_until(lambda: len(loader.worker_pids()) == 2, 30.0, "its replacement")
        pids = loader.worker_pids()
        assert frozen not in pids and other in pids  # one death, one replacement
        assert loader.stats().restarts == 1
        assert _epoch(loader, face) == (ALL, [])


@pytest.mark.parametrize("face", FACES)
def test_a_worker_init_fn_that_never_returns_on_a_shared_pool_times_out(face: str) -> None:
    pool = aioloader.WorkerPool(2)
    try:
        first = aioloader.DataLoader(RangeDataset(N), BS, pool=pool)  # no timeout of its own
        second = aioloader.DataLoader(
            RangeDataset(N), BS, pool=pool, worker_init_fn=H.init_never_returns, timeout=1.0
        )
        with first, second:
            assert _epoch(first, face) == (ALL, [])
            if face == "for":
                it = iter(second)
                with pytest.raises(aioloader.LoaderTimeout) as raised:
                    next(it)
                it.close()
                exc = raised.value
            else:
                got, errors = _epoch(second, face)
                assert got == [] and len(errors) == 1
                exc = errors[0]
            text = str(exc)
            assert "was running the loader's worker_init_fn" in text, text
            found = re.search(r"worker pid (\d+)", text)
            assert found is not None  # the worker that hung: one of these, or one that replaced them
            assert exc.indices and exc.timeout == 1.0
            # The hung init holds no worker for good: the first loader goes on, and the
            # workers started since do not run the second loader's init as they start.
            assert _epoch(first, face) == (ALL, [])
            assert int(found.group(1)) not in pool.worker_pids()
    finally:
        pool.close()


def test_a_job_behind_another_is_due_only_once_the_one_ahead_is_answered(tmp_path: Path) -> None:
    """The clock of a job waiting in a worker's socket starts when the job ahead is
    answered: a long but healthy job ahead costs it nothing."""
    first, second = tmp_path / "first", tmp_path / "second"
    os.mkfifo(first)
    os.mkfifo(second)
    pool = aioloader.WorkerPool(1)
    try:
        pool.start()
        ahead = pool.send(H.pass_gate, H.AtGate(1, str(first)))
        behind = pool.send(H.pass_gate, H.AtGate(2, str(second)))
        wait_until(lambda: pool.due_at(ahead) is not None, 30.0, "the worker to start")
        assert pool.due_at(behind) is None  # the one worker holds both: one runs, one waits
        os.close(os.open(first, os.O_WRONLY))
        pid = asyncio.run(pool.result(ahead))
        answered = time.monotonic_ns()
        assert pid in pool.worker_pids()
        wait_until(lambda: pool.due_at(behind) is not None, 30.0, "the job behind to become due")
        due = pool.due_at(behind)
        assert due is not None and due <= answered
        os.close(os.open(second, os.O_WRONLY))
        assert asyncio.run(pool.result(behind)) == pid
    finally:
        pool.close()


@pytest.mark.parametrize("face", FACES)
def test_a_start_stuck_unpickling_the_dataset_names_it_and_the_loader_recovers(
    face: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start is given max(timeout, START_FLOOR_S); the floor is lifted here. The error
    names the step that hung, and the replacement loads that dataset with its first
    batch instead of as it starts."""
    from aioloader._engine import dispatch

    monkeypatch.setattr(dispatch, "START_FLOOR_S", 0.0)
    marker = tmp_path / "stuck"
    ds = H.UnpicklesSlowlyOnce(N, str(marker))
    with aioloader.DataLoader(ds, BS, num_workers=2, timeout=1.0, prefetch_next_epoch=False) as loader:
        if face == "for":
            got = []
            with pytest.raises(aioloader.LoaderTimeout) as raised:
                for batch in loader:
                    got.append(batch.tolist())
            exc = raised.value
        else:
            got, errors = [], []

            async def main() -> None:
                try:
                    async for batch in loader:
                        got.append(batch.tolist())
                except aioloader.LoaderTimeout as err:
                    errors.append(err)

            asyncio.run(main())
            assert len(errors) == 1
            exc = errors[0]
        text = str(exc)
        assert marker.exists() and "had not finished starting" in text, text
        assert "the unpickling of a loader's payload (its dataset) did not return" in text, text
        assert "worker_init_fn" not in text, text
        assert exc.indices
        whole = [b.tolist() for b in loader]
        assert whole == ALL
        assert loader.stats().restarts == 1
