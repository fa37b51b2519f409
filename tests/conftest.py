"""Shared fixtures: the two faces of iteration, and leak checks around every test."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

SHM_PREFIX = "aioloader_"
# The Python on which CI installs torch (the one torch build on the machine's disk): there a
# missing torch is a broken environment, not a reason to skip.
TORCH_REQUIRED_ON = (3, 11)
# The process's fork server (forked from the consumer) and its standby have the consumer's
# command line and are told apart by their name (``aioloader._pool.zygote.ZYGOTE_NAME``).
TRACKER_MARKERS = ("resource_tracker", "semaphore_tracker")
HELPER_MARKERS = ("forkserver", "aioloader-zyg", *TRACKER_MARKERS)


def _children(pid: int) -> list[int]:
    # Children are listed per thread: a process started from a helper thread (the
    # forkserver, say) only appears under that thread's entry.
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
        except OSError:
            pass
    return out


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` now (for a consumer: its forkserver, resource
    tracker and workers), to stop after the consumer is killed."""
    found: set[int] = set()
    stack = [pid]
    while stack:
        kids = _children(stack.pop())
        found.update(kids)
        stack.extend(kids)
    return found


def ctrl_c(script: Path, ready: Callable[[], bool], what: str) -> tuple[subprocess.Popen[bytes], str]:
    """Run ``script`` in a session of its own, wait until ``ready()``, then do what a
    terminal's Ctrl-C does (SIGINT to the whole group); the process and its stderr."""
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        wait_until(lambda: ready() or proc.poll() is not None, 60.0, what)
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()  # reaps it and closes its pipes
    return proc, err.decode()


def oversubscribed(num_workers: int) -> contextlib.AbstractContextManager[Any]:
    """What a DataLoader with ``num_workers`` owes this machine: torch's UserWarning
    when that is more than the CPUs this process may use, else nothing."""
    from aioloader._cpus import available_cpus

    if num_workers > available_cpus()[0]:
        return pytest.warns(UserWarning, match=f"will create {num_workers} worker processes in total")
    return contextlib.nullcontext()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _label(pid: int) -> str:
    """The command line and the process name: what tells a helper process apart."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        comm = ""
    return f"{_cmdline(pid)} [{comm}]"


def is_tracker(pid: int) -> bool:
    """Is ``pid`` a resource tracker, spawned (its command line) or forked (its name)?"""
    label = _label(pid)
    return any(m in label for m in TRACKER_MARKERS)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    return not _is_zombie(pid)


def descendant_workers(root: int | None = None) -> set[int]:
    """Live processes below ``root``, looking *through* multiprocessing's helper
    processes (forkserver, resource tracker) but not counting them: they belong to the
    interpreter, not to any loader."""
    out: set[int] = set()
    top = os.getpid() if root is None else root
    stack = [(pid, _label(top)) for pid in _children(top)]
    while stack:
        pid, parent_cmd = stack.pop()
        cmd = _label(pid)
        stack.extend((c, cmd) for c in _children(pid))
        if _is_zombie(pid):
            continue
        # forkserver children are forked without exec, so they share its command line:
        # the helper is the process whose parent is *not* a helper of the same kind.
        # aioloader's server and its standby (the server's child) are told apart by name.
        if any(m in cmd and m not in parent_cmd for m in HELPER_MARKERS) or cmd.endswith("[aioloader-zyg]"):
            continue
        out.add(pid)
    return out


def group_alive(pgid: int) -> bool:
    """Whether any process of process group ``pgid`` is alive (zombies do not count)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    with open(f"/proc/{entry}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                            return True
            except (ProcessLookupError, OSError):
                pass
    return False


def shm_entries() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX)}
    except FileNotFoundError:
        return set()


def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``cond`` until it holds (a bounded wait on an observable state, not a sleep
    standing in for synchronisation)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


async def wait_until_async(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """:func:`wait_until` inside a coroutine: polls ``cond`` between turns of the running
    loop (which go on meanwhile), with the same bound."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.005)


# A test that runs into pytest-timeout's limit has hung. When the hang comes from state
# the whole process shares (a forkserver, a lock of every pool), every later test hangs
# too, each for the full limit: the run would outlast any CI budget and print nothing
# useful. After this many, the session stops, and prints the hung tests' tracebacks.
MAX_TIMEOUTS = 3
_session: list[pytest.Session] = []
_timeouts: list[str] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    _session[:] = [session]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.failed or "Timeout (>" not in report.longreprtext:
        return
    _timeouts.append(report.nodeid)
    if len(_timeouts) >= MAX_TIMEOUTS and _session:
        _session[0].shouldstop = f"{len(_timeouts)} tests hung past the timeout: {', '.join(_timeouts)}"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``@pytest.mark.torch`` tests skip where torch is not installed, except on
    :data:`TORCH_REQUIRED_ON`, where they fail instead of passing silently."""
    if item.get_closest_marker("torch") is None or importlib.util.find_spec("torch") is not None:
        return
    if sys.version_info[:2] == TORCH_REQUIRED_ON:
        pytest.fail(
            "torch is not installed, and on Python 3.11 the torch tests must run "
            '(pip install -e ".[dev]" installs torch==2.13.0)',
            pytrace=False,
        )
    pytest.skip(
        f"torch is not installed (CI installs it only on Python {'.'.join(map(str, TORCH_REQUIRED_ON))})"
    )


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Every test must leave no worker process, thread or shared-memory segment behind."""
    procs0 = descendant_workers()
    threads0 = {t.ident for t in threading.enumerate()}
    shm0 = shm_entries()
    yield

    def clean() -> bool:
        return (
            not (descendant_workers() - procs0)
            and not ({t.ident for t in threading.enumerate()} - threads0)
            and not (shm_entries() - shm0)
        )

    # A full collection costs ~0.1 s once torch is imported; it is needed only where
    # something is still there (a loader in a reference cycle, a batch view holding a slab).
    if not clean():
        gc.collect()
    try:
        wait_until(lambda: not (descendant_workers() - procs0), 15.0, "worker processes to exit")
    except AssertionError:
        left = descendant_workers() - procs0
        raise AssertionError(f"child processes left behind: {[(p, _cmdline(p)) for p in left]}") from None
    try:
        wait_until(lambda: not ({t.ident for t in threading.enumerate()} - threads0), 10.0, "threads to exit")
    except AssertionError:
        left_t = [t.name for t in threading.enumerate() if t.ident not in threads0]
        raise AssertionError(f"threads left behind: {left_t}") from None
    left_shm = shm_entries() - shm0
    assert not left_shm, f"/dev/shm entries left behind: {sorted(left_shm)}"


def _collect_sync(loader: Any, limit: int | None = None) -> list[Any]:
    out = []
    for batch in loader:
        out.append(batch)
        if limit is not None and len(out) >= limit:
            break
    return out


def _collect_async(loader: Any, limit: int | None = None) -> list[Any]:
    async def main() -> list[Any]:
        out = []
        async for batch in loader:
            out.append(batch)
            if limit is not None and len(out) >= limit:
                break
        return out

    return asyncio.run(main())


@pytest.fixture(params=["for", "async-for"])
def collect(request: pytest.FixtureRequest) -> Callable[..., list[Any]]:
    """``collect(loader, limit=None)``: one epoch through ``for`` or ``async for``."""
    return _collect_sync if request.param == "for" else _collect_async


FIXTURES = Path(__file__).resolve().parent / "fixtures"  # copied byte for byte; see fixtures/README.md
