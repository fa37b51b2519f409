"""Datasets, killers and scenario scripts for the pool-boundary tests. Module level, so
that forkserver and spawn workers can import them."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import platform
import random
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import aioloader

# write(2) and writev(2): what a worker sending its result is inside of; read(2) and
# futex(2): what an idle worker waiting for its next task is inside of.
WRITE_SYSCALLS = {"x86_64": {"1", "20"}, "aarch64": {"64", "66"}}.get(platform.machine(), {"1"})
WAIT_SYSCALLS = {"x86_64": {"0", "202"}, "aarch64": {"63", "98"}}.get(platform.machine(), {"0"})


def syscall_of(pid: int) -> str | None:
    """The system call the main thread of ``pid`` is in ("running" when in user code)."""
    try:
        with open(f"/proc/{pid}/syscall") as f:
            return f.read().split()[0]
    except (OSError, IndexError):
        return None


def kill_while_writing(pid: int, poll_s: float = 2.0, size: int = 0) -> bool:
    """SIGKILL ``pid`` as soon as it is seen writing its result: blocked in a write(2)
    to its channel; or after ``poll_s`` anyway. The poll is busy: the write may last
    only milliseconds. True if the kill landed there."""
    deadline = time.monotonic() + poll_s
    seen = False
    while time.monotonic() < deadline:
        if syscall_of(pid) in WRITE_SYSCALLS:
            seen = True
            break
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return seen


def announce(fifo: str) -> None:
    """Write this worker's pid to the FIFO, if someone reads it (never blocks)."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    with contextlib.suppress(OSError):  # a full pipe: the killer was not listening
        os.write(fd, f"{os.getpid()}\n".encode())
    os.close(fd)


class BigDataset:
    """Sample ``i``: ``nbytes`` of float32 ``i``. Every sample announces its worker on
    ``fifo`` (when given) just before it returns; sample ``marked``, the first time it
    is loaded, writes its worker's pid to ``marker`` (atomically) just before."""

    def __init__(
        self, n: int, nbytes: int, fifo: str | None = None, marker: str | None = None, marked: int = -1
    ) -> None:
        self.n = n
        self.count = nbytes // 4
        self.fifo = fifo
        self.marker = marker
        self.marked = marked

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        sample = np.full(self.count, i, dtype=np.float32)
        if self.marker is not None and i == self.marked and not os.path.exists(self.marker):
            tmp = f"{self.marker}.{os.getpid()}"
            Path(tmp).write_text(str(os.getpid()))
            os.replace(tmp, self.marker)
        if self.fifo is not None:
            announce(self.fifo)
        return sample


def first(samples: list[Any]) -> Any:
    """collate_fn for batch_size=1: the sample itself, no copy."""
    return samples[0]


def check_batch(batch: np.ndarray, indices: list[int]) -> None:
    """A batch of BigDataset samples holds exactly ``indices``, every element."""
    rows = batch.reshape(len(indices), -1)
    assert (rows == np.asarray(indices, dtype=np.float32)[:, None]).all(), f"batch {indices} corrupted"


def collect(loader: Any, face: str, each: Any = None) -> list[Any]:
    """One epoch through ``for`` or ``async for``, calling ``each(batch)`` on every batch."""

    def take(batch: Any) -> Any:
        if each is not None:
            each(batch)
        return batch

    if face == "for":
        return [take(b) for b in loader]

    async def main() -> list[Any]:
        return [take(b) async for b in loader]

    return asyncio.run(main())


# ------------------------------------------------------------------ kill mid-send scenario
def kill_on_write_main() -> None:
    """``python -m tests._pool_helpers kill-on-write MARKER SIZE``: wait for the marker,
    then SIGKILL the pid in it while it writes its result of SIZE bytes; prints whether
    it was caught there. A process of its own, so that no GIL stands between it and
    the moment of the write."""
    marker, size = sys.argv[2], int(sys.argv[3])
    print("ready", flush=True)
    while not os.path.exists(marker):
        time.sleep(0.0002)  # waiting on the file the worker writes
    pid = int(Path(marker).read_text())
    if size:
        print(json.dumps(kill_while_writing(pid, size=size)), flush=True)
    else:  # a shared-memory batch is written by memcpy: kill while it is being made
        os.kill(pid, signal.SIGKILL)
        print(json.dumps(True), flush=True)


