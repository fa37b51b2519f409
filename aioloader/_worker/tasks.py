"""What runs inside a worker: loader contexts, the one task entry, and DataLoader batches.

A loader's dataset (or a stream's ``fn``), collate function and options travel to a
worker once, as a pickled *payload* keyed by a token. An owned pool installs the
payloads of its loaders when each worker starts (:func:`worker_main`); any other
executor learns them lazily: a task whose token the worker has not seen comes back as
:data:`NEED_PAYLOAD`, and the dispatcher resubmits it once with the payload attached.
Either way a task carries only its indices (or items) and a little metadata.

Every kind of task runs through :func:`run_task`: context lookup, ``worker_init_fn``,
the slot-table marks (:mod:`aioloader._worker.slots`), the caller's global random state
(threads), and one *build* step, all that differs between a DataLoader batch
(:func:`run_batch`) and a stream micro-batch (:mod:`aioloader._worker.stream`). How the
outcome travels back, exceptions included, is :mod:`aioloader._worker.reply`'s business.

In an owned process pool, ``torch.utils.data.get_worker_info()`` answers as in a torch
worker (id, num_workers, seed, dataset) wherever torch is imported in the worker; this
module never imports torch itself (see :mod:`aioloader._worker.info`).

This module never imports asyncio.
"""

from __future__ import annotations

import itertools
import os
import pickle
import random
import signal
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, TypeVar

import numpy as np

from .. import _seeding
from ..errors import CollateError, DatasetPickleError, add_note
from . import byvalue as _byvalue
from . import channel as _channel
from . import info as _info
from . import orphan as _orphan
from . import reply as _reply
from . import slots as _slots
from . import unpicklable as _unpicklable
from .slots import Slots

__all__ = [
    "NEED_PAYLOAD",
    "BatchResult",
    "BatchTask",
    "GroupResult",
    "GroupTask",
    "WorkerContext",
    "install_context",
    "reads_batches",
    "run_batch",
    "run_group",
    "run_task",
    "worker_main",
]

NEED_PAYLOAD = "__aioloader_need_payload__"
R = TypeVar("R")


_MAX_CONTEXTS = 16  # loaders remembered per worker process (LRU) when a pool is shared


class BatchTask(NamedTuple):
    """One unit of work. Small by design: it is pickled for every batch."""

    token: str
    task_id: int
    epoch: int
    position: int
    indices: Any  # int64 bytes (the loader's form), a 1-d integer array or a list of ints
    seed: int
    payload: bytes | None = None
    values: Sequence[Any] | None = None  # fetch=: the fetched samples, one per index


class BatchResult(NamedTuple):
    data: Any
    skipped: tuple[tuple[int, str], ...]
    pid: int
    start_ns: int
    end_ns: int

    def unpicklable(self, task: BatchTask, exc: BaseException, where: str) -> None:
        _unpicklable.batch(self, task, exc, where)  # see aioloader._worker.culprit.salvage


class GroupTask(NamedTuple):
    """Several batches of one loader in one pool task; the members carry the group's
    ``task_id`` (the slot table names the group) and no payload of their own."""

    token: str
    task_id: int
    members: tuple[BatchTask, ...]
    payload: bytes | None = None


class GroupResult(NamedTuple):
    outcomes: tuple[BatchResult | _reply.Failed, ...]  # one per member, in order
    pid: int
    start_ns: int
    end_ns: int

    def unpicklable(self, task: GroupTask, exc: BaseException, where: str) -> GroupResult | None:
        return _unpicklable.group(self, task, exc, where)  # type: ignore[no-any-return]


@dataclass
class WorkerContext:
    """Everything a worker needs to build a loader's batches."""

    dataset: Any
    collate_fn: Callable[[list[Any]], Any]
    worker_init_fn: Callable[[int], Any] | None = None
    on_error: Literal["raise", "skip"] = "raise"
    seed_samples: _seeding.SeedMode = "batch"
    encode: Callable[[Any], Any] | None = None
    reads_batches: bool = False  # read a batch with one dataset.__getitems__(indices) call
    unbatched: bool = False  # batch_size=None: collate_fn takes the one sample, not a list
    seed: int = 0  # the loader's seed when the payload was made (worker info in worker_init_fn)
    transform: Callable[[Any], Any] | None = None  # applied to each sample before collate_fn
    # An iterable dataset's: worker_init_fn runs as each shard task begins, with the
    # shard's id (see aioloader._worker.shard), not once per process with its slot.
    iterable: bool = False
    batch_size: int = 1  # an iterable dataset's (its worker cuts the batches)
    drop_last: bool = False
    # Set in the worker, never pickled with the payload:
    remote: bool = field(default=False, compare=False)
    init_error: BaseException | None = field(default=None, compare=False)
    init_done: bool = field(default=False, compare=False)
    torch_info: Any = field(default=None, compare=False)  # torch's WorkerInfo, made once per seed

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["remote"] = True
        state["init_error"] = None
        state["init_done"] = False
        state["torch_info"] = None
        return state


