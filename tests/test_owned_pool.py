"""The pool owns its worker processes: one death replaces one worker and charges one
task, the pool is a ``concurrent.futures.Executor`` that loaders share, and what it
says of itself is safe to ask from any thread."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import os
import signal
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import aioloader

from . import _owned_pool_datasets as D
from ._datasets import KillableDataset, RangeDataset
from .conftest import _collect_async, wait_until

pytestmark = pytest.mark.timeout(180)
FACES = ["for", "async-for"]


def _epoch(loader: Any, face: str) -> list[list[int]]:
    if face == "for":
        return [b.tolist() for b in loader]

    async def main() -> list[list[int]]:
        return [b.tolist() async for b in loader]

    return asyncio.run(main())


@pytest.mark.parametrize("face", FACES)
def test_one_of_three_busy_workers_killed_only_it_is_replaced_and_nothing_else_reloads(
    tmp_path: Path, face: str
) -> None:
    n, bs = 60, 4
    log, gate = tmp_path / "loads", tmp_path / "gate"
    log.touch()
    os.mkfifo(gate)
    # Each worker's first batch waits at the gate: all three are busy when one is killed.
    ds = D.GatedLog(n, str(log), str(gate), frozenset({0, 4, 8}))
    clean = [list(range(k, k + bs)) for k in range(0, n, bs)]
    with aioloader.DataLoader(ds, bs, num_workers=3, prefetch_next_epoch=False) as loader:
        out: list[list[list[int]]] = []
        consumer = threading.Thread(target=lambda: out.append(_epoch(loader, face)))
        consumer.start()
        writer = -1
        try:
            wait_until(lambda: {i for _, i in D.loads(str(log))} >= {0, 4, 8}, 60.0, "three busy workers")
            before = loader.worker_pids()
            holders = {i: p for p, i in D.loads(str(log))}
            assert sorted(holders[i] for i in (0, 4, 8)) == sorted(before)  # one batch each
            victim = holders[4]
            os.kill(victim, signal.SIGKILL)
            wait_until(lambda: victim not in loader.worker_pids() and len(loader.worker_pids()) == 3, 30.0,
                       "the killed worker to be replaced")
            writer = os.open(gate, os.O_WRONLY)  # the gate opens for everyone from now on
            consumer.join(60)
        finally:
            if writer < 0:
                writer = os.open(gate, os.O_RDWR)
            consumer.join(60)
            os.close(writer)
        assert out == [clean]
        after = loader.worker_pids()
        survivors = set(before) - {victim}
        assert survivors <= set(after) and len(set(after) - set(before)) == 1  # exactly that pid replaced
        loads = D.loads(str(log))
        by_survivors = Counter(i for p, i in loads if p in survivors)
        assert max(by_survivors.values()) == 1  # no sample a survivor loaded was loaded again
        assert {i for _, i in loads} == set(range(n))
        redone = Counter(i for _, i in loads) - Counter(range(n))
        assert set(redone) <= {i for p, i in loads if p == victim}  # only the victim's work ran twice
        st = loader.stats()
        assert st.restarts == 1 and st.retries == 1


def test_the_pool_is_an_executor_that_loaders_share() -> None:
    with aioloader.WorkerPool(2) as pool:
        assert isinstance(pool, cf.Executor)
        first = aioloader.DataLoader(list(range(12)), 4, pool=pool)
        second = aioloader.DataLoader(list(range(100, 106)), 3, pool=pool)
        with first, second:
            assert [b.tolist() for b in first] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
            futures = [pool.submit(D.triple, k) for k in range(10)]
            assert [b.tolist() for b in second] == [[100, 101, 102], [103, 104, 105]]
            assert [f.result(timeout=60) for f in futures] == [3 * k for k in range(10)]
            assert list(pool.map(D.triple, range(5))) == [0, 3, 6, 9, 12]
            assert pool.submit(pow, 2, 10).result(timeout=60) == 1024
            with pytest.raises(ZeroDivisionError):
                pool.submit(divmod, 1, 0).result(timeout=60)
            # the loaders and the functions ran on the same processes
            assert set(first.worker_pids()) == set(pool.worker_pids()) == set(second.worker_pids())
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(D.triple, 1)


def test_a_worker_that_dies_running_a_function_fails_that_future_only(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    with aioloader.WorkerPool(2) as pool:
        waiting = pool.submit(D.pid_after, str(gate))  # holds one worker until the gate opens
        doomed = pool.submit(D.die)
        with pytest.raises(aioloader.WorkerCrashedError, match="SIGKILL"):
            doomed.result(timeout=60)
        later = [pool.submit(D.triple, k) for k in range(6)]
        fd = os.open(gate, os.O_WRONLY)
        try:
            assert waiting.result(timeout=60) in pool.worker_pids()  # the survivor kept its task
        finally:
            os.close(fd)
        assert [f.result(timeout=60) for f in later] == [3 * k for k in range(6)]


def test_shutdown_waits_for_submitted_work_or_cancels_what_has_not_started(tmp_path: Path) -> None:
    pool = aioloader.WorkerPool(1)
    futures = [pool.submit(D.triple, k) for k in range(20)]
    pool.shutdown(wait=True)
    assert [f.result(timeout=0) for f in futures] == [3 * k for k in range(20)]
    assert pool.worker_pids() == []

    gate = tmp_path / "gate"
    os.mkfifo(gate)
    pool = aioloader.WorkerPool(1)
    held = pool.submit(D.pid_after, str(gate))
    queued = [pool.submit(D.triple, k) for k in range(8)]
    wait_until(lambda: len(pool.worker_pids()) == 1, 30.0, "the worker")
    closer = threading.Thread(target=pool.shutdown, kwargs={"wait": True, "cancel_futures": True})
    closer.start()
    fd = os.open(gate, os.O_WRONLY)
    try:
        closer.join(60)
    finally:
        os.close(fd)
    assert not closer.is_alive() and held.result(timeout=0) > 0
    # what no worker had taken yet is cancelled; what it had (two at most) ran
    assert sum(f.cancelled() for f in queued) >= len(queued) - 2
    assert all(f.done() for f in queued)


@pytest.mark.parametrize("kind", ["processes", "thread"])
def test_a_future_cancelled_before_a_worker_takes_it_never_runs(tmp_path: Path, kind: str) -> None:
    gate, log = tmp_path / "gate", tmp_path / "ran"
    os.mkfifo(gate)
    log.touch()
    pool = aioloader.WorkerPool(1 if kind == "processes" else 0)
    try:
        held = pool.submit(D.pid_after, str(gate))  # the one worker waits at the gate
        queued = [pool.submit(D.note, str(log), k) for k in range(6)]
        cancelled = [k for k, f in enumerate(queued) if f.cancel()]
        # A worker holds at most two jobs it has not answered: the held one and one more.
        assert len(cancelled) >= len(queued) - 1, cancelled
        os.close(os.open(gate, os.O_WRONLY))
        assert held.result(timeout=60) > 0
        assert pool.submit(D.note, str(log), 99).result(timeout=60) == 99  # runs after the rest
        ran = [int(line) for line in log.read_text().split()]
        assert ran == [k for k in range(6) if k not in cancelled] + [99]
        for k in cancelled:
            with pytest.raises(cf.CancelledError):
                queued[k].result(timeout=0)
        assert all(f.done() for f in queued)
    finally:
        pool.shutdown(wait=True)


def _labels(batches: list[Any]) -> list[list[int]]:
    return [b[1].tolist() for b in batches]


@pytest.mark.parametrize("face", FACES)
def test_two_live_pools_a_death_in_one_leaves_the_other_alone(tmp_path: Path, face: str) -> None:
    marker = tmp_path / "holder"
    clean = [list(range(k, k + 4)) for k in range(0, 40, 4)]
    opts: dict[str, Any] = {"num_workers": 2, "prefetch_next_epoch": False}
    with (
        aioloader.DataLoader(KillableDataset(40, 13, str(marker)), 4, **opts) as a,
        aioloader.DataLoader(RangeDataset(40), 4, **opts) as b,
    ):
        b_iter = iter(b)
        b_out = [next(b_iter)]  # b's pool is up and serving while a's worker dies
        a_out: list[list[Any]] = []
        consumer = threading.Thread(
            target=lambda: a_out.append(list(a) if face == "for" else _collect_async(a))
        )
        consumer.start()
        try:
            wait_until(lambda: marker.exists(), 60.0, "a's worker to hold sample 13")
            a_pids, b_pids = set(a.worker_pids()), set(b.worker_pids())
            assert len(a_pids) == len(b_pids) == 2 and not a_pids & b_pids  # two pools
            victim = int(marker.read_text())
            assert victim in a_pids
            os.kill(victim, signal.SIGKILL)
            b_out += list(b_iter)
        finally:
            consumer.join(60)
        assert not consumer.is_alive() and _labels(a_out[0]) == clean
        assert _labels(b_out) == clean
        assert (a.stats().restarts, b.stats().restarts) == (1, 0)
        assert set(b.worker_pids()) == b_pids  # b's workers never noticed
        wait_until(  # the replacement may still be starting when the epoch ends
            lambda: victim not in a.worker_pids() and len(a.worker_pids()) == 2, 30.0, "a's new worker"
        )


def test_worker_pids_and_stats_are_safe_from_any_thread_at_any_moment() -> None:
    stop = threading.Event()
    errors: list[BaseException] = []
    calls = [0]
    loaders: list[Any] = []

    def hammer() -> None:
        while not stop.is_set():
            for loader in list(loaders):
                try:
                    loader.worker_pids()
                    loader.stats()
                    calls[0] += 1
                except BaseException as exc:  # any error is the finding
                    errors.append(exc)

    t = threading.Thread(target=hammer)
    t.start()
    try:
        for round_ in range(3):
            loader = aioloader.DataLoader(list(range(32)), 4, num_workers=2)
            loaders.append(loader)
            try:
                it = iter(loader)  # starts the pool while the other thread asks
                next(it)
                wait_until(lambda loader=loader: len(loader.worker_pids()) == 2, 30.0, "both workers' pids")
                pid = loader.worker_pids()[round_ % 2]
                os.kill(pid, signal.SIGKILL)  # a death and a replacement while it asks
                rest = list(it)
                assert len(rest) == 7
            finally:
                loader.close()  # and a close
                loaders.remove(loader)
    finally:
        stop.set()
        t.join(30)
    assert not errors, errors[:3]
    assert calls[0] > 0


def test_workers_killed_from_outside_as_they_start_are_reported_so(
    collect: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIOLOADER_TEST_CONSUMER", str(os.getpid()))
    with aioloader.DataLoader(D.KilledAtBirth(), 4, num_workers=2) as loader:
        with pytest.raises(aioloader.PoolBrokenError) as info:
            collect(loader)
    text = str(info.value)
    assert "killed by SIGKILL" in text and "-9" in text and "outside" in text
    assert "import the main module" not in text  # not the user's code's fault
    assert info.value.exitcode == -9
