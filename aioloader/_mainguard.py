"""A script that starts workers while a worker imports it: one clear error, nothing leaked.

A worker started by ``spawn``, or forked from a spawned forkserver (aioloader spawns
it when the consumer already runs threads), imports the main script again, as
``__mp_main__``, before it runs anything. A script without
``if __name__ == "__main__":`` then reaches its loader in every worker, whose pool
would start workers of its own. multiprocessing refuses that with a ``RuntimeError``,
but only after the worker's pool made its semaphores: each pool retried, errors nested
in every worker, the body ran again and again, and semaphores leaked.

So a pool about to start processes first looks for the main module's import on the
stack. Found, this process is such a worker: it ends at once with :data:`EXIT_CODE`,
before it makes anything, and prints nothing. The consumer sees that exit code among
the workers that die as they start and raises :func:`error`, which names the
script, instead of retrying. A module-level loader that is only iterated under the
guard is fine: nothing starts while the worker imports it.

Only the stack and ``os._exit`` are used: no private name of multiprocessing. This
module never imports asyncio.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Mapping

from .errors import PoolBrokenError

__all__ = ["EXIT_CODE", "error", "refuse_while_main_imports", "verdict"]

#: How such a worker ends; an exit code no other path of aioloader uses.
EXIT_CODE = 121

_MP_MAIN = "__mp_main__"  # the name multiprocessing runs the main module under in a child


def importing_main() -> bool:
    """Is this thread inside the body of the main module that a child re-imports?"""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == _MP_MAIN:
                return True
            frame = frame.f_back
        return False
    finally:
        del frame  # a frame kept in a local would keep the whole stack alive


def refuse_while_main_imports() -> None:
    """End this process if it is a worker importing the main module (see module doc).

    ``os._exit``, not an exception: an exception would print a traceback in every
    worker and let the rest of the script run on a failed import. The worker has not
    finished starting; nothing of aioloader's exists in it yet.
    """
    if importing_main():
        os._exit(EXIT_CODE)


def verdict(dead: Mapping[int, int | None]) -> PoolBrokenError | None:
    """:func:`error` if a dead worker (pid -> exit code) ended as such a worker, else None."""
    code = next((c for c in dead.values() if c == EXIT_CODE), None)
    return None if code is None else error(code)


def error(exitcode: int) -> PoolBrokenError:
    """The consumer's error once a worker ended with :data:`EXIT_CODE`."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    path = getattr(main, "__file__", None)
    script = f"python -m {spec.name}" if spec is not None and spec.name else path or "the main script"
    err = PoolBrokenError(
        f"{script} iterates a loader with worker processes when it is imported, and each worker "
        "imports it again as it starts (under the spawn start method, or forkserver once the "
        'script runs a thread). Put that code under `if __name__ == "__main__":` (or in a '
        "function called from there), so that only the main process runs it",
        exitcode=exitcode,
    )
    err.__suppress_context__ = True  # raised while the engine handles a lost task: not the user's concern
    return err
