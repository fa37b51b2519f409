"""Borrowed executors (issue 9): the core behaviours of the loader on a user's
``ThreadPoolExecutor``, a user's ``ProcessPoolExecutor`` and a dask ``LocalCluster``
(worker processes on 127.0.0.1), a dask worker killed mid-epoch, and the executor left
running after the loader closes.

One dask cluster serves the whole module (it starts once, before the first test, so
the per-test leak check sees its processes and threads as already there). The test
that kills a worker runs its own cluster: the nanny's replacement worker is a new
process, which must be gone again when that test ends.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioloader
from aioloader._worker import tasks

from ._datasets import AugmentedDataset, FailingDataset, HeavyDataset, KillableDataset, RangeDataset
from .conftest import wait_until

REPO = Path(__file__).resolve().parents[1]
EXECUTORS = ["thread", "process", "dask"]


def _local_cluster() -> tuple[Any, Any]:
    import distributed

    dd: Any = distributed  # only partly typed
    cluster = dd.LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        # None would still bind the scheduler's HTTP endpoint to the fixed port 8787,
        # which a second cluster (the kill test's, the example's) then cannot have.
        dashboard_address="127.0.0.1:0",
    )
    return cluster, dd.Client(cluster)


@pytest.fixture(scope="module", autouse=True)
def dask_client() -> Iterator[Any]:
    """The module's dask client (``None`` when distributed is not installed).

    Autouse, so that it starts before the first test's leak snapshot whatever the test
    order. A warm-up epoch starts the helper threads that dask creates lazily and keeps
    for the life of the interpreter (its offload thread, say)."""
    try:
        import distributed  # noqa: F401
    except ImportError:
        yield None
        return
    cluster, client = _local_cluster()
    try:
        with aioloader.DataLoader(RangeDataset(8), 2, executor=client.get_executor(pure=False)) as loader:
            assert len(list(loader)) == 4
        yield client
    finally:
        client.close()
        cluster.close()


@pytest.fixture(params=EXECUTORS)
def executor(request: pytest.FixtureRequest, dask_client: Any) -> Iterator[cf.Executor]:
    """A user-owned executor of each kind, shut down by the test (never by the loader)."""
    kind = request.param
    if kind == "thread":
        with cf.ThreadPoolExecutor(4, thread_name_prefix="user-pool") as tex:
            yield tex
    elif kind == "process":
        ctx = multiprocessing.get_context("forkserver")
        with cf.ProcessPoolExecutor(2, mp_context=ctx) as pex:
            yield pex
    else:
        if dask_client is None:
            pytest.skip("dask.distributed is not installed (pip install 'aioloader[dask]')")
        yield dask_client.get_executor(pure=False)


def reference(dataset: Any, epochs: int = 2, **kwargs: Any) -> list[list[Any]]:
    """What ``num_workers=0`` delivers, epoch by epoch."""
    with aioloader.DataLoader(dataset, num_workers=0, **kwargs) as loader:
        return [list(loader) for _ in range(epochs)]


def as_bytes(batches: list[Any]) -> list[tuple[bytes, ...]]:
    return [tuple(np.asarray(leaf).tobytes() for leaf in batch) for batch in batches]


def still_running(ex: cf.Executor) -> None:
    assert ex.submit(pow, 2, 5).result(timeout=30) == 32


# ------------------------------------------------------------------------- order
@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "unordered"])
@pytest.mark.parametrize("shuffle", [False, True], ids=["seq", "shuffle"])
def test_batches_equal_num_workers_0(
    executor: cf.Executor, collect: Callable[..., list[Any]], shuffle: bool, ordered: bool
) -> None:
    opts: dict[str, Any] = {"batch_size": 5, "shuffle": shuffle, "seed": 7, "last_batch": "rollover"}
    expected = reference(RangeDataset(37), **opts)
    with aioloader.DataLoader(RangeDataset(37), executor=executor, ordered=ordered, **opts) as loader:
        assert loader.pool.kind == "external"
        got = [collect(loader) for _ in range(2)]
    for epoch_got, epoch_expected in zip(got, expected, strict=True):
        if ordered:
            assert as_bytes(epoch_got) == as_bytes(epoch_expected)
        else:
            assert sorted(as_bytes(epoch_got)) == sorted(as_bytes(epoch_expected))
            assert len(epoch_got) == len(epoch_expected)


def test_determinism_same_augmented_bytes(executor: cf.Executor, collect: Callable[..., list[Any]]) -> None:
    opts: dict[str, Any] = {"batch_size": 8, "shuffle": True, "seed": 11}
    expected = reference(AugmentedDataset(40), **opts)
    with aioloader.DataLoader(AugmentedDataset(40), executor=executor, **opts) as loader:
        got = [collect(loader) for _ in range(2)]
    assert as_bytes(got[0]) == as_bytes(expected[0])
    assert as_bytes(got[1]) == as_bytes(expected[1])
    assert as_bytes(got[0]) != as_bytes(got[1])  # a new epoch draws new augmentations


# -------------------------------------------------------------------- in-flight bound
class CountingExecutor(cf.Executor):
    """Wraps an executor and records the most futures it had outstanding at once."""

    def __init__(self, inner: cf.Executor) -> None:
        self.inner = inner
        self.lock = threading.Lock()
        self.outstanding = 0
        self.peak = 0
        self.submitted = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future[Any]:
        fut = self.inner.submit(fn, *args, **kwargs)
        with self.lock:
            self.outstanding += 1
            self.submitted += 1
            self.peak = max(self.peak, self.outstanding)
        fut.add_done_callback(self._done)
        return fut

    def _done(self, _fut: cf.Future[Any]) -> None:
        with self.lock:
            self.outstanding -= 1


def _iterate_checking_window(loader: aioloader.DataLoader, prefetch: int) -> list[int]:
    """One epoch with ``for``; after each batch, the window must refill to exactly
    ``prefetch`` (while enough batches remain) and never exceed it."""
    seen = []
    n = len(loader)
    for k, batch in enumerate(loader):
        assert loader.stats().in_flight <= prefetch
        seen.append(loader.stats().in_flight)
        if n - (k + 1) >= prefetch:
            wait_until(lambda: loader.stats().in_flight == prefetch, 30.0, "the window to refill")
        assert loader.stats().in_flight <= prefetch
        assert batch[1].tolist() == list(range(4 * k, min(4 * k + 4, 40)))
    return seen


def test_in_flight_bound(executor: cf.Executor) -> None:
    prefetch = 3
    counting = CountingExecutor(executor)
    with aioloader.DataLoader(
        RangeDataset(40), 4, executor=counting, prefetch=prefetch, prefetch_next_epoch=False
    ) as loader:
        _iterate_checking_window(loader, prefetch)
        assert loader.stats().in_flight == 0
    assert 0 < counting.peak <= prefetch
    assert counting.submitted >= 10  # every batch, plus one resubmission per worker that lacked the dataset
    still_running(executor)
    # The loader's own pool keeps the same bound, by the same measure.
    with aioloader.DataLoader(
        RangeDataset(40), 4, num_workers=2, prefetch=prefetch, prefetch_next_epoch=False
    ) as own:
        _iterate_checking_window(own, prefetch)


# ---------------------------------------------------------------------------- errors
def test_error_keeps_type_and_names_the_sample(
    executor: cf.Executor, collect: Callable[..., list[Any]]
) -> None:
    with aioloader.DataLoader(FailingDataset(24, {13}, KeyError), 4, executor=executor) as loader:
        with pytest.raises(KeyError, match="sample 13 is bad") as info:
            collect(loader)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "sample index 13" in notes
    assert "batch 3 of epoch 0" in notes
    still_running(executor)


def test_skip_on_error(executor: cf.Executor) -> None:
    with aioloader.DataLoader(FailingDataset(12, {1, 9}), 4, executor=executor, on_error="skip") as loader:
        got = [b[1].tolist() for b in loader]
        assert loader.stats().skipped == 2
    assert got == [[0, 2, 3], [4, 5, 6, 7], [8, 10, 11]]


# ------------------------------------------------------------------------- lifecycle
def test_close_leaves_the_executor_running(executor: cf.Executor, collect: Callable[..., list[Any]]) -> None:
    loader = aioloader.DataLoader(RangeDataset(64), 4, executor=executor, prefetch=6)
    assert len(collect(loader, limit=3)) == 3  # leaves batches in flight, then cancels them
    loader.close()
    assert loader.closed
    still_running(executor)
    # A new loader on the same executor works, and so does the executor after it.
    with aioloader.DataLoader(RangeDataset(10), 4, executor=executor) as again:
        assert [b[1].tolist() for b in collect(again)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    still_running(executor)


@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "unordered"])
def test_stream_loader_on_the_executor(executor: cf.Executor, ordered: bool) -> None:
    from aioloader.stream import StreamLoader

    from ._stream_helpers import as_lists, square

    expected = [[x * x for x in range(k, min(k + 4, 22))] for k in range(0, 22, 4)]
    with StreamLoader(range(22), square, batch_size=4, executor=executor, ordered=ordered) as stream:
        got = as_lists(list(stream))
    assert (got if ordered else sorted(got)) == expected
    still_running(executor)


def test_task_carries_what_makes_it_unique() -> None:
    # dask's pure=True names a task by hashing its function and arguments. Every task
    # aioloader submits differs from every other one: the loader's token (a uuid4), a
    # task id unique in the process, the epoch and the seed are all fields of the task.
    assert tasks.BatchTask._fields[:3] == ("token", "task_id", "epoch")
    assert "seed" in tasks.BatchTask._fields
    tokenize = pytest.importorskip("dask.base").tokenize
    idx = np.arange(4)
    a = tasks.BatchTask("t", 1, 0, 0, idx, 5)
    b = tasks.BatchTask("t", 2, 0, 0, idx, 5)  # the same batch, resubmitted
    c = tasks.BatchTask("t", 1, 1, 0, idx, 5)  # the same batch, next epoch
    assert len({tokenize(tasks.run_batch, t) for t in (a, b, c)}) == 3


def test_dask_pure_true_executor_still_gives_every_batch(dask_client: Any) -> None:
    if dask_client is None:
        pytest.skip("dask.distributed is not installed")
    opts: dict[str, Any] = {"batch_size": 4, "shuffle": True, "seed": 3}
    expected = reference(AugmentedDataset(24), **opts)
    with aioloader.DataLoader(AugmentedDataset(24), executor=dask_client.get_executor(), **opts) as loader:
        got = [list(loader) for _ in range(2)]
    assert as_bytes(got[0]) == as_bytes(expected[0])
    assert as_bytes(got[1]) == as_bytes(expected[1])


def test_ranks_share_one_executor(executor: cf.Executor) -> None:
    # Data-parallel ranks (here two loaders in one process) with the same seed, each
    # with its shard, on one executor: each rank gets what num_workers=0 gives it, and
    # together they cover the epoch once.
    opts: dict[str, Any] = {"batch_size": 4, "shuffle": True, "seed": 21, "shard_policy": "drop"}
    expected = [reference(AugmentedDataset(40), epochs=1, shard=(r, 2), **opts)[0] for r in range(2)]
    with (
        aioloader.DataLoader(AugmentedDataset(40), executor=executor, shard=(0, 2), **opts) as rank0,
        aioloader.DataLoader(AugmentedDataset(40), executor=executor, shard=(1, 2), **opts) as rank1,
    ):
        it0, it1 = iter(rank0), iter(rank1)
        got: list[list[Any]] = [[], []]
        for b0, b1 in zip(it0, it1, strict=True):  # interleaved, both in flight at once
            got[0].append(b0)
            got[1].append(b1)
    assert as_bytes(got[0]) == as_bytes(expected[0])
    assert as_bytes(got[1]) == as_bytes(expected[1])
    indices = sorted(int(i) for rank in got for batch in rank for i in batch[1])
    assert indices == list(range(40))


# ------------------------------------------------------------------ dask worker death
def _worker_pids(client: Any) -> set[int]:
    """The pids of the cluster's workers; empty while the scheduler still lists one that
    died (a broadcast to it fails until the scheduler notices, after its nanny restarts it)."""
    from distributed.comm.core import CommClosedError

    try:
        return set(client.run(os.getpid).values())
    except (CommClosedError, OSError):
        return set()


class _Killer:
    """Kills the worker process whose pid the gated sample writes to ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker
        self.killed: list[int] = []
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="test-killer")

    def _run(self) -> None:
        try:
            wait_until(self.marker.exists, 60.0, "the gated sample to start")
            pid = int(self.marker.read_text())
            os.kill(pid, signal.SIGKILL)
            self.killed.append(pid)
        except BaseException as exc:
            self.errors.append(exc)

    def __enter__(self) -> _Killer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join(90)