_contexts: OrderedDict[str, WorkerContext] = OrderedDict()
_contexts_lock = threading.Lock()

_startup_error: BaseException | None = None  # what kept this worker's start from finishing
# An owned worker gives torch one intra-op thread, as torch's workers do, once torch is
# imported here (by the dataset's module, say). This module never imports it.
_torch_threads_pending = False


def _one_torch_thread() -> None:
    global _torch_threads_pending
    torch = sys.modules.get("torch")
    if torch is None or not callable(getattr(torch, "set_num_threads", None)):
        return
    _torch_threads_pending = False
    torch.set_num_threads(1)


def install_context(token: str, ctx: WorkerContext) -> None:
    """Register a loader's context in this process (thread mode and a worker's start)."""
    with _contexts_lock:
        _contexts[token] = ctx
        _contexts.move_to_end(token)
        while len(_contexts) > _MAX_CONTEXTS:
            _contexts.popitem(last=False)


def forget_context(token: str) -> None:
    with _contexts_lock:
        _contexts.pop(token, None)
    _load_errors.pop(token, None)


# Tokens whose payload this worker could not unpickle as it started, with the reason:
# each task of that loader raises it (a failing start would instead kill the worker,
# and every batch would look lost to a dying worker).
_load_errors: dict[str, BaseException] = {}


def _load_payload(token: str, payload: bytes | _byvalue.Inherited) -> WorkerContext:
    """Unpickle and install a payload; raises :class:`DatasetPickleError` if it cannot."""
    ctx: WorkerContext = _byvalue.loads_payload(payload)
    install_context(token, ctx)
    return ctx


def check_loaded(token: str) -> None:
    """Raise the error that kept this worker from unpickling ``token``'s payload, if any."""
    exc = _load_errors.get(token)
    if exc is not None:
        raise _byvalue.unpickle_error(exc) from exc


def _run_init(ctx: WorkerContext) -> None:
    ctx.init_done = True
    _info.publish(ctx, ctx.seed)
    if ctx.worker_init_fn is None or ctx.iterable:
        return
    wid = _info.worker_id
    try:
        ctx.worker_init_fn(wid)
    except Exception as exc:  # surfaced with the first batch this worker builds
        add_note(exc, f"aioloader: raised by worker_init_fn({wid}) in {_reply.process_label()}")
        ctx.init_error = exc


