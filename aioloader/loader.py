"""The :class:`DataLoader` facade: validated configuration, lifecycle, resume state,
statistics, and the two faces (``for`` and ``async for``) over one async core."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import os
import secrets
import threading
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from multiprocessing.context import BaseContext
from typing import Any, Literal

import numpy as np

from . import _worker
from ._collate import default_collate
from ._lifecycle import (
    ClosedFlag,
    LifecycleMixin,
    State,
    check_int,
    close_run_from_outside,
    close_run_soon,
    pickle_for_workers,
)
from ._pool import WorkerPool
from ._portal import Portal
from ._sampler import BatchPlanner, EpochPlan, LastBatch, ShardPolicy
from ._scheduler import EpochRun, RunConfig
from ._stats import LoaderStats, Recorder
from ._trace import Tracer
from ._transport import Transport, TransportKind, make_transport
from .errors import LoaderClosedError, StateDictError

__all__ = ["DataLoader"]

STATE_VERSION = 1


def _check_choice(name: str, value: Any, choices: Sequence[str]) -> Any:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


class _Shared(ClosedFlag):
    """What the loader shares with its epoch runs (see :class:`ClosedFlag`)."""

    def __init__(self) -> None:
        super().__init__()
        self.payload: bytes | None = None

    def get_payload(self) -> bytes | None:
        return self.payload


def _weak_callback(method: Callable[[EpochRun], None]) -> Callable[[EpochRun], None]:
    ref = weakref.WeakMethod(method)

    def call(run: EpochRun) -> None:
        target = ref()
        if target is not None:
            target(run)

    return call


class _Resume:
    def __init__(self, epoch: int, done: set[int], carry: np.ndarray, sampler_state: Any) -> None:
        self.epoch = epoch
        self.done = done
        self.carry = carry
        self.sampler_state = sampler_state


class _RunMeta:
    """Where a run sits in the loader's sequence of epochs (for ``state_dict``)."""

    def __init__(self, run: EpochRun, plan: EpochPlan, done_before: set[int], sampler_state: Any) -> None:
        self.run = run
        self.plan = plan
        self.done_before = done_before
        self.sampler_state = sampler_state

    def done(self) -> set[int]:
        return self.done_before | set(self.run.delivered)


