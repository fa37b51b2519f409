"""The pool boundary: replies a dying worker cannot wedge, crash attribution that
charges only the task a worker died holding, startup failures that end, and no
executor-internal exception reaching a user or a thread.

The SIGKILL storm and the kill-mid-send scenarios run real process pools; the latter
in a subprocess, since the failure they guard against is a hang that would also stop
the interpreter from exiting.
"""

from __future__ import annotations

import asyncio
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
from aioloader import _shm
from aioloader._pool import procs
from aioloader._validate import default_mp_context
from aioloader._worker import channel as _channel
from aioloader._worker import reply as _reply

from . import _pool_helpers as H
from ._datasets import KillableDataset, RangeDataset, first_to_claim
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
def _reply_of(value: Any) -> Any:
    """What a borrowed executor's process would send back for ``value`` (raised, if an
    exception): the reply, as it arrives here once unpickled."""

    def fn(task: Any) -> Any:
        if isinstance(value, BaseException):
            raise value
        return value

    return pickle.loads(pickle.dumps(_reply.Entry(fn, (1, _shm.host_key()))(None)))


def test_exceptions_travel_as_values_with_their_traceback() -> None:
    err = KeyError("x" * 20000)
    aioloader.errors.add_note(err, "aioloader: raised by dataset[3]")  # 3.10 has no add_note
    outcome = _reply_of(err)
    with pytest.raises(KeyError) as info:
        outcome.unwrap()
    assert "Traceback" in str(info.value.__cause__) and info.value.__notes__ == [
        "aioloader: raised by dataset[3]"
    ]
    # BaseExceptions too: a worker's SystemExit comes back as itself, not as a dead worker
    outcome = _reply_of(SystemExit(5))
    with pytest.raises(SystemExit) as sinfo:
        outcome.unwrap()
    # (args, not .code: tblib, which dask installs, rebuilds exceptions without __init__)
    assert sinfo.value.args == (5,) and "Traceback" in str(sinfo.value.__cause__)


def test_a_result_that_cannot_be_pickled_arrives_as_its_error() -> None:
    outcome = _reply_of(threading.Lock())
    with pytest.raises(TypeError, match="pickle") as info:
        outcome.unwrap()
    assert any("pickling a task's result" in n for n in info.value.__notes__)


def test_large_replies_travel_whole_through_the_channel() -> None:
    batch = {"x": np.arange(1 << 22, dtype=np.float32), "y": list(range(10))}
    with aioloader.WorkerPool(1) as pool:
        got = pool.submit(dict, batch).result(timeout=60)
    assert got["y"] == batch["y"] and np.array_equal(got["x"], batch["x"])


@pytest.mark.torch
def test_plain_tensors_cross_a_channel_as_numpy_arrays_and_others_as_torch_pickles_them() -> None:
    torch = pytest.importorskip("torch")
    a = torch.arange(64)
    data = _channel.pickled({"x": a, "again": a, "f": torch.ones(2, 3, dtype=torch.float16)})
    assert b"_rebuild_tensor" not in data and b"_load_from_bytes" not in data  # torch's serializer unused
    back = pickle.loads(data)
    assert back["again"] is back["x"]  # one object stays one object
    assert torch.equal(back["x"], a) and back["x"].dtype == torch.int64
    assert back["f"].dtype == torch.float16 and back["f"].shape == (2, 3)
    # A view, a tensor that needs grad, a dtype numpy lacks, a strided layout numpy would
    # copy: torch's own pickling, which keeps what they are.
    base = torch.arange(10.0)
    others = [base[2:5], torch.ones(3, requires_grad=True), torch.ones(3, dtype=torch.bfloat16),
              torch.ones(2, 3, 4, 5).to(memory_format=torch.channels_last)]  # fmt: skip
    for t in others:
        got = pickle.loads(_channel.pickled(t))
        assert torch.equal(got.detach(), t.detach()) and got.dtype == t.dtype
        assert got.requires_grad == t.requires_grad and got.stride() == t.stride()


def test_fetched_bytes_travel_beside_the_pickle_uncopied() -> None:
    # The frame's buffers after the pickle are the very bytes objects the task holds:
    # the main process never copies a batch of fetched bodies into a pickle.
    big = bytes(range(256)) * 512  # 128 KiB
    arr = np.arange(1024, dtype=np.int64)  # numpy offers its buffer too: it must stay in
    values = _channel.Carried([big, (big, 1), {"jpg": big, "n": 2}, b"small", arr, 7])
    parts = _channel.frame_parts((len, (values,)))
    assert all(p.obj is big for p in parts[-3:]) and not any(p.obj is big for p in parts[:-3])
    body = b"".join(bytes(p) for p in parts)
    size = _channel.HEAD.unpack_from(body)[0]
    assert size & _channel.BESIDE and size & ~_channel.BESIDE == len(body) - _channel.HEAD.size
    fn, (got,) = _channel.loads(bytearray(body[_channel.HEAD.size :]), True)
    assert fn is len and type(got) is _channel.Carried
    assert type(got[0]) is bytes and type(got[1][0]) is bytes and type(got[2]["jpg"]) is bytes
    assert got[:4] == values[:4] and np.array_equal(got[4], arr) and got[5] == 7
    # An array is a snapshot in the pickle (it could change before the write); so is
    # everything in a frame without large bytes.
    assert len(_channel.frame_parts((len, (_channel.Carried([arr, b"small"]),)))) == 1
    # Any other pickler keeps the bytes in its pickle, at protocol 4 or 5.
    for protocol in (4, 5):
        again = pickle.loads(pickle.dumps(values, protocol))
        assert type(again) is _channel.Carried and type(again[1][0]) is bytes and again[:4] == values[:4]


