"""The forkserver that owned process pools fork their workers from, and the private
names of ``multiprocessing.forkserver`` that aioloader reads (no other module does).

Why a forkserver started by ``fork``
------------------------------------
multiprocessing starts its forkserver as a new interpreter that imports ``__main__``
(and so the dataset's modules) before it forks the first worker. A dataset module that
imports torch makes that about 2 s on a laptop-class core, paid before the first batch,
where torch's ``fork`` workers inherit the consumer's imports for nothing.

So the first time an owned pool is created (:func:`prepare`), in a process with a
single thread, on Linux, and on a Python whose forkserver protocol this module knows,
the consumer forks a copy of itself and runs multiprocessing's own forkserver loop
(``multiprocessing.forkserver.main``) in it. Every module the consumer has imported is
already there; workers are forked from it exactly as from a spawned forkserver (one
request on its socket each, the same fds passed, the same exit codes reported), so
nothing else in the pool changes. The copy is made while nothing else runs in the
process: no lock of another thread can be inherited held, which is what makes ``fork``
unsafe in threaded programs. With more than one thread, the spawned forkserver is used,
as before.

The copy resets what a fresh interpreter would not have: Python-level signal handlers
go back to the default (SIGINT is ignored, as the preload does for spawned servers),
stdout and stderr are flushed before the fork (no buffered text printed twice), and
the garbage collector's current objects are frozen (workers do not touch their pages).
Its socket lives in a folder of its own (``aioloader-fsrv-*`` in the temporary
directory), which the server removes as it ends: also after a consumer that was killed,
which a socket in multiprocessing's ``pymp-*`` folder would outlast, and when SIGTERM
ends it (a supervisor stopping the whole process group).
It holds the consumer's memory as it was at that moment, shared copy-on-write, until
the consumer exits: memory the consumer frees later stays resident in it. Set
``AIOLOADER_FORKSERVER=spawn`` to always use the spawned forkserver.

The resource tracker comes the same way. multiprocessing starts it, before the first
worker, as a new interpreter (``python -c ...``): about 30 ms of a core, on a 2-core
machine half of the cores for most of the time to the first batch. When the forked
server is installed and no tracker runs yet, the server forks one first (its child,
named ``aioloader-trk``) that runs multiprocessing's own tracker loop
(``resource_tracker.main``) on a pipe the consumer made; the consumer records the write
end as its tracker, as ``ensure_running`` would, and passes it to every worker as
usual. The tracker ends, cleaning up what was leaked, once the consumer and every
worker have closed that end. The server forks it once no request has come for 0.1 s (1 s after
it starts at the latest, or as it ends): before its loop, that fork (5-8 ms of the server's time with torch imported)
delayed the first worker by as much. Until then
what the consumer registers waits in the pipe.

The first worker comes without a fork on its way too. As it starts, the server forks a
spare worker (``aioloader-spare``) that waits for a request, and answers the first
request with it: the spare receives that request's fds and runs as a worker forked for
it would. Later requests, and the first if the spare has died, get a fork. An unused
spare ends with the server (end of file on its socket). See :class:`_Hooks` for how
multiprocessing's loop is made to do both. Together they took the benchmark suite's
cold start (median of 7-9 repetitions) from about torch's to 0.79-0.82x of it.

Private names read, because the public API has no way to install a forkserver:

=================================================  ===============================================
``multiprocessing.forkserver._forkserver``:        installing the forked server; preloading the
``._forkserver_pid``, ``._forkserver_address``,    spawned one; resetting what a forked child
``._forkserver_alive_fd``, ``._preload_modules``,  inherits from its parent's
``._lock``
``multiprocessing.forkserver._serve_one``          naming the workers (in the forked server only)
``multiprocessing.forkserver``'s globals ``os``,   the spare worker and the late tracker:
``reduction``, ``selectors``; ``.MAXFDS_TO_SEND``  the loop's fork, fd receipt and wait,
                                                   hooked (in the forked server only)
``multiprocessing.resource_tracker``:              adopting the forked tracker (what
``._resource_tracker._fd``, ``._pid``,             ``ensure_running`` records), running
``._lock``, ``.main``                              its loop
=================================================  ===============================================

This module never imports asyncio.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import gc
import os
import selectors
import signal
import socket
import sys
import tempfile
import threading
import time
import types
import warnings
from multiprocessing import forkserver, reduction
from multiprocessing import resource_tracker as mp_tracker
from multiprocessing.context import BaseContext
from typing import Any

from . import _byvalue
from . import _forkserver_parts as parts

__all__ = ["after_fork_in_child", "prepare", "server_pid"]

ENV = "AIOLOADER_FORKSERVER"  # "spawn": never fork the forkserver
PROCESS_NAME = b"aioloader-fsrv"  # its /proc/<pid>/comm (its command line is the consumer's)
WORKER_NAME = b"aioloader-work"  # the name of each worker it forks
TRACKER_NAME = b"aioloader-trk"  # the resource tracker it forks
SPARE_NAME = b"aioloader-spare"  # the worker it forks before the first request (then aioloader-work)

_lock = threading.Lock()
_TRACKER_GRACE = 0.1  # seconds without a request after which the forked server forks the tracker
_TRACKER_LATEST = 1.0  # seconds after its start by which it forks the tracker, requests or not
_MAX_FD = 1 << 20  # closerange's end: past any fd a process here may hold
_NATIVE_AT_IMPORT: int | None = None  # set below, once the module's imports are done


def server_pid() -> int | None:
    """The pid of this process's forkserver, if one runs."""
    pid: int | None = getattr(forkserver._forkserver, "_forkserver_pid", None)
    return pid


