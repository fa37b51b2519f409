"""The pool's own fork server: a copy of the consumer that forks the workers.

Why: a worker forked from a copy of the consumer has every module the consumer had
imported (torch, the dataset's modules) for nothing. A spawned interpreter imports
them again before its first batch: seconds with torch. ``fork`` from the consumer
itself is unsafe once it runs threads (a lock held by another thread stays held in the
child), and the consumer runs some as soon as it loads.

So the first owned pool of a process forks a *zygote*, while the process has one
thread. The zygote is single-threaded for ever. It waits on a socket pair
(``SOCK_SEQPACKET``: one message per request, descriptors passed with it). A request
carries a worker's slot, its channel and its pool's slot table; the zygote forks, and
the child runs :func:`aioloader._worker.tasks.worker_main`. The zygote answers with the pid,
reaps its children, and reports each exit code. It ends when the consumer's end of
the socket closes (the consumer exited, or was killed).

The zygote resets what a fresh interpreter would not have: Python signal handlers go
back to the default (SIGINT is ignored), buffered output is flushed before the fork,
an interactive ``__main__`` is emptied (what was defined there travels by value), and
the garbage collector's objects are frozen. It keeps the consumer's memory as it was,
shared copy-on-write, until the consumer exits. ``AIOLOADER_FORKSERVER=spawn`` turns it
off: multiprocessing then starts the workers.

Only public APIs: ``os.fork``, ``socket.send_fds``/``recv_fds``, ``os.waitpid``. This
module never imports asyncio.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import inspect
import itertools
import mmap
import multiprocessing
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import types
import warnings
import zlib
from typing import Any

__all__ = ["ENV", "Server", "Session", "at_import", "ensure", "main_by_value", "notice_death", "server_pid", "session", "usable"]

ENV = "AIOLOADER_FORKSERVER"  # "spawn": never fork a zygote
REQUEST = struct.Struct("<qqqqq")  # request number, slot, table size, number of workers, consumer pid
# kind, pid, value: F (forked: the request's number), X (exited: exit code),
# E (failed: pid holds the request's number, value the errno)
REPORT = struct.Struct("<cxxxxxxxqq")
ZYGOTE_NAME = b"aioloader-zyg"
WORKER_NAME = b"aioloader-work"

PID = struct.Struct("<q")

_lock = threading.Lock()
_server: Server | None = None  # this process's fork server
_unreaped: list[int] = []  # servers this process forked that ended, or were told to, unreaped
_spawned: list[subprocess.Popen[bytes]] = []  # servers started as fresh interpreters


# Native threads that prepare themselves for fork, by name: jemalloc's background
# thread (pyarrow starts one as it is imported; jemalloc's fork handlers stop it).
_FORK_READY = frozenset({"jemalloc_bg_thd"})


def _native_threads() -> int | None:
    """The threads of this process, but those in :data:`_FORK_READY`."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    count = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() in _FORK_READY:
                    continue
        except OSError:
            pass  # it ended
        count += 1
    return count


def _native_only() -> int | None:
    """The threads that run no Python (:func:`_native_threads` less Python's own)."""
    native = _native_threads()
    return None if native is None else native - threading.active_count()


_NATIVE_AT_IMPORT = _native_only()


def _is_tqdm_monitor(t: threading.Thread) -> bool:
    kind = type(t)
    return kind.__name__ == "TMonitor" and kind.__module__.startswith("tqdm") and callable(getattr(t, "exit", None))


def _others() -> list[threading.Thread] | None:
    """The Python threads but this one, if each is one that can be stopped before a fork
    and is restarted when needed: tqdm's monitor (every tqdm bar starts one, and it never
    ends: ``datasets.load_dataset`` leaves one behind); else ``None``."""
    others = [t for t in threading.enumerate() if t is not threading.current_thread()]
    return others if all(_is_tqdm_monitor(t) for t in others) else None


def usable() -> bool:
    """Can this process fork a zygote now? Linux; one Python thread, or only tqdm's
    monitor besides (:func:`fork_for_pool` stops it first; the next tqdm bar starts a
    new one); no more threads that run no Python than when aioloader was imported
    (numpy's OpenBLAS pool, which prepares itself for fork), jemalloc's not counted;
    not turned off by :data:`ENV`."""
    if os.environ.get(ENV, "").lower() == "spawn" or not sys.platform.startswith("linux"):
        return False
    others = _others()
    if not hasattr(socket, "send_fds") or others is None:
        return False
    native = _native_only()
    return native is not None and native <= max(0, _NATIVE_AT_IMPORT or 0)


