"""Which part of an object will not pickle: the path to it, for an error message.

Pickle's own error names only the type it refused (``cannot pickle '_thread.lock'
object``). :func:`find` walks from the object that failed into its parts (dict values,
list and tuple items, named tuple, dataclass and instance attributes), always into the
first part that fails too, and stops at a part none of whose own parts fails. That part
is the culprit; the steps taken are its path, as code would spell it: ``['meta'].lock``.

Only failure paths call this: every step pickles a part again, which costs time on a
large batch but nothing while batches pickle. This module never imports asyncio.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ..errors import add_note

__all__ = ["Step", "batch_note", "find", "result_dumps", "salvage"]

_MAX_DEPTH = 64  # a path this deep is a cycle or a linked structure: named as far as it went


class Step:
    """One step of a path: the container it goes through and how code spells it."""

    __slots__ = ("container", "text")

    def __init__(self, container: Any, text: str) -> None:
        self.container = container
        self.text = text


def result_dumps(obj: Any) -> None:
    """Pickle ``obj`` as a worker pickles a result, without copying its large buffers."""
    ForkingPickler(io.BytesIO(), 5, True, _skip_buffer).dump(obj)


def _skip_buffer(_buffer: Any) -> bool:
    return False  # out of band, and dropped: only whether it pickles matters here


def _fails(obj: Any, dumps: Callable[[Any], Any]) -> bool:
    try:
        dumps(obj)
    except Exception:
        return True
    return False


def _parts(obj: Any) -> Iterator[tuple[str, Any]]:
    """``(how code spells the step, part)`` for each part of ``obj`` that is walked."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield f"[{key!r}]", value
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        for name, value in zip(obj._fields, obj, strict=False):
            yield f".{name}", value
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield f"[{i}]", value
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            if hasattr(obj, f.name):
                yield f".{f.name}", getattr(obj, f.name)
    elif not isinstance(obj, (type, str, bytes, bytearray, memoryview)):
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            yield from ((f".{k}", v) for k, v in list(attrs.items()))
        for cls in type(obj).__mro__:
            slots = cls.__dict__.get("__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                    yield f".{name}", getattr(obj, name)


def find(obj: Any, dumps: Callable[[Any], Any]) -> tuple[list[Step], Any] | None:
    """The steps from ``obj`` to the part that ``dumps`` refuses, and that part;
    ``None`` when ``obj`` pickles after all."""
    if not _fails(obj, dumps):
        return None
    steps: list[Step] = []
    node, seen = obj, {id(obj)}
    while len(steps) < _MAX_DEPTH:
        for text, part in _parts(node):
            if id(part) not in seen and _fails(part, dumps):
                steps.append(Step(node, text))
                node = part
                seen.add(id(part))
                break
        else:
            break
    return steps, node


def batch_note(
    what: str, batch: Any, ids: Sequence[int], id_name: str, where: str, unit: str = "sample", makers: str = ""
) -> str | None:
    """The note for a batch that does not pickle: ``what`` (``batch 3 of epoch 0``), the
    path to the culprit in ``batch`` and the sample it came from. ``ids`` are the
    samples' indices (``id_name``) in batch order; a step into a list or tuple as long
    as ``ids`` is taken to pick the sample, as the default collate_fn and ``list``
    arrange them. ``None`` if the batch pickles on its own."""
    found = find(batch, result_dumps)
    if found is None:
        return None
    steps, culprit = found
    path = "batch" + "".join(s.text for s in steps)
    sample = ""
    for k, step in enumerate(steps):
        box = step.container
        if isinstance(box, (list, tuple)) and not hasattr(box, "_fields") and len(box) == len(ids) > 1:
            position = int(step.text[1:-1])
            rest = "".join(s.text for s in steps[:k] + steps[k + 1 :])
            field = f", field {unit}{rest}" if rest else ""
            sample = f"; it comes from {unit} {position} of the batch ({_named(id_name, ids[position])}){field}"
            break
    else:
        if len(ids) == 1:
            sample = f"; it comes from the batch's one {unit} ({_named(id_name, ids[0])})"
    kind = f"{type(culprit).__module__}.{type(culprit).__qualname__}".removeprefix("builtins.")
    return (
        f"aioloader: {what} cannot be pickled to travel to the main process: {path} holds a "
        f"{kind}{sample}; in {where}. Make {makers or 'the dataset and collate_fn'} return picklable "
        "objects (drop that one or replace it), or use num_workers=0"
    )


def _named(id_name: str, i: int) -> str:
    """``sample index 5``, or ``id_name`` with ``{}`` filled in (``sample 5 of worker 0's iteration``)."""
    return id_name.format(i) if "{}" in id_name else f"{id_name} {i}"


def salvage(value: Any, task: Any, exc: BaseException, where: str) -> Any:
    """A task's result did not pickle: note on ``exc`` what will not (``value`` names it
    with its ``unpicklable(task, exc, where)``, when it has one); return what may still
    travel instead (a group's other batches), or ``None`` to send ``exc`` alone."""
    explain = getattr(value, "unpicklable", None)
    if explain is not None:
        try:
            return explain(task, exc, where)
        except Exception:  # naming the culprit must not hide the error itself
            pass
    add_note(exc, f"aioloader: raised while pickling a task's result in {where}")
    return None