def mid_send(nbytes: int, transport: str, face: str, marker: str) -> dict[str, Any]:
    """Six batches of ``nbytes`` each, one sample per batch; the worker that returns
    sample 2 is killed while it writes the batch back (if the killer catches it there).
    Runs in a subprocess."""
    import subprocess

    ds = BigDataset(6, nbytes, marker=marker, marked=2)
    killer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests._pool_helpers",
            "kill-on-write",
            marker,
            str(nbytes if transport == "pickle" else 0),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert killer.stdout is not None and killer.stdout.readline() == "ready\n"
        with aioloader.DataLoader(
            ds, 1, num_workers=2, transport=transport, collate_fn=first, timeout=30
        ) as loader:
            got = []
            for b in collect(loader, face):
                got.append(int(b[0]))
                check_batch(b, [got[-1]])
            in_write = json.loads(killer.communicate(timeout=60)[0])
            restarts = loader.stats().restarts
    finally:
        if killer.poll() is None:
            killer.kill()
            killer.wait()
    pool_threads = [x for x in threading.enumerate() if x.name == "aioloader-pool"]
    return {"got": got, "restarts": restarts, "in_write": in_write, "managers": len(pool_threads)}


def mid_send_main() -> None:
    """``python -m tests._pool_helpers mid-send DIR``: every size x transport x face. A
    pickled case is run again (up to three times) until its kill lands inside a write;
    a shared-memory batch is killed as soon as its last sample is loaded."""
    out = Path(sys.argv[2])
    cases = [
        (8 << 20, "pickle", "for"),
        (8 << 20, "shm", "async-for"),
        (64 << 20, "pickle", "async-for"),
        (64 << 20, "shm", "for"),
    ]
    for k, (nbytes, transport, face) in enumerate(cases):
        for attempt in range(3 if transport == "pickle" else 1):
            res = mid_send(nbytes, transport, face, str(out / f"marker-{k}-{attempt}"))
            if res["in_write"]:
                break
        print(json.dumps({"case": [nbytes, transport, face], "attempts": attempt + 1, **res}), flush=True)