def _stop_monitors() -> bool:
    """Stop tqdm's monitor threads (see :func:`_others`); whether a zygote may then be
    forked. A joined thread's OS thread ends a moment later, and nothing signals that:
    its end is polled for, 50 ms at most (then multiprocessing starts the workers)."""
    stopped = _others() or []
    for t in stopped:
        t.exit()  # type: ignore[attr-defined]  # sets its event and joins it
    if threading.active_count() != 1:
        return False
    deadline = time.monotonic() + (0.05 if stopped else 0.0)
    while not usable():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


def server_pid() -> int | None:
    """The pid of this process's fork server, if it has one."""
    with _lock:
        srv = _live()
    return srv.pid if srv is not None else None


def at_import() -> None:
    """Fork the server now, as aioloader is imported, if that is safe: a process is most
    likely to have one thread then. It is *early*: modules imported later, and the rest
    of a ``__main__`` still running, are not in it. A pool made while the process still
    has one thread forks a fresh server in its place; one made once threads run uses it.
    Each session then brings it up to date (see :meth:`Server.session`), and payloads
    that name ``__main__`` go by value (:func:`main_by_value`)."""
    global _server
    if os.environ.get(ENV, "").lower() == "spawn" or multiprocessing.parent_process() is not None or not usable():
        return  # (a process multiprocessing started is a worker of some pool: it starts none of its own)
    running = _modules_being_imported()
    with _lock:
        if _server is None:
            with contextlib.suppress(OSError):
                _server = Server.fork(early=running)


def main_by_value() -> bool:
    """Must payloads that name ``__main__`` go by value? Yes when this process's server
    is early: its ``__main__`` stopped where the consumer imported aioloader."""
    srv = _server
    return srv is not None and srv.early is not None and srv.consumer == os.getpid()


def _modules_being_imported() -> list[str]:
    """The modules whose import is under way on this thread's stack (their copies in an
    early server are incomplete), but aioloader's own."""
    names = []
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "<module>":
            name = frame.f_globals.get("__name__")
            if isinstance(name, str) and name != "__main__" and name.split(".")[0] != "aioloader":
                names.append(name)
        frame = frame.f_back
    return names


def ensure() -> None:
    """Make this process's fork server now, if it has none and forking one is safe (a new
    pool calls this before it starts any thread)."""
    with _lock:
        _current()


def session() -> Session | None:
    """A new session with this process's fork server, for one pool: what the pool asks
    for and what the server reports to it (forks, exit codes) are that pool's alone. The
    server is made on first use if that is safe now; if it died, its standby takes over.
    ``None``: no server (threads ran when the first was needed,
    ``AIOLOADER_FORKSERVER=spawn``, not Linux); multiprocessing starts the workers."""
    global _server
    with _lock:
        for _ in range(3):
            srv = _current()
            if srv is None:
                return None
            try:
                return srv.session()
            except OSError:
                _server = srv.successor()
    return None


def notice_death() -> None:
    """A session ended: the server died (it closes none of its own). Its standby serves
    from now on, and the dead one is reaped at once (no zombie waits for the next worker's
    start). A dying process's sockets close one by one: its control socket's end is
    waited for a moment (if it is late, the next look at the server sees it)."""
    with _lock:
        _live(within=0.2)


def _live(within: float = 0.0) -> Server | None:
    """This process's server, its standby in its place if it died (the lock held)."""
    global _server
    srv = _server
    if srv is not None and srv.consumer != os.getpid():
        srv = _server = None
    if srv is not None and (srv.dead or srv.hung_up(within)):
        srv = _server = srv.successor()
    return srv


def _current() -> Server | None:
    """This process's server, made now if it has none and that is safe (the lock held)."""
    global _server
    _reap_ended()
    if os.environ.get(ENV, "").lower() == "spawn":
        return None
    srv = _live()
    if (srv is None or srv.early is not None) and usable() and _stop_monitors():
        with contextlib.suppress(OSError):
            fresh = Server.fork()  # a copy of the consumer as it is now
            if srv is not None:
                srv.close(reap=True)  # the early one: its sessions end, its workers live on
            srv = _server = fresh
    if srv is None and sys.platform.startswith("linux") and hasattr(socket, "send_fds"):
        with contextlib.suppress(OSError, ValueError):
            srv = _server = Server.spawn()  # threads ran before aioloader was imported
    return srv


def _reap_ended() -> None:
    """Wait for the servers this process forked that have ended (no zombie is left)."""
    for proc in list(_spawned):
        if proc.poll() is not None:
            _spawned.remove(proc)
    for pid in list(_unreaped):
        try:
            done = os.waitpid(pid, os.WNOHANG)[0] != 0
        except ChildProcessError:
            done = True
        if done:
            _unreaped.remove(pid)