def worker_main(
    channel: Any,
    slot: int,
    table: Any,
    num_workers: int,
    consumer_pid: int,
    payloads: dict[str, bytes | _byvalue.Inherited] | None,
) -> None:
    """An owned worker's life: start, then serve its channel until the pool stops it.

    ``channel`` is the worker's end of its channel (a descriptor, or a
    ``multiprocessing`` connection where multiprocessing started the process);
    ``payloads`` its loaders' payloads, or ``None`` when they come as the channel's
    first frame (a worker forked by the pool's own fork server).

    Starting never raises: a payload that cannot be loaded fails the tasks of its
    loader; anything else fails every task of this worker, each time with the worker's
    own exception (a worker that died here would only be started again, for ever)."""
    global _startup_error, _torch_threads_pending
    _torch_threads_pending = True
    fd = channel if isinstance(channel, int) else channel.fileno()
    # Ctrl-C reaches the whole process group; only the consumer should react to it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _reply.framed = True
    _slots.claim(table, slot, os.getpid())
    _info.worker_id, _info.num_workers = slot, num_workers
    watch = None
    try:
        watch = threading.Thread(
            target=_orphan.exit_when_orphaned, args=(consumer_pid,), name="aioloader-orphan-watch", daemon=True
        )
        watch.start()
        if payloads is None:
            head = _channel.read_exact(fd, _channel.HEAD.size)
            body = _channel.read_exact(fd, _channel.HEAD.unpack(head)[0]) if head is not None else None
            if body is None:
                return  # the consumer is gone before this worker started
            payloads = pickle.loads(body)
            del body
        for k, (token, payload) in enumerate(payloads.items()):
            _slots.starting(k, Slots.LOADING)  # a stuck start names the loader and the step
            try:
                ctx = _load_payload(token, payload)
            except DatasetPickleError as exc:
                _load_errors[token] = exc.__cause__ or exc
                continue
            if _torch_threads_pending:  # before worker_init_fn, which may set its own
                _one_torch_thread()
            _slots.starting(k, Slots.INITIALIZING)
            _run_init(ctx)
        del payloads
    except BaseException as exc:
        add_note(exc, f"aioloader: raised while worker pid {os.getpid()} was starting")
        _startup_error = exc
    _slots.mark(Slots.READY)
    seqs = itertools.count()

    def run(fn: Callable[..., Any], args: tuple[Any, ...]) -> memoryview:
        _slots.accepted(next(seqs))
        try:
            return _reply.run_framed(fn, args)
        finally:
            _slots.holding()

    if not _channel.serve(fd, run) and watch is not None:
        # The consumer's end closed: it is gone, or going. Its watch frees what the
        # consumer would have freed, and ends this process.
        watch.join(5.0)


_SEEDED_BATCH_LOCK = threading.RLock()


class _GlobalRngGuard:
    """Thread mode: keep the consumer's global random state as it was."""

    def __enter__(self) -> None:
        self.py = random.getstate()
        self.np = np.random.get_state()
        torch = sys.modules.get("torch")
        self.torch = torch.random.get_rng_state() if torch is not None else None

    def __exit__(self, *exc: object) -> None:
        random.setstate(self.py)
        np.random.set_state(self.np)
        torch = sys.modules.get("torch")
        if torch is not None and self.torch is not None:
            torch.random.set_rng_state(self.torch)


def context_of(task: Any, kind: type[WorkerContext] = WorkerContext) -> WorkerContext | None:
    """The context ``task`` names (``token``, ``payload``), loading the payload it
    carries if need be; ``None`` if this process has not seen it and it came without.
    Raises the error that kept this worker from starting or from loading it."""
    payload = task.payload
    if isinstance(payload, kind):  # thread mode: the context itself rides along
        return payload
    if _startup_error is not None:
        raise _startup_error
    check_loaded(task.token)
    ctx = _contexts.get(task.token)
    if ctx is None:
        if payload is None:
            return None
        _slots.mark(Slots.LOADING)  # a timeout names the unpickling of the payload
        ctx = _load_payload(task.token, payload)
    if not isinstance(ctx, kind):  # pragma: no cover - tokens are uuids
        raise TypeError(f"aioloader: token {task.token} names another kind of loader")
    return ctx


def run_task(
    task: Any,
    build: Callable[[Any, Any], tuple[Any, ...]],
    result: Callable[..., R],
    kind: type[WorkerContext] = WorkerContext,
) -> R | str:
    """Run one task of any kind: ``result(*build(ctx, task), pid, start_ns, end_ns)``.

    ``task`` has ``token``, ``task_id`` and ``payload``. Returns :data:`NEED_PAYLOAD`
    when this worker has not seen the loader and the task came without its payload.
    Exceptions from user code propagate with their own type and the notes ``build``
    added (BaseExceptions too: :class:`aioloader._worker.reply.Entry` carries them home)."""
    ctx = context_of(task, kind)
    if ctx is None:
        return NEED_PAYLOAD
    return _run_in(ctx, task, build, result)


