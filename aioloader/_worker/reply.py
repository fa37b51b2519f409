"""How a task's outcome travels back to the consumer.

The pool runs every task through :class:`Entry`, which never raises:

* **in the consumer's own process** (threads): the :class:`Outcome` itself, nothing
  pickled;
* **in an owned worker**: one frame of its channel (:mod:`aioloader._worker.channel`), the
  outcome pickled once, whatever its size (:func:`run_framed`);
* **in a borrowed executor's process**: the pickle, inline (:class:`_Inline`), which
  that executor carries home and which unpickles there as the :class:`Outcome`.

Exceptions travel the same way, ``BaseException`` included: the reply carries the
exception and its formatted traceback, rebuilt in the consumer as the exception with a
:class:`RemoteTraceback` as ``__cause__``. An exception that does not survive pickling
arrives as :class:`~aioloader.RemoteError`. A value that does not pickle is named
(the batch, the sample, the field) by :mod:`aioloader._worker.culprit`.

This module never imports asyncio.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import traceback
from collections.abc import Callable
from typing import Any

from .._shm import host_key
from ..errors import RemoteError, add_note
from . import culprit as _culprit
from .channel import frame

__all__ = [
    "Entry",
    "Failed",
    "Origin",
    "Outcome",
    "RemoteTraceback",
    "arrived",
    "origin",
    "process_label",
    "run_framed",
    "travelling",
]

# (consumer pid, consumer host key).
Origin = tuple[int, tuple[str, int, int, int]]
# Set in an owned worker by aioloader._worker.tasks.worker_main: replies are channel frames.
framed = False


def origin() -> Origin:
    """What a task must know about the consumer to choose how to reply (made once a
    process: it is asked for every task)."""
    global _origin
    if _origin is None or _origin[0] != os.getpid():
        _origin = (os.getpid(), host_key())
    return _origin


_origin: Origin | None = None


class RemoteTraceback(Exception):
    """The ``__cause__`` of an exception raised in a worker: its traceback there."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


class Outcome:
    """A task's outcome in the consumer: ``ok`` and its return value, or the exception
    it raised (``ok`` false)."""

    __slots__ = ("ok", "value")

    def __init__(self, ok: bool, value: Any) -> None:
        self.ok = ok
        self.value = value

    def unwrap(self) -> Any:
        """The value, or raise the exception (``SystemExit`` and other
        ``BaseException``s too: the engine carries those to the consumer as values, so
        that they cannot stop the event loop that runs the iteration)."""
        if self.ok:
            return self.value
        raise self.value


class Framed:
    """A reply already pickled into a channel frame (an owned worker's :class:`Entry`)."""

    __slots__ = ("view",)

    def __init__(self, view: memoryview) -> None:
        self.view = view


class Entry:
    """The callable the pool submits: runs ``fn(task)`` and replies (see module doc).

    Never raises. Pickles as ``fn`` and the consumer's :data:`Origin`, so a task still
    carries only what it did before."""

    __slots__ = ("fn", "origin")

    def __init__(self, fn: Callable[[Any], Any], origin: Origin) -> None:
        self.fn = fn
        self.origin = origin

    def __reduce__(self) -> tuple[Any, ...]:
        return (Entry, (self.fn, self.origin))

    def __call__(self, task: Any) -> Any:
        consumer, host = self.origin
        local = host == host_key()
        _running.consumer = consumer if local else 0
        try:
            value, ok = self.fn(task), True
        except BaseException as exc:  # SystemExit too: it must not end the worker
            value, ok = exc, False
        if local and consumer == os.getpid():
            return Outcome(ok, value)
        pack = _framed if framed else _inline
        try:
            return pack(ok, value)
        except BaseException as exc:
            # The failure path only: name the batch, the sample and the field that will not pickle.
            kept = _culprit.salvage(value if ok else None, task, exc, process_label())
            if kept is not None:  # a group, whose other batches still travel
                with contextlib.suppress(Exception):
                    return pack(True, kept)
            return pack(False, exc)


def _framed(ok: bool, value: Any) -> Framed:
    return Framed(frame((ok, value if ok else _portable(value))))