class Server:
    """The consumer's handle on its fork server: one per process, for every owned pool.

    A server keeps a *standby*: a copy of itself forked when it starts serving, idle, with
    a control socket of its own. If the server dies, the standby serves in its place (and
    forks a standby of its own), so a new worker still starts from a copy of the consumer.
    The workers are not the server's to keep: they live on without it."""

    def __init__(self, pid: int, ctl: socket.socket, reaps: bool, early: list[str] | None = None) -> None:
        self.pid = pid
        self.ctl = ctl
        self.early = early  # made at import: the modules whose import was under way then
        self.consumer = os.getpid()
        self.dead = False
        self._reaps = reaps  # this process forked it: it must wait for its exit
        self.standby: socket.socket | None = None
        self._lock = threading.Lock()
        self._ask_standby()

    @classmethod
    def fork(cls, early: list[str] | None = None) -> Server:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        feeding = _shared_with_children()
        with warnings.catch_warnings():
            # 3.12+ warns of any other OS thread; the only ones allowed (see usable) prepare for fork.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # pragma: no cover - the server (coverage does not follow it)
            code = 1
            try:
                ours.close()
                _neutralize(feeding)
                for name in early or ():
                    sys.modules.pop(name, None)  # incomplete here: imported afresh if needed
                _prepare()
                _serve(theirs)
                code = 0
            finally:
                os._exit(code)
        theirs.close()
        return cls(pid, ours, reaps=True, early=early)

    @classmethod
    def spawn(cls) -> Server:
        """A server started as a fresh interpreter, for a consumer that ran threads
        before it imported aioloader (no copy of it can be forked safely). The first
        session's catch-up imports the consumer's modules there, once for every worker."""
        if not sys.executable:
            raise ValueError("no interpreter to start")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, ENV: "spawn", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", f"from aioloader._pool import zygote; zygote.serve_fd({theirs.fileno()})"],
                pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        _spawned.append(proc)
        return cls(proc.pid, ours, reaps=False, early=[])

    def _ask_standby(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            socket.send_fds(self.ctl, [b"T"], [theirs.fileno()])
        except OSError:
            ours.close()
            return
        finally:
            theirs.close()
        self.standby = ours

    def session(self) -> Session:
        """Open a session. Raises ``OSError`` if the server is gone."""
        with self._lock:
            if self.dead:
                raise OSError("the fork server is gone")
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                socket.send_fds(self.ctl, [b"S"], [theirs.fileno()])
            except OSError:
                ours.close()
                self._gone()
                raise
            finally:
                theirs.close()
            try:
                ours.send(b"I" + _catch_up(self.early is not None))
            except OSError:
                ours.close()
                raise
            return Session(ours)

    def hung_up(self, within: float = 0.0) -> bool:
        """Has the server's end of the control socket closed (it died), or does it
        within ``within`` seconds?"""
        poller = select.poll()
        poller.register(self.ctl.fileno(), 0)  # only its hangup (POLLHUP, POLLERR are always reported)
        return bool(poller.poll(int(within * 1000)))

    def successor(self) -> Server | None:
        """This server died: its standby, serving from now on (``None`` if it has none)."""
        self._gone()
        standby, self.standby = self.standby, None
        pid = self._standby_pid()
        self.ctl.close()
        if standby is None or pid is None:
            if standby is not None:
                standby.close()
            return None
        return Server(pid, standby, reaps=False, early=self.early)

    def _standby_pid(self) -> int | None:
        """The standby's pid, as the server reported it (its report outlives it)."""
        pid = None
        while True:
            try:
                data = self.ctl.recv(PID.size + 1, socket.MSG_DONTWAIT)
            except OSError:
                return pid
            if not data:
                return pid
            if data[:1] == b"P":
                (pid,) = PID.unpack_from(data, 1)

    def _gone(self) -> None:
        self.dead = True
        if self._reaps:
            _unreaped.append(self.pid)
            self._reaps = False
        _reap_ended()

    def close(self, reap: bool = False) -> None:
        """Stop it and its standby (their sockets close: each ends at once). ``reap``:
        end it now and wait for it, so that no zombie is left (one replaced while the
        consumer goes on); its workers live on."""
        self.dead = True
        standby, self.standby = self.standby, None
        for sock in (self.ctl, standby):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        if self._reaps:
            self._reaps = False
            if reap:
                with contextlib.suppress(OSError):
                    os.kill(self.pid, signal.SIGKILL)
                    os.waitpid(self.pid, 0)
            else:
                _unreaped.append(self.pid)


def _catch_up(modules: bool) -> bytes:
    """What a session tells the server before its first worker: this process's
    environment, working directory and ``sys.path`` as they are now (a worker sees them
    as a forked child would), and, for an early server, the modules imported here, in
    the order their imports began."""
    names = [n for n, m in list(sys.modules.items()) if getattr(m, "__spec__", None) is not None] if modules else []
    state = (dict(os.environ), os.getcwd(), list(sys.path), [n for n in names if n != "__main__"])
    return zlib.compress(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL), 1)


