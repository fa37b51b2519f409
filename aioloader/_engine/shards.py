"""The unit source of an iterable dataset: each worker iterates its own copy, and the
run takes their batches in turn.

::

    shard task 0 (worker) ──batches──▶ ┐
    shard task 1 (worker) ──batches──▶ ├─ links ─▶ ShardSource ─▶ units (0,0) (1,0) (0,1) ...
    ...                    ◀─credits── ┘                            one window slot each

One *shard task* per worker and epoch runs on the pool through a
:class:`~aioloader._engine.dispatch.Dispatcher` of its own (retries after a crash, the
payload protocol, the timeout), for as long as the shard's iteration lasts (see
:mod:`aioloader._worker.shard` for the worker's half). A unit is batch ``j`` of shard
``s``; units come round-robin over the shards, as torch's DataLoader takes them. A unit
executes by granting its shard the credit for batch ``j`` and waiting for that batch:
so the run's window (``prefetch``) bounds the batches built and not taken, as for any
other unit source. A shard whose iteration ended answers its later units with nothing
(the run skips them), and the source ends once every shard has.

A shard task talks with the source through its own job: its messages (a hello, then
its batches) come over the worker's channel (``on_part``), and its credits go back
with :meth:`~aioloader.WorkerPool.tell`. An iterable dataset always has a pool of its
own (processes, or the loader's thread), never a borrowed executor, so that is the
only way.

A worker that dies is replaced as for any task; the new shard task replays the
iteration up to the first batch not received yet. ``timeout`` bounds how long a shard
may owe a batch it has credit for (the dispatcher's watchdog, on the shard's clock); on
expiry its worker is stopped and the batch raises :class:`~aioloader.LoaderTimeout`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._pool import Job, WorkerPool
from .._seeding import sample_seed, worker_seed
from .._stats import Recorder
from .._wake import waker_for
from .._worker import shard as _shard
from .._worker import tasks as _tasks
from ..errors import add_note
from .dispatch import Dispatcher

__all__ = ["ShardPosition", "ShardSource", "ShardUnit"]

_EMPTY = _tasks.BatchResult(None, (), 0, 0, 0)


@dataclass(frozen=True)
class ShardPosition:
    """Where an iterable dataset's epoch stands: batches delivered per shard, which
    shards ended, and the shard whose turn is next."""

    epoch: int
    num_shards: int
    delivered: tuple[int, ...]
    ended: tuple[bool, ...]
    turn: int = 0

    @classmethod
    def start(cls, epoch: int, num_shards: int) -> ShardPosition:
        return cls(epoch, num_shards, (0,) * num_shards, (False,) * num_shards)

    @property
    def fresh(self) -> bool:
        return not any(self.delivered) and not any(self.ended)

    def deliver(self, shard: int, ended: bool) -> ShardPosition:
        """This position once shard ``shard`` delivered its next batch (or, ``ended``,
        turned out to have none left)."""
        if ended:
            flags = list(self.ended)
            flags[shard] = True
            return ShardPosition(
                self.epoch, self.num_shards, self.delivered, tuple(flags), (shard + 1) % self.num_shards
            )
        counts = list(self.delivered)
        counts[shard] += 1
        return ShardPosition(
            self.epoch, self.num_shards, tuple(counts), self.ended, (shard + 1) % self.num_shards
        )


class ShardUnit:
    """Batch ``key`` of shard ``shard`` in epoch ``group``."""

    __slots__ = ("group", "key", "shard", "size")

    fn = staticmethod(_shard.run_shard)  # what runs it, though the source submits it
    indices: tuple[int, ...] = ()

    def __init__(self, epoch: int, shard: int, key: int) -> None:
        self.group = epoch
        self.shard = shard
        self.key = key
        self.size = 0  # the samples of its batch, known when it arrives

    @property
    def label(self) -> str:
        return f"batch {self.key} of worker {self.shard} in epoch {self.group}"

    def make_task(self, task_id: int, with_payload: bool) -> Any:  # pragma: no cover - never dispatched
        raise TypeError("a shard unit runs through its source, not the dispatcher")


class _Shard:
    """The consumer's side of one shard: its batches received, who waits, its credit."""

    batches = 0  # a shard task's time is not a batch's: the window's policy learns it per batch

    def __init__(self, source: ShardSource, index: int, skip: int) -> None:
        self.source = source
        self.index = index
        self.frames: dict[int, tuple[int, Any]] = {}  # batch -> (samples, data), received, not taken
        self.received = skip  # every batch below this has arrived (or was delivered before)
        self.waiters: dict[int, asyncio.Future[Any]] = {}
        self.granted = skip
        self.told = skip  # the credit the current attempt was told
        self.telling = False  # a tell is due at the end of this turn of the loop
        self.ended: int | None = None  # how many batches the shard had, once known
        self.failure: BaseException | None = None
        self.task_id = 0  # the current attempt's
        self.job: Job | None = None  # the current attempt's, once it said hello
        self.pid = 0
        self.owing_since: int | None = None  # monotonic ns since it owes a batch it has credit for
        self.driver: asyncio.Task[None] | None = None

    # Named, for the dispatcher's errors.
    @property
    def label(self) -> str:
        return (
            f"the iteration of worker {self.index} in epoch {self.source.epoch} (batch {self.received} due)"
        )

    indices: tuple[int, ...] = ()

    def make_task(self, task_id: int, with_payload: bool) -> _shard.ShardTask:
        src = self.source
        side = src.side
        self.task_id = task_id
        self.job = None
        self.owing_since = None  # timed again once the new attempt says hello
        return _shard.ShardTask(
            side.token, task_id, src.epoch, self.index, src.num_shards, src.shard_seed(self.index),
            self.received, side.payload() if with_payload else None,
        )  # fmt: skip

    def hello(self, job: Job, pid: int) -> None:
        """The attempt runs: it gets its credit, and owes what that credit allows."""
        self.job, self.pid = job, pid
        if self.granted > self.received:
            self.owing_since = time.monotonic_ns()
        self.source.pool.tell(job, self.granted)
        self.told = self.granted

    def grant(self, limit: int) -> None:
        """Credit the shard for the batches below ``limit``. The grants of one turn of
        the loop go to the worker as one message, at the end of that turn."""
        if limit <= self.granted:
            return
        if self.granted <= self.received and self.job is not None:
            self.owing_since = time.monotonic_ns()
        self.granted = limit
        if self.job is not None and not self.telling:
            self.telling = True
            asyncio.get_running_loop().call_soon(self._tell)

    def _tell(self) -> None:
        self.telling = False
        if self.job is not None and self.granted > self.told:
            self.source.pool.tell(self.job, self.granted)
            self.told = self.granted

    def arrived(self, j: int, n: int, data: Any) -> None:
        if j < self.received or j in self.frames:
            return  # a replay of a batch that an earlier attempt already sent
        self.frames[j] = (n, data)
        while self.received in self.frames:
            self.received += 1
        self.owing_since = time.monotonic_ns() if self.granted > self.received else None
        fut = self.waiters.pop(j, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def owing(self) -> int | None:
        """Since when the current attempt owes a batch it has credit for (its clock for
        the dispatcher's timeout), or ``None``."""
        return self.owing_since if self.job is not None else None

    def settle(self, ended: int | None, failure: BaseException | None) -> None:
        """The shard's iteration is over: it had ``ended`` batches, or raised ``failure``
        (every batch it sent came before). A failure stays."""
        self.job = None
        if self.failure is not None:
            return
        self.ended, self.failure = ended, failure
        self.owing_since = None
        for fut in self.waiters.values():
            if not fut.done():
                fut.set_result(None)
        self.waiters.clear()

    async def take(self, j: int) -> tuple[int, Any] | None:
        """Batch ``j``'s ``(samples, data)``; ``None`` if the shard ended before it."""
        while True:
            got = self.frames.pop(j, None)
            if got is not None:
                return got
            if self.failure is not None:
                raise self.failure
            if self.ended is not None:
                return None  # settled after its last batch arrived: j is past the end
            fut = self.waiters.get(j)
            if fut is None:
                fut = self.waiters[j] = asyncio.get_running_loop().create_future()
            await fut


class ShardSource:
    """Units of one epoch of an iterable dataset (see the module docstring)."""

    def __init__(
        self,
        side: Any,  # epochs.WorkerSide: token, seed, payload
        pool: WorkerPool,
        recorder: Recorder,
        position: ShardPosition,
        *,
        timeout: float | None,
        max_retries: int,
        is_closed: Callable[[], bool],
    ) -> None:
        self.side = side
        self.epoch = position.epoch
        self.num_shards = position.num_shards
        self.pool = pool
        self.dispatcher = Dispatcher(pool, recorder, timeout, max_retries, is_closed, alone=True)
        self.growth = recorder.group  # the window's policy, if it grows
        self._costs = self._cost_ns = 0  # batches' worker time not yet told to it
        self.shards = [_Shard(self, s, position.delivered[s]) for s in range(self.num_shards)]
        for s, ended in enumerate(position.ended):
            if ended:
                self.shards[s].settle(position.delivered[s], None)
        self._next = [position.delivered[s] for s in range(self.num_shards)]
        self._turn = position.turn
        self._started = False
        self.closing = False
        # Jobs that said hello (told to end when the source closes), and the lock that
        # the pool's I/O thread shares with the loop for them and for ``closing``.
        self._talking: set[Job] = set()
        self._lock = threading.Lock()

    def shard_seed(self, shard: int) -> int:
        """``get_worker_info().seed`` of ``shard`` in this epoch; it also seeds the
        shard's global generators. A pure function of (seed, epoch, shard)."""
        return worker_seed(sample_seed(self.side.seed, self.epoch, 0), shard)

    async def next_unit(self) -> ShardUnit | None:
        if not self._started and not self.closing:
            self._started = True
            loop = asyncio.get_running_loop()
            self.waker = waker_for(loop)
            for sh in self.shards:
                if sh.ended is None:
                    sh.driver = loop.create_task(self._drive(sh))
        for _ in range(self.num_shards):
            s = self._turn
            self._turn = (s + 1) % self.num_shards
            sh = self.shards[s]
            if sh.ended is not None and self._next[s] >= sh.ended:
                continue  # known to be over: no unit for it
            j = self._next[s]
            self._next[s] = j + 1
            return ShardUnit(self.epoch, s, j)
        return None

    async def execute(self, unit: ShardUnit) -> Any:
        """Run one unit: credit its shard for the batch, wait for the batch to arrive."""
        sh = self.shards[unit.shard]
        sh.grant(unit.key + 1)
        got = await sh.take(unit.key)
        if got is None:
            return _EMPTY
        unit.size, data = got
        return _tasks.BatchResult(data, (), sh.pid, 0, 0)

    async def _drive(self, sh: _Shard) -> None:
        # The task's messages come before its job settles (one channel, one order), so
        # every batch it sent has arrived when it returns or raises.
        try:
            res = await self.dispatcher.run(
                _shard.run_shard, sh.make_task, sh, on_part=self._on_part, owing=sh.owing
            )
        except asyncio.CancelledError:
            self._end_all()  # the run closes, or its loop goes away: no task may wait for credit
            raise
        except BaseException as exc:
            sh.settle(None, exc)
            return
        finally:
            with self._lock:  # the attempts that ended need no telling any more
                self._talking = {j for j in self._talking if not j.done}
        sh.settle(res.batches, None)

    def _end_all(self) -> None:
        """Tell every shard task to end (at its next credit wait or send); from now on
        a task that says hello is told so at once (see :meth:`_on_part`)."""
        with self._lock:
            self.closing = True
            jobs, self._talking = [*self._talking, *self.dispatcher.jobs()], set()
        for job in jobs:
            self.pool.tell(job, None)

    def _on_part(self, job: Job, message: Any) -> None:
        """A shard task's message, from the pool's I/O thread (or the loader's thread):
        handled on the loop, in order. A task that says hello once the source is
        closing is told to end from here at once: the loop may be gone, and a task
        waiting for credit would hold its worker for ever."""
        if type(message) is tuple and message[0] == "hello":
            with self._lock:
                closing = self.closing
                if not closing:
                    self._talking.add(job)
            if closing:
                self.pool.tell(job, None)
                return
        self.waker.call(self._handle, job, message)

    def _handle(self, job: Job, message: Any) -> None:
        sh = next((x for x in self.shards if x.task_id == job.task_id), None)
        if sh is None or sh.ended is not None or self.closing:
            self.pool.tell(job, None)  # a stale attempt, or a run that is over: it ends
            return
        if isinstance(message, BaseException):  # a batch that cannot be unpickled here
            add_note(message, f"aioloader: raised unpickling batch {sh.received} of worker {sh.index} in "
                     f"epoch {self.epoch} in the main process (worker pid {sh.pid})")  # fmt: skip
            sh.settle(None, message)
            self.pool.tell(job, None)
        elif message[0] == "batch":  # ("batch", j, samples, data, worker ns)
            _, j, n, data, ns = message
            sh.arrived(j, n, data)
            if self.growth is not None:  # what batches cost decides how far the window grows
                self._cost_ns += ns
                self._costs += 1
                if self._costs == 8:
                    self.growth.observe(self._costs, self._cost_ns)
                    self._costs = self._cost_ns = 0
        else:  # ("hello", pid)
            sh.hello(job, message[1])

    async def aclose(self) -> None:
        """Tell every shard task to end (at its next credit wait or send), and stop the
        drivers."""
        if self.closing:
            return
        self._end_all()  # the tasks not sent yet are told in _on_part
        pending: list[asyncio.Task[Any]] = [*self.dispatcher.stop()]
        for sh in self.shards:
            if sh.driver is not None and not sh.driver.done():
                pending.append(sh.driver)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