@pytest.mark.parametrize("collect_mode", ["for", "async-for"])
def test_dask_worker_killed_mid_epoch(dask_client: Any, tmp_path: Path, collect_mode: str) -> None:
    """A worker process is killed while it builds a batch; its nanny restarts it, dask
    reruns the lost task (on either worker), and the epoch equals a crash-free one."""
    if dask_client is None:
        pytest.skip("dask.distributed is not installed")
    from .conftest import _collect_async, _collect_sync

    collect = _collect_sync if collect_mode == "for" else _collect_async
    marker = tmp_path / "running-pid"
    opts: dict[str, Any] = {"batch_size": 4, "shuffle": True, "seed": 5}
    expected = reference(RangeDataset(48), epochs=1, **opts)[0]
    cluster, client = _local_cluster()  # its own: the replacement worker must not outlive the test
    try:
        before = set(client.run(os.getpid).values())
        ex = client.get_executor(pure=False)
        with _Killer(marker) as killer:
            with aioloader.DataLoader(KillableDataset(48, 21, str(marker)), executor=ex, **opts) as loader:
                got = collect(loader)
                assert loader.stats().restarts == 0  # nothing for the loader to do: dask reran it
        assert not killer.errors, killer.errors
        assert killer.killed and killer.killed[0] in before
        assert as_bytes(got) == as_bytes(expected)
        # The nanny replaced the dead process; the cluster is whole again.
        client.wait_for_workers(2, timeout=60)
        wait_until(lambda: len(_worker_pids(client) - before) == 1, 60.0, "the restarted worker")
        pids = _worker_pids(client)
        assert pids and killer.killed[0] not in pids
        still_running(ex)
    finally:
        client.close()
        cluster.close()


