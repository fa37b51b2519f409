"""The orphan watch of an owned worker: when the consumer process dies (SIGKILL, the OOM
killer), run the cleanup hooks registered here and end the worker.

A worker's parent is the pool's zygote, not the consumer, and a worker busy in a sample
does not read its channel, whose end would tell it that the consumer is gone: without this watch such workers would
live on forever, holding their shared-memory slabs. Worker side: never imports asyncio.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

__all__ = ["exit_when_orphaned", "on_orphaned", "wait_for_exit"]

_orphan_hooks: list[Callable[[], None]] = []
_orphan_lock = threading.Lock()
_orphaned = False


def on_orphaned(hook: Callable[[], None]) -> None:
    """Run ``hook`` in this worker if its consumer process dies (before the worker exits);
    at once, in the caller, if it has died already."""
    with _orphan_lock:
        if not _orphaned:
            _orphan_hooks.append(hook)
            return
    hook()


def wait_for_exit(pid: int) -> None:
    """Block until process ``pid`` has exited (a pidfd where the kernel has them, else
    polling twice a second)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd: poll
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            except PermissionError:
                pass
            time.sleep(0.5)
    import select

    try:
        select.select([fd], [], [])  # readable once the process has exited
    finally:
        os.close(fd)


def exit_when_orphaned(consumer_pid: int) -> None:
    """Daemon thread of an owned worker: run the hooks and exit once the consumer is gone."""
    wait_for_exit(consumer_pid)
    _run_hooks()
    os._exit(0)


def _run_hooks() -> None:
    global _orphaned
    with _orphan_lock:  # a hook registered from now on runs in its caller
        if _orphaned:
            return
        _orphaned = True
        hooks = list(_orphan_hooks)
        _orphan_hooks.clear()
    for hook in hooks:
        try:
            hook()
        except Exception:  # best effort: the process is going away
            pass