# ---------------------------------------------------------------------- the SIGKILL storm
class Storm:
    """A killer thread: every ``every`` delivered batches it SIGKILLs one worker,
    alternately a random current pid of ``loader.worker_pids()`` and the next worker to
    announce (on ``fifo``) that it is returning a sample, i.e. about to collate and send
    its batch. The consumer reports each batch to :meth:`progress`, which holds it
    until every other step's kill is done: the kills keep pace with the batches."""

    def __init__(self, loader: Any, fifo: str, every: int) -> None:
        self.loader = loader
        self.every = every
        self.delivered = 0
        self.handled = 0  # steps whose kill is done
        self.kills = 0
        self.mid_send = 0
        self.errors: list[BaseException] = []
        self.cond = threading.Condition()
        self.done = False
        self.fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # RDWR: never blocks, never EOF
        self.thread = threading.Thread(target=self._run, name="test-storm")

    def progress(self, _batch: Any = None) -> None:
        """Count one batch; at an odd step, wait until its (random) kill is done. Even
        steps do not wait: their victim must still be working. So a batch in flight
        meets at most two kills (an even step's, late, and the next one's)."""
        with self.cond:
            self.delivered += 1
            self.cond.notify_all()
            step = self.delivered // self.every
            if self.delivered % self.every == 0 and step % 2 == 1:
                self.cond.wait_for(lambda: self.done or self.handled >= step, timeout=30)

    def __enter__(self) -> Storm:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.cond:
            self.done = True
            self.cond.notify_all()
        self.thread.join(60)
        os.close(self.fd)

    def _announced(self, within: float) -> int | None:
        """The next worker to announce itself (earlier announcements are dropped)."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self.fd, 4096):
                pass
        ready, _, _ = select.select([self.fd], [], [], within)
        if not ready:
            return None
        try:
            return int(os.read(self.fd, 64).split(b"\n")[0])
        except BlockingIOError:
            return None

    def _run(self) -> None:
        try:
            step = 0
            while True:
                with self.cond:
                    self.cond.wait_for(lambda s=step: self.done or self.delivered >= (s + 1) * self.every)  # type: ignore[misc]
                    if self.done:
                        return
                step += 1
                pid = self._announced(2.0) if step % 2 == 0 else None
                self.mid_send += pid is not None
                pids = self.loader.worker_pids()
                if pid is None and pids:
                    pid = random.choice(pids)
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                        self.kills += 1
                with self.cond:
                    self.handled = step
                    self.cond.notify_all()
        except BaseException as exc:  # pragma: no cover - reported by the test
            self.errors.append(exc)
            with self.cond:
                self.handled = 1 << 30
                self.cond.notify_all()


def make_fifo(path: str) -> str:
    try:
        os.mkfifo(path, 0o600)
    except OSError as exc:  # pragma: no cover
        if exc.errno != errno.EEXIST:
            raise
    return path


# ----------------------------------------------------------------------- startup failures
class DiesOnArrival:
    """Pickles fine; unpickling it in any other process ends that process (exit 7), or
    with ``raise_instead`` raises there."""

    def __init__(self, n: int, raise_instead: bool = False, home: int | None = None) -> None:
        self.n = n
        self.raise_instead = raise_instead
        self.home = os.getpid() if home is None else home

    def __reduce__(self) -> Any:
        return (_arrive, (self.n, self.raise_instead, self.home))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _arrive(n: int, raise_instead: bool, home: int) -> DiesOnArrival:
    if os.getpid() != home:
        if raise_instead:
            raise RuntimeError(f"this dataset cannot be unpickled in pid {os.getpid()}")
        os._exit(7)
    return DiesOnArrival(n, raise_instead, home)


class ExitingDataset:
    """``sys.exit(5)`` at index ``bad``."""

    def __init__(self, n: int, bad: int) -> None:
        self.n = n
        self.bad = bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.bad:
            sys.exit(5)
        return i


def ready_file(directory: str) -> Any:
    """A worker_init_fn that marks its worker as started (a file named by its pid)."""
    return _ReadyFile(directory)


class _ReadyFile:
    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, worker_id: int) -> None:
        Path(self.directory, str(os.getpid())).touch()


# --------------------------------------------------------------------- forked consumers
def fork_child_main() -> None:
    """``python -m tests._pool_helpers fork-child``: a consumer that uses a forkserver
    pool, then forks a child that uses a pool of its own; both must work."""
    import multiprocessing as mp

    from ._datasets import RangeDataset

    with aioloader.DataLoader(RangeDataset(16), 4, num_workers=1) as parent:
        before = [b[1].tolist() for b in parent]
        pids = parent.worker_pids()
        child = mp.get_context("fork").Process(target=_child)
        child.start()
        child.join(60)
        after = [b[1].tolist() for b in parent]
        same_workers = parent.worker_pids() == pids and parent.stats().restarts == 0
    print(json.dumps({"child": child.exitcode, "parent_ok": before == after and same_workers}), flush=True)


def _child() -> None:
    from ._datasets import RangeDataset

    try:
        with aioloader.DataLoader(RangeDataset(8), 4, num_workers=1) as loader:
            assert [b[1].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(3)


def _holds_a_loader(how: str) -> None:
    from ._datasets import RangeDataset

    loader = aioloader.DataLoader(RangeDataset(100), 2, num_workers=1)
    it = iter(loader)
    next(it)
    if how == "raise":
        raise RuntimeError("boom (expected)")
    _kept.append(loader)  # still referenced when the interpreter exits


_kept: list[Any] = []


def child_exit_main() -> None:
    """``python -m tests._pool_helpers child-exit``: multiprocessing children (each start
    method) that hold a loader with a live worker when their target returns or raises;
    prints each child's exit code, or "alive" if it is still running after 60 s."""
    import multiprocessing as mp

    out = {}
    for method in ("spawn", "forkserver", "fork"):
        for how in ("return", "raise"):
            child = mp.get_context(method).Process(target=_holds_a_loader, args=(how,))
            child.start()
            child.join(60)
            out[f"{method}-{how}"] = "alive" if child.is_alive() else child.exitcode
            if child.is_alive():
                child.kill()
                child.join()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    {
        "mid-send": mid_send_main,
        "kill-on-write": kill_on_write_main,
        "fork-child": fork_child_main,
        "child-exit": child_exit_main,
    }[sys.argv[1]]()


# ------------------------------------------------------------------ lane tasks
def block_until_released(started: str, release: str) -> int:
    """A task that holds its worker: it creates ``started``, then reads the FIFO
    ``release`` until the test closes its end. Returns the worker's pid."""
    Path(started).touch()
    with open(release, "rb") as f:
        f.read()
    return os.getpid()


def length_of(data: bytes) -> int:
    return len(data)


def first_and_length(data: bytes) -> tuple[int, int]:
    return data[0], len(data)


def pid_of(_: Any) -> int:
    return os.getpid()


class BreaksOnUnpickle:
    """Pickles in the consumer; unpickling it (in a worker) raises ``ValueError``."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_refuse_to_unpickle, ())


def _refuse_to_unpickle() -> None:
    raise ValueError("this object cannot be rebuilt in a worker")


def arrives_as_marker(path: str) -> Any:
    """A task whose reply, as it is unpickled in the consumer, creates ``path``."""
    return _Marker(path)


class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (_touch, (self.path,))


def _touch(path: str) -> None:
    Path(path).touch()
