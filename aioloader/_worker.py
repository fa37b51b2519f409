"""What runs inside a worker: the dataset cache, per-sample seeding, fetch and collate.

A loader's dataset, collate function and options travel to a worker once, as a pickled
*payload* keyed by a token. An owned pool installs the payloads of its loaders when each
worker starts (the pool's initializer); any other executor learns them lazily: a task
whose token the worker has not seen comes back as :data:`NEED_PAYLOAD`, and the
scheduler resubmits it once with the payload attached. Either way a batch task carries
only its indices and a little metadata.

In an owned process pool, ``torch.utils.data.get_worker_info()`` answers as in a torch
worker (id, num_workers, seed, dataset) wherever torch is imported in the worker; this
module never imports torch itself (see :func:`_publish_worker_info`).

Crash attribution and timeouts need to know which worker runs which task and since
when. Each worker of an owned pool claims a slot in a small shared int64 table and
writes ``(pid, task_id, start_ns)`` there before touching the dataset.

This module never imports asyncio.
"""

from __future__ import annotations

import os
import pickle
import random
import signal
import sys
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np

from . import _byvalue, _orphan, _seeding
from .errors import CollateError, DatasetPickleError, RemoteError

__all__ = [
    "NEED_PAYLOAD",
    "BatchResult",
    "BatchTask",
    "WorkerContext",
    "install_context",
    "pool_initializer",
    "run_batch",
]

NEED_PAYLOAD = "__aioloader_need_payload__"


def _imported_by_forkserver_preload() -> bool:
    frame: Any = sys._getframe()
    suffix = os.path.join("multiprocessing", "forkserver.py")
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_code.co_filename.endswith(suffix):
            return True
        frame = frame.f_back
    return False


# Workers must ignore Ctrl-C from birth, not only from the pool initializer on: a worker
# still starting when the terminal's SIGINT reaches the process group would print a
# KeyboardInterrupt traceback of its own. The forkserver hands its children the SIGINT
# disposition it found after its preloads, so when this module is preloaded there (the
# pool arranges that) it sets "ignore". Only the forkserver process is affected.
if _imported_by_forkserver_preload():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
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


@dataclass
class WorkerContext:
    """Everything a worker needs to build a loader's batches."""

    dataset: Any
    collate_fn: Callable[[list[Any]], Any]
    worker_init_fn: Callable[[int], Any] | None = None
    on_error: Literal["raise", "skip"] = "raise"
    seed_samples: _seeding.SeedMode = "batch"
    encode: Callable[[Any], Any] | None = None
    fetch_batch: bool = False  # call dataset.__getitems__(indices) when the dataset has it
    unbatched: bool = False  # batch_size=None: collate_fn takes the one sample, not a list
    seed: int = 0  # the loader's seed when the payload was made (worker info in worker_init_fn)
    transform: Callable[[Any], Any] | None = None  # applied to each sample before collate_fn
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
_worker_id = 0
_num_workers = 0  # the owned pool's size; 0 elsewhere (threads, borrowed executors)

# Side channel for crash attribution and timeouts (owned process pools only).
_slot_table: Any = None  # numpy int64 view over a shared RawArray, 3 fields per slot
_slot: int = -1
# Thread mode: the scheduler lives in this same process and reads these directly.
thread_starts: dict[int, int] = {}


def _add_note(exc: BaseException, note: str) -> None:
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(note)
    else:  # Python 3.10
        notes = getattr(exc, "__notes__", None)
        if notes is None:
            try:
                exc.__notes__ = [note]
            except AttributeError:
                pass
        else:
            notes.append(note)


def install_context(token: str, ctx: WorkerContext) -> None:
    """Register a loader's context in this process (thread mode and initializers)."""
    with _contexts_lock:
        _contexts[token] = ctx
        _contexts.move_to_end(token)
        while len(_contexts) > _MAX_CONTEXTS:
            _contexts.popitem(last=False)


def forget_context(token: str) -> None:
    with _contexts_lock:
        _contexts.pop(token, None)
    _load_errors.pop(token, None)


# Tokens whose payload this worker's initializer could not unpickle, with the reason:
# each task of that loader raises it (a failing initializer would instead break the pool,
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


_TORCH_WORKER = "torch.utils.data._utils.worker"


def _publish_worker_info(ctx: WorkerContext, seed: int) -> None:
    """Make ``torch.utils.data.get_worker_info()`` describe this worker and ``ctx``'s
    dataset, as torch's own workers do (torch keeps it in a module global).

    Only in a worker of an owned pool (its id and the pool's size are known), and only
    when torch is already imported here: a torch dataset's module imports it while the
    dataset is unpickled, and code that never imported torch cannot ask. Threads
    (``num_workers=0``) leave it ``None``, as torch's main process does. Set again for
    every batch: loaders sharing a pool have different datasets.
    """
    if not _num_workers:
        return
    module: Any = sys.modules.get(_TORCH_WORKER)
    if module is None:
        return
    info = ctx.torch_info
    want = _seeding.worker_seed(seed, _worker_id)
    if info is None or info.seed != want:
        info = ctx.torch_info = module.WorkerInfo(
            id=_worker_id, num_workers=_num_workers, seed=want, dataset=ctx.dataset
        )
    module._worker_info = info


def _run_init(ctx: WorkerContext) -> None:
    ctx.init_done = True
    _publish_worker_info(ctx, ctx.seed)
    if ctx.worker_init_fn is None:
        return
    try:
        ctx.worker_init_fn(_worker_id)
    except Exception as exc:  # surfaced with the first batch this worker builds
        _add_note(exc, f"aioloader: raised by worker_init_fn({_worker_id}) in worker pid {os.getpid()}")
        ctx.init_error = exc