def prepare(ctx: BaseContext) -> None:
    """Called where an owned pool is created, before it starts: if the forkserver that
    ``ctx`` uses is not running yet, fork it from this process when that is safe, else
    have the one multiprocessing will spawn preload aioloader's worker modules."""
    if ctx.get_start_method() != "forkserver":
        return
    with _lock:
        if server_pid() is not None:
            return
        server: Any = forkserver._forkserver
        if _can_fork(server):
            with contextlib.suppress(OSError):
                _fork_server(server)
                return
        current = list(getattr(server, "_preload_modules", ["__main__"]))
        if "aioloader._forkserver_preload" not in current:
            ctx.set_forkserver_preload([*current, "aioloader._forkserver_preload"])


def _can_fork(server: Any) -> bool:
    if os.environ.get(ENV, "").lower() == "spawn" or not sys.platform.startswith("linux"):
        return False
    # The protocol this module speaks: 3.14 added an authentication key, and any
    # other change means the spawned server.
    if not hasattr(forkserver, "main") or hasattr(server, "_forkserver_authkey"):
        return False
    if threading.active_count() != 1:
        return False
    # Native threads: those that were there when aioloader was imported (numpy's
    # OpenBLAS pool, which prepares itself for fork) are allowed, not one more (an OpenMP
    # team, CUDA's, a library's own), since such a pool may not survive a fork.
    native = _native_threads()
    return native is not None and native <= max(1, _NATIVE_AT_IMPORT or 1)


def _native_threads() -> int | None:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def _fork_server(server: Any) -> None:
    """What ``ForkServer.ensure_running`` does, with ``os.fork`` in place of a new
    interpreter. Holds the server's own lock, as that method does. The socket is in a
    folder of the server's own, which it removes as it ends, however the consumer ended
    (multiprocessing's ``pymp-*`` folder is removed only by a consumer that exits)."""
    with server._lock:
        tracker = _tracker_pipe()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        consumer, folder = os.getpid(), ""
        alive_r = alive_w = -1
        try:
            folder = tempfile.mkdtemp(prefix="aioloader-fsrv-")
            address = os.path.join(folder, _SOCKET)
            with socket.socket(socket.AF_UNIX) as listener:
                listener.bind(address)
                os.chmod(address, 0o600)  # as multiprocessing does (the folder is 0o700 too)
                listener.listen()
                alive_r, alive_w = os.pipe()
                theirs = parts.shared_with_children()
                with warnings.catch_warnings():
                    # 3.12+ warns about any other OS thread; the only ones allowed here
                    # (see _can_fork) are pools that prepare themselves for fork.
                    warnings.simplefilter("ignore", DeprecationWarning)
                    pid = os.fork()
                if pid == 0:  # pragma: no cover - the forked server (coverage does not follow it)
                    code = 1
                    try:
                        os.close(alive_w)
                        parts.neutralize(theirs)
                        _serve(listener.fileno(), alive_r, tracker, folder)
                        code = 0
                    except SystemExit:  # forkserver.main's way out, once every client is gone
                        code = 0
                    finally:
                        _remove_folder(folder)
                        os._exit(code)
        except BaseException:
            if os.getpid() != consumer:  # pragma: no cover - the server, interrupted before its try
                os._exit(1)
            for fd in (alive_r, alive_w, *(tracker or ())):
                if fd >= 0:
                    os.close(fd)
            if folder:
                _remove_folder(folder)
            raise
        os.close(alive_r)
        if tracker is not None:
            os.close(tracker[0])
            _adopt_tracker(tracker[1])
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid


