"""What runs inside a worker for an iterable dataset (a torch ``IterableDataset``): one
*shard task* per worker and epoch.

As in torch, each worker iterates its own copy of the dataset, which tells the workers
apart through ``torch.utils.data.get_worker_info()`` (id ``shard`` of ``num_shards``),
cuts the samples into batches, collates them and sends each batch to the consumer. A
shard task lasts the whole epoch, so its batches cannot travel as the task's result:
they go over a Unix socket that the consumer listens on, one connection per shard task,
in frames of ``8-byte length + pickle``. The consumer grants *credits* over the same
connection (an 8-byte absolute count: "you may send batches below this index"), and
the worker blocks before building a batch it has no credit for, so batches in flight
never exceed the consumer's window.

A connection belongs to one shard task, so a worker killed mid-frame leaves only its own
half-written frame, which the consumer discards at end of stream. The restarted task
iterates from the start and skips the batches the consumer already has (``skip``): an
iterable dataset has no random access, and replaying is the only position it has. The
consumer closing the connection ends the task at its next credit wait or send.

The task's own result (via :func:`aioloader._worker.tasks.run_task`) is only how many batches
the shard had, or the exception that ended its iteration, with a note naming the worker,
the batch and the epoch. The connection is closed before the task returns, so the
consumer settles a shard once it has read the connection to its end.

This module never imports asyncio.
"""

from __future__ import annotations

import functools
import itertools
import os
import pickle
import socket
import struct
from collections.abc import Iterator
from typing import Any, NamedTuple

from .. import _seeding
from ..errors import CollateError, add_note
from . import info as _info
from . import reply as _reply
from . import tasks as _tasks
from . import unpicklable as _unpicklable

__all__ = ["CREDIT", "FRAME_LENGTH", "ShardResult", "ShardTask", "run_shard"]

FRAME_LENGTH = struct.Struct("!Q")  # worker -> consumer: the pickled message follows
CREDIT = struct.Struct("!q")  # consumer -> worker: send the batches below this index


class ShardTask(NamedTuple):
    """One worker's iteration of one epoch of an iterable dataset."""

    token: str
    task_id: int
    epoch: int
    shard: int  # get_worker_info().id
    num_shards: int  # get_worker_info().num_workers
    seed: int  # get_worker_info().seed, and the global generators' seed
    address: str  # the consumer's Unix socket
    skip: int  # batches the consumer already has (a restarted task replays past them)
    payload: bytes | _tasks.WorkerContext | None = None


class ShardResult(NamedTuple):
    batches: int  # how many the shard had (its batches went over the socket)
    pid: int
    start_ns: int
    end_ns: int


def run_shard(task: ShardTask) -> ShardResult | str:
    """Iterate one shard of an iterable dataset for one epoch (see the module docstring).

    The connection is made first, so every task that returns (a result, an exception, or
    :data:`~aioloader._worker.tasks.NEED_PAYLOAD`) closed it before: once the consumer has read
    it to its end, it holds every batch the task sent."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.connect(task.address)
            _send(sock, ("hello", task.task_id, os.getpid()))
        except OSError:  # the consumer's run is over (or its socket cannot be reached)
            return ShardResult(-1, os.getpid(), 0, 0)
        try:
            return _tasks.run_task(task, functools.partial(_build, sock), ShardResult)
        finally:
            _hang_up(sock)
    finally:
        sock.close()


def _hang_up(sock: socket.socket) -> None:
    """End the connection so that the consumer reads every frame sent: say "no more"
    (the consumer answers by closing its side), and read, discarding them, the credits
    that came meanwhile. Closing at once could reset the connection (unread credits) or
    fail the consumer's next credit write, and either may drop frames it has not read."""
    try:
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(4096):
            pass
    except OSError:
        pass


def _where(task: ShardTask, j: int) -> str:
    return f"batch {j} of worker {task.shard} in epoch {task.epoch}, {_reply.process_label()}"


def _batches(ctx: _tasks.WorkerContext, task: ShardTask) -> Iterator[list[Any]]:
    """The shard's samples, ``batch_size`` at a time (the last one short unless
    ``drop_last``); one at a time for ``batch_size=None``. Errors name the batch."""
    it = iter(ctx.dataset)
    size = 1 if ctx.unbatched else ctx.batch_size
    transform = ctx.transform
    for j in itertools.count():
        samples: list[Any] = []
        try:
            for sample in itertools.islice(it, size):
                samples.append(sample if transform is None else transform(sample))
        except BaseException as exc:
            what = "iterating the dataset" if transform is None else "iterating the dataset or transform"
            add_note(exc, f"aioloader: raised by {what} (sample {len(samples)} of {_where(task, j)})")
            raise
        if not samples or (len(samples) < size and ctx.drop_last):
            return
        yield samples
        if len(samples) < size:
            return


def _build(sock: socket.socket, ctx: _tasks.WorkerContext, task: ShardTask) -> tuple[int]:
    if ctx.remote:  # a process of the pool: torch's worker info and seeding, per shard
        _info.publish_shard(ctx, task.shard, task.num_shards, task.seed)
        _seeding.seed_worker(task.seed)
        if ctx.worker_init_fn is not None:
            try:
                ctx.worker_init_fn(task.shard)
            except BaseException as exc:
                add_note(
                    exc, f"aioloader: raised by worker_init_fn({task.shard}) in {_reply.process_label()}"
                )
                raise
    n = 0
    limit = 0
    batches = _batches(ctx, task)
    try:
        for j in itertools.count():
            # The credit first: no sample of batch j is read before the consumer's
            # window has room for it (the end of the iteration is found the same way).
            while j >= task.skip and j >= limit:
                got = _recv_credit(sock)
                if got is None:  # the consumer closed the connection: the run is over
                    return (n,)
                limit = got
            samples = next(batches, None)
            if samples is None:
                break
            n = j + 1
            if j < task.skip:
                continue
            try:
                batch = ctx.collate_fn(samples[0] if ctx.unbatched else samples)
                if ctx.encode is not None:
                    batch = ctx.encode(batch)
            except Exception as exc:
                named = ""
                if isinstance(exc, CollateError):
                    named = f"; the mismatching samples are at positions {getattr(exc, 'positions', [])} of the batch"
                add_note(exc, f"aioloader: raised by collate_fn in {_where(task, j)}{named}")
                raise
            try:
                _send(sock, ("batch", j, len(samples), batch))
            except (TypeError, AttributeError, pickle.PicklingError) as exc:  # what pickling raises
                _unpicklable.shard(exc, task, j, (1 if ctx.unbatched else ctx.batch_size) * j, samples, batch)
                raise
    except (BrokenPipeError, ConnectionResetError):
        pass  # the consumer closed the connection: the run is over
    return (n,)


def _send(sock: socket.socket, message: tuple[Any, ...]) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    head = FRAME_LENGTH.pack(len(data))
    if len(data) < 65536:  # one write; a large frame is not copied to prepend its length
        sock.sendall(head + data)
    else:
        sock.sendall(head)
        sock.sendall(data)


def _recv_credit(sock: socket.socket) -> int | None:
    buf = b""
    while len(buf) < CREDIT.size:
        chunk = sock.recv(CREDIT.size - len(buf))
        if not chunk:
            return None
        buf += chunk
    value: int = CREDIT.unpack(buf)[0]
    return value