def pool_initializer(
    payloads: dict[str, bytes | _byvalue.Inherited],
    table: Any,
    lock: Any,
    counter: Any,
    max_slots: int,
    consumer_pid: int = 0,
) -> None:
    """Initializer of an owned process pool: one call per worker process."""
    global _slot_table, _slot, _worker_id, _num_workers
    # Ctrl-C reaches the whole process group; only the consumer should react to it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if consumer_pid:
        threading.Thread(
            target=_orphan.exit_when_orphaned, args=(consumer_pid,), name="aioloader-orphan-watch", daemon=True
        ).start()
    if table is not None:
        with lock:
            _slot = counter.value
            counter.value += 1
        _worker_id = _slot
        _num_workers = max_slots
        if _slot < max_slots:
            _slot_table = np.frombuffer(table, dtype=np.int64)
            _slot_table[_slot * 3] = os.getpid()
            _slot_table[_slot * 3 + 1] = -1
        else:  # more processes than slots (never with a fixed-size pool): run untracked
            _slot = -1
    for token, payload in payloads.items():
        try:
            ctx = _load_payload(token, payload)
        except DatasetPickleError as exc:
            _load_errors[token] = exc.__cause__ or exc
            continue
        _run_init(ctx)


def _portable(exc: BaseException, ctx: WorkerContext) -> BaseException:
    """Make sure ``exc`` survives the trip to the consumer's process."""
    if not ctx.remote:
        return exc
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        name = f"{type(exc).__module__}.{type(exc).__qualname__}"
        remote = RemoteError(
            f"{name}: {exc} (the original exception could not be pickled; its traceback "
            "is in .remote_traceback)",
            type_name=name,
            original_message=str(exc),
            remote_traceback=tb,
        )
        for note in getattr(exc, "__notes__", ()):
            _add_note(remote, note)
        return remote


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


def _mark_start(task_id: int, now: int) -> None:
    if _slot_table is not None and _slot >= 0:
        _slot_table[_slot * 3 + 2] = now
        _slot_table[_slot * 3 + 1] = task_id
    else:
        thread_starts[task_id] = now


def _mark_end(task_id: int) -> None:
    if _slot_table is not None and _slot >= 0:
        _slot_table[_slot * 3 + 1] = -1
    else:
        thread_starts.pop(task_id, None)


def run_batch(task: BatchTask) -> BatchResult | str:
    """Fetch and collate one batch. The function every executor runs."""
    check_loaded(task.token)
    ctx = _contexts.get(task.token)
    if ctx is None:
        if task.payload is None:
            return NEED_PAYLOAD
        ctx = _load_payload(task.token, task.payload)
    if not ctx.init_done:
        _run_init(ctx)
    if ctx.init_error is not None:
        raise _portable(ctx.init_error, ctx)
    _publish_worker_info(ctx, task.seed)
    start = time.monotonic_ns()
    _mark_start(task.task_id, start)
    try:
        if not ctx.seed_samples:
            data, skipped = _build(ctx, task)
        elif ctx.remote:
            # random's and numpy's global generators are shared by every thread of a
            # process (a borrowed thread executor, a dask worker's threads): seeded batches
            # build one at a time. A process-pool worker has one thread; the lock is free.
            with _SEEDED_BATCH_LOCK:
                data, skipped = _build(ctx, task)
        else:
            # The loader's own thread (num_workers=0) runs one batch at a time; no lock, so
            # a thread abandoned after a timeout cannot hold up its replacement. The
            # consumer's own random state is put back after each batch.
            with _GlobalRngGuard():
                data, skipped = _build(ctx, task)
    finally:
        _mark_end(task.task_id)
    return BatchResult(data, skipped, os.getpid(), start, time.monotonic_ns())


def _where(task: BatchTask) -> str:
    return f"batch {task.position} of epoch {task.epoch}, worker pid {os.getpid()}"


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
    kept: list[int] = []
    skipped: list[tuple[int, str]] = []
    try:
        enter = _seeding.start_batch(ctx.seed_samples, task.seed, task.epoch, raw)
        for k, i in enumerate(indices):
            enter(k, i)
            in_transform = False
            try:
                sample = dataset[i] if values is None else values[k]
                if transform is not None:
                    in_transform = True
                    sample = transform(sample)
                samples.append(sample)
            except Exception as exc:
                if ctx.on_error == "skip":
                    skipped.append((i, f"{type(exc).__name__}: {exc}"))
                    continue
                what = f"dataset[{i}]"
                if in_transform:
                    what = "transform(the fetched sample)" if values is not None else f"transform(dataset[{i}])"
                _add_note(exc, f"aioloader: raised by {what} (sample index {i}) in {_where(task)}")
                raise _portable(exc, ctx)  # noqa: B904 (re-raises exc itself)
            kept.append(i)
    finally:
        _seeding.clear_sample()
    if not samples:
        return None, tuple(skipped)
    try:
        batch = ctx.collate_fn(samples[0] if ctx.unbatched else samples)
        if ctx.encode is not None:
            batch = ctx.encode(batch)
    except Exception as exc:
        if isinstance(exc, CollateError):
            positions = getattr(exc, "positions", [])
            exc.indices = [kept[p] for p in positions if p < len(kept)]  # type: ignore[attr-defined]
            named = f"; the mismatching samples have indices {exc.indices}"  # type: ignore[attr-defined]
        else:
            named = ""
        _add_note(exc, f"aioloader: raised by collate_fn in {_where(task)}, sample indices {kept}{named}")
        raise _portable(exc, ctx)  # noqa: B904 (re-raises exc itself)
    return batch, tuple(skipped)


def noop() -> int:
    """Submitted once per worker to start the pool's processes in parallel."""
    return os.getpid()