def _run_in(
    ctx: WorkerContext, task: Any, build: Callable[[Any, Any], tuple[Any, ...]], result: Callable[..., R]
) -> R:
    """:func:`run_task` once the context is loaded (the slot marked ``ACCEPTED``)."""
    if _torch_threads_pending:
        _one_torch_thread()
    if not ctx.init_done:
        _slots.mark(Slots.INITIALIZING)  # a timeout names worker_init_fn
        _run_init(ctx)
    if ctx.init_error is not None:
        raise ctx.init_error
    _info.publish(ctx, getattr(task, "seed", ctx.seed))
    start = time.monotonic_ns()
    _slots.mark(Slots.RUNNING, start)
    if not ctx.seed_samples:
        fields = build(ctx, task)
    elif ctx.remote:
        # random's and numpy's global generators are shared by every thread of a
        # process (a borrowed thread executor, a dask worker's threads): seeded batches
        # build one at a time. A process-pool worker has one thread; the lock is free.
        with _SEEDED_BATCH_LOCK:
            fields = build(ctx, task)
    else:
        # The loader's own thread (num_workers=0) runs one batch at a time; no lock, so
        # a thread abandoned after a timeout cannot hold up its replacement. The
        # consumer's own random state is put back after each batch.
        with _GlobalRngGuard():
            fields = build(ctx, task)
    return result(*fields, os.getpid(), start, time.monotonic_ns())


def run_batch(task: BatchTask) -> BatchResult | str:
    """Fetch and collate one DataLoader batch (see :func:`run_task`)."""
    return run_task(task, _build, BatchResult)


def run_group(task: GroupTask) -> GroupResult | str:
    """Build several DataLoader batches in one pool task, one after the other (see
    :mod:`aioloader._engine.group`). A batch that raises fails alone: its exception
    travels as its outcome and the next batch is built. Every batch is seeded from
    its own position, as if it were a task of its own."""
    ctx = context_of(task)
    if ctx is None:
        return NEED_PAYLOAD
    start = time.monotonic_ns()
    outcomes: list[BatchResult | _reply.Failed] = []
    for member in task.members:
        try:
            outcomes.append(_run_in(ctx, member, _build, BatchResult))
        except BaseException as exc:  # SystemExit too: it fails its own batch only
            outcomes.append(_reply.Failed.of(exc))
    return GroupResult(tuple(outcomes), os.getpid(), start, time.monotonic_ns())


def reads_batches(dataset: Any) -> bool:
    """Whether a batch of ``dataset`` is read with one ``__getitems__(indices)`` call, as
    torch's DataLoader reads it (a list of samples back, one per index).

    torch's ``Subset`` and ``StackDataset`` have a ``__getitems__`` that only loops over
    ``dataset[i]`` when what they wrap has none. Such a dataset is read sample by
    sample here: the same samples, with per-sample seeding and error naming."""
    if not callable(getattr(dataset, "__getitems__", None)):
        return False
    data = sys.modules.get("torch.utils.data")
    if data is None:
        return True
    method = getattr(type(dataset), "__getitems__", None)
    if method is getattr(getattr(data, "Subset", None), "__getitems__", None):
        return reads_batches(getattr(dataset, "dataset", None))
    if method is getattr(getattr(data, "StackDataset", None), "__getitems__", None):
        inner = getattr(dataset, "datasets", ())
        return any(reads_batches(d) for d in (inner.values() if isinstance(inner, dict) else inner))
    return True


def _brief(indices: Sequence[int]) -> str:
    shown = ", ".join(map(str, indices[:8]))
    return f"[{shown}]" if len(indices) <= 8 else f"[{shown}, ...] ({len(indices)} indices)"


_FAILED = object()  # a batched read that raised under on_error="skip"


def _read_batch(
    dataset: Any, indices: list[int], seeds: _seeding.BatchSeeds, task: BatchTask, skip: bool
) -> Any:
    """One ``dataset.__getitems__(indices)`` call. Under ``skip`` an exception returns
    :data:`_FAILED`: the caller then reads sample by sample to find the culprit."""
    seeds.batched = True
    try:
        got = dataset.__getitems__(indices)
    except BaseException as exc:  # SystemExit too: named, then carried home as a value
        if skip and isinstance(exc, Exception):
            return _FAILED
        add_note(exc, f"aioloader: raised by dataset.__getitems__({_brief(indices)}) in {_where(task)}")
        raise
    finally:
        seeds.batched = False
    if isinstance(got, (list, tuple)) and len(got) != len(indices):
        raise ValueError(
            f"aioloader: dataset.__getitems__ returned {len(got)} samples for {len(indices)} indices "
            f"{_brief(indices)} in {_where(task)}; it must return one sample per index, in order"
        )
    return got


def _where(task: BatchTask) -> str:
    return f"batch {task.position} of epoch {task.epoch}, {_reply.process_label()}"


