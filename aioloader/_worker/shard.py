"""What runs inside a worker for an iterable dataset (a torch ``IterableDataset``): one
*shard task* per worker and epoch.

As in torch, each worker iterates its own copy of the dataset, which tells the workers
apart through ``torch.utils.data.get_worker_info()`` (id ``shard`` of ``num_shards``),
cuts the samples into batches, collates them and sends each batch to the consumer. A
shard task lasts the whole epoch, so its batches cannot travel as the task's result:
they go as messages of its *link* (:func:`aioloader._worker.channel.current_link`): the
worker's channel in a process, a queue pair on the loader's thread. The consumer grants
*credits* over the same link (an absolute count: "you may send batches below this
index"; ``None`` ends the task), and the worker blocks before building a batch it has
no credit for, so batches in flight never exceed the consumer's window.

A worker killed mid-batch loses only that task. The restarted task iterates from the
start and skips the batches the consumer already has (``skip``): an iterable dataset
has no random access, and replaying is the only position it has. The consumer ending
the link (no more credit) ends the task at its next credit wait or send.

The task's own result (via :func:`aioloader._worker.tasks.run_task`) is only how many
batches the shard had, or the exception that ended its iteration, with a note naming
the worker, the batch and the epoch. Every batch it sent reaches the consumer before
that result does.

This module never imports asyncio.
"""

from __future__ import annotations

import functools
import itertools
import os
import pickle
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

from .. import _seeding
from ..errors import CollateError, add_note
from . import channel as _channel
from . import info as _info
from . import reply as _reply
from . import tasks as _tasks
from . import unpicklable as _unpicklable

__all__ = ["ShardResult", "ShardTask", "run_shard"]


class ShardTask(NamedTuple):
    """One worker's iteration of one epoch of an iterable dataset."""

    token: str
    task_id: int
    epoch: int
    shard: int  # get_worker_info().id
    num_shards: int  # get_worker_info().num_workers
    seed: int  # get_worker_info().seed, and the global generators' seed
    skip: int  # batches the consumer already has (a restarted task replays past them)
    payload: bytes | _tasks.WorkerContext | None = None


class ShardResult(NamedTuple):
    batches: int  # how many the shard had (its batches went over its link)
    pid: int
    start_ns: int
    end_ns: int


def run_shard(task: ShardTask) -> ShardResult | str:
    """Iterate one shard of an iterable dataset for one epoch (see the module docstring).

    The task says hello first (with its pid), so the consumer knows the attempt is live
    and sends it its credit."""
    link = _channel.current_link()
    if link is None:
        raise RuntimeError("a shard task runs only on an aioloader pool's worker (it needs its link)")
    try:
        link.send(("hello", os.getpid()))
    except OSError:  # the consumer is gone
        return ShardResult(0, os.getpid(), 0, 0)
    return _tasks.run_task(task, functools.partial(_build, link), ShardResult)


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


def _build(link: Any, ctx: _tasks.WorkerContext, task: ShardTask) -> tuple[int]:
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
                got = link.recv()
                if got is None:  # the consumer ended the link: the run is over
                    return (n,)
                limit = got
            start = time.monotonic_ns()
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
                link.send(("batch", j, len(samples), batch, time.monotonic_ns() - start))
            except (TypeError, AttributeError, pickle.PicklingError) as exc:  # what pickling raises
                _unpicklable.shard(exc, task, j, (1 if ctx.unbatched else ctx.batch_size) * j, samples, batch)
                raise
    except (BrokenPipeError, ConnectionResetError):
        pass  # the consumer is gone: the run is over
    return (n,)
