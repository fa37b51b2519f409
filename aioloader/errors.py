"""Every exception aioloader raises on its own account.

Exceptions raised by *your* code (a dataset's ``__getitem__``, a ``collate_fn``, a
``worker_init_fn``, a stream's ``fn``) are not wrapped: they reach you with their own
type and message, the worker's traceback as ``__cause__`` and a note naming the epoch,
the batch and the sample index. Only an exception that cannot travel between processes
(it does not pickle) is replaced, by :class:`RemoteError`.

The tree::

    AioLoaderError
    ├── LoaderClosedError        (also RuntimeError)  iterating or using a closed loader/pool
    ├── RemoteError              (also RuntimeError)  user code raised an unpicklable exception
    ├── WorkerCrashedError       (also RuntimeError)  a batch kept killing its worker
    ├── PoolBrokenError          (also RuntimeError)  the pool cannot run anything
    ├── LoaderTimeout            (also TimeoutError)  a batch overran ``timeout`` once due
    ├── DeadlineExceeded         (also TimeoutError)  a Batcher request's deadline passed
    ├── Overloaded               (also RuntimeError)  a Batcher refused a request (full, or too late)
    ├── TooManySkippedError      (also RuntimeError)  ``on_error="skip"`` passed ``max_skipped``
    ├── CollateError             (also ValueError)    samples that do not stack together
    ├── DatasetPickleError       (also TypeError)     the dataset (or collate_fn...) won't pickle
    ├── StateDictError           (also ValueError)    a state dict from an incompatible loader
    ├── RecordIOError            (also ValueError)    a malformed .rec/.idx file
    ├── ImageDecodeError         (also OSError)       a file or record is not a decodable image
    └── SharedMemoryError        (also RuntimeError)  a shared-memory batch could not be mapped

And one warning: ``ShmFallbackWarning`` (a ``UserWarning``), issued once when shared
memory cannot carry a loader's batches and they are pickled instead.

Every class pickles and unpickles with its message and attributes intact, so an error
raised inside a worker process arrives whole. Construction follows one rule: the first
positional argument is the message, everything else is keyword-only and stored as an
attribute of the same name.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AioLoaderError",
    "CollateError",
    "DatasetPickleError",
    "DeadlineExceeded",
    "ImageDecodeError",
    "LoaderClosedError",
    "LoaderTimeout",
    "Overloaded",
    "PoolBrokenError",
    "RecordIOError",
    "RemoteError",
    "SharedMemoryError",
    "ShmFallbackWarning",
    "StateDictError",
    "TooManySkippedError",
    "WorkerCrashedError",
]


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also on Python 3.10 (which has ``__notes__`` but no
    ``add_note``; its tracebacks do not print notes, but they stay on the exception)."""
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(note)
        return
    notes = getattr(exc, "__notes__", None)
    try:
        if notes is None:
            exc.__notes__ = [note]
        else:
            notes.append(note)
    except (AttributeError, TypeError):  # an exception type that refuses new attributes
        pass


class AioLoaderError(Exception):
    """Base class of every exception aioloader raises itself."""

    def __init__(self, message: str = "", **attrs: Any) -> None:
        super().__init__(message)
        for name, value in attrs.items():
            setattr(self, name, value)

    # BaseException.__reduce__ gives (type, args, __dict__): args is (message,) and the
    # keyword attributes live in __dict__, so the default pickling already round-trips.

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class LoaderClosedError(AioLoaderError, RuntimeError):
    """The loader, stream or pool was closed and then used (iterated, submitted to)."""


class RemoteError(AioLoaderError, RuntimeError):
    """User code in a worker raised an exception that cannot be pickled.

    Attributes: ``type_name`` (qualified name of the original type), ``original_message``
    and ``remote_traceback`` (the worker's formatted traceback).
    """

    type_name: str
    original_message: str
    remote_traceback: str