def test_dask_gives_up_on_a_batch_that_keeps_killing_workers(dask_client: Any, tmp_path: Path) -> None:
    """Past ``distributed.scheduler.allowed-failures`` (3 by default; 0 here, so one
    death is enough) dask stops rerunning the task and fails it with ``KilledWorker``.
    The loader passes dask's verdict on unchanged, as it would any task's exception:
    the executor is not broken, and aioloader does not second-guess its retry policy."""
    if dask_client is None:
        pytest.skip("dask.distributed is not installed")
    import dask
    from distributed import KilledWorker

    marker = tmp_path / "running-pid"
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        cluster, client = _local_cluster()
    try:
        ex = client.get_executor(pure=False)
        with _Killer(marker) as killer:
            with aioloader.DataLoader(KillableDataset(16, 5, str(marker)), 4, executor=ex) as loader:
                with pytest.raises(KilledWorker) as info:
                    list(loader)
        assert killer.killed and not killer.errors
        assert any("epoch 0" in n for n in getattr(info.value, "__notes__", []))
        client.wait_for_workers(2, timeout=60)
        still_running(ex)
    finally:
        client.close()
        cluster.close()


# ------------------------------------------------------------------------- example
@pytest.mark.slow
def test_dask_example_runs(dask_client: Any) -> None:
    if dask_client is None:
        pytest.skip("dask.distributed is not installed")
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "dask_cluster.py"), "--epochs", "2", "--samples", "1024"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 workers" in proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("final loss")
    final, first = (float(w.strip("()")) for w in (last.split()[2], last.split()[-1]))
    assert final < first


