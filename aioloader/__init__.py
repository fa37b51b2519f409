"""aioloader: an asyncio-based data loader with a persistent process pool.

Public names are re-exported here; the implementation lives in private modules.
"""

from __future__ import annotations

from . import _iterloader  # noqa: F401  (DataLoader(iterable_dataset) needs it)
from ._collate import default_collate as default_collate
from ._collate import default_convert as default_convert
from ._plan.sampler import DistributedSampler as DistributedSampler
from ._pool import WorkerPool as WorkerPool
from ._pool import zygote as _zygote
from ._seeding import sample_rng as sample_rng
from ._stats import EpochStats as EpochStats
from ._stats import LoaderStats as LoaderStats
from .errors import AioLoaderError as AioLoaderError
from .errors import CollateError as CollateError
from .errors import DatasetPickleError as DatasetPickleError
from .errors import DeadlineExceeded as DeadlineExceeded
from .errors import ImageDecodeError as ImageDecodeError
from .errors import LoaderClosedError as LoaderClosedError
from .errors import LoaderTimeout as LoaderTimeout
from .errors import Overloaded as Overloaded
from .errors import OversubscribedWarning as OversubscribedWarning
from .errors import PoolBrokenError as PoolBrokenError
from .errors import RecordIOError as RecordIOError
from .errors import RemoteError as RemoteError
from .errors import SharedMemoryError as SharedMemoryError
from .errors import ShmFallbackWarning as ShmFallbackWarning
from .errors import StateDictError as StateDictError
from .errors import TooManySkippedError as TooManySkippedError
from .errors import WorkerCrashedError as WorkerCrashedError
from .loader import DataLoader as DataLoader
from .serving import Batcher as Batcher
from .serving import BatcherStats as BatcherStats
from .stream import StreamLoader as StreamLoader

__version__ = "0.1.0"

__all__ = [
    "AioLoaderError",
    "Batcher",
    "BatcherStats",
    "CollateError",
    "DataLoader",
    "DatasetPickleError",
    "DeadlineExceeded",
    "DistributedSampler",
    "EpochStats",
    "ImageDecodeError",
    "LoaderClosedError",
    "LoaderStats",
    "LoaderTimeout",
    "Overloaded",
    "OversubscribedWarning",
    "PoolBrokenError",
    "RecordIOError",
    "RemoteError",
    "SharedMemoryError",
    "ShmFallbackWarning",
    "StateDictError",
    "StreamLoader",
    "TooManySkippedError",
    "WorkerCrashedError",
    "WorkerPool",
    "default_collate",
    "default_convert",
    "sample_rng",
]


def _fixup_module_metadata() -> None:
    # Tracebacks, reprs and pickles say aioloader.X, not aioloader._private.X.
    # Exceptions keep their real module (aioloader.errors), which is public already.
    g = globals()
    for name in __all__:
        obj = g[name]
        mod = getattr(obj, "__module__", "")
        if mod.startswith("aioloader._"):
            try:
                obj.__module__ = "aioloader"
            except (AttributeError, TypeError):
                pass


_fixup_module_metadata()
del _fixup_module_metadata

_zygote.at_import()  # the fork server, while this process most likely has one thread
del _zygote