class WorkerCrashedError(AioLoaderError, RuntimeError):
    """A batch killed its worker process more than ``max_retries`` times.

    Attributes: ``indices`` (the batch's sample indices), ``exitcode`` (the dead
    process's exit code, negative for a signal, or ``None`` when unknown) and ``attempts``.
    """

    indices: list[int]
    exitcode: int | None
    attempts: int


class PoolBrokenError(AioLoaderError, RuntimeError):
    """The pool cannot run anything: a borrowed executor broke (aioloader may not rebuild
    it), or the pool's own workers keep dying before they finish starting."""


class LoaderTimeout(AioLoaderError, TimeoutError):
    """A batch was not delivered within ``timeout`` seconds of being due.

    A batch is due once its worker could start it. The message names the worker's pid
    and what hung: the batch itself, the loader's ``worker_init_fn``, the unpickling of
    its dataset, or a worker that never took the batch up (a stopped process, say).
    The stuck worker was killed and replaced; the loader stays usable.
    Attributes: ``indices``, ``timeout``.
    """

    indices: list[int]
    timeout: float


class DeadlineExceeded(AioLoaderError, TimeoutError):
    """A :class:`~aioloader.Batcher` request was not answered by its ``deadline``.

    Attributes: ``deadline`` (seconds, as given) and ``dispatched``: False when it never
    reached a worker (no worker time spent), True when a worker still had it (its result
    is dropped when it arrives)."""

    deadline: float
    dispatched: bool


class Overloaded(AioLoaderError, RuntimeError):
    """A :class:`~aioloader.Batcher` refused a request at ``submit()``: answer "busy" (HTTP
    503) rather than queue without bound or answer late.

    Either ``max_pending`` requests already wait, or the request has a ``deadline`` and
    the Batcher estimates it would be answered after it. Attributes ``max_pending``,
    ``estimate`` (the estimated seconds to an answer; None for a full queue) and
    ``retry_after`` (seconds after which a retry may be let in, by the same estimate:
    what a service puts in a ``Retry-After`` header, rounded up)."""

    max_pending: int
    estimate: float | None
    retry_after: float


class TooManySkippedError(AioLoaderError, RuntimeError):
    """With ``on_error="skip"``, more than ``max_skipped`` samples failed in one epoch.

    Attribute ``skipped``: list of ``(index, "Type: message")`` pairs, in order.
    """

    skipped: list[tuple[int, str]]


class CollateError(AioLoaderError, ValueError):
    """Samples of one batch could not be combined (different shapes, types or keys).

    Attribute ``indices``: the sample indices of the batch, when known.
    """


class DatasetPickleError(AioLoaderError, TypeError):
    """An object that must reach the workers (dataset, collate_fn, ...) cannot be pickled."""


class StateDictError(AioLoaderError, ValueError):
    """``load_state_dict`` got a state from an incompatible loader (names the mismatch)."""


class RecordIOError(AioLoaderError, ValueError):
    """A RecordIO file is malformed. Attributes: ``path``, ``key``, ``offset`` (when known)."""


class ImageDecodeError(AioLoaderError, OSError):
    """A file or record could not be decoded as an image (built-in datasets).

    The message names the file (and the record key, for record files) and what Pillow
    reported; the original exception is the ``__cause__``. Attributes: ``path`` and
    ``key`` (``None`` for image folders).
    """

    path: str
    key: int | None


class SharedMemoryError(AioLoaderError, RuntimeError):
    """A batch's shared-memory slab could not be mapped or was not in the expected state."""


class OversubscribedWarning(UserWarning):
    """``num_workers`` is more than the CPUs this process may use (torch warns the same).

    A ``UserWarning``, so code that filters torch's warning filters this one too. A test
    suite that runs its loaders with warnings as errors can ignore this class alone.
    """


class ShmFallbackWarning(UserWarning):
    """Shared memory could not carry a loader's batches; they are pickled instead.

    Issued once per loader, with advice on enlarging ``/dev/shm``.
    """