# -------------------------------------------------------------------- kill mid-send
@pytest.mark.slow
def test_worker_killed_while_it_writes_its_batch_never_hangs(tmp_path: Path) -> None:
    """8 and 64 MiB batches, pickled and through shared memory, the worker SIGKILLed
    inside the write of its result: every batch arrives, close() stops the pool's I/O
    thread, and the interpreter exits."""
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
        assert case["managers"] == 0, case  # close() stopped the pool's I/O thread
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
    """Worker A holds the only batch; worker B, started and idle, is killed. Only B is
    replaced: A keeps its pid and its batch. Then A is killed: with max_retries=1 the
    batch runs once more and arrives, which it could not had B's death been charged."""
    marker, ready = tmp_path / "holder", tmp_path / "ready"
    ready.mkdir()
    ds = KillableDataset(4, 2, str(marker))
    with aioloader.DataLoader(
        ds,
        4,
        num_workers=2,
        max_retries=1,
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
            wait_until(lambda: idle not in loader.worker_pids() and len(loader.worker_pids()) == 2, 30.0,
                       "the idle worker to be replaced")
            assert holder in loader.worker_pids() and consumer.is_alive()  # A still holds its batch
            os.kill(holder, signal.SIGKILL)
        finally:
            consumer.join(60)
        assert out and [b[1].tolist() for b in out[0]] == [[0, 1, 2, 3]]
        assert loader.stats().restarts == 2 and loader.stats().retries == 1


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
    start method for the whole process; a worker killed inside that section left it
    held, and every later pool waited for it for ever. Now a worker killed while it
    starts costs a restart, and the live workers, and the next loader's, hold rows
    0..n-1."""
    ctx = default_mp_context() if method == "default" else "fork"
    ids = tmp_path / "ids"
    ids.mkdir()
    init = _DiesOnceAsItStarts(str(ids))
    expected = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    for round_ in range(2):
        with aioloader.DataLoader(
            RangeDataset(16), 4, num_workers=2, mp_context=ctx, worker_init_fn=init
        ) as loader:
            assert [b[1].tolist() for b in collect(loader)] == expected
            assert loader.stats().restarts == (1 if round_ == 0 else 0)
            # A replacement that got no batch (the other worker was up) may still be starting.
            wait_until(
                lambda loader=loader: len(pids := loader.worker_pids()) == 2 and all((ids / str(p)).exists() for p in pids),
                30.0, "every live worker's start",
            )  # fmt: skip
            pids = loader.worker_pids()
        assert (ids / "killed").exists()
        # The live generation's workers hold rows 0 and 1, one each.
        assert sorted(int((ids / str(p)).read_text()) for p in pids) == [0, 1]


def test_repeated_startup_deaths_end_in_a_clear_error(collect: Any) -> None:
    with aioloader.DataLoader(H.DiesOnArrival(8), 4, num_workers=1) as loader:
        with pytest.raises(aioloader.PoolBrokenError, match="before they finish starting") as info:
            collect(loader)
        assert info.value.exitcode == 7 and "7" in str(info.value)
        # each death but the last was replaced; the last ended the pool
        assert loader.stats().restarts == procs.MAX_START_FAILURES - 1


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
    monkeypatch.setenv("AIOLOADER_FORKSERVER", "spawn")  # multiprocessing starts the workers
    ctx = default_mp_context()
    monkeypatch.setattr(ctx, "Process", _FlakyProcess(type(ctx).Process, exc, fail=1))
    with aioloader.DataLoader(RangeDataset(16), 4, num_workers=2, mp_context=ctx) as loader:
        assert [b[1].tolist() for b in collect(loader)] == [
            [0, 1, 2, 3],
            [4, 5, 6, 7],
            [8, 9, 10, 11],
            [12, 13, 14, 15],
        ]
        assert loader.stats().restarts >= 1


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
    cancelled), then the worker dies: settling what it held must not fail in the
    pool's I/O thread, and the loader stays usable."""
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
        async for _ in loader:  # still usable, on the replacement worker
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
