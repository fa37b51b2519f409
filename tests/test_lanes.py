"""Lanes (``aioloader/_lanes.py``): an owned process pool's workers each serve a pipe of
their own, and the consumer sends them tasks directly, at most two unanswered per lane,
the rest waiting in the consumer. Workers are held by tasks that wait on FIFOs, so every
state below is reached by synchronisation, not by timing."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioloader
from aioloader import _lane_wire, _lanes
from aioloader._shm._names import _pid_alive

from . import _pool_helpers as H
from ._datasets import RangeDataset
from .conftest import wait_until


@pytest.fixture
def pool() -> Iterator[aioloader.WorkerPool]:
    p = aioloader.WorkerPool(2)
    try:
        yield p
    finally:
        p.close()


def _gen(pool: aioloader.WorkerPool) -> Any:
    gen = pool.start()
    assert gen.lanes is not None, "an owned process pool serves its tasks through lanes"
    return gen


class _Held:
    """Both workers held by a blocking task each, until :meth:`release`."""

    def __init__(self, gen: Any, tmp: Path) -> None:
        self.fifos = [tmp / f"release{k}" for k in range(2)]
        started = [tmp / f"started{k}" for k in range(2)]
        for f in self.fifos:
            os.mkfifo(f)
        self.futures = [
            gen.submit(H.block_until_released, str(s), str(f)) for s, f in zip(started, self.fifos, strict=True)
        ]
        wait_until(lambda: all(s.exists() for s in started), 30, "both workers to hold their task")

    def release(self) -> None:
        for f in self.fifos:
            fd = os.open(f, os.O_WRONLY)  # the reader is there: this does not block
            os.close(fd)
        pids = {fut.result(timeout=30) for fut in self.futures}
        assert len(pids) == 2


def test_tasks_take_turns_on_the_lanes_of_both_workers(pool: aioloader.WorkerPool) -> None:
    gen = _gen(pool)
    sent = gen.lanes.sent
    assert [gen.submit(pow, k, 2).result(timeout=30) for k in range(40)] == [k * k for k in range(40)]
    assert gen.lanes.sent - sent == 40 and gen.lanes.held == 0
    pids = [gen.submit(H.pid_of, k).result(timeout=30) for k in range(4)]
    assert set(pids) == set(pool.worker_pids())  # idle lanes take turns


def test_beyond_two_unanswered_a_lane_takes_nothing_more(pool: aioloader.WorkerPool, tmp_path: Path) -> None:
    """Each held worker's lane takes one more task (it waits in the pipe); the other
    four wait in the consumer and go out as lanes answer. All of them run."""
    gen = _gen(pool)
    held = _Held(gen, tmp_path)
    futures: list[Future[Any]] = [gen.submit(pow, k, 3) for k in range(6)]
    assert gen.lanes.loads() == [_lanes.DEPTH, _lanes.DEPTH]
    assert gen.lanes.held == 4
    assert not any(f.done() for f in futures)
    held.release()
    assert [f.result(timeout=30) for f in futures] == [k**3 for k in range(6)]
    assert gen.lanes.loads() == [0, 0]


def test_once_tasks_are_long_a_lane_holds_one_at_a_time(pool: aioloader.WorkerPool, tmp_path: Path) -> None:
    """Behind a long task, a second one could not go to the worker that frees first:
    once the measured average reaches LONG_NS, each lane holds only what its worker
    runs, and every other task waits in the consumer for the first lane to answer."""
    gen = _gen(pool)
    lanes = gen.lanes
    assert lanes.depth == _lanes.DEPTH
    with lanes._lock:
        lanes._observe(10 * _lanes.LONG_NS)  # what the lanes' thread records as replies come
    assert lanes.depth == 1
    held = _Held(gen, tmp_path)
    futures = [gen.submit(pow, k, 2) for k in range(4)]
    assert lanes.loads() == [1, 1] and lanes.held == 4
    held.release()
    assert [f.result(timeout=30) for f in futures] == [k * k for k in range(4)]
    with lanes._lock:
        for _ in range(40):  # short tasks bring the average down again
            lanes._observe(0)
    assert lanes.depth == _lanes.DEPTH


@pytest.fixture(params=["carried", "piped"])
def carrying(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Large tasks carried in memfds (the default on Linux), or sent through the pipe (where
    no memfd can be made, or after a worker could not take one)."""
    on = request.param == "carried"
    if on and not hasattr(os, "memfd_create"):
        pytest.skip("no memfd here: large tasks always go through the pipe")
    monkeypatch.setattr(_lanes, "_carrying", on)
    return on