class DataLoader(LifecycleMixin):
    """Batches from a map-style dataset, built by a persistent pool of workers.

    Iterate with ``for batch in loader`` or ``async for batch in loader``: both run the
    same asyncio scheduler (the first on a private loop in a background thread, the
    second on the caller's loop, which it never blocks).

    Args:
        dataset: any object with ``__len__`` and ``__getitem__(int)`` (a torch
            ``Dataset`` works). With workers it must pickle; it is sent to each worker once.
        batch_size: samples per batch.
        shuffle: reshuffle every epoch; the order of epoch ``e`` is a pure function of
            ``(seed, e, len(dataset))``.
        sampler: a re-iterable of indices (its ``set_epoch(e)`` is called before each
            epoch). Excludes ``shuffle``.
        batch_sampler: a re-iterable of index sequences. Excludes ``batch_size``,
            ``shuffle``, ``sampler``, ``last_batch`` and ``drop_last``.
        last_batch: ``"keep"`` the incomplete last batch, ``"discard"`` it, or
            ``"rollover"``: carry its samples to the front of the next epoch.
        drop_last: torch's spelling: ``True`` means ``last_batch="discard"``.
        collate_fn: turns a list of samples into a batch; default
            :func:`~aioloader.default_collate`.
        num_workers: worker processes; ``0`` builds batches in one background thread.
        prefetch: most batches submitted, running or waiting for the consumer at once
            (default ``2 * num_workers``, at least 2).
        timeout: seconds a batch may take from the moment a worker starts it; on expiry
            :class:`~aioloader.LoaderTimeout` is raised and the worker is killed.
        worker_init_fn: called once in each worker with the worker's id.
        mp_context: start method name or context (default ``forkserver``, else ``spawn``).
        seed: seeds the shuffle and every sample's randomness; ``None`` draws one
            (readable as ``loader.seed``).
        ordered: deliver batches in sampler order (``True``) or as they complete.
        on_error: ``"raise"`` the first exception from the dataset, or ``"skip"`` the
            failing samples (counted; see ``max_skipped``).
        max_skipped: with ``on_error="skip"``, raise once more samples than this failed
            in one epoch (default: no limit).
        max_retries: resubmissions of a batch whose worker died while building it.
        shard: ``(rank, world_size)`` for data-parallel training.
        shard_policy: ``"pad"``, ``"drop"`` or ``"uneven"`` (see :doc:`determinism`).
        transport: ``"auto"``, ``"shm"`` or ``"pickle"``.
        pool: a :class:`~aioloader.WorkerPool` to share with other loaders.
        executor: any ``concurrent.futures.Executor`` to run batches on (never shut down
            by the loader).
        prefetch_next_epoch: start building the next epoch's first batches while the
            current epoch's last ones are in flight (within the same ``prefetch`` bound).
        seed_samples: seed ``random``/numpy/torch before every sample (see
            :func:`~aioloader.sample_rng`).
        trace: write a Chrome trace-event file here when the loader closes (see
            :meth:`tracing` to trace a part of a run).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int = 1,
        *,
        shuffle: bool = False,
        sampler: Iterable[int] | None = None,
        batch_sampler: Iterable[Sequence[int]] | None = None,
        last_batch: LastBatch = "keep",
        drop_last: bool | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        prefetch: int | None = None,
        timeout: float | None = None,
        worker_init_fn: Callable[[int], Any] | None = None,
        mp_context: str | BaseContext | None = None,
        seed: int | None = None,
        ordered: bool = True,
        on_error: Literal["raise", "skip"] = "raise",
        max_skipped: int | None = None,
        max_retries: int = 2,
        shard: tuple[int, int] | None = None,
        shard_policy: ShardPolicy = "pad",
        transport: TransportKind = "auto",
        pool: WorkerPool | None = None,
        executor: cf.Executor | None = None,
        prefetch_next_epoch: bool = True,
        seed_samples: bool = True,
        trace: str | os.PathLike[str] | None = None,
    ) -> None:
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise TypeError(
                f"dataset must be map-style (define __len__ and __getitem__), got {type(dataset).__name__}"
            )
        length = len(dataset)
        batch_size_given = batch_size != 1
        batch_size = check_int("batch_size", batch_size, 1)
        _check_choice("last_batch", last_batch, ("keep", "discard", "rollover"))
        if drop_last is not None:
            if not isinstance(drop_last, bool):
                raise TypeError(f"drop_last must be a bool or None, got {drop_last!r}")
            if drop_last and last_batch not in ("keep", "discard"):
                raise ValueError(f"drop_last=True conflicts with last_batch={last_batch!r}")
            if drop_last:
                last_batch = "discard"
        if batch_sampler is not None:
            conflicts = [
                name
                for name, given in (
                    ("batch_size", batch_size_given),
                    ("shuffle", bool(shuffle)),
                    ("sampler", sampler is not None),
                    ("last_batch", last_batch != "keep"),
                    ("drop_last", drop_last is not None),
                )
                if given
            ]
            if conflicts:
                raise ValueError(f"batch_sampler is mutually exclusive with {', '.join(conflicts)}")
            if not isinstance(batch_sampler, Iterable):
                raise TypeError(
                    f"batch_sampler must be a re-iterable of index sequences, got {batch_sampler!r}"
                )
        if sampler is not None:
            if shuffle:
                raise ValueError("sampler is mutually exclusive with shuffle=True")
            if not isinstance(sampler, Iterable):
                raise TypeError(f"sampler must be a re-iterable of ints, got {sampler!r}")
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable, got {collate_fn!r}")
        if worker_init_fn is not None and not callable(worker_init_fn):
            raise TypeError(f"worker_init_fn must be callable, got {worker_init_fn!r}")
        num_workers = check_int("num_workers", num_workers, 0)
        if prefetch is not None:
            prefetch = check_int("prefetch", prefetch, 1)
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
                raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        if seed is not None:
            seed = check_int("seed", seed, 0)
        _check_choice("on_error", on_error, ("raise", "skip"))
        if max_skipped is not None:
            max_skipped = check_int("max_skipped", max_skipped, 0)
        max_retries = check_int("max_retries", max_retries, 0)
        _check_choice("shard_policy", shard_policy, ("pad", "drop", "uneven"))
        if shard is None:
            shard = (0, 1)
        if (
            not isinstance(shard, (tuple, list))
            or len(shard) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in shard)
            or shard[1] < 1
            or not 0 <= shard[0] < shard[1]
        ):
            raise ValueError(f"shard must be (rank, world_size) with 0 <= rank < world_size, got {shard!r}")
        _check_choice("transport", transport, ("auto", "shm", "pickle"))
        if pool is not None and not isinstance(pool, WorkerPool):
            raise TypeError(f"pool must be an aioloader.WorkerPool, got {pool!r}")
        if sum(x is not None for x in (pool, executor)) > 1:
            raise ValueError("pass at most one of pool= and executor=")
        if (pool is not None or executor is not None) and (num_workers or mp_context is not None):
            raise ValueError(
                "num_workers and mp_context configure the loader's own pool; "
                "they conflict with pool= or executor="
            )

        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.last_batch: LastBatch = last_batch
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.timeout = float(timeout) if timeout is not None else None
        self.worker_init_fn = worker_init_fn
        self.ordered = bool(ordered)
        self.on_error = on_error
        self.max_skipped = max_skipped
        self.max_retries = max_retries
        self.shard = (int(shard[0]), int(shard[1]))
        self.shard_policy: ShardPolicy = shard_policy
        self.prefetch_next_epoch = bool(prefetch_next_epoch)
        self.seed_samples = bool(seed_samples)
        self._length = length
        self.seed: int = seed if seed is not None else secrets.randbits(63)

        if pool is not None:
            self._pool, owns_pool = pool, False
        elif executor is not None:
            self._pool, owns_pool = WorkerPool(executor=executor), False
        else:
            self._pool, owns_pool = WorkerPool(num_workers, mp_context=mp_context), True
        self.num_workers = num_workers
        self.prefetch = prefetch if prefetch is not None else max(2, 2 * self._pool.concurrency)
        self._transport: Transport = make_transport(
            transport, pool_kind=self._pool.kind, prefetch=self.prefetch
        )

        self._planner = BatchPlanner(
            length,
            batch_size=batch_size,
            shuffle=self.shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            last_batch=last_batch,
            seed=self.seed,
            shard=self.shard,
            shard_policy=shard_policy,
        )
        self._token = f"{uuid.uuid4().hex}"
        self._state = State.OPEN
        self._shared = _Shared()
        self._lock = threading.RLock()
        self._prepared = False
        self._next_epoch = 0
        self._carry: np.ndarray = np.zeros(0, dtype=np.int64)
        self._resume: _Resume | None = None
        self._latest: _RunMeta | None = None
        self._runs: weakref.WeakSet[EpochRun] = weakref.WeakSet()
        self._spec: tuple[EpochRun, EpochPlan] | None = None
        self._recorder = Recorder()
        if trace is not None:
            self._recorder.tracer = Tracer(trace)
        self._portal_box: list[Portal | None] = [None]
        self._finalizer = weakref.finalize(
            self,
            DataLoader._cleanup,
            self._pool if owns_pool else None,
            self._pool,
            self._token,
            self._portal_box,
            self._transport,
            self._recorder,
            self._shared,
            self._runs,
        )

    # ------------------------------------------------------------------ lifecycle
    @staticmethod
    def _cleanup(
        owned_pool: WorkerPool | None,
        pool: WorkerPool,
        token: str,
        portal_box: list[Portal | None],
        transport: Transport,
        recorder: Recorder,
        shared: _Shared,
        runs: weakref.WeakSet[EpochRun],
    ) -> None:
        # Reached from close() or, for a loader dropped without close(), from the GC or
        # at interpreter exit: either way every run must learn that the loader is gone.
        shared.closed = True
        for run in list(runs):
            close_run_soon(run)
        tracer = recorder.tracer
        if tracer is not None:
            recorder.tracer = None
            tracer.write()
        portal = portal_box[0]
        portal_box[0] = None
        if portal is not None:
            portal.close()
        if owned_pool is not None:
            owned_pool.close()
        else:
            pool.unregister(token)
        transport.close()

    @property
    def closed(self) -> bool:
        return self._state is State.CLOSED

    def close(self) -> None:
        """Stop all iteration, shut down the loader's own pool and thread. Idempotent.

        An iterator still running in another thread or task ends with
        :class:`~aioloader.LoaderClosedError`. A pool or executor passed in is left running.
        """
        runs = self._mark_closed()
        if runs is None:
            return
        for run in runs:
            close_run_from_outside(run)
        self._finalizer()

    def _mark_closed(self) -> list[EpochRun] | None:
        """Flip the loader to CLOSED (so every run sees it), or ``None`` if it already was."""
        with self._lock:
            if self._state is State.CLOSED:
                return None
            self._state = State.CLOSED
            self._shared.closed = True
            self._spec = None
            return list(self._runs)

    async def aclose(self) -> None:
        """Async twin of :meth:`close`; the pool shutdown runs off the event loop."""
        loop = asyncio.get_running_loop()
        runs = self._mark_closed()
        if runs is None:
            return
        for run in runs:
            if run.loop is loop:
                await run.aclose()
        others = [r for r in runs if r.loop is not loop]

        def teardown() -> None:
            for run in others:
                close_run_from_outside(run)
            self._finalizer()

        await loop.run_in_executor(None, teardown)

    # -------------------------------------------------------------------- payload
    def _make_payload(self) -> bytes:
        ctx = _worker.WorkerContext(
            dataset=self.dataset,
            collate_fn=self._transport.wrap_collate(self.collate_fn),
            worker_init_fn=self.worker_init_fn,
            on_error=self.on_error,
            seed_samples=self.seed_samples,
            encode=self._transport.encode,
        )
        parts = (("dataset", self.dataset), ("collate_fn", self.collate_fn), ("worker_init_fn", self.worker_init_fn))
        return pickle_for_workers(ctx, parts, "DataLoader")

    def _prepare(self) -> None:
        """Ship the dataset to the pool (once). Runs before the first batch is submitted."""
        with self._lock:
            if self._prepared:
                return
            if self._pool.kind == "thread":
                _worker.install_context(
                    self._token,
                    _worker.WorkerContext(
                        self.dataset,
                        self.collate_fn,
                        self.worker_init_fn,
                        self.on_error,
                        self.seed_samples,
                        self._transport.encode,
                    ),
                )
            else:
                self._shared.payload = self._make_payload()
                self._pool.register(self._token, self._shared.payload)
            self._prepared = True

    # ------------------------------------------------------------------- planning
    def __len__(self) -> int:
        """Number of batches in the next epoch."""
        if self._resume is not None:
            return self._planner.num_batches(len(self._resume.carry))
        return self._planner.num_batches(len(self._carry))

    @property
    def epoch(self) -> int:
        """The epoch the next fresh iteration will run."""
        return self._resume.epoch if self._resume is not None else self._next_epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration run epoch ``epoch`` (an explicit alternative to counting)."""
        epoch = check_int("epoch", epoch, 0)
        with self._lock:
            if epoch == self._next_epoch and self._resume is None:
                return  # already next: keep a speculative start of this epoch
            self._next_epoch = epoch
            self._resume = None
            self._discard_spec()

    def _run_config(self) -> RunConfig:
        return RunConfig(
            token=self._token,
            pool=self._pool,
            payload=self._shared.get_payload,
            seed=self.seed,
            prefetch=self.prefetch,
            ordered=self.ordered,
            timeout=self.timeout,
            max_retries=self.max_retries,
            max_skipped=self.max_skipped,
            decode=self._transport.decode,
            recorder=self._recorder,
            is_closed=self._shared.is_closed,
        )

    def _sampler_state(self) -> Any:
        custom = self._planner.custom
        getter = getattr(custom, "state_dict", None)
        return getter() if callable(getter) else None

    def _open_run(self) -> EpochRun:
        """Start the next epoch on the running loop (or adopt the speculative one)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            self._check_open()
            spec = self._spec
            self._spec = None
            if spec is not None:
                run, plan = spec
                if (
                    run.loop is loop
                    and not run.closed
                    and self._resume is None
                    and run.epoch == self._next_epoch
                ):
                    self._next_epoch += 1
                    self._carry = plan.carry_out
                    self._latest = _RunMeta(run, plan, set(), None)
                    run.on_submitted_all = _weak_callback(self._speculate)
                    if run.submitted_all:  # short epoch: it finished submitting already
                        self._speculate(run)
                    return run
                close_run_soon(run)
            resume = self._resume
            self._resume = None
            if resume is not None:
                epoch, carry, done = resume.epoch, resume.carry, resume.done
                if resume.sampler_state is not None:
                    self._planner.custom.load_state_dict(resume.sampler_state)
            else:
                epoch, carry, done = self._next_epoch, self._carry, set()
            sampler_state = self._sampler_state()
            plan = self._planner.plan(epoch, carry)
            self._next_epoch = epoch + 1
            self._carry = plan.carry_out
            positions = [p for p in range(len(plan)) if p not in done]
            run = EpochRun(self._run_config(), epoch, plan.batches, positions)
            self._runs.add(run)
            self._latest = _RunMeta(run, plan, set(done), sampler_state)
            run.on_submitted_all = _weak_callback(self._speculate)
            run.start()
            return run

    def _speculate(self, run: EpochRun) -> None:
        """Called on the run's loop once it has submitted its last batch."""
        with self._lock:
            if (
                not self.prefetch_next_epoch
                or self._state is State.CLOSED
                or self._planner.custom is not None
                or self._resume is not None
                or self._spec is not None
                or self._latest is None
                or self._latest.run is not run
                or run.closed
            ):
                return
            plan = self._planner.plan(run.epoch + 1, self._carry)
            nxt = EpochRun(self._run_config(), run.epoch + 1, plan.batches, range(len(plan)), sem=run.sem)
            self._runs.add(nxt)
            self._spec = (nxt, plan)
            nxt.start()

    def _discard_spec(self) -> None:
        spec = self._spec
        self._spec = None
        if spec is not None:
            close_run_soon(spec[0])

    # ------------------------------------------------------------------ iteration
    async def _start(self) -> EpochRun:
        self._check_open()
        if not self._prepared:
            await asyncio.get_running_loop().run_in_executor(None, self._prepare)
        return self._open_run()

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._aiterate()

    async def _aiterate(self) -> AsyncIterator[Any]:
        run = await self._start()
        try:
            while True:
                try:
                    batch = await run.next_batch()
                except StopAsyncIteration:
                    return
                yield batch
        finally:
            await run.aclose()
            if not run.complete:
                self._discard_spec_for(run)

    def _discard_spec_for(self, run: EpochRun) -> None:
        with self._lock:
            if self._spec is not None and self._spec[0].sem is run.sem:
                self._discard_spec()

    def __iter__(self) -> Iterator[Any]:
        portal = self._portal()
        if portal.in_portal():
            raise RuntimeError("cannot iterate a DataLoader synchronously from its own event-loop thread")
        return self._iterate(portal)

    def _iterate(self, portal: Portal) -> Iterator[Any]:
        # The epoch starts at the first next(), like the async face: an iterator that is
        # created and dropped unused costs nothing and skips no epoch.
        run = portal.call(self._start())
        try:
            while True:
                if self._state is State.CLOSED or portal.loop.is_closed():
                    raise LoaderClosedError("the loader was closed while it was being iterated")
                try:
                    batch = portal.call(run.next_batch())
                except StopAsyncIteration:
                    return
                yield batch
        finally:
            if not run.closed or not run.finished:
                try:
                    if portal.in_portal():
                        portal.loop.create_task(run.aclose())
                    elif not portal.loop.is_closed():
                        portal.call(self._finish(run), timeout=30.0)
                except (RuntimeError, cf.TimeoutError):
                    pass

    async def _finish(self, run: EpochRun) -> None:
        await run.aclose()
        if not run.complete:
            self._discard_spec_for(run)

    # -------------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        """A small JSON-serialisable snapshot: loading it into a new loader with the same
        dataset and arguments makes its next batch the one this loader would yield next."""
        with self._lock:
            if self._resume is not None:
                epoch, done = self._resume.epoch, set(self._resume.done)
                carry, sampler_state = self._resume.carry, self._resume.sampler_state
            elif self._latest is not None and not self._latest.run.closed:
                meta = self._latest
                epoch, done = meta.run.epoch, meta.done()
                carry, sampler_state = meta.plan.carry_in, meta.sampler_state
                if len(done) >= len(meta.plan):
                    epoch, done, carry, sampler_state = (
                        epoch + 1,
                        set(),
                        meta.plan.carry_out,
                        self._sampler_state(),
                    )
            else:
                epoch, done, carry, sampler_state = (
                    self._next_epoch,
                    set(),
                    self._carry,
                    self._sampler_state(),
                )
            prefix = 0
            while prefix in done:
                prefix += 1
            return {
                "version": STATE_VERSION,
                "seed": self.seed,
                "epoch": int(epoch),
                "batches_delivered": len(done),
                "next_position": prefix,
                "delivered_after": sorted(p for p in done if p > prefix),
                "rollover": [int(i) for i in carry],
                "length": self._length,
                "batch_size": self.batch_size,
                "last_batch": self.last_batch,
                "shuffle": self.shuffle,
                "shard": list(self.shard),
                "shard_policy": self.shard_policy,
                "sampler": sampler_state,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (see :meth:`state_dict`). Costs no sample loads.

        Raises :class:`~aioloader.StateDictError` naming the first mismatch when the
        state comes from an incompatible loader.
        """
        if not isinstance(state, dict):
            raise StateDictError(
                f"state must be a dict from DataLoader.state_dict(), got {type(state).__name__}"
            )
        if state.get("version") != STATE_VERSION:
            raise StateDictError(
                f"state version {state.get('version')!r} is not supported (expected {STATE_VERSION})"
            )
        mine = {
            "length": self._length,
            "batch_size": self.batch_size,
            "last_batch": self.last_batch,
            "shuffle": self.shuffle,
            "shard": list(self.shard),
            "shard_policy": self.shard_policy,
        }
        for key, value in mine.items():
            if state.get(key) != value:
                raise StateDictError(
                    f"state dict does not match this loader: {key} is {state.get(key)!r} in the state "
                    f"but {value!r} here"
                )
        sampler_state = state.get("sampler")
        if sampler_state is not None and not callable(getattr(self._planner.custom, "load_state_dict", None)):
            raise StateDictError(
                "state dict holds a sampler state but this loader's sampler has no load_state_dict"
            )
        try:
            seed, epoch = int(state["seed"]), int(state["epoch"])
            prefix = int(state["next_position"])
            after = [int(p) for p in state.get("delivered_after", [])]
            rollover = [int(i) for i in state.get("rollover", [])]
        except KeyError as exc:
            raise StateDictError(f"state dict lacks the key {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise StateDictError(f"state dict holds a malformed value: {exc}") from None
        n_batches = self._planner.num_batches(len(rollover))
        if seed < 0 or epoch < 0 or not 0 <= prefix <= n_batches or any(not prefix < p < n_batches for p in after):
            raise StateDictError(
                f"state dict positions are out of range: seed={seed}, epoch={epoch}, "
                f"next_position={prefix}, delivered_after={after} for {n_batches} batches"
            )
        with self._lock:
            self._check_open()
            self.seed = seed
            self._planner.seed = self.seed
            self._discard_spec()
            done = set(range(prefix)) | set(after)
            carry = np.asarray(rollover, dtype=np.int64)
            self._resume = _Resume(epoch, done, carry, sampler_state)
            self._latest = None

    # --------------------------------------------------------------------- misc
    def stats(self) -> LoaderStats:
        """A frozen snapshot of the loader's statistics (cheap; always on)."""
        return self._recorder.snapshot(self._pool.restarts, self._pool.concurrency)

    @contextlib.contextmanager
    def tracing(self, path: str | os.PathLike[str]) -> Iterator[Tracer]:
        """Record a Chrome trace of what happens inside the ``with`` block; the file is
        written when the block exits."""
        tracer = Tracer(path)
        previous = self._recorder.tracer
        self._recorder.tracer = tracer
        try:
            yield tracer
        finally:
            self._recorder.tracer = previous
            tracer.write()

    @property
    def pool(self) -> WorkerPool:
        return self._pool

    def worker_pids(self) -> list[int]:
        """Pids of the worker processes of the pool's current incarnation."""
        return self._pool.worker_pids()

    def __repr__(self) -> str:
        return (
            f"<aioloader.DataLoader batch_size={self.batch_size} num_workers={self.num_workers} "
            f"prefetch={self.prefetch} {self._state.value}>"
        )
