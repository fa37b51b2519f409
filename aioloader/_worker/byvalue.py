"""Payloads sent by value: what a worker process could not import by name.

Plain pickle sends classes and functions by reference (module and name), and a worker
imports them. That fails for lambdas, local functions and classes, and for anything
defined in an interactive ``__main__`` (a notebook cell, ``python -``, ``python -c``):
a worker's ``__main__`` is a bare module that never ran those cells. For such payloads
the consumer uses cloudpickle, which carries the code itself; the worker needs only
plain ``pickle.loads`` (cloudpickle must be importable there, which a dependency
guarantees).

A by-value payload is a :class:`ByValue` envelope: the context, and the top-level
``__main__`` classes and functions it uses. The worker binds those names in its own
``__main__``, so a sample or batch holding an instance of a notebook-defined class
pickles back by reference and arrives as the consumer's own class.

Unpickling a payload in a worker either gives the context or raises
:class:`~aioloader.DatasetPickleError` carrying the worker's own exception.

This module never imports asyncio.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import sys
import traceback
import types
from collections.abc import Callable
from typing import Any, NamedTuple

from .._shm._dataseg import SharedPayload
from ..errors import DatasetPickleError

__all__ = [
    "ByValue",
    "Inherited",
    "drop_fake_main_file",
    "dumps_by_value",
    "inheritance_only",
    "loads_payload",
    "main_is_interactive",
    "pickles_at_process_start",
    "run_by_value",
]


class ByValue(NamedTuple):
    context: Any
    main_objects: dict[str, Any]  # qualified name in __main__ -> class or function


class Inherited(NamedTuple):
    """A payload that holds ``multiprocessing`` primitives (``Value``, ``Lock``,
    ``Queue``, ...). Those pickle only while a process is being started, so it reaches
    the workers as an argument of the process multiprocessing starts, pickled then,
    never as bytes made in advance. It arrives in the worker already unpickled."""

    context: Any


def inheritance_only(exc: BaseException) -> bool:
    """Did pickling fail only because an object may reach a process when it starts?"""
    return isinstance(exc, RuntimeError) and "through inheritance" in str(exc)


class _SpawningProbe:
    """Stands in for a process being started while a payload is test-pickled, so that
    primitives that pickle only then pickle (their file descriptors are not sent)."""

    def duplicate_for_child(self, fd: int) -> int:
        return fd

    def DupFd(self, fd: int) -> int:  # multiprocessing's own name
        return fd


def pickles_at_process_start(obj: object) -> None:
    """Pickle ``obj`` as multiprocessing will when a worker starts; raises what that
    would raise (a primitive of another start method, an unpicklable member)."""
    from multiprocessing import context, reduction, synchronize

    class Probe(reduction.ForkingPickler):
        def persistent_id(self, o: Any) -> None:
            # A lock made for fork has no name: 3.11 and later refuse it with this
            # message as it pickles; 3.10 pickles it, and the worker crashes using it.
            if isinstance(o, synchronize.SemLock):
                state = o.__getstate__()  # the pickle protocol's own call (we are "spawning")
                if isinstance(state, tuple) and state and state[-1] is None:
                    raise RuntimeError(
                        "A SemLock created in a fork context is being shared with a process in a spawn context"
                    )

    previous = context.get_spawning_popen()
    context.set_spawning_popen(_SpawningProbe())  # type: ignore[arg-type]
    try:
        Probe.dumps(obj)
    finally:
        context.set_spawning_popen(previous)


# Names this worker bound in its __main__ (a later loader may rebind them, as a notebook
# re-running a cell does; names the worker's __main__ had of its own are left alone).
_bound: set[str] = set()


def main_is_interactive() -> bool:
    """Is ``__main__`` a module that worker processes cannot re-create? (They re-run a
    main script from its file; a notebook, ``python -c`` or ``python -`` has none.)"""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return not (isinstance(path, str) and os.path.isfile(path))


def drop_fake_main_file() -> None:
    """``python -`` names its main module's file ``<stdin>``; multiprocessing would make
    every spawn or forkserver worker re-run that "file" and die before its initializer.
    Without the name, workers start with a bare ``__main__``, which by-value payloads
    handle."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if (
        isinstance(path, str)
        and path.startswith("<")
        and path.endswith(">")
        and getattr(main, "__spec__", None) is None
        and not os.path.exists(path)
    ):
        del main.__file__  # type: ignore[union-attr]


def dumps_by_value(
    obj: object, buffer_callback: Callable[[pickle.PickleBuffer], bool] | None = None
) -> bytes:
    """cloudpickle ``obj`` into a :class:`ByValue` envelope (consumer side);
    ``buffer_callback`` as for :func:`pickle.dumps` (protocol 5 out-of-band buffers)."""
    # Imported by name: cloudpickle has no type information, and users' own strict mypy
    # runs must not trip over this module.
    cloudpickle: Any = importlib.import_module("cloudpickle")

    main = sys.modules.get("__main__")
    found: dict[str, Any] = {}

    class _Recording(cloudpickle.Pickler):  # type: ignore[misc]
        def reducer_override(self, o: Any) -> Any:
            if isinstance(o, io.TextIOWrapper) and o is not sys.stdout and o is not sys.stderr:
                # cloudpickle would send a copy of a text file's contents as a StringIO, which
                # the dataset then reads and writes apart from the file: refused like binary files.
                raise TypeError(f"cannot pickle '{type(o).__module__}.{type(o).__qualname__}' object")
            if isinstance(o, (type, types.FunctionType)) and getattr(o, "__module__", None) == "__main__":
                name = getattr(o, "__qualname__", "")
                if "." not in name and getattr(main, name, None) is o:
                    found[name] = o
            return super().reducer_override(o)

    buf = io.BytesIO()
    # The envelope's dict is pickled after the context, so it holds what the context used.
    _Recording(buf, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=buffer_callback).dump(
        ByValue(obj, found)
    )
    return buf.getvalue()


def loads_payload(payload: bytes | Inherited) -> Any:
    """Unpickle a payload in a worker; a failure becomes a :class:`DatasetPickleError`
    whose message, ``remote_traceback`` and ``__cause__`` carry the worker's exception."""
    if isinstance(payload, Inherited):
        return payload.context
    try:
        obj = pickle.loads(payload)
        if isinstance(obj, SharedPayload):  # its large arrays wait in a data segment
            obj = obj.load()
    except Exception as exc:
        raise unpickle_error(exc) from exc
    if isinstance(obj, ByValue):
        main = sys.modules.get("__main__")
        if main is not None:
            for name, value in obj.main_objects.items():
                if name in _bound or not hasattr(main, name):
                    setattr(main, name, value)
                    _bound.add(name)
        obj = obj.context
    return obj


def run_by_value(blob: bytes) -> Any:
    """Run a call sent by value, ``(function, args)`` (the pool's Executor face, when the
    workers' ``__main__`` is not the consumer's)."""
    call, args = loads_payload(blob)
    return call(*args)


def unpickle_error(exc: BaseException) -> DatasetPickleError:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return DatasetPickleError(
        f"a worker process (pid {os.getpid()}) could not unpickle the loader's dataset, collate_fn "
        f"or fn: {type(exc).__name__}: {exc}. Objects defined in an importable module must be "
        "importable in the workers too (same sys.path, same installed packages); the worker's "
        "traceback is in .remote_traceback",
        remote_traceback=tb,
    )