needs_memfd = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="no memfd here: nothing is carried")


def _memfds() -> list[str]:
    """This process's open memfds of carried tasks."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed since
            continue
        if target.startswith("/memfd:aioloader-task"):
            out.append(target)
    return out


def test_a_task_too_large_for_the_pipe_never_blocks_the_submitting_thread(
    pool: aioloader.WorkerPool, tmp_path: Path, carrying: bool
) -> None:
    """With both workers held nobody reads the pipes: a 3 MiB task written from this
    thread would block it for good. What the pipe cannot take, the lanes' thread
    writes once the worker reads (or the task is carried, and the pipe takes its name)."""
    gen = _gen(pool)
    held = _Held(gen, tmp_path)
    big = gen.submit(H.length_of, b"x" * (3 << 20))  # returns: the test would hang here otherwise
    small = gen.submit(pow, 7, 2)
    held.release()
    assert (big.result(timeout=30), small.result(timeout=30)) == (3 << 20, 49)
    assert gen.lanes.carried == carrying


def test_a_task_that_cannot_be_pickled_fails_alone(pool: aioloader.WorkerPool) -> None:
    gen = _gen(pool)
    bad = gen.submit(pow, threading.Lock(), 2)
    with pytest.raises(TypeError, match="pickle"):
        bad.result(timeout=30)
    assert gen.submit(pow, 3, 2).result(timeout=30) == 9  # the pool is unharmed


class _ExitsWhenPickled:
    def __reduce__(self) -> Any:
        raise SystemExit("not a task")


@pytest.mark.parametrize(
    ("bad_arg", "error"), [(threading.Lock(), TypeError), (_ExitsWhenPickled(), SystemExit)], ids=["type", "exit"]
)
def test_a_waiting_task_is_pickled_when_its_lane_takes_it_and_fails_alone_there(
    pool: aioloader.WorkerPool, tmp_path: Path, bad_arg: Any, error: type[BaseException]
) -> None:
    """A task that waits in the consumer is pickled only when a lane takes it (a pickle
    made earlier would sit beside the values it copies), from the lanes' thread: one
    that cannot be pickled then fails alone, even with a BaseException (which would
    otherwise end the lanes' thread with answered tasks still running), and the tasks
    around it run."""
    gen = _gen(pool)
    held = _Held(gen, tmp_path)
    first = [gen.submit(pow, k, 2) for k in range(2)]  # one more task in each lane's pipe
    bad = gen.submit(pow, bad_arg, 2)
    after = [gen.submit(pow, k, 3) for k in range(3)]
    assert gen.lanes.held == 4 and not bad.done()
    held.release()
    with pytest.raises(error):
        bad.result(timeout=30)
    assert [f.result(timeout=30) for f in first + after] == [0, 1, 0, 1, 8]
    assert gen.submit(pow, 5, 2).result(timeout=30) == 25  # the lanes' thread still serves


def test_large_tasks_queued_behind_each_other_on_one_lane_arrive_whole_and_in_order(
    pool: aioloader.WorkerPool, tmp_path: Path, carrying: bool
) -> None:
    """With its worker held, a lane allowed to hold three tasks keeps two large frames
    that its pipe cannot take, one behind the other; the lanes' thread writes both,
    in order, as the worker reads."""
    gen = _gen(pool)
    held = _Held(gen, tmp_path)
    with gen.lanes._lock:
        gen.lanes.depth = 3  # until the next reply sets it from the measured average again
    sizes = [(3 << 20) + k for k in range(4)]  # beyond a pipe's capacity (1 MiB at most)
    futures = [gen.submit(H.length_of, b"y" * n) for n in sizes]
    assert gen.lanes.loads() == [3, 3] and gen.lanes.held == 0
    held.release()
    assert [f.result(timeout=30) for f in futures] == sizes
    assert gen.lanes.carried == (len(sizes) if carrying else 0)
    pool.close()
    assert not _memfds()


@needs_memfd
def test_a_carried_tasks_memfd_is_refilled_for_a_later_one_and_freed_with_the_pool(
    pool: aioloader.WorkerPool, tmp_path: Path
) -> None:
    """A task over a pipe's capacity travels in a memfd of the consumer, which the worker
    opens through /proc; small ones do not. Once answered, the memfd is kept to carry a
    later task (refilled, and cut to its size), unless it is over SPARE_MAX; the pool's
    end frees it."""
    gen = _gen(pool)
    held = _Held(gen, tmp_path)
    big = gen.submit(H.first_and_length, b"a" * (_lane_wire.CARRY_MIN + 100))
    small = gen.submit(H.first_and_length, b"b" * 1000)
    assert gen.lanes.carried == 1 and len(_memfds()) == 1
    held.release()
    assert (big.result(timeout=30), small.result(timeout=30)) == ((97, _lane_wire.CARRY_MIN + 100), (98, 1000))
    after = gen.submit(H.first_and_length, b"c" * (_lane_wire.CARRY_MIN + 1)).result(timeout=30)
    assert after == (99, _lane_wire.CARRY_MIN + 1)  # the refilled memfd holds this task, whole
    assert gen.lanes.carried == 2 and len(_memfds()) == 1
    huge = gen.submit(H.first_and_length, b"d" * (_lane_wire.SPARE_MAX + 1)).result(timeout=30)
    assert huge == (100, _lane_wire.SPARE_MAX + 1) and gen.lanes.carried == 3
    assert not _memfds()  # too large to keep: freed once answered
    pool.close()
    assert not _memfds()


@needs_memfd
def test_a_carried_task_the_worker_cannot_take_is_sent_again_through_the_pipe(
    pool: aioloader.WorkerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that cannot open a carried task, or finds another one there (here: the
    message names the wrong token), answers so; the consumer sends the task again through
    the pipe, and from then on carries none. Nothing is lost or run twice."""
    _wrong_token(monkeypatch)
    gen = _gen(pool)
    payloads = [bytes([k]) * (_lane_wire.CARRY_MIN + k) for k in range(1, 4)]
    futures = [gen.submit(H.length_of, p) for p in payloads]
    assert [f.result(timeout=30) for f in futures] == [len(p) for p in payloads]
    assert gen.lanes.carried >= 1 and _lanes._carrying is False
    assert gen.submit(H.length_of, payloads[0]).result(timeout=30) == len(payloads[0])
    pool.close()
    assert not _memfds()


def _wrong_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every carried task's message name a token its memfd does not hold."""
    real = _lane_wire.pack

    def wrong_token(obj: Any, spares: list[int] | None) -> Any:
        fd, msg = real(obj, spares)
        if fd < 0:
            return fd, msg
        pid, mfd, size, token = _lane_wire.CARRY.unpack_from(msg, _lane_wire.HEAD.size)
        head = msg[: _lane_wire.HEAD.size].tobytes()
        return fd, memoryview(head + _lane_wire.CARRY.pack(pid, mfd, size, token ^ 1))

    monkeypatch.setattr(_lanes, "_carrying", True)
    monkeypatch.setattr(_lane_wire, "pack", wrong_token)


@needs_memfd
def test_a_carried_task_refused_after_stop_fails_at_once(
    pool: aioloader.WorkerPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the lanes are stopped, a task sent again through the pipe would land behind
    the stop and never run: it fails at once instead (the pool reruns what a retired
    generation held), rather than when the lanes are joined."""
    _wrong_token(monkeypatch)
    gen = _gen(pool)
    held = _Held(gen, tmp_path)
    big = gen.submit(H.length_of, b"s" * (_lane_wire.CARRY_MIN + 1))  # behind a held task, carried
    gen.lanes.stop()
    held.release()
    with pytest.raises(BrokenProcessPool, match="stopped"):
        big.result(timeout=30)


@needs_memfd
def test_the_consumers_helpers_read_back_refuse_and_free_what_they_should(tmp_path: Path) -> None:
    """``uncarry`` gives back the very frame that was carried; ``take_carried`` refuses,
    without waiting, a record that names something other than a memfd (here a FIFO with
    no writer, which a blocking open would wait on for ever); a memfd that broken lanes
    get back is freed, not kept."""
    task = (len, (b"u" * (_lane_wire.CARRY_MIN + 3),))
    fd, _ = _lane_wire.pack(task, [])
    assert fd >= 0
    assert bytes(_lane_wire.uncarry(fd)) == bytes(_lane_wire.frame(task))
    spares: list[int] = []
    _lane_wire.recycle(fd, spares, keep=False)
    assert spares == [] and not _memfds()
    os.mkfifo(tmp_path / "stale")
    r = os.open(tmp_path / "stale", os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert _lane_wire.take_carried(_lane_wire.CARRY.pack(os.getpid(), r, 10, 1)) is None
    finally:
        os.close(r)


@needs_memfd
def test_pack_never_holds_a_whole_large_pickle_and_falls_back_to_a_frame() -> None:
    """A carried task is pickled straight into its memfd: packing 8 MB of payloads
    allocates a small part of that in this process (a frame of it, pickled first, holds
    all of it); a small task makes no memfd. A memfd that refuses the write (sealed
    here; out of memory in life) is freed and the task framed for the pipe, whole; a
    task that cannot be pickled raises its own error and leaves its memfd a spare."""
    import fcntl
    import tracemalloc

    payloads = [bytes([k]) * 40_000 for k in range(200)]  # 8 MB, each under a pickle frame
    spares: list[int] = []
    tracemalloc.start()
    try:
        fd, msg = _lane_wire.pack((len, (payloads,)), spares)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert fd >= 0 and len(msg) == _lane_wire.HEAD.size + _lane_wire.CARRY.size
    assert peak < 2 << 20, peak  # the first CARRY_MIN bytes, a pickle frame, a copy of them
    assert bytes(_lane_wire.uncarry(fd)) == bytes(_lane_wire.frame((len, (payloads,))))
    _lane_wire.release(fd)
    fd, msg = _lane_wire.pack((len, (b"s" * 1000,)), spares)
    assert fd == -1 and bytes(msg) == bytes(_lane_wire.frame((len, (b"s" * 1000,))))
    assert spares == [] and not _memfds()

    sealed = os.memfd_create("aioloader-task", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    fcntl.fcntl(sealed, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW)
    _lane_wire._carries.add(sealed)
    spares = [sealed]
    fd, msg = _lane_wire.pack((len, (payloads,)), spares)
    assert fd == -1 and bytes(msg) == bytes(_lane_wire.frame((len, (payloads,))))
    assert spares == [] and not _memfds()  # the refusing memfd was freed
    # one that refuses only past its size: what went in is read back, the rest follows
    short = os.memfd_create("aioloader-task", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(short, 300_000)
    fcntl.fcntl(short, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW)
    _lane_wire._carries.add(short)
    spares = [short]
    fd, msg = _lane_wire.pack((len, (payloads,)), spares)
    assert fd == -1 and bytes(msg) == bytes(_lane_wire.frame((len, (payloads,))))
    assert spares == [] and not _memfds()

    spares = []
    with pytest.raises(TypeError, match="lock"):
        _lane_wire.pack((len, (payloads, threading.Lock())), spares)
    assert len(spares) == 1 and len(_memfds()) == 1
    _lane_wire.release(spares.pop())
    assert not _memfds()


@needs_memfd
def test_a_worker_killed_with_carried_tasks_leaves_no_memfd(pool: aioloader.WorkerPool, tmp_path: Path) -> None:
    """The tasks a dead generation held fail (the pool retries them on the next one);
    their memfds are closed with them."""
    gen = _gen(pool)
    _Held(gen, tmp_path)
    futures = [gen.submit(H.length_of, b"k" * (_lane_wire.CARRY_MIN + 8)) for _ in range(4)]
    assert len(_memfds()) == gen.lanes.carried == 2  # one more in each held worker's lane
    os.kill(pool.worker_pids()[0], 9)
    for f in futures:
        with pytest.raises(BrokenProcessPool):
            f.result(timeout=30)
    wait_until(lambda: not _memfds(), 10, "the failed tasks' memfds to be closed")


def test_a_task_that_cannot_be_unpickled_in_the_worker_fails_alone(pool: aioloader.WorkerPool) -> None:
    gen = _gen(pool)
    out = gen.submit(H.length_of, H.BreaksOnUnpickle()).result(timeout=30)
    assert not out.ok and isinstance(out.value, ValueError) and "rebuilt in a worker" in str(out.value)
    assert gen.submit(pow, 4, 2).result(timeout=30) == 16  # the worker still serves its lane


def test_tasks_sent_before_the_workers_exist_wait_in_their_lanes(pool: aioloader.WorkerPool) -> None:
    """``start()`` returns once the lanes exist; the workers are forked by a thread of
    their own. Here that thread is held before it forks anything: tasks sent meanwhile
    wait in the pipes (two to a lane), and run once the workers come up."""
    gen = pool.current()
    go = threading.Event()
    launch = gen.launch

    def held_launch() -> None:
        assert go.wait(30)
        launch()

    gen.launch = held_launch
    assert pool.start() is gen and not go.is_set() and gen.processes == {}
    futures = [gen.submit(pow, k, 2) for k in range(6)]
    assert gen.lanes.loads() == [_lanes.DEPTH, _lanes.DEPTH] and gen.lanes.held == 2
    assert not any(f.done() for f in futures)
    go.set()
    assert [f.result(timeout=30) for f in futures] == [k * k for k in range(6)]
    assert len(pool.worker_pids()) == 2  # waits for the launch, which is over


@pytest.mark.parametrize("face", ["for", "async-for"])
def test_workers_that_cannot_be_forked_fail_the_sent_tasks_and_the_pool_starts_again(face: str) -> None:
    """A failed launch (the forkserver gone, no more processes) fails the tasks already
    in the lanes, as a death at start-up would: they come back lost, the generation is
    replaced, and the loader's batches are the reference ones."""
    with aioloader.WorkerPool(2) as wp:
        first = wp.current()

        def no_processes() -> None:
            raise OSError(11, "Resource temporarily unavailable")

        first.launch = no_processes
        loader = aioloader.DataLoader(RangeDataset(32), 4, shuffle=True, seed=5, pool=wp)
        got = _drain(loader, face)
        ref = aioloader.DataLoader(RangeDataset(32), 4, shuffle=True, seed=5, num_workers=0)
        assert got == [_plain(b) for b in ref] and len(got) == 8
        assert isinstance(first.failure, OSError) and first.crash is not None
        assert wp.current() is not first and loader.stats().restarts == 1
        loader.close()
        ref.close()


@pytest.mark.parametrize("why", ["turned off", "no room for the FIFOs"])
def test_without_lanes_tasks_take_the_executors_way(
    why: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    if why == "turned off":
        monkeypatch.setenv(_lanes.ENV, "0")
    else:  # mkfifo fails: the temporary directory does not exist
        monkeypatch.setattr(_lanes.tempfile, "gettempdir", lambda: str(tmp_path / "missing"))
    p = aioloader.WorkerPool(1)
    try:
        gen = p.start()
        assert gen.lanes is None
        assert gen.submit(pow, 5, 2).result(timeout=30) == 25
    finally:
        p.close()


def _plain(batch: Any) -> Any:
    return [np.asarray(part).tolist() for part in batch]


def _drain(loader: aioloader.DataLoader, face: str) -> list[Any]:
    """One epoch of ``loader`` through ``for`` or ``async for``, as plain lists."""
    if face == "for":
        return [_plain(b) for b in loader]

    async def collect() -> list[Any]:
        return [_plain(b) async for b in loader]

    return asyncio.run(collect())


@pytest.mark.parametrize("face", ["for", "async-for"])
def test_a_loader_gets_its_batches_through_the_lanes(face: str) -> None:
    """End to end: the batches of a loader on an owned pool are the reference ones, and
    its tasks went through the lanes."""
    with aioloader.WorkerPool(2) as wp:
        loader = aioloader.DataLoader(RangeDataset(64), 4, shuffle=True, seed=3, pool=wp, batches_per_task=1)
        got = _drain(loader, face)
        ref = aioloader.DataLoader(RangeDataset(64), 4, shuffle=True, seed=3, num_workers=0)
        assert got == [_plain(b) for b in ref] and len(got) == 16
        assert wp.start().lanes.sent + wp.start().lanes.held >= 16
        loader.close()
        ref.close()


def _exit_1_if_it_holds_a_carried_task(fd: int) -> None:
    try:
        held = os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:aioloader-task")
    except OSError:
        held = False
    os._exit(1 if held else 0)


@needs_memfd
def test_a_forked_child_does_not_keep_the_consumers_carried_tasks() -> None:
    """A process forked while tasks are carried (a fork-started generation after a
    restart) closes its copies of their memfds, which would otherwise keep their memory
    for its whole life."""
    fd, _ = _lane_wire.pack((len, (b"m" * (_lane_wire.CARRY_MIN + 1),)), [])
    assert fd >= 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork beside pytest's threads
            child = mp.get_context("fork").Process(target=_exit_1_if_it_holds_a_carried_task, args=(fd,))
            child.start()
        child.join(30)
        assert child.exitcode == 0
    finally:
        _lane_wire.release(fd)
    assert not _memfds()


async def _blob(i: int) -> bytes:
    return bytes([i % 251]) * 40_000


@needs_memfd
@pytest.mark.parametrize("face", ["for", "async-for"])
def test_a_fetch_loaders_batches_are_carried_to_the_workers(face: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end: a batch of fetched payloads (8 x 40 KB, over a pipe's capacity) reaches
    its worker carried, and the batches are the ones the fetches and the transform make."""
    monkeypatch.setattr(_lanes, "_carrying", True)
    with aioloader.WorkerPool(2) as wp:
        loader = aioloader.DataLoader(
            list(range(48)), 8, shuffle=True, seed=5, pool=wp, fetch=_blob, transform=H.first_and_length
        )
        got = _drain(loader, face)
        with aioloader.DataLoader(list(range(48)), 8, shuffle=True, seed=5, num_workers=0) as ref:
            order = [int(i) for batch in ref for i in batch]
        assert [pair for batch in got for pair in zip(*batch, strict=True)] == [(i % 251, 40_000) for i in order]
        assert wp.start().lanes.carried >= 6
        loader.close()
    assert not _memfds()


def test_replies_written_after_stop_are_still_read(pool: aioloader.WorkerPool, tmp_path: Path) -> None:
    """Stopping the lanes lets each worker answer what it holds; those last replies are
    read and unpickled (arrival frees what a reply holds: a slab's name, ring space)
    until the lanes are joined. The task's reply here creates a file as it arrives."""
    gen = _gen(pool)
    held = _Held(gen, tmp_path)
    marker = tmp_path / "arrived"
    last = gen.submit(H.arrives_as_marker, str(marker))
    gen.lanes.stop()
    with pytest.raises(RuntimeError, match="after shutdown"):
        gen.submit(pow, 2, 2)
    held.release()
    wait_until(lambda: all(f.done() for f in gen.lanes.servers), 30, "the workers to stop serving")
    gen.lanes.join()
    assert marker.exists() and last.result(timeout=0) is None


def test_fifos_of_a_consumer_that_is_gone_are_swept_and_a_live_ones_are_kept(tmp_path: Path) -> None:
    """A consumer killed before its workers opened their FIFOs leaves the names behind;
    the next process that opens lanes removes this user's FIFOs, older than ten minutes,
    named for a pid that no longer exists. Anything else stays."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)  # reaped: its pid names no process now (reuse aside, which keeps it)
    dead = [tmp_path / f"aioloader-lane-{child.pid}-0a0b0c0d-{k}.task" for k in range(2)]
    young = tmp_path / f"aioloader-lane-{child.pid}-0a0b0c0e-0.task"  # could be another namespace's
    live = tmp_path / f"aioloader-lane-{os.getpid()}-0a0b0c0d-0.reply"
    not_a_pid = tmp_path / "aioloader-lane-99999999999999999999-0a0b0c0d-0.task"  # no OverflowError
    plain = tmp_path / f"aioloader-lane-{child.pid}-0a0b0c0f-0.task"  # not a FIFO
    for p in [*dead, young, live, not_a_pid]:
        os.mkfifo(p)
    plain.write_text("not a lane")
    old = time.time() - 3600
    for p in [*dead, live, not_a_pid, plain]:
        os.utime(p, (old, old))
    removed = _lane_wire.sweep(str(tmp_path))
    alive_again = _pid_alive(child.pid)  # the pid was reused meanwhile: kept, as it should be
    assert all(p.exists() == alive_again for p in dead)
    assert removed == (1 if alive_again else 3)  # the dead pid's two, and the pid no process can have
    assert young.exists() and live.exists() and plain.exists() and not not_a_pid.exists()
