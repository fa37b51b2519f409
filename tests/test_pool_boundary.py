"""The pool boundary: small replies that a dying worker cannot wedge, crash attribution
that charges only the task a worker died holding, startup failures that end, and no
executor-internal exception reaching a user or a thread.

The SIGKILL storm and the kill-mid-send scenarios run real process pools; the latter
in a subprocess, since the failure they guard against is a hang that would also stop
the interpreter from exiting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import errno
import gc
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioloader
from aioloader import _pool, _reply, _shm

from . import _pool_helpers as H
from ._datasets import CrashDataset, KillableDataset, RangeDataset, first_to_claim
from .conftest import wait_until

REPO = Path(__file__).resolve().parents[1]
FACES = ["for", "async-for"]


def thread_errors(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """From now on, collect the exceptions that escape any thread (the manager thread of
    an executor, say). Called in the test body: pytest installs a hook of its own for
    the call phase, after the fixtures."""
    seen: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", seen.append)
    return seen


# --------------------------------------------------------------------------- replies
def _foreign_origin(dirs: tuple[str, ...]) -> _reply.Origin:
    """An origin that makes this process reply as a worker of another consumer would."""
    return (1, _shm.host_key(), dirs)


def _reply_of(value: Any, dirs: tuple[str, ...] = ()) -> Any:
    def fn(task: Any) -> Any:
        if isinstance(value, BaseException):
            raise value
        return value

    return _reply.Entry(fn, _foreign_origin(dirs))(None)


def test_large_outcomes_are_spilled_and_unlinked_on_arrival(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing")
    batch = {"x": np.arange(1 << 20, dtype=np.float32), "y": list(range(10))}
    reply = _reply_of(batch, (missing, str(tmp_path)))
    wire = pickle.dumps(reply)
    assert len(wire) < 1024, "what crosses the pipe stays far below PIPE_BUF"
    [spill] = [p for p in tmp_path.iterdir() if p.name.startswith(_shm.PREFIX)]
    outcome = pickle.loads(wire)
    assert not spill.exists(), "the consumer unlinks the spill file on arrival"
    assert outcome.ok and outcome.value["y"] == batch["y"]
    x = outcome.value["x"]
    assert np.array_equal(x, batch["x"]) and x.flags.writeable


def test_small_outcomes_and_remote_replies_stay_inline(tmp_path: Path) -> None:
    small = _reply_of([1, 2, 3], (str(tmp_path),))
    assert len(pickle.dumps(small)) <= _reply.INLINE_MAX and not list(tmp_path.iterdir())
    assert pickle.loads(pickle.dumps(small)).value == [1, 2, 3]
    remote = _reply.Entry(lambda t: np.ones(1 << 18), (1, ("another", 0, 0, 0), (str(tmp_path),)))(None)
    assert not list(tmp_path.iterdir()), "a worker on another host never spills"
    assert pickle.loads(pickle.dumps(remote)).value.sum() == 1 << 18


def test_exceptions_travel_as_values_with_their_traceback(tmp_path: Path) -> None:
    err = KeyError("x" * 20000)  # a large exception is spilled like a large batch
    aioloader.errors.add_note(err, "aioloader: raised by dataset[3]")  # 3.10 has no add_note
    outcome = pickle.loads(pickle.dumps(_reply_of(err, (str(tmp_path),))))
    assert not list(tmp_path.iterdir())
    with pytest.raises(KeyError) as info:
        outcome.unwrap()
    assert "Traceback" in str(info.value.__cause__) and info.value.__notes__ == [
        "aioloader: raised by dataset[3]"
    ]
    # BaseExceptions too: a worker's SystemExit comes back as itself, not as a dead worker
    outcome = pickle.loads(pickle.dumps(_reply_of(SystemExit(5))))
    with pytest.raises(SystemExit) as sinfo:
        outcome.unwrap()
    # (args, not .code: tblib, which dask installs, rebuilds exceptions without __init__)
    assert sinfo.value.args == (5,) and "Traceback" in str(sinfo.value.__cause__)


def test_a_result_that_cannot_be_pickled_arrives_as_its_error() -> None:
    outcome = pickle.loads(pickle.dumps(_reply_of(threading.Lock())))
    with pytest.raises(TypeError, match="pickle") as info:
        outcome.unwrap()
    assert any("pickling a task's result" in n for n in info.value.__notes__)


def test_sweep_removes_only_dead_workers_spill_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_reply, "spill_dirs", lambda: (str(tmp_path),))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    me = os.getpid()
    gone = tmp_path / f"{_shm.PREFIX}{me}_{dead_pid}_spill0a0b0c0d_0"
    live = tmp_path / f"{_shm.PREFIX}{me}_{me}_spill0a0b0c0d_0"
    slab = tmp_path / f"{_shm.PREFIX}{me}_{dead_pid}_0a0b0c0d_0"  # shared memory's, not ours
    for p in (gone, live, slab):
        p.write_bytes(b"x")
    assert _reply.sweep_spills([dead_pid]) == 1 and _reply.sweep_spills() == 0
    assert not gone.exists() and live.exists() and slab.exists()


# -------------------------------------------------------------------- kill mid-send
@pytest.mark.slow
def test_worker_killed_while_it_writes_its_batch_never_hangs(tmp_path: Path) -> None:
    """8 and 64 MiB batches, pickled and through shared memory, the worker SIGKILLed
    inside the write of its result: every batch arrives, close() stops the executor's
    manager thread, and the interpreter exits."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "tests._pool_helpers", "mid-send", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    cases = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(cases) == 4, proc.stdout + proc.stderr[-2000:]
    for case in cases:
        assert case["got"] == list(range(6)), case
        assert case["managers"] == 0, case  # close() stopped the executor's manager thread
        assert case["in_write"] and case["restarts"] >= 1, case


