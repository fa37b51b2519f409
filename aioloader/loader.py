"""The :class:`DataLoader` facade: validated configuration, epochs, resume state.

It owns what is particular to map-style datasets: the epoch plan, where the loader stands
(one frozen :class:`~aioloader._engine.epochs.Cursor`, from which ``state_dict()`` is
derived), and the policy that lets a finished epoch's run go on into the next epoch.
Everything else (the window, the pool, the lifecycle, both faces) is shared with
:class:`~aioloader.StreamLoader`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import functools
import os
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from multiprocessing.context import BaseContext
from typing import Any, Generic, Literal

from ._collate import collate_torch, convert_torch, default_collate, default_convert, is_torch_dataset
from ._engine.epochs import Cursor, EpochPass, EpochSource, Parked, WorkerSide
from ._engine.fetch import DEFAULT_IO_BUFFER, FetchConfig, resolve_remote
from ._engine.group import WINDOW_BUDGET, policy_for
from ._engine.resume import Resumable
from ._engine.run import Run
from ._engine.units import RunConfig
from ._facade import IterableLoader, Lifecycle, Pass
from ._plan.sampler import BatchPlanner, LastBatch, ShardPolicy, dataset_length, plan_ahead
from ._plan.views import EpochBatchSampler, EpochCell, EpochSampler
from ._pool import WorkerPool
from ._torch_compat import (
    PinningPass,
    default_seed,
    distributed_world,
    rank_aware,
    resolve_torch_args,
    warn_if_oversubscribed,
    warn_unsharded,
    workers_of,
)
from ._transport import TransportKind
from ._types import Batch, BatchSampler, CollateFn, MapDataset, Sampler
from ._validate import (
    check_bool,
    check_choice,
    check_int,
    check_map_dataset,
    check_sampling,
    check_seconds,
    check_seed_samples,
    check_shard,
    check_unbatched,
    is_iterable_dataset,
    resolve_context,
)
from ._worker import tasks as _tasks
from .errors import PoolBrokenError

__all__ = ["DataLoader"]

_FROZEN = frozenset(
    {"dataset", "batch_size", "sampler", "batch_sampler", "drop_last", "last_batch", "shuffle"}
)


class DataLoader(IterableLoader, Resumable, Generic[Batch]):
    """Batches from a map-style dataset, built by a persistent pool of workers.

    Iterate with ``for batch in loader`` (on a private loop in a background thread) or
    ``async for batch in loader`` (on the caller's loop, which it never blocks).

    Args:
        dataset: any object with ``__len__`` and ``__getitem__(int)`` (a torch ``Dataset``
            works), or a torch ``IterableDataset``, which each worker iterates as in torch
            (see :doc:`migrating-from-torch`). With workers it must pickle; it is sent to
            each worker once. A ``__getitems__(indices)`` method reads a whole batch in
            one call, as in torch (not with ``seed_samples="sample"``).
        batch_size: samples per batch. ``None``: no automatic batching, as in torch: each
            sample is a batch of its own, given alone (not in a list) to ``collate_fn``,
            whose default is then :func:`~aioloader.default_convert`. Excludes
            ``batch_sampler``, ``drop_last=True`` and ``last_batch`` other than ``"keep"``.
        shuffle: reshuffle every epoch (``None``, torch's default, is ``False``); epoch
            ``e``'s order is a function of ``(seed, e, len(dataset))``, with the length read
            as each epoch begins (a dataset that grew is seen whole by the next epoch).
        sampler: a re-iterable of indices (its ``set_epoch(e)`` is called before each
            epoch). Excludes ``shuffle=True``. With ``batch_size=None`` it may yield any
            key (a list of indices, say), passed to ``dataset[key]`` as torch passes it.
        batch_sampler: a re-iterable of index sequences. Excludes ``batch_size``,
            ``shuffle=True``, ``sampler``, ``last_batch`` and ``drop_last=True``.
        last_batch: ``"keep"`` the incomplete last batch, ``"discard"`` it, or
            ``"rollover"``: carry its samples to the front of the next epoch.
        drop_last: torch's spelling: ``True`` means ``last_batch="discard"``.
        collate_fn: turns a list of samples into a batch; default
            :func:`~aioloader.default_collate`.
        num_workers: worker processes; ``0`` builds batches in one background thread;
            ``"auto"``: one per CPU this process may use (affinity mask and cgroup quota),
            ``stats().settings`` says why; more warns (:class:`~aioloader.OversubscribedWarning`).
        prefetch: most batches submitted, running or waiting for the consumer at once.
            The default (or ``"auto"``) starts at ``2 * num_workers``, at least 2, and grows,
            up to 16x and within 64 MiB of batches, while batches are cheap (see
            ``batches_per_task``); ``stats().window`` says where it is. An int fixes it.
        timeout: seconds a batch may take from the moment it is *due*: when its worker
            could start it (it was sent to an idle worker, or the batch ahead of it on that
            worker was answered). Time queued behind other work does not count; the
            loader's ``worker_init_fn`` and the unpickling of its dataset in a worker that
            loads them for this batch do. On expiry :class:`~aioloader.LoaderTimeout` names
            the worker's pid and what hung, and the worker is killed (a stopped one too)
            and replaced. A worker stuck in its own start is given max(``timeout``, 30 s).
            ``None`` or ``0`` (torch's default): none; ``loader.timeout`` is then ``0``, as
            in torch.
        worker_init_fn: called once in each worker with the worker's id. A seed it sets
            for ``random``, numpy or torch is replaced by the per-batch seeding; pass
            ``seed_samples=False`` to keep it.
        mp_context: start method name or context (default ``forkserver``, else ``spawn``).
        seed: seeds the shuffle and the samples' randomness; ``None`` draws one (``loader.seed``)
            from torch's global generator where torch is imported (so ``torch.manual_seed``
            fixes it, as it fixes torch's ``RandomSampler``), else at random; ``0`` where
            the loader shards by rank on its own (every rank must agree).
        ordered: deliver batches in sampler order (``True``, the default) or as they complete.
        on_error: ``"raise"`` the first exception from the dataset, or ``"skip"`` the
            failing samples (counted; see ``max_skipped``).
        max_skipped: with ``on_error="skip"``, raise once more than this failed in an epoch.
        max_retries: resubmissions of a batch whose worker died while building it.
        shard: ``(rank, world_size)`` for data-parallel training. ``None``: where
            ``torch.distributed`` is initialized with several ranks (at construction or
            at the first use) and no sampler is given, ``(rank, world_size)`` of the
            default process group; a sampler that does not split by rank warns. ``(0, 1)``:
            every rank reads the whole dataset. See :doc:`training-frameworks`.
        shard_policy: ``"pad"``, ``"drop"`` or ``"uneven"`` (see :doc:`determinism`).
        transport: ``"auto"``, ``"shm"`` or ``"pickle"``.
        pool: a :class:`~aioloader.WorkerPool` to share with other loaders.
        executor: any ``concurrent.futures.Executor`` to run batches on (never shut down).
        prefetch_next_epoch: start building the next epoch's first batches while the
            current epoch's last ones are in flight (within the same window).
        seed_samples: how ``random``, numpy's and torch's global generators are seeded
            (see :doc:`determinism`). ``"batch"`` (default): once per batch, from
            ``(seed, epoch)`` and the batch's indices. ``"sample"`` (or ``True``): before
            every sample, from ``(seed, epoch, index)``; a few µs a sample. ``False``: not
            at all. :func:`~aioloader.sample_rng` is seeded per sample in every mode.
            Threads of one process share the global generators, so on a thread executor
            seeded batches build one at a time; ``False`` lets threads overlap.
        trace: write a Chrome trace-event file here when the loader closes (or :meth:`tracing`).
        prefetch_factor: torch's spelling of ``prefetch``, per worker: ``prefetch =
            prefetch_factor * num_workers``. Needs ``num_workers > 0``; excludes ``prefetch``.
        persistent_workers: accepted for torch compatibility and has no effect: the
            workers always persist for the loader's life (``False`` does not restart them).
        pin_memory: pin the torch tensors of every batch (through tuples, lists and
            dicts; numpy arrays are left as they are). Without CUDA (or torch) it warns
            once, at construction, and batches are not pinned.
        pin_memory_device: passed to ``Tensor.pin_memory()``; warns without ``pin_memory``.
        generator: a ``torch.Generator``: ``seed`` is drawn from it once, at
            construction, as torch draws its base seed. Excludes ``seed``.
        multiprocessing_context: torch's spelling of ``mp_context``; excludes it.
        in_order: torch's spelling of ``ordered``; excludes it.
        fetch: an async callable applied to ``dataset[i]`` on the event loop (many at
            once) before the batch goes to a worker; then ``dataset`` is read in this
            process only (a list of keys, say) and never sent to the workers; the
            fetched values must pickle. See :doc:`fetch`.
        transform: applied in the worker to each sample (the fetched value, or
            ``dataset[i]`` without ``fetch``) before ``collate_fn``, seeded per sample.
        io_concurrency: most fetches running at once.
        io_buffer: bytes fetched and not yet handed to a worker at most (the oldest
            batch waiting is always let through).
        fetch_retries: retries of a fetch that failed transiently (connection errors,
            timeouts, HTTP 5xx/429), with exponential backoff. ``timeout`` bounds each try.
        fetch_timeout: seconds one sample's fetch may take in all, every try and the
            waits between them together (default 60; ``None``: no bound). A fetch still
            unanswered then fails with its last error, or with
            :class:`~aioloader.LoaderTimeout` if no try has ended.
        batches_per_task: batches a worker builds in one pool task; ``"auto"`` groups cheap
            batches (under about 2 ms of worker time) up to ``window // num_workers`` a task (16 at most),
            to spare the consumer's process a task's cost per batch. See :doc:`performance`.

    The positional parameters are torch's, in torch's order; aioloader's are keyword-only.
    torch's attributes read back as torch's do: ``sampler`` and ``batch_sampler`` are
    views of this loader's order for its rank (a torch loader built on them reads the same
    batches), ``timeout``, ``generator``, ``prefetch_factor``, ``persistent_workers``,
    ``multiprocessing_context`` and ``in_order`` hold torch's values.
    A failed batch raises; ``next()`` again gives the next one, as torch's; ``async for`` ends.

    Two spellings of one setting (``prefetch``/``prefetch_factor``, ``ordered``/``in_order``,
    ``mp_context``/``multiprocessing_context``, ``seed``/``generator``), both given, raise
    ``ValueError`` naming both.
    """

    _kind = "DataLoader"
    _shards_by_rank = True  # an iterable dataset's loader splits nothing by rank itself
    # The class that iterates a torch IterableDataset in the workers themselves: set by
    # aioloader._iterloader, which subclasses this one, as it is imported.
    _iterable_cls: type[DataLoader[Any]] | None = None

    def __new__(cls, dataset: Any = None, *args: Any, **kwargs: Any) -> DataLoader[Any]:
        if cls is DataLoader and is_iterable_dataset(dataset) and DataLoader._iterable_cls is not None:
            return super().__new__(DataLoader._iterable_cls)
        return super().__new__(cls)

    def __init__(
        self,
        dataset: MapDataset[Any],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler | Iterable[Any] | None = None,
        batch_sampler: BatchSampler | None = None,
        num_workers: int | Literal["auto"] = 0,
        collate_fn: CollateFn | Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float | None = 0,
        worker_init_fn: Callable[[int], Any] | None = None,
        multiprocessing_context: str | BaseContext | None = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool | None = None,
        last_batch: LastBatch = "keep",
        prefetch: int | Literal["auto"] | None = None,
        mp_context: str | BaseContext | None = None,
        seed: int | None = None,
        ordered: bool | None = None,
        on_error: Literal["raise", "skip"] = "raise",
        max_skipped: int | None = None,
        max_retries: int = 2,
        shard: tuple[int, int] | None = None,
        shard_policy: ShardPolicy = "pad",
        transport: TransportKind = "auto",
        pool: WorkerPool | None = None,
        executor: cf.Executor | None = None,
        prefetch_next_epoch: bool = True,
        seed_samples: bool | Literal["batch", "sample"] = "batch",
        trace: str | os.PathLike[str] | None = None,
        fetch: Callable[[Any], Awaitable[Any]] | None = None,
        transform: Callable[[Any], Any] | None = None,
        io_concurrency: int = 64,
        io_buffer: int = DEFAULT_IO_BUFFER,
        fetch_retries: int = 3,
        fetch_timeout: float | None = 60.0,
        batches_per_task: int | Literal["auto"] = "auto",
    ) -> None:
        keys, fetch, self.transform = resolve_remote(dataset, fetch, transform)
        length = check_map_dataset(keys)
        unbatched = batch_size is None
        if unbatched:
            check_unbatched(batch_sampler, drop_last, last_batch)
        batch_size_given = batch_size != 1 and not unbatched
        batch_size = 1 if batch_size is None else check_int("batch_size", batch_size, 1)
        shuffle = False if shuffle is None else check_bool("shuffle", shuffle)  # None: torch's default
        torch_args = resolve_torch_args(
            num_workers=workers_of(num_workers, pool, executor), prefetch=prefetch, prefetch_factor=prefetch_factor,
            ordered=ordered, in_order=in_order, seed=seed, generator=generator,
            mp_context=mp_context, multiprocessing_context=multiprocessing_context,
            persistent_workers=persistent_workers, pin_memory=pin_memory, pin_memory_device=pin_memory_device,
        )  # fmt: skip
        seed = torch_args.seed
        seed_given = seed is not None
        prefetch_next_epoch = check_bool("prefetch_next_epoch", prefetch_next_epoch)
        seed_mode = check_seed_samples(seed_samples)
        last_batch = check_sampling(batch_size_given, shuffle, sampler, batch_sampler, last_batch, drop_last)
        for name, fn in (("collate_fn", collate_fn), ("worker_init_fn", worker_init_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable, got {fn!r}")
        if type(timeout) in (int, float) and timeout == 0:
            timeout = None  # torch's default, 0, means no timeout
        timeout = check_seconds("timeout", timeout, allow_zero=False)
        shard_given = shard is not None
        if seed is not None:
            seed = check_int("seed", seed, 0)
        check_choice("on_error", on_error, ("raise", "skip"))
        if max_skipped is not None:
            max_skipped = check_int("max_skipped", max_skipped, 0)
        max_retries = check_int("max_retries", max_retries, 0)
        check_choice("shard_policy", shard_policy, ("pad", "drop", "uneven"))
        shard = check_shard(shard)
        self._fetch = FetchConfig.make(
            fetch, io_concurrency, io_buffer, fetch_retries, timeout, on_error, fetch_timeout
        )
        self.fetch = fetch

        self.dataset = dataset
        self._keys = keys  # what is indexed: the dataset, or the items a remote dataset fetches
        self.batch_size: int | None = None if unbatched else batch_size
        self.shuffle = shuffle
        self.last_batch: LastBatch = last_batch
        self.collate_fn = (
            collate_fn if collate_fn is not None else default_convert if unbatched else default_collate
        )
        self.timeout: float = 0 if timeout is None else timeout  # torch's value for none is 0
        self.worker_init_fn = worker_init_fn
        self.ordered: bool = torch_args.ordered
        self.pin_memory = bool(pin_memory)
        self._pin = torch_args.pin
        self.on_error = on_error
        self.max_skipped = max_skipped
        self.max_retries = max_retries
        self.shard = shard
        self.shard_policy: ShardPolicy = shard_policy
        self.prefetch_next_epoch = prefetch_next_epoch
        self.seed_samples = seed_mode
        self.seed: int = seed if seed is not None else default_seed()
        # What torch's loader reads back as it was given (tools rebuild loaders from them).
        self.generator = generator
        self.persistent_workers = bool(persistent_workers)
        context = torch_args.mp_context if multiprocessing_context is None else multiprocessing_context
        if pool is None and executor is None:
            warn_if_oversubscribed(num_workers)
        self._setup(
            num_workers=num_workers, mp_context=torch_args.mp_context, pool=pool, executor=executor,
            prefetch=torch_args.prefetch, transport=transport, trace=trace,
        )  # fmt: skip
        self._group = self._recorder.group = policy_for(
            batches_per_task, self.prefetch, self._pool, fetch is not None, grow=self._window_grows
        )
        if self._group is not None and self._group.grow:  # slabs for the window it may grow to
            self._transport.allow_growth(self._group.most, WINDOW_BUDGET)
        self.prefetch_factor: int | None = None
        self.multiprocessing_context: BaseContext | None = None
        if self.num_workers > 0:
            self.prefetch_factor = 2 if prefetch_factor is None else prefetch_factor
            self.multiprocessing_context = None if context is None else resolve_context(context)
        self._planner = BatchPlanner(
            length, batch_size=batch_size, shuffle=shuffle, sampler=sampler, batch_sampler=batch_sampler,
            last_batch=last_batch, seed=self.seed, shard=self.shard, shard_policy=shard_policy,
            keyed=unbatched and fetch is None,
        )  # fmt: skip
        # torch's attributes: the objects a torch loader would hold, in aioloader's order.
        self._cell = EpochCell()
        self.sampler = sampler if sampler is not None else EpochSampler(self._planner, self._keys, self._cell)
        self.batch_sampler = batch_sampler
        if batch_sampler is None and not unbatched:
            self.batch_sampler = EpochBatchSampler(self._planner, self._keys, self._cell, self.sampler)
        # Sharding by rank: decided here, or at the first use if torch.distributed starts later.
        self._by_rank = not shard_given and self._shards_by_rank
        self._seed_given = seed_given
        self._ranks_settled = False
        self._ranks_warned = False
        self._next = Cursor(0)  # where the next fresh iteration starts
        self._active: EpochPass | None = None  # the newest iteration, for state_dict()
        self._parked: Parked | None = None  # a run that went on into self._next's epoch
        self._sources: weakref.WeakSet[EpochSource] = weakref.WeakSet()
        self._initialized = True
        self._settle_ranks()

    def __iter__(self) -> Iterator[Batch]:
        return super().__iter__()

    def __aiter__(self) -> AsyncIterator[Batch]:
        return super().__aiter__()

    def __setattr__(self, name: str, value: Any) -> None:
        # The planner read these at construction; changing them later would be ignored.
        if name in _FROZEN and self.__dict__.get("_initialized"):
            raise ValueError(
                f"{name} cannot be changed after the DataLoader is created (the epoch plan is built "
                f"from it); create a new DataLoader instead"
            )
        super().__setattr__(name, value)

    @property
    def drop_last(self) -> bool:
        """torch's spelling: ``last_batch == "discard"``."""
        return self.last_batch == "discard"

    @property
    def in_order(self) -> bool:
        """torch's spelling of ``ordered``."""
        return self.ordered

    # ------------------------------------------------------------ ranks
    def _settle_ranks(self, *, final: bool = False) -> None:
        """Shard by rank where ``torch.distributed`` runs with several ranks and nothing
        else splits the data; warn where that cannot be known. Until the first
        iteration (``final``) a loader built before the process group waits for it."""
        if self._ranks_settled:
            self._warn_late()
            return
        world = distributed_world()
        if world is None or world[1] == 1:
            self._ranks_settled = final
            return
        self._ranks_settled = True
        if not self._by_rank:
            return
        rank, size = world
        custom = self._planner.custom
        if custom is not None:
            if not rank_aware(custom):
                name = "sampler" if self._planner.sampler is not None else "batch_sampler"
                warn_unsharded(
                    rank, size, f"this loader's {name} ({type(custom).__name__}) does not split by rank",
                    f"Pass a DistributedSampler, or shard=({rank}, {size}) to split the {name}'s output",
                )  # fmt: skip
            return
        # Every rank must draw the same order without talking: a seed they all share.
        if not self._seed_given:
            self.seed = self._planner.seed = 0  # torch's DistributedSampler's default seed
        self.shard = (rank, size)
        self._planner.rank, self._planner.world_size = rank, size

    def _warn_late(self) -> None:
        """Warn once if the process group started after this loader's first epoch."""
        if self._ranks_warned or not self._by_rank or self.shard[1] > 1 or self._planner.custom is not None:
            return
        world = distributed_world()
        if world is not None and world[1] > 1:
            self._ranks_warned = True
            warn_unsharded(
                world[0], world[1], "this loader ran its first epoch before the process group started",
                "Build the loader after torch.distributed.init_process_group (Lightning, accelerate "
                "and torchrun do that first), or pass shard=(rank, world_size)",
            )  # fmt: skip

    # -------------------------------------------------------------------- payload
    def _worker_collate(self) -> Callable[[list[Any]], Any]:
        # A torch dataset gets torch batches all through from the default collate, even
        # when its samples are numpy (see aioloader._collate on torch mode).
        if is_torch_dataset(self.dataset):
            if self.collate_fn is default_collate:
                return collate_torch
            if self.collate_fn is default_convert:
                return convert_torch
        return self.collate_fn

    def _worker_context(self) -> _tasks.WorkerContext:
        return _tasks.WorkerContext(
            dataset=None if self._fetch is not None else self.dataset,
            transform=self.transform,
            collate_fn=self._transport.wrap_collate(self._worker_collate()),
            worker_init_fn=self.worker_init_fn,
            on_error=self.on_error,
            seed_samples=self.seed_samples,
            encode=self._transport.encode,
            seed=self.seed,
            unbatched=self.batch_size is None,
            reads_batches=self._fetch is None and self.batch_size is not None and _tasks.reads_batches(self.dataset),
        )

    def _pickled_parts(self) -> Sequence[tuple[str, object]]:
        ds = () if self._fetch is not None else (("dataset", self.dataset),)
        return (
            *ds,
            ("transform", self.transform),
            ("collate_fn", self.collate_fn),
            ("worker_init_fn", self.worker_init_fn),
        )

    # ------------------------------------------------------------------- planning
    def __len__(self) -> int:
        """Number of batches in the next epoch (for ``len(dataset)`` as it is now, unless
        the next epoch is one resumed mid-way, which keeps its recorded length)."""
        self._settle_ranks()
        nxt = self._next
        return self._planner.num_batches(len(nxt.carry), self._epoch_length(nxt))

    def _epoch_length(self, cur: Cursor) -> int:
        """``len(dataset)`` for epoch ``cur``: read again for each epoch not yet begun (as torch does)."""
        return cur.length if cur.length is not None else dataset_length(self._keys)

    def _parked_fits(self, parked: Parked, cur: Cursor, loop: asyncio.AbstractEventLoop) -> bool:
        if parked.successor is not cur or parked.run.loop is not loop or parked.run.closed:
            return False
        plan = parked.source.plans.get(cur.epoch)
        if plan is None:  # not started yet: the source starts it in begin(), if it still may
            return parked.source.continues_into(cur.epoch)
        return plan.length == self._epoch_length(cur)

    @property
    def epoch(self) -> int:
        """The epoch the next fresh iteration will run."""
        return self._next.epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration run epoch ``epoch`` (an explicit alternative to counting)."""
        epoch = check_int("epoch", epoch, 0)
        with self._lock:
            nxt = self._next
            if epoch == nxt.epoch and nxt.fresh:
                return  # already next: keep a run that went on into this epoch
            self._next = Cursor(epoch, nxt.carry)
            self._cell.epoch = epoch
            self._forget_runs()

    def _epoch_changed(self, epoch: int) -> None:
        self._cell.epoch = epoch

    def _forget_runs(self) -> None:
        parked, self._parked = self._parked, None
        if parked is not None:
            parked.run.close_threadsafe()

    # ------------------------------------------------------------------ iteration
    async def _begin(self) -> Pass:
        await self._open()
        with self._lock:
            self._check_open()
            self._settle_ranks(final=True)
            cur = self._next
            self._cell.epoch = cur.epoch
            parked, self._parked = self._parked, None
            if parked is not None and self._parked_fits(parked, cur, asyncio.get_running_loop()):
                run, source = parked.run, parked.source
                plan = source.begin(cur.epoch)
                cur = dataclasses.replace(cur, length=plan.length)
            else:
                if parked is not None:
                    parked.run.close_threadsafe()
                for other in list(self._sources):
                    other.stop_following()  # this pass runs the epoch they would go on into
                if cur.sampler_state is not None:
                    self._planner.custom.load_state_dict(cur.sampler_state)
                length = self._epoch_length(cur)
                cur = Cursor(cur.epoch, cur.carry, cur.prefix, cur.after, self._sampler_state(), length)
                plan = self._planner.plan(cur.epoch, cur.carry, length)
                speculate = self.prefetch_next_epoch and self._planner.custom is None
                side = WorkerSide(self._token, self.seed, self._shared.get_payload, keys=self._keys)
                ahead = functools.partial(plan_ahead, self._planner, self._keys)  # holds no loader
                source = EpochSource(side, plan, cur, ahead if speculate else None)
                run = Run(self._run_config(), source)
                self._runs.add(run)
                self._sources.add(source)
                run.start()
            self._next = successor = Cursor(cur.epoch + 1, plan.carry_out)
            p = self._active = EpochPass(
                run,
                source,
                plan,
                cur,
                successor,
                lock=self._lock,
                recorder=self._recorder,
                max_skipped=self.max_skipped,
                on_end=self._end_pass,
            )
            return p if self._pin is None else PinningPass(p, self._pin)

    def _run_config(self) -> RunConfig:
        # A failed batch is delivered as its error, and the run goes on (torch's way), but
        # not past a pool that cannot start.
        cfg = {"fail_fast": False, "fatal": (PoolBrokenError,)}
        return self._config(ordered=self.ordered, fetch=self._fetch, group=self._group, **cfg)

    def _end_pass(self, p: EpochPass) -> bool:
        """Called when pass ``p`` ends: park its run if it went on into the epoch the
        next iteration will run; returns whether it did (else the caller closes it)."""
        with self._lock:
            if self._active is p:
                self._active = None
            keep = (
                p.left == 0
                and self._state is not Lifecycle.CLOSED
                and self._next is p.successor
                and not p.run.closed
                and p.source.continues_into(p.successor.epoch)
            )
            if keep:
                self._forget_runs()
                self._parked = Parked(p.run, p.source, p.successor)
            if p.left == 0 and self._next is p.successor:
                self._cell.epoch = p.successor.epoch
            return keep

    def __repr__(self) -> str:
        return (
            f"<aioloader.DataLoader batch_size={self.batch_size} num_workers={self.num_workers} "
            f"prefetch={self.prefetch} {self._state.value}>"
        )

