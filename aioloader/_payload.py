"""The payload: a loader's worker context (dataset, ``collate_fn``, ``worker_init_fn``, a
stream's ``fn``) made ready to reach the workers, in the consumer, once per loader.

Three ways, chosen by what the context holds: plain pickle (importable objects go by
reference) with its large numpy arrays out of band in a shared-memory data segment
(:mod:`aioloader._shm._dataseg`); by value through cloudpickle (lambdas, what an
interactive ``__main__`` defined: :mod:`aioloader._worker.byvalue`); or, for ``multiprocessing``
primitives, as the object itself, which the pool passes to its workers as they start.
An object that can take none of them is named in a :class:`DatasetPickleError`.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Sequence
from typing import Any

from ._pool import zygote as _zygote
from ._shm import _dataseg
from ._shm._dataseg import DataSegment
from ._worker import byvalue as _byvalue
from ._worker import culprit as _culprit
from .errors import DatasetPickleError

__all__ = ["pickle_for_workers"]


def pickle_for_workers(
    whole: object,
    parts: Sequence[tuple[str, object]],
    owner: str,
    *,
    share: bool = False,
    inherit: str | None = None,
) -> tuple[bytes | _byvalue.Inherited, DataSegment | None]:
    """Pickle ``whole`` once for the workers; if that fails, find the culprit among
    ``parts`` and raise :class:`DatasetPickleError` naming it and the fix.

    Importable objects go by reference (plain pickle). What a worker could not import
    goes by value, through cloudpickle: lambdas, local functions and classes, and
    anything defined in an interactive ``__main__`` (a notebook cell, ``python -``,
    ``python -c``), which worker processes do not have.

    With ``share``, large numpy arrays go out of band into one data segment that every
    worker maps (:mod:`aioloader._shm._dataseg`); the segment comes back with the bytes,
    and the caller unlinks it when the workers no longer need it.

    ``multiprocessing`` primitives (``Value``, ``Lock``, ``Queue``) pickle only while a
    process starts. With ``inherit``, the start method of an owned process pool, a context
    holding them comes back as :class:`~aioloader._worker.byvalue.Inherited`, for the pool to
    pass to its workers when they start; without, that is a :class:`DatasetPickleError`
    saying so.
    """
    buffers: list[pickle.PickleBuffer] = []
    callback = _dataseg.collector(buffers) if share else None
    data: bytes | None
    try:
        data = pickle.dumps(whole, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=callback)
    except Exception as exc:
        if _byvalue.inheritance_only(exc):
            return _inherited(whole, parts, owner, exc, inherit), None
        data = None
    # A reference to ``__main__`` names the module in the pickle; a false positive
    # (that string inside the data) only costs a by-value pickle. Workers have no
    # complete ``__main__`` of their own under an interactive consumer, or when they come
    # from a fork server made while the consumer imported aioloader.
    main_missing = _byvalue.main_is_interactive() or _zygote.main_by_value()
    if data is None or (b"__main__" in data and main_missing):
        buffers.clear()
        data = _by_value(whole, parts, owner, callback)
    if buffers:
        shared = _dataseg.share(data, buffers, owner)
        if shared is not None:
            return shared
        return pickle_for_workers(whole, parts, owner)
    return data, None


def _inherited(
    whole: object, parts: Sequence[tuple[str, object]], owner: str, exc: BaseException, inherit: str | None
) -> _byvalue.Inherited:
    if inherit is None:
        raise DatasetPickleError(
            f"the {owner}'s worker context holds a multiprocessing primitive ({exc}). Such objects "
            "reach a process only when it starts: the loader's own process pool passes them to its "
            "workers then, a borrowed executor cannot. Use num_workers= instead of executor=, or "
            "num_workers=0."
        ) from exc
    if inherit == "fork":  # a forked worker inherits the objects themselves: no pickling
        return _byvalue.Inherited(whole)
    try:
        _byvalue.pickles_at_process_start(whole)
    except Exception as failed:
        culprit = next(
            (f"{name} ({type(obj).__name__})" for name, obj in parts if _fails_at_start(obj)), "context"
        )
        raise DatasetPickleError(
            f"the {owner}'s {culprit} cannot reach the worker processes even when they start: "
            f"{type(failed).__name__}: {str(failed).rstrip('.')}. A primitive made by another start method than the "
            "pool's cannot: create it with multiprocessing.get_context(<the loader's mp_context>) "
            "(forkserver by default), or pass that start method as mp_context."
        ) from failed
    return _byvalue.Inherited(whole)


def _fails_at_start(obj: object) -> bool:
    try:
        _byvalue.pickles_at_process_start(obj)
    except Exception:
        return True
    return False


def _by_value(
    whole: object, parts: Sequence[tuple[str, object]], owner: str, callback: Callable[[Any], bool] | None
) -> bytes:
    try:
        return _byvalue.dumps_by_value(whole, callback)
    except Exception as exc:
        for name, obj in parts:
            try:
                _byvalue.dumps_by_value(obj)
            except Exception as inner:
                raise DatasetPickleError(
                    f"the {owner}'s {name} ({type(obj).__name__}: {obj!r:.80}) cannot be pickled, so it "
                    f"cannot reach the worker processes: {_holder(name, obj)}{type(inner).__name__}: {inner}. "
                    "Drop unpicklable members (open files, locks, sockets) or reopen them lazily in "
                    "the worker, or use num_workers=0."
                ) from inner
        raise DatasetPickleError(f"the {owner}'s worker context cannot be pickled: {exc}") from exc


def _holder(name: str, obj: object) -> str:
    """``dataset.files['labels'] holds a _io.TextIOWrapper: `` (the member that will not
    pickle, found on this failure path only), or nothing when ``obj`` itself is it."""
    found = _culprit.find(obj, _byvalue.dumps_by_value)
    if not found or not found[0]:
        return ""
    steps, culprit = found
    kind = f"{type(culprit).__module__}.{type(culprit).__qualname__}".removeprefix("builtins.")
    opened = " (an open file)" if isinstance(culprit, io.IOBase) else ""
    return f"{name}{''.join(s.text for s in steps)} holds a {kind}{opened}: "