_SOCKET = "listener"  # the server's socket, in its folder


def _remove_folder(folder: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(folder, _SOCKET))
    with contextlib.suppress(OSError):
        os.rmdir(folder)


def _tracker_pipe() -> tuple[int, int] | None:
    """The pipe of a resource tracker to fork (see :func:`_track`), or ``None`` when one
    already runs (then checked, and started again if it died, as multiprocessing does)."""
    rt: Any = mp_tracker._resource_tracker
    if rt._fd is not None:
        mp_tracker.ensure_running()
        return None
    return os.pipe()


def _adopt_tracker(w: int) -> None:
    """Make the forked tracker this process's: what ``ensure_running`` records after it
    spawns one. Its pid stays ``None``, as in any process whose tracker another process
    started: it is the forkserver's child, not ours (a dead one is still noticed, by the
    write that probes it, and spawned again)."""
    rt: Any = mp_tracker._resource_tracker
    with rt._lock:
        rt._fd, rt._pid = w, None


def _track(r: int) -> None:  # pragma: no cover - in the forked tracker
    """The resource tracker, forked from the forkserver: multiprocessing's own loop
    (``resource_tracker.main``) on the read end of the consumer's pipe, with none of a
    new interpreter's start-up (about 30 ms of a core, taken from the first batch).
    It keeps no other fd of the server's: a pipe end kept open here would hide the end
    of a worker or of the server from whoever waits on it."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.closerange(3, r)
        os.closerange(r + 1, _MAX_FD)
        _name_process(TRACKER_NAME)
        mp_tracker.main(r)
        code = 0
    finally:
        os._exit(code)


def _serve(listener_fd: int, alive_r: int, tracker: tuple[int, int] | None, folder: str) -> None:  # pragma: no cover
    global _lock
    # Both locks were held by the fork; workers forked from here inherit these copies.
    _lock = threading.Lock()
    forkserver._forkserver._lock = threading.Lock()  # type: ignore[attr-defined]
    _name_process(PROCESS_NAME)
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, TypeError):
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    from . import _forkserver_preload  # noqa: F401  (workers ignore SIGINT from birth)

    serve_one = forkserver._serve_one  # type: ignore[attr-defined]  # replaced in this process only
    hooks: _Hooks | None = None  # stays None in the spare, which it forks

    def at_sigterm() -> None:  # what the server's end does (below), before SIGTERM ends it
        if hooks is not None:
            hooks.start_tracker()  # not forked yet: what the consumer registered still gets cleaned up
        _remove_folder(folder)

    parts.on_sigterm(at_sigterm)

    def worker(*args: Any) -> Any:  # each forked worker takes a name of its own
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server's cleanup is not a worker's
        _name_process(WORKER_NAME)
        _Hooks.remove()
        if hooks is not None and hooks.tracker_r is not None:  # the tracker's read end, not forked yet
            os.close(hooks.tracker_r)
        return serve_one(*args)

    forkserver._serve_one = worker  # type: ignore[attr-defined]
    if _byvalue.main_is_interactive():
        # An interactive consumer (``python -c``, stdin, a prompt): a spawned server's
        # workers have an empty ``__main__``, and what was defined there reaches them by
        # value. Keep it so: a copy of the consumer's would shadow those definitions.
        sys.modules["__main__"] = types.ModuleType("__main__")
    gc.freeze()
    # The tracker and the spare worker are our children: multiprocessing's loop reaps
    # them, and would warn that it never forked those pids.
    warnings.filterwarnings("ignore", message="forkserver: waitpid returned unexpected pid")
    hooks = _Hooks(worker, (listener_fd, alive_r, *(tracker or ())))
    if tracker is not None:
        os.close(tracker[1])  # the consumer's end: the tracker stops once every copy of it is closed
        hooks.tracker_r = tracker[0]
    hooks.install()
    try:
        forkserver.main(listener_fd, alive_r, [])
    finally:
        hooks.start_tracker()  # the server ends before its tracker was forked: it still cleans up


class _Hooks:  # pragma: no cover - in the forked server
    """What the forked server adds to multiprocessing's loop, for a faster first worker.

    * **A spare worker**, forked before anyone asks for one: the first request is
      answered with its pid, with no fork in between (a fork of a process that imported
      torch takes 5-8 ms of the server's time, measured, on the way to the first batch).
      The spare waits on a socket pair for what the request brings (the pipe its process
      object comes on and the fds multiprocessing passes), then runs as a worker forked
      for that request would. It ends, unused, when the server does (end of file on its
      socket). Later requests, and the first when the spare is gone, get a fork.
    * **The resource tracker forked late**: once the loop has had nothing to do for
      ``_TRACKER_GRACE``, or ``_TRACKER_LATEST`` after the start however busy the loop
      is, or when the server ends, rather than before the loop starts,
      where its fork delayed the first worker by as much, or right after the first
      request, where it took a core from the first batch. Until then what the consumer
      registers waits in the tracker's pipe.

    Both hook the names the loop looks up in ``multiprocessing.forkserver``: its ``os``
    (``fork``), ``reduction`` (``recvfds``, to see the request's fds) and ``selectors``
    (a selector whose ``select`` first runs what was put off), replaced in this process
    only; each worker puts the real modules back."""

    def __init__(self, worker: Any, close: tuple[int, ...]) -> None:
        self.tracker_r: int | None = None
        self.received: list[int] = []
        self.spare: tuple[int, socket.socket] | None = None
        self.deadline = 0.0
        try:
            ours, theirs = socket.socketpair()
        except OSError:
            return
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            return
        if pid == 0:
            code, armed = 1, False
            try:
                _name_process(SPARE_NAME)
                ours.close()
                for fd in close:
                    os.close(fd)
                fds = parts.await_request(theirs)
                theirs.close()
                if fds is None:
                    code = 0
                else:
                    armed = parts.arm_exit_hooks()
                    code = worker(fds[0], fds[1:], [], {})
            except Exception:
                sys.excepthook(*sys.exc_info())
                sys.stderr.flush()
            finally:
                if armed:
                    atexit._run_exitfuncs()
                os._exit(code)
        theirs.close()
        self.spare = (pid, ours)

    def install(self) -> None:
        self.deadline = time.monotonic() + _TRACKER_LATEST
        forkserver.os = parts.Override(os, fork=self.fork)  # type: ignore[attr-defined]
        forkserver.reduction = parts.Override(reduction, recvfds=self.recvfds)  # type: ignore[attr-defined]
        forkserver.selectors = parts.Override(selectors, DefaultSelector=lambda: parts.Selector(self))  # type: ignore[attr-defined]

    @staticmethod
    def remove() -> None:
        forkserver.os, forkserver.reduction, forkserver.selectors = os, reduction, selectors  # type: ignore[attr-defined]

    def recvfds(self, sock: socket.socket, size: int) -> list[int]:
        fds: list[int] = reduction.recvfds(sock, size)
        self.received = fds
        return fds

    def fork(self) -> int:
        spare, self.spare = self.spare, None
        if spare is not None:
            pid, sock = spare
            with sock:
                if len(self.received) >= 2:
                    child_r, _child_w, *fds = self.received
                    rights = array.array("i", [child_r, *fds])
                    with contextlib.suppress(OSError):  # it died unused: a fork, then
                        # MSG_NOSIGNAL: a consumer may have left SIGPIPE at its default.
                        sock.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)], socket.MSG_NOSIGNAL)
                        return pid
        return os.fork()

    def grace(self) -> float | None:
        """How long the loop may wait for a request before the tracker is forked
        (``None`` once it is, 0 when it is due now): ``_TRACKER_GRACE``, so that its
        fork comes after the burst of requests that starts a pool and the first batch
        that follows, not among them, and a consumer that asks for no worker gets its
        tracker all the same, before what it registers can fill the pipe; and at the
        latest ``_TRACKER_LATEST`` after the server started, however busy it is."""
        if self.tracker_r is None:
            return None
        return max(0.0, min(_TRACKER_GRACE, self.deadline - time.monotonic()))

    def start_tracker(self) -> None:
        r, self.tracker_r = self.tracker_r, None
        if r is not None:
            with contextlib.suppress(OSError):
                if os.fork() == 0:
                    _track(r)
            os.close(r)


def _name_process(name: bytes) -> None:  # pragma: no cover - in the forked server
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME


def after_fork_in_child() -> None:
    """A child forked from this process inherits its forkserver's bookkeeping, which it
    does not own: without this, its first pool would fail with ``ChildProcessError``
    (multiprocessing would wait for a forkserver that is not its child)."""
    server: Any = forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is not None:
        alive = server._forkserver_alive_fd
        server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None
        server._lock = threading.Lock()
        if alive is not None:
            with contextlib.suppress(OSError):
                os.close(alive)


_NATIVE_AT_IMPORT = _native_threads() if threading.active_count() == 1 else None
