"""The pool: the one boundary between the engine and the workers.

:mod:`.pool` is the :class:`WorkerPool` (a ``concurrent.futures.Executor``);
:mod:`.procs` its owned processes (one channel each, one I/O thread); :mod:`.zygote`
the fork server they come from; :mod:`.local` the loader's own thread and the adapter
to a borrowed executor; :mod:`.jobs` what every backend settles.
"""

from .._worker.slots import describe_exit
from .jobs import Job, Lost
from .pool import WorkerPool, concurrency_of

__all__ = ["Job", "Lost", "WorkerPool", "concurrency_of", "describe_exit"]
