"""The unit source of an iterable dataset: each worker iterates its own copy, and the
run takes their batches in turn.

::

    shard task 0 (worker) ──frames──▶ ┐
    shard task 1 (worker) ──frames──▶ ├─ Unix socket ─▶ ShardSource ─▶ units (0,0) (1,0) (0,1) ...
    ...                    ◀─credits─ ┘                                 one window slot each

One *shard task* per worker and epoch runs on the pool through a
:class:`~aioloader._engine.dispatch.Dispatcher` of its own (retries after a crash, the
payload protocol), for as long as the shard's iteration lasts (see
:mod:`aioloader._worker.shard` for the worker's half). A unit is batch ``j`` of shard
``s``; units come round-robin over the shards, as torch's DataLoader takes them. A unit
executes by granting its shard the credit for batch ``j`` and waiting for that batch's
frame: so the run's window (``prefetch``) bounds the batches built and not taken, as
for any other unit source. A shard whose iteration ended answers its later units with
nothing (the run skips them), and the source ends once every shard has.

A worker that dies is replaced by the dispatcher as for any task; the new shard task
replays the iteration up to the first batch not received yet. ``timeout`` bounds how long
a shard may owe a batch it has credit for; on expiry its worker is stopped and the batch
raises :class:`~aioloader.LoaderTimeout`.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._pool import WorkerPool
from .._seeding import sample_seed, worker_seed
from .._stats import Recorder
from .._worker import shard as _shard
from .._worker import tasks as _tasks
from ..errors import LoaderClosedError, LoaderTimeout, PoolBrokenError, WorkerCrashedError
from .dispatch import Dispatcher

__all__ = ["ShardPosition", "ShardSource", "ShardUnit"]

_EMPTY = _tasks.BatchResult(None, (), 0, 0, 0)
_POOL_ERRORS = (LoaderClosedError, LoaderTimeout, PoolBrokenError, WorkerCrashedError)


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

    def __init__(self, source: ShardSource, index: int, skip: int) -> None:
        self.source = source
        self.index = index
        self.frames: dict[int, tuple[int, Any]] = {}  # batch -> (samples, data), received, not taken
        self.received = skip  # every batch below this has arrived (or was delivered before)
        self.waiters: dict[int, asyncio.Future[Any]] = {}
        self.granted = skip
        self.ended: int | None = None  # how many batches the shard had, once known
        self.failure: BaseException | None = None
        self.task_id = 0  # the current attempt's
        self.connection: _Connection | None = None  # the current attempt's, once it said hello
        self.pid = 0
        self.owing_since: int | None = None  # monotonic ns since it owes a batch it has credit for
        self.driver: asyncio.Task[None] | None = None
        self.read_out: set[int] = set()  # attempts whose connection was read to its end
        self.changed = asyncio.Event()

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
        self.owing_since = None  # timed again once the new attempt connects
        return _shard.ShardTask(
            side.token, task_id, src.epoch, self.index, src.num_shards, src.shard_seed(self.index),
            src.address, self.received, side.payload() if with_payload else None,
        )  # fmt: skip

    def grant(self, limit: int) -> None:
        if limit <= self.granted:
            return
        if self.granted <= self.received and self.connection is not None:
            self.owing_since = time.monotonic_ns()
        self.granted = limit
        if self.connection is not None:
            self.connection.send_credit(limit)

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

    def settle(self, ended: int | None, failure: BaseException | None) -> None:
        """The shard's iteration is over: it had ``ended`` batches, or raised ``failure``
        (called once every batch it sent has been read)."""
        self.ended, self.failure = ended, failure
        self.owing_since = None
        for fut in self.waiters.values():
            if not fut.done():
                fut.set_result(None)
        self.waiters.clear()

    async def read_to_end(self, task_id: int) -> None:
        """Wait until attempt ``task_id``'s connection has been read to its end."""
        while task_id not in self.read_out:
            self.changed.clear()
            await self.changed.wait()

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
        self.dispatcher = Dispatcher(pool, recorder, timeout, max_retries, is_closed, watch=False, alone=True)
        self.timeout = timeout
        self.shards = [_Shard(self, s, position.delivered[s]) for s in range(self.num_shards)]
        for s, ended in enumerate(position.ended):
            if ended:
                self.shards[s].settle(position.delivered[s], None)
        self._next = [position.delivered[s] for s in range(self.num_shards)]
        self._turn = position.turn
        self._dir = ""
        self.address = ""
        self._server: asyncio.AbstractServer | None = None
        self.connections: set[_Connection] = set()
        self._watchdog: asyncio.Task[None] | None = None
        self.closing = False

    def shard_seed(self, shard: int) -> int:
        """``get_worker_info().seed`` of ``shard`` in this epoch; it also seeds the
        shard's global generators. A pure function of (seed, epoch, shard)."""
        return worker_seed(sample_seed(self.side.seed, self.epoch, 0), shard)

    async def _start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="aioloader-shards-")
        self.address = os.path.join(self._dir, "s")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Connection(self), path=self.address)
        for sh in self.shards:
            if sh.ended is None:
                sh.driver = asyncio.get_running_loop().create_task(self._drive(sh))
        if self.timeout is not None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch(self.timeout))

    async def next_unit(self) -> ShardUnit | None:
        if self._server is None and not self.closing:
            await self._start()
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
        try:
            res = await self.dispatcher.run(_shard.run_shard, sh.make_task, sh)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            # An exception raised in the worker: its task connected first and closed the
            # connection before it returned, so the batches it sent before failing are
            # delivered first. The pool's own verdicts (a dead or stopped worker) may
            # come from a worker that never connected.
            if not isinstance(exc, _POOL_ERRORS):
                await sh.read_to_end(sh.task_id)
            sh.settle(None, exc)
            return
        if res.batches < 0:
            sh.settle(None, PoolBrokenError(f"worker pid {res.pid} could not connect to {self.address!r}"))
            return
        await sh.read_to_end(sh.task_id)
        sh.settle(res.batches, None)

    async def _watch(self, timeout: float) -> None:
        limit = int(timeout * 1e9)
        while True:
            await asyncio.sleep(min(0.05, timeout / 4))
            self.dispatcher.expire_stuck_start()
            now = time.monotonic_ns()
            for sh in self.shards:
                since = sh.owing_since
                if since is not None and now - since > limit and sh.connection is not None:
                    sh.owing_since = None
                    await self.dispatcher.expire(sh.task_id)

    async def aclose(self) -> None:
        """Close every connection (each shard task ends at its next credit wait or
        send), stop the drivers and remove the socket."""
        if self.closing:
            return
        self.closing = True
        if self._server is not None:
            self._server.close()
        pending: list[asyncio.Task[Any]] = [*self.dispatcher.stop()]
        if self._watchdog is not None:
            pending.append(self._watchdog)
        for conn in list(self.connections):
            conn.close()
        for sh in self.shards:
            if sh.driver is not None and not sh.driver.done():
                pending.append(sh.driver)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)


