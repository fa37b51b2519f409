"""Pieces of the forkserver that :mod:`aioloader._forkserver` forks from the consumer
which read none of ``multiprocessing.forkserver``'s private state: what the server must
not keep of the consumer's fds, and the parts of its hooks on multiprocessing's loop.

**Pipes that feed a child.** The server lives as long as the consumer, and a fork copies
every open fd. It would keep open the consumer's write end of each pipe that feeds one of
the consumer's child processes (a ``subprocess.Popen`` with ``stdin=PIPE``), so such a
child, waiting for the end of its input (``communicate()`` with a filter such as
``sort``, a server told to stop by its stdin), would wait for ever, and so would the
consumer that waits for it. :func:`shared_with_children` finds those fds and the server
points them at ``/dev/null`` as it starts (:func:`neutralize`: a closed fd's number
would be taken by the next one opened, where an inherited object still writes). Only
such pipes: a child that holds the pipe's write end too (a ``fork`` child of the
consumer, which holds copies of everything) never sees its end anyway, and a pipe or
socket both sides use (a ``multiprocessing.Queue`` to a logging process) may be used by
workers through what they inherit.

Private names read: ``atexit._clear`` and ``atexit._run_exitfuncs``,
``multiprocessing.util._exit_function`` (what multiprocessing's loop does around a
worker since 3.13, which the spare worker does as well).

This module never imports asyncio.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import os
import selectors
import signal
import socket
import types
from collections.abc import Callable
from multiprocessing import forkserver, util
from typing import Any

__all__ = [
    "Override", "Selector", "arm_exit_hooks", "await_request", "neutralize", "on_sigterm", "shared_with_children",
]  # fmt: skip



def shared_with_children() -> list[int]:
    """This process's write ends of pipes (but stdin, stdout and stderr) whose read end a
    child process holds, and no child the write end. Best effort: a child whose fds
    cannot be read (it exited, another user's) is skipped."""
    read_by: set[str] = set()
    written_by: set[str] = set()
    for kid in _children():
        for fd, pipe in _pipes(f"/proc/{kid}").items():
            (written_by if _mode(f"/proc/{kid}", fd) == os.O_WRONLY else read_by).add(pipe)
    feeding = read_by - written_by
    if not feeding:
        return []
    mine = _pipes("/proc/self")
    return sorted(
        int(fd)
        for fd, pipe in mine.items()
        if pipe in feeding and int(fd) > 2 and _mode("/proc/self", fd) == os.O_WRONLY
    )


def neutralize(fds: list[int]) -> None:
    """Point each of ``fds`` at ``/dev/null`` (for writing): the pipe end is closed, its
    number stays taken."""
    if not fds:
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.dup2(null, fd)
    finally:
        os.close(null)


def _children() -> list[str]:
    kids: list[str] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/children") as f:
                kids.extend(f.read().split())
    return kids


def _pipes(proc: str) -> dict[str, str]:
    """fd -> ``pipe:[inode]`` for the pipes open in the process at ``proc``."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"{proc}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"{proc}/fd/{fd}")
                if link.startswith("pipe:"):
                    found[fd] = link
    return found


def _mode(proc: str, fd: str) -> int | None:
    """The access mode (``O_RDONLY``, ``O_WRONLY``, ``O_RDWR``) of an fd, from fdinfo."""
    with contextlib.suppress(OSError, ValueError), open(f"{proc}/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("flags:"):
                return int(line.split()[1], 8) & os.O_ACCMODE
    return None


def arm_exit_hooks() -> bool:  # pragma: no cover - in the spare
    """What multiprocessing's loop does in a child it forks, since 3.13, around the
    worker (its ``_bootstrap`` no longer runs the exit function): only the exit
    function runs at its end (finalizers, queue feeders), not the consumer's hooks.
    The caller runs ``atexit._run_exitfuncs()`` when the worker returns."""
    if not hasattr(forkserver, "atexit"):
        return False
    atexit._clear()
    atexit.register(util._exit_function)  # type: ignore[attr-defined]
    return True


def await_request(sock: socket.socket) -> list[int] | None:  # pragma: no cover - in the spare
    """The fds of the request the spare serves, or ``None`` once the server is gone."""
    size = socket.CMSG_SPACE(forkserver.MAXFDS_TO_SEND * array.array("i").itemsize)
    msg, ancdata, _flags, _addr = sock.recvmsg(1, size)
    if not msg:
        return None
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)


class Selector(selectors.DefaultSelector):  # pragma: no cover - in the forked server
    """The loop's selector: while the tracker is still to fork (``hooks.grace()`` is
    not ``None``), a wait that outlasts its grace, or a grace already spent, forks it
    (``hooks.start_tracker()``), then it waits as asked."""

    def __init__(self, hooks: Any) -> None:
        super().__init__()
        self._hooks = hooks

    def select(self, timeout: float | None = None) -> Any:
        grace = self._hooks.grace()
        if grace is not None:
            events = super().select(grace) if grace > 0 else None
            if events:
                return events
            self._hooks.start_tracker()
        return super().select(timeout)


class Override(types.SimpleNamespace):  # pragma: no cover - in the forked server
    """A module with some of its names replaced."""

    def __init__(self, module: types.ModuleType, **names: Any) -> None:
        super().__init__(**names)
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def on_sigterm(cleanup: Callable[[], None]) -> None:  # pragma: no cover - in the forked server
    """SIGTERM still ends this process as the default action does, after ``cleanup()``. A
    supervisor that stops a whole process group or cgroup (systemd, Slurm) sends it to
    the server too. Only in this process: a child forked from it before it set its own
    disposition (workers set the default at once) just ends."""
    me = os.getpid()

    def handler(signum: int, frame: Any) -> None:
        if os.getpid() == me:
            with contextlib.suppress(Exception):
                cleanup()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)
