"""The formats layer: bytes on disk become samples here, inside the worker processes.

Record files (``rio_*``, ``image_record``), the image datasets, the transforms and the
synthetic demo data live in this package. Everything in it runs in workers, so nothing
in it imports asyncio, and it imports nothing from aioloader but :mod:`aioloader.errors`
and :mod:`aioloader._seeding` (``tests/test_layout.py`` checks both). The public modules
:mod:`aioloader.recordio`, :mod:`aioloader.datasets` and :mod:`aioloader.transforms`
re-export from here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["publish"]


def publish(namespace: Mapping[str, Any], names: Iterable[str]) -> None:
    """Make the objects ``names`` of a public module's ``namespace`` say they live there.

    Tracebacks, reprs and pickles then name the stable public path
    (``aioloader.recordio.IndexedRecordReader``), not the private module that defines it,
    so moving code inside this package never breaks a pickle.
    """
    public = namespace["__name__"]
    for name in names:
        obj = namespace[name]
        if getattr(obj, "__module__", "").startswith("aioloader._formats"):
            try:
                obj.__module__ = public
            except (AttributeError, TypeError):  # constants and aliases have no __module__ to set
                pass