# ------------------------------------------------------------------------ the storm
def _clean_plan(n: int, bs: int, seed: int, epochs: int) -> list[list[list[int]]]:
    with aioloader.DataLoader(RangeDataset(n), bs, shuffle=True, seed=seed) as loader:
        return [[b[1].tolist() for b in loader] for _ in range(epochs)]


@pytest.mark.slow
@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("transport", ["shm", "pickle"])
def test_sigkill_storm_every_epoch_identical(
    tmp_path: Path,
    transport: str,
    face: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """2 workers, 1 MiB samples, shuffled; a worker is SIGKILLed after every few batches
    (a random one, or one caught sending its batch). With max_retries=2 every epoch
    equals a clean run, and nothing of the executor reaches the user or a thread."""
    n, bs, seed, epochs, prefetch = 32, 4, 3, 5, 2
    expected = _clean_plan(n, bs, seed, epochs)
    fifo = H.make_fifo(str(tmp_path / "announce"))
    ds = H.BigDataset(n, 1 << 20, fifo=fifo)
    errors = thread_errors(monkeypatch)
    caplog.set_level(logging.ERROR, logger="concurrent.futures")
    with aioloader.DataLoader(
        ds, bs, shuffle=True, seed=seed, num_workers=2, transport=transport, prefetch=prefetch, max_retries=2
    ) as loader:
        with H.Storm(loader, fifo, every=prefetch + 2) as storm:
            got = []
            for _ in range(epochs):
                batches = H.collect(loader, face, storm.progress)
                got.append([[int(v) for v in b[:, 0]] for b in batches])
                for b, idx in zip(batches, got[-1], strict=True):
                    H.check_batch(b, idx)
                del batches
        stats = loader.stats()
    assert not storm.errors, storm.errors
    identical = sum(g == e for g, e in zip(got, expected, strict=True))
    print(
        f"storm {transport}/{face}: kills={storm.kills} (mid-send: {storm.mid_send}) "
        f"restarts={stats.restarts} retries={stats.retries} epochs identical={identical}/{epochs}"
    )
    assert identical == epochs
    # The storm really happened: most of its steps found a worker to kill (a step that
    # comes while the pool restarts finds none), and the kills cost restarts. Not one
    # restart per kill: two kills can land on one incarnation of the pool.
    steps = n // bs * epochs // (prefetch + 2)
    assert storm.kills >= steps // 2 and stats.restarts >= 2, (storm.kills, stats.restarts)
    assert not errors
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# --------------------------------------------------------------- crash attribution
@pytest.mark.parametrize("face", FACES)
def test_killing_an_idle_worker_charges_nobody(tmp_path: Path, face: str) -> None:
    """Worker A holds the only batch; worker B, started and idle, is killed. The pool
    breaks, but B held nothing: with max_retries=0 the batch is simply run again."""
    marker, ready = tmp_path / "holder", tmp_path / "ready"
    ready.mkdir()
    ds = KillableDataset(4, 2, str(marker))
    with aioloader.DataLoader(
        ds,
        4,
        num_workers=2,
        max_retries=0,
        prefetch_next_epoch=False,
        worker_init_fn=H.ready_file(str(ready)),
    ) as loader:
        out: list[Any] = []
        consumer = threading.Thread(target=lambda: out.append(H.collect(loader, face)))
        consumer.start()
        try:
            wait_until(
                lambda: marker.exists() and len(list(ready.iterdir())) == 2, 60.0, "both workers, one holding"
            )
            holder = int(marker.read_text())
            [idle] = [p for p in loader.worker_pids() if p != holder]
            wait_until(
                lambda: H.syscall_of(idle) in H.WAIT_SYSCALLS, 20.0, "the idle worker to wait for work"
            )
            os.kill(idle, signal.SIGKILL)
        finally:
            consumer.join(60)
        assert out and [b[1].tolist() for b in out[0]] == [[0, 1, 2, 3]]
        assert loader.stats().restarts == 1


def test_a_death_before_the_pool_watches_is_still_charged_to_its_holder(
    tmp_path: Path, collect: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker can die holding its first batch before the launcher thread has added
    its callbacks to the executor's watched future; the executor then fails that future
    and stops the survivors before any callback runs. Forced here for two generations
    in a row: each death is charged all the same (before, neither was, and the batch
    ran four times for max_retries=1)."""
    from multiprocessing.connection import wait as wait_ready

    from aioloader import _generation, _worker

    forced: list[int] = []
    submit = _generation.Generation._submit

    def late_watch(self: Any, fn: Any, *args: Any) -> Any:
        if fn is _worker.noop and self.lanes is not None and len(forced) < 2:
            forced.append(self.number)
            # the batch that kills its worker is sent before the workers exist
            assert wait_ready([p.sentinel for p in self.processes.values()], 60), "no worker died"
            real = self.executor.submit

            def submit_and_wait(*a: Any) -> Any:
                fut = real(*a)
                cf.wait([fut], 60)  # the executor saw the death: failed before a callback is added
                assert fut.done()
                return fut

            self.executor.submit = submit_and_wait
        return submit(self, fn, *args)

    monkeypatch.setattr(_generation.Generation, "_submit", late_watch)
    ds = CrashDataset(8, {6}, str(tmp_path), always=True)
    with aioloader.DataLoader(ds, 4, num_workers=2, max_retries=1, prefetch_next_epoch=False) as loader:
        with pytest.raises(aioloader.WorkerCrashedError) as info:
            collect(loader)
    assert len(forced) == 2
    assert info.value.indices == [4, 5, 6, 7] and info.value.attempts == 2
    assert (tmp_path / "crashed-6").read_text() == "xx"


class _DiesOnceAsItStarts:
    """A worker_init_fn that records ``pid worker_id`` in ``directory``; the first worker
    to run it (of any pool: an O_EXCL marker decides) SIGKILLs itself there, half-way
    through starting."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, worker_id: int) -> None:
        Path(self.directory, str(os.getpid())).write_text(str(worker_id))
        if first_to_claim(os.path.join(self.directory, "killed")):
            os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("method", ["default", "fork"])
def test_a_worker_killed_as_it_starts_leaves_later_pools_working(
    tmp_path: Path, collect: Any, method: str
) -> None:
    """Regression: workers once claimed their row of the slot table under one lock per
    start method for the whole process; a worker killed inside that section (a crash's
    survivors are killed, so is a stuck start) left it held, and every later pool of
    that start method waited for it for ever. Rows now come numbered with the process
    object: a worker killed while it starts costs a restart, and each generation's
    workers, and the next loader's, are numbered 0..n-1."""
    ctx = _pool.default_mp_context() if method == "default" else "fork"
    ids = tmp_path / "ids"
    ids.mkdir()
    init = _DiesOnceAsItStarts(str(ids))
    expected = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    for round_ in range(2):
        with aioloader.DataLoader(
            RangeDataset(16), 4, num_workers=2, mp_context=ctx, worker_init_fn=init
        ) as loader:
            assert [b[1].tolist() for b in collect(loader)] == expected
            pids = loader.worker_pids()
            assert loader.stats().restarts == (1 if round_ == 0 else 0)
        assert (ids / "killed").exists()
        # The live generation's workers hold rows 0 and 1, one each.
        assert sorted(int((ids / str(p)).read_text()) for p in pids) == [0, 1]


def test_workers_share_no_lock_with_other_generations() -> None:
    """What the regression above guards, where no kill can be aimed: a semaphore that
    every worker takes as it starts, held by a worker that is killed, stops every pool
    that shares it. Nothing a worker is given at its start is one."""
    from multiprocessing.synchronize import SemLock

    def locks(value: Any) -> list[Any]:
        if isinstance(value, SemLock):
            return [value]
        if isinstance(value, (tuple, list)):
            return [lock for v in value for lock in locks(v)]
        if isinstance(value, dict):
            return [lock for v in value.values() for lock in locks(v)]
        return []

    with aioloader.WorkerPool(2) as pool:
        pool.start()
        executor = pool.current().executor
        assert isinstance(executor, cf.ProcessPoolExecutor)
        assert not locks(executor._initargs)  # type: ignore[attr-defined]


def test_repeated_startup_deaths_end_in_a_clear_error(collect: Any) -> None:
    with aioloader.DataLoader(H.DiesOnArrival(8), 4, num_workers=1) as loader:
        with pytest.raises(aioloader.PoolBrokenError, match="before they finish starting") as info:
            collect(loader)
        assert info.value.exitcode == 7 and "7" in str(info.value)
        assert loader.stats().restarts == _pool.MAX_START_FAILURES


def test_a_payload_the_worker_cannot_load_raises_its_own_error(collect: Any) -> None:
    with aioloader.DataLoader(H.DiesOnArrival(8, raise_instead=True), 4, num_workers=2) as loader:
        with pytest.raises(
            aioloader.DatasetPickleError, match="RuntimeError: this dataset cannot be unpickled in pid"
        ):
            collect(loader)
        assert loader.stats().restarts == 0  # no worker died for it


class _FlakyProcess:
    """Wraps a context's Process class: the first ``fail`` starts raise ``exc``."""

    def __init__(self, cls: type, exc: BaseException, fail: int) -> None:
        self.cls, self.exc, self.left = cls, exc, fail

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        proc = self.cls(*args, **kwargs)
        if self.left > 0:
            self.left -= 1
            exc = self.exc

            def start() -> None:
                raise exc

            proc.start = start
        return proc


@pytest.mark.parametrize(
    "exc",
    [ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), OSError("handle is closed")],
    ids=["forkserver-gone", "handle-closed"],
)
def test_a_pool_failing_as_it_starts_is_rebuilt(
    collect: Any, monkeypatch: pytest.MonkeyPatch, exc: Exception
) -> None:
    ctx = _pool.default_mp_context()
    monkeypatch.setattr(ctx, "Process", _FlakyProcess(type(ctx).Process, exc, fail=1))
    with aioloader.DataLoader(RangeDataset(16), 4, num_workers=2, mp_context=ctx) as loader:
        assert [b[1].tolist() for b in collect(loader)] == [
            [0, 1, 2, 3],
            [4, 5, 6, 7],
            [8, 9, 10, 11],
            [12, 13, 14, 15],
        ]
        assert loader.stats().restarts >= 1


@pytest.mark.parametrize(
    ("factory", "code"), [("Lock", errno.EROFS), ("RawArray", errno.ENOSPC)], ids=["read-only", "full"]
)
def test_unusable_dev_shm_is_a_clear_error(
    collect: Any, monkeypatch: pytest.MonkeyPatch, factory: str, code: int
) -> None:
    ctx = _pool.default_mp_context()

    def refuse(*_: Any, **__: Any) -> Any:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(ctx, factory, refuse)
    with aioloader.DataLoader(
        RangeDataset(8), 4, num_workers=2, mp_context=ctx, transport="pickle"
    ) as loader:
        with pytest.raises(aioloader.PoolBrokenError, match="/dev/shm") as info:
            collect(loader)
        assert os.strerror(code) in str(info.value) and info.value.errno == code


@pytest.mark.parametrize("num_workers", [0, 2], ids=["thread", "processes"])
def test_system_exit_in_a_sample_is_an_error_from_iteration(collect: Any, num_workers: int) -> None:
    with aioloader.DataLoader(H.ExitingDataset(12, 5), 4, num_workers=num_workers) as loader:
        with pytest.raises(SystemExit) as info:
            collect(loader)
        assert info.value.args == (5,) and any("sample index 5" in n for n in info.value.__notes__)
        pids = loader.worker_pids()
        with pytest.raises(SystemExit):  # nothing was killed, no loop stopped: it happens again
            collect(loader)
        assert loader.worker_pids() == pids and loader.stats().restarts == 0


def test_a_break_after_cancelled_batches_does_not_kill_the_manager_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches queued behind a stuck one are abandoned (the iterating task is
    cancelled), then the worker dies: the executor fails every pending future, and one
    cancelled by asyncio would have raised InvalidStateError in its manager thread."""
    marker = tmp_path / "holder"
    errors = thread_errors(monkeypatch)

    async def main() -> None:
        loader = aioloader.DataLoader(
            KillableDataset(32, 0, str(marker)), 1, num_workers=1, prefetch=6, prefetch_next_epoch=False
        )

        async def consume() -> None:
            async for _ in loader:
                pass

        task = asyncio.create_task(consume())
        await asyncio.to_thread(wait_until, marker.exists, 60.0, "the stuck batch to start")
        task.cancel()  # what reaches the queued batches' futures is the question
        await asyncio.gather(task, return_exceptions=True)
        os.kill(int(marker.read_text()), signal.SIGKILL)
        async for _ in loader:  # still usable, on a new generation
            pass
        await loader.aclose()

    asyncio.run(main())
    assert not errors


def _helper_script(mode: str, timeout: float) -> Any:
    """Run ``python -m tests._pool_helpers MODE`` and return the JSON of its last line."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "tests._pool_helpers", mode],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_forked_child_of_a_forkserver_consumer_has_working_pools() -> None:
    assert _helper_script("fork-child", 120) == {"child": 0, "parent_ok": True}


def test_a_multiprocessing_child_holding_a_loader_exits() -> None:
    """Defect: multiprocessing's exit in a child joins its non-daemonic children (our
    workers) before any exit hook of ours ran, so such a child never exited."""
    codes = _helper_script("child-exit", 200)
    assert codes == {
        f"{m}-{h}": (0 if h == "return" else 1)
        for m in ("spawn", "forkserver", "fork")
        for h in ("return", "raise")
    }


# -------------------------------------------------------------------- house rules
def test_only_the_generation_module_reads_executor_internals() -> None:
    """Executor internals are read in ``_generation.py`` alone (the lanes use the
    executor's public ``submit`` only); the forkserver's and the resource tracker's in
    ``_forkserver.py`` alone."""
    executor = (
        "_processes",
        "_executor_manager_thread",
        "_threads_queues",
        "_global_shutdown",
        "_max_workers",
        "_register_atexit",
        "_launch_processes",
        "_call_queue",
        "_pending_work_items",
        "_work_ids",
        "_shutdown_lock",
        "_CallItem",
    )
    server = (
        "forkserver._forkserver",
        "_forkserver_pid",
        "_forkserver_address",
        "_forkserver_alive_fd",
        "_resource_tracker",
    )
    pkg = Path(aioloader.__file__).resolve().parent
    for path in pkg.rglob("*.py"):
        text = path.read_text()
        if path.name != "_generation.py":
            assert not [n for n in executor if f".{n}" in text or f'"{n}"' in text], path.name
        if path.name != "_forkserver.py":
            assert not [n for n in server if n in text], path.name
    dispatch = (pkg / "_engine" / "dispatch.py").read_text()
    assert ".kind" not in dispatch and "thread_starts" not in dispatch


def test_a_future_left_unsettled_by_a_retired_generation_is_reported_lost() -> None:
    """The safety net behind "never hangs": once a process generation is retired, a
    submission whose future it never settled is woken as lost (and so resubmitted)
    instead of waiting for ever."""
    import concurrent.futures as cf

    from aioloader import _pool

    pool = aioloader.WorkerPool(1)
    try:
        gen = pool.start()
        stranded = _pool.Job(gen, task_id=-1, submit_ns=0, future=cf.Future())  # nobody will settle it
        gen.jobs.add(stranded)

        async def main() -> str:
            waiting = asyncio.ensure_future(pool.result(stranded))
            for _ in range(10_000):  # loop turns until the task waits (bounded, not timed)
                if stranded.waiter is not None or waiting.done():
                    break
                await asyncio.sleep(0)
            assert stranded.waiter is not None and not waiting.done()  # it waits on its waiter
            await asyncio.get_running_loop().run_in_executor(None, _pool._release_stranded, gen)
            try:
                await asyncio.wait_for(waiting, 10)
            except _pool.Lost:
                return "lost"
            return "settled"

        assert asyncio.run(main()) == "lost"
    finally:
        pool.close()


@pytest.mark.parametrize("transport", ["shm", "pickle"])
@pytest.mark.parametrize("face", ["for", "async-for"])
def test_a_batch_the_consumer_drops_is_freed_at_once(transport: str, face: str) -> None:
    # Nothing of the engine may keep a delivered batch in a reference cycle: it would
    # live (with its shared-memory slab, so later batches fall back to pickling) until
    # the cyclic GC happened to run. With the GC off, a dropped batch must die at once.
    from ._shm_datasets import ImageDataset

    refs: list[Any] = []

    def keep(batch: Any) -> None:
        refs.append(weakref.ref(batch["img"]))

    loader = aioloader.DataLoader(
        ImageDataset(48), 4, num_workers=2, transport=transport, prefetch_next_epoch=False
    )
    gc.collect()
    gc.disable()
    try:
        with loader:
            if face == "for":
                for batch in loader:
                    keep(batch)
                    del batch
            else:

                async def main() -> None:
                    async for batch in loader:
                        keep(batch)
                        del batch

                asyncio.run(main())
            alive = [k for k, r in enumerate(refs) if r() is not None]
    finally:
        gc.enable()
    assert len(refs) == 12
    assert alive == []