class _Connection(asyncio.Protocol):
    """One shard task's connection: frames in, credits out.

    A protocol rather than a stream reader, because of how such a connection ends: a
    worker that closes its socket with credits it never read (those for batches past its
    end) resets the connection, and a stream reader would then raise before handing out
    the frames already buffered. Here every frame is handled as its bytes arrive, and
    :meth:`connection_lost` comes after all of them."""

    def __init__(self, source: ShardSource) -> None:
        self.source = source
        self.buf = bytearray()
        self.shard: _Shard | None = None
        self.task_id = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass
        if self.source.closing:
            transport.close()
            return
        self.source.connections.add(self)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        head = _shard.FRAME_LENGTH.size
        while len(buf) >= head:
            end = head + _shard.FRAME_LENGTH.unpack_from(buf)[0]
            if len(buf) < end:
                return
            message = pickle.loads(memoryview(buf)[head:end])
            del buf[:end]
            self._handle(message)

    def _handle(self, message: tuple[Any, ...]) -> None:
        if message[0] == "batch":
            if self.shard is not None:
                _, j, n, data = message
                self.shard.arrived(j, n, data)
            return
        # ("hello", task_id, pid): which shard task this is
        task_id, pid = message[1], message[2]
        sh = next((x for x in self.source.shards if x.task_id == task_id), None)
        if sh is None or sh.ended is not None or self.source.closing:
            self.close()
            return
        self.shard, self.task_id = sh, task_id
        sh.connection, sh.pid = self, pid
        if sh.granted > sh.received:
            sh.owing_since = time.monotonic_ns()
        self.send_credit(sh.granted)

    def send_credit(self, limit: int) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_shard.CREDIT.pack(limit))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        # What the shard task ended with is its result (the driver settles the shard).
        self.source.connections.discard(self)
        sh = self.shard
        if sh is not None:
            if sh.connection is self:
                sh.connection = None
            sh.read_out.add(self.task_id)
            sh.changed.set()