class Session:
    """One pool's line to the fork server: :meth:`request` a worker; the pool's I/O
    thread reads :meth:`reports` when :attr:`sock` is readable."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.dead = False
        self.send_lock = threading.Lock()
        self._requests = itertools.count()

    def request(self, slot: int, channel: int, table: int, table_size: int, workers: int) -> int:
        """Ask for a worker in ``slot`` (its channel and slot table's descriptors are
        passed); the answer comes as a report. Raises ``OSError`` if the server is gone."""
        with self.send_lock:
            req = next(self._requests)
            msg = b"W" + REQUEST.pack(req, slot, table_size, workers, os.getpid())
            socket.send_fds(self.sock, [msg], [channel, table])
        return req

    def reports(self) -> list[tuple[bytes, int, int]]:
        """What the server said since the last call: ``(kind, pid, value)`` each; an
        empty list once it is gone (then :attr:`dead` is set)."""
        out: list[tuple[bytes, int, int]] = []
        while True:
            try:
                data = self.sock.recv(REPORT.size, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return out
            except OSError:
                data = b""
            if not data:
                self.dead = True
                return out
            out.append(REPORT.unpack(data))

    def close(self) -> None:
        self.dead = True
        with contextlib.suppress(OSError):
            self.sock.close()


# ----------------------------------------------------------------- the server itself
def serve_fd(fd: int) -> None:  # pragma: no cover - a server started as a fresh interpreter
    """The entry of a server started by :meth:`Server.spawn`: serve control socket ``fd``."""
    _prepare()
    with socket.socket(fileno=fd) as ctl:
        _serve(ctl)


def _prepare() -> None:  # pragma: no cover - in the server
    """Once, in the first server: reset what a fresh interpreter would not have."""
    _name_process(ZYGOTE_NAME)
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, TypeError):
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from .._worker import byvalue as _byvalue
    from .._worker import tasks as _tasks  # noqa: F401  (imported once here, not in every worker)

    if _byvalue.main_is_interactive():
        # Workers of an interactive consumer get what was defined in __main__ by value;
        # a copy of the consumer's module would shadow those definitions.
        sys.modules["__main__"] = types.ModuleType("__main__")
    gc.freeze()


class _Serving:  # pragma: no cover - in the server
    """A server's state: its control socket, its sessions, and which session asked for
    which child."""

    def __init__(self, ctl: socket.socket) -> None:
        self.ctl = ctl
        self.sessions: dict[int, socket.socket] = {}
        self.owner: dict[int, socket.socket | None] = {}  # child pid -> the session that asked for it
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, _ignore)
        self.poller = select.poll()
        self.poller.register(ctl.fileno(), select.POLLIN)
        self.poller.register(self.wake_r, select.POLLIN)

    def drop_all(self) -> None:
        """In a child: what this server holds is not the child's."""
        signal.set_wakeup_fd(-1)
        for fd in (self.wake_r, self.wake_w):
            os.close(fd)
        for sock in (self.ctl, *self.sessions.values()):
            sock.close()


def _serve(ctl: socket.socket) -> None:  # pragma: no cover - in the server
    state = _Serving(ctl)
    while True:
        for fd, _ in state.poller.poll():
            if fd == state.wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(state.wake_r, 4096)
                _reap(state)
            elif fd == ctl.fileno():
                try:
                    msg, fds, _, _ = socket.recv_fds(ctl, 16, 1)
                except OSError:
                    msg, fds = b"", []
                if not msg:
                    return  # the consumer is gone; the workers see their channels end
                if msg == b"S" and fds:
                    sock = socket.socket(fileno=fds[0])
                    state.sessions[sock.fileno()] = sock
                    state.poller.register(sock.fileno(), select.POLLIN)
                elif msg == b"T" and fds:
                    _fork_standby(state, fds[0])
                else:
                    for extra in fds:
                        os.close(extra)
            elif fd in state.sessions:
                _session_message(state, state.sessions[fd])