def _inline(ok: bool, value: Any) -> _Inline:
    return _Inline(ok, pickle.dumps(value if ok else _portable(value), pickle.HIGHEST_PROTOCOL))


def run_framed(fn: Callable[..., Any], args: tuple[Any, ...]) -> memoryview:
    """An owned worker runs each task of its channel through this: ``fn(*args)`` as a
    reply frame, ``(ok, value)``. Never raises."""
    try:
        value, ok = fn(*args), True
    except BaseException as exc:  # SystemExit too: it must not end the worker
        value, ok = exc, False
    if isinstance(value, Framed):
        return value.view
    try:
        return frame((ok, value if ok else _portable(value)))
    except BaseException as exc:  # the value does not pickle: its error travels instead
        return frame((False, _portable(exc)))


def arrived(data: Any) -> Outcome:
    """A reply frame's body, in the consumer: the :class:`Outcome`. Never raises."""
    try:
        ok, obj = pickle.loads(data)
        return _outcome(ok, obj)
    except BaseException as exc:
        return _unreadable(exc, "")


_note = add_note

# The consumer's pid for the task this thread runs (0 when it is on another host).
_running = threading.local()


def process_label() -> str:
    """The process running this thread's task, as error notes name it: a worker, or the
    consumer itself (``num_workers=0``, a borrowed thread executor)."""
    pid = os.getpid()
    if getattr(_running, "consumer", 0) == pid:
        return f"the main process (pid {pid})"
    return f"worker pid {pid}"


class Failed:
    """One part of a reply that failed while the rest succeeded (a batch of a group):
    its exception and traceback, ready to pickle; :meth:`exception` in the consumer
    rebuilds it as a task's own exception arrives (a :class:`RemoteTraceback` cause)."""

    __slots__ = ("exc", "tb")

    def __init__(self, exc: BaseException, tb: str) -> None:
        self.exc = exc
        self.tb = tb

    @classmethod
    def of(cls, exc: BaseException) -> Failed:
        return cls(*_portable(exc))

    def __reduce__(self) -> tuple[Any, ...]:
        return (Failed, (self.exc, self.tb))

    def exception(self) -> BaseException:
        exc = self.exc
        if exc.__cause__ is None:
            exc.__cause__ = RemoteTraceback(self.tb)
        return exc


def travelling(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a :class:`~aioloader.RemoteError` standing
    for it (with its notes and traceback text)."""
    return _portable(exc)[0]


def _portable(exc: BaseException) -> tuple[BaseException, str]:
    """``exc`` (or a RemoteError standing for it) and its traceback, ready to pickle."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        why = "(the original exception could not be pickled; its traceback is in .remote_traceback)"
        exc = _remote(exc, tb, why)
    exc.__traceback__ = None  # frames hold the batch's objects; the text is enough
    return exc, '\n"""\n' + tb + '"""'


def _remote(exc: BaseException, tb: str, why: str) -> RemoteError:
    """A RemoteError standing for ``exc``, with its notes."""
    name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    err = RemoteError(f"{name}: {exc} {why}", type_name=name, original_message=str(exc), remote_traceback=tb)
    for note in getattr(exc, "__notes__", ()):
        _note(err, note)
    return err


class _Inline:
    """A reply pickled in full; unpickles as its :class:`Outcome`."""

    __slots__ = ("data", "ok")

    def __init__(self, ok: bool, data: bytes) -> None:
        self.ok = ok
        self.data = data

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpack_inline, (self.ok, self.data))


def _outcome(ok: bool, obj: Any) -> Outcome:
    if ok:
        return Outcome(True, obj)
    exc, tb = obj
    exc.__cause__ = RemoteTraceback(tb)
    return Outcome(False, exc)


def _unpack_inline(ok: bool, data: bytes) -> Outcome:
    try:
        return _outcome(ok, pickle.loads(data))
    except BaseException as exc:
        return _unreadable(exc, "")


def _unreadable(exc: BaseException, where: str) -> Outcome:
    _note(exc, f"aioloader: raised while unpickling a task's result{where} in the consumer")
    return Outcome(False, exc)
