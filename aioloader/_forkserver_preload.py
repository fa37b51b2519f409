"""Imported by the forkserver process alone (the pool adds it to the forkserver's
preload list), never by a consumer or a worker.

Workers must ignore Ctrl-C from birth, not only once the pool's initializer runs: a
worker still starting when a terminal's SIGINT reaches the process group would print
a KeyboardInterrupt traceback of its own. The forkserver gives its children the SIGINT
disposition it found after its preloads, so setting "ignore" here is inherited by
every worker it forks (the forkserver itself ignores SIGINT anyway). Importing the
worker module here also means each worker starts with numpy and aioloader loaded.
"""

from __future__ import annotations

import signal

from . import _reply, _shard_worker, _stream_worker, _worker  # noqa: F401  (preloaded for the workers)

signal.signal(signal.SIGINT, signal.SIG_IGN)