def _session_message(state: _Serving, sock: socket.socket) -> None:  # pragma: no cover
    try:
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 22, 2)
    except OSError:
        msg, fds = b"", []
    if not msg:  # the pool closed: its workers' exits are reaped, not reported
        state.poller.unregister(sock.fileno())
        del state.sessions[sock.fileno()]
        for pid, owner in list(state.owner.items()):
            if owner is sock:
                state.owner[pid] = None
        sock.close()
        return
    if msg[:1] == b"W" and len(fds) == 2:
        _fork_worker(state, sock, msg[1:], fds)
    elif msg[:1] == b"I":
        with contextlib.suppress(Exception):
            _take_state(*pickle.loads(zlib.decompress(msg[1:])))
        for extra in fds:
            os.close(extra)
    else:
        for extra in fds:
            os.close(extra)


def _take_state(environ: dict[str, str], cwd: str, path: list[str], names: list[str]) -> None:  # pragma: no cover
    """Become the consumer as it is now (see :func:`_catch_up`): the workers forked next
    inherit it. The modules it imported since this server was made are imported here,
    once, not in every worker; one that fails to import is left to the worker that needs
    it (which then raises the error)."""
    os.environ.clear()
    os.environ.update(environ)
    with contextlib.suppress(OSError):
        os.chdir(cwd)
    sys.path[:] = path
    for name in names:
        if name not in sys.modules:
            with contextlib.suppress(BaseException):
                importlib.import_module(name)


def _fork_standby(state: _Serving, fd: int) -> None:  # pragma: no cover - in the server
    """Fork this server's standby, to serve the control socket ``fd`` if this one dies."""
    try:
        pid = os.fork()
    except OSError:
        os.close(fd)
        return
    if pid == 0:
        code = 1
        try:
            state.drop_all()
            with socket.socket(fileno=fd) as ctl:
                _serve(ctl)
            code = 0
        finally:
            os._exit(code)
    os.close(fd)
    with contextlib.suppress(OSError):
        state.ctl.send(b"P" + PID.pack(pid))


def _fork_worker(state: _Serving, sock: socket.socket, msg: bytes, fds: list[int]) -> None:  # pragma: no cover
    req, slot, table_size, workers, consumer = REQUEST.unpack(msg)
    try:
        pid = os.fork()
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        _report(sock, b"E", req, exc.errno or 0)
        return
    if pid == 0:
        code = 1
        try:
            state.drop_all()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _name_process(WORKER_NAME)
            channel, table_fd = fds
            table = mmap.mmap(table_fd, table_size)
            os.close(table_fd)
            from .._worker.tasks import worker_main

            worker_main(channel, slot, table, workers, consumer, None)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)
    for fd in fds:
        os.close(fd)
    state.owner[pid] = sock
    _report(sock, b"F", pid, req)


def _reap(state: _Serving) -> None:  # pragma: no cover - in the server
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock = state.owner.pop(pid, None)
        if sock is not None:
            _report(sock, b"X", pid, os.waitstatus_to_exitcode(status))


def _report(sock: socket.socket, kind: bytes, pid: int, value: int) -> None:  # pragma: no cover
    with contextlib.suppress(OSError):
        sock.send(REPORT.pack(kind, pid, value))


def _ignore(*_: Any) -> None:  # pragma: no cover - SIGCHLD only wakes the server's poll
    pass


def _name_process(name: bytes) -> None:  # pragma: no cover - in the server and its workers
    with contextlib.suppress(OSError), open("/proc/self/comm", "wb") as f:
        f.write(name)


# ------------------------------------------------- what the zygote must not keep open
def _shared_with_children() -> list[int]:
    """This process's write ends of pipes (but stdin, stdout and stderr) whose read end a
    child process holds, and no child the write end. The zygote lives as long as the
    consumer: a copy of such an end kept there would make a child that waits for the end
    of its input (``subprocess`` with ``stdin=PIPE``) wait for ever. Best effort."""
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


def _neutralize(fds: list[int]) -> None:  # pragma: no cover - in the zygote
    """Point each of ``fds`` at ``/dev/null``: the pipe end is closed, its number stays
    taken (a closed number would go to the next file opened, where an inherited object
    still writes)."""
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


def _after_fork_in_child() -> None:
    """A child forked from this process (the server, its workers, a user's fork) does
    not own this process's server: it would fork its workers from another's."""
    global _server, _lock, _unreaped, _spawned
    _server, _lock, _unreaped, _spawned = None, threading.Lock(), [], []


def _close_at_exit() -> None:
    s = _server
    if s is not None and s.consumer == os.getpid():
        s.close()
    _reap_ended()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_close_at_exit)