class CapturingExecutor(cf.Executor):
    """Wraps an executor and records the pickled size of every task submitted to it."""

    def __init__(self, inner: cf.Executor) -> None:
        self.inner = inner
        self.sizes: list[tuple[int, bool]] = []  # (bytes, carries the payload)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future[Any]:
        task = args[0]
        size = len(pickle.dumps((fn, *args), protocol=pickle.HIGHEST_PROTOCOL))
        self.sizes.append((size, isinstance(task, tasks.BatchTask) and task.payload is not None))
        return self.inner.submit(fn, *args, **kwargs)


def test_batch_task_stays_small_whatever_the_dataset(executor: cf.Executor) -> None:
    # The dataset (here 1 MiB) travels only with tasks that reached a worker which had
    # not seen it yet: the `prefetch` tasks in flight at the start, and more while the
    # executor keeps sending plain tasks to a worker that has not had a payload task
    # (dask places tasks itself: one run saw 9 such at the start). Once every worker
    # has it, a task carries only its indices and a little metadata.
    nbytes, prefetch, batches = 1 << 20, 4, 48
    capture = CapturingExecutor(executor)
    with aioloader.DataLoader(
        HeavyDataset(64 * batches, nbytes),
        64,
        shuffle=True,
        executor=capture,
        prefetch=prefetch,
        batches_per_task=1,  # one BatchTask a batch (test_grouping.py covers groups)
    ) as loader:
        got = [b[1].tolist() for b in loader]
    assert sorted(i for b in got for i in b) == list(range(64 * batches))
    plain = [size for size, with_payload in capture.sizes if not with_payload]
    heavy = [size for size, with_payload in capture.sizes if with_payload]
    assert len(plain) >= batches
    assert max(plain) < 1024
    assert 1 <= len(heavy) <= batches // 3  # the start's, not one a batch
    assert min(heavy) > nbytes
    still_running(executor)