def _load_plainly(
    dataset: Any, indices: Sequence[int], samples: list[Any], seeds: _seeding.BatchSeeds, task: BatchTask
) -> None:
    """The common batch (no transform, no per-sample seeding, no skipping, read here):
    one ``dataset[i]`` and one append a sample. The position ``sample_rng`` reads is the
    number of samples loaded so far, and so is the culprit's when one raises."""
    seeds.loaded = samples
    append = samples.append
    try:
        for i in indices:
            append(dataset[i])
    except BaseException as exc:  # SystemExit too: named, then carried home as a value
        i = indices[len(samples)]
        add_note(exc, f"aioloader: raised by dataset[{i}] (sample index {i}) in {_where(task)}")
        raise
    finally:
        seeds.loaded, seeds.k = None, len(samples)


def _build(ctx: WorkerContext, task: BatchTask) -> tuple[Any, tuple[tuple[int, str], ...]]:
    raw = task.indices
    indices: Sequence[int]
    if isinstance(raw, bytes):
        indices = np.frombuffer(raw, dtype=np.int64).tolist()
    elif isinstance(raw, np.ndarray):
        indices = raw.tolist()
    else:
        indices = raw
    dataset = ctx.dataset
    values = task.values  # fetched in the main process: no dataset here
    transform = ctx.transform
    samples: list[Any] = []
    skipped: list[tuple[int, str]] = []
    gaps: set[int] = set()  # positions of the skipped samples
    read = "the fetched sample" if values is not None else ""  # what transform is given
    batch_in: Any = samples  # what collate_fn gets
    try:
        seed_raw, seed_indices = raw, indices
        if type(raw) is list:  # only a sampler's own keys (batch_size=None) come as a list
            seed_raw = seed_indices = [task.position]  # seeded by the batch's position
        seeds = _seeding.start_batch(ctx.seed_samples, task.seed, task.epoch, seed_raw, seed_indices)
        hook = seeds.hook
        rest: Sequence[int] = indices
        # "sample" mode seeds the global generators before each sample: one call for the
        # whole batch cannot honour that, so it reads sample by sample.
        if ctx.reads_batches and hook is None and values is None:
            got = _read_batch(dataset, list(indices), seeds, task, ctx.on_error == "skip")
            if got is _FAILED:  # read again one by one, drawing as if the batched read never ran
                seeds = _seeding.start_batch(ctx.seed_samples, task.seed, task.epoch, seed_raw, seed_indices)
            elif transform is None or not isinstance(got, (list, tuple)):
                batch_in = got  # torch's contract: handed to collate_fn as it is
                rest = ()
            else:
                values, read = got, "the sample dataset.__getitems__ read"
        elif hook is None and values is None and transform is None and ctx.on_error != "skip":
            _load_plainly(dataset, indices, samples, seeds, task)
            rest = ()  # loaded: the loop below has nothing left to do
        for k, i in enumerate(rest):  # runs for every sample: keep it lean
            seeds.k = k
            if hook is not None:
                hook(k)
            in_transform = False
            try:
                sample = dataset[i] if values is None else values[k]
                if transform is not None:
                    in_transform = True
                    sample = transform(sample)
            except BaseException as exc:  # SystemExit too: named, then carried home as a value
                if ctx.on_error == "skip" and isinstance(exc, Exception):
                    skipped.append((i, f"{type(exc).__name__}: {exc}"))
                    gaps.add(k)
                    continue
                what = f"dataset[{i}]"
                if in_transform:
                    what = f"transform({read or what})"
                add_note(exc, f"aioloader: raised by {what} (sample index {i}) in {_where(task)}")
                raise
            samples.append(sample)
    finally:
        _seeding.clear_sample()
    if batch_in is samples and not samples:
        return None, tuple(skipped)
    try:
        batch = ctx.collate_fn(samples[0] if ctx.unbatched else batch_in)
        if ctx.encode is not None:
            batch = ctx.encode(batch)
    except Exception as exc:
        kept = [i for k, i in enumerate(indices) if k not in gaps]
        if isinstance(exc, CollateError):
            positions = getattr(exc, "positions", [])
            exc.indices = [kept[p] for p in positions if p < len(kept)]  # type: ignore[attr-defined]
            named = f"; the mismatching samples have indices {exc.indices}"  # type: ignore[attr-defined]
        else:
            named = ""
        add_note(exc, f"aioloader: raised by collate_fn in {_where(task)}, sample indices {kept}{named}")
        raise
    return batch, tuple(skipped)
