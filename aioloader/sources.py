"""Small async sources for :class:`~aioloader.StreamLoader`, built on aiofiles.

* :func:`read_files` — ``(path, bytes)`` for each path, a bounded number read at once.
* :func:`follow_lines` — the lines appended to a text file, like ``tail -f``.
* :func:`watch_folder` — paths of files as they appear in a folder.

Each is an async generator. Closing it (``break`` out of ``async for``, ``aclose()``,
or cancelling the task that iterates it) releases everything it holds: open files are
closed and reads already started are awaited, never abandoned.

Without an inotify dependency, :func:`follow_lines` and :func:`watch_folder` *poll*:
they look again every ``poll_interval`` seconds when nothing new has turned up, so a
new line or file is seen up to one interval late. File system calls run in aiofiles'
threads and never block the event loop; the exception is one ``stat``/``listdir`` at
call time, which fixes the starting point (see each function).
"""

from __future__ import annotations

import asyncio
import collections
import fnmatch
import os
import stat
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from pathlib import Path
from typing import Any, TypeVar

import aiofiles
import aiofiles.os

from .errors import add_note

__all__ = ["follow_lines", "read_files", "watch_folder"]

StrPath = str | os.PathLike[str]
P = TypeVar("P", bound=StrPath)


def _check_interval(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


async def _read_bytes(path: StrPath) -> bytes:
    async with aiofiles.open(path, "rb") as f:
        data: bytes = await f.read()
    return data


async def read_files(
    paths: Iterable[P] | AsyncIterable[P], concurrency: int = 8
) -> AsyncIterator[tuple[P, bytes]]:
    """Yield ``(path, contents)`` for each path, in the order of ``paths``.

    Up to ``concurrency`` files are read at once. ``paths`` (a sync or async iterable,
    possibly infinite, possibly slow such as :func:`watch_folder`) is advanced only while
    fewer than ``concurrency`` reads are pending, so it is pulled lazily, and a finished
    read is yielded without waiting for the next path. A synchronous ``paths`` is
    advanced on the event loop (it should not block). An ``OSError`` (a missing file, say)
    is raised when its turn comes, with a note naming the path.

    Closing the generator waits for the reads already started (at most ``concurrency``)
    and drops their results, and closes ``paths`` when it is an async generator.
    """
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
    pending: collections.deque[tuple[P, asyncio.Task[bytes]]] = collections.deque()
    ait = paths.__aiter__() if isinstance(paths, AsyncIterable) else None
    sit = iter(paths) if not isinstance(paths, AsyncIterable) else None
    next_path: asyncio.Future[P] | None = None
    exhausted = False
    try:
        while True:
            while not exhausted and next_path is None and len(pending) < concurrency:
                if ait is not None:
                    next_path = asyncio.ensure_future(ait.__anext__())
                    break
                assert sit is not None
                try:
                    p = next(sit)
                except StopIteration:
                    exhausted = True
                    break
                pending.append((p, asyncio.ensure_future(_read_bytes(p))))
            if not pending and next_path is None:
                return
            waiting = {f for f in (next_path, pending[0][1] if pending else None) if f is not None}
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if next_path is not None and next_path in done:
                fut, next_path = next_path, None
                try:
                    p = fut.result()
                except StopAsyncIteration:
                    exhausted = True
                else:
                    pending.append((p, asyncio.ensure_future(_read_bytes(p))))
                continue
            path, task = pending.popleft()
            try:
                data = task.result()
            except OSError as exc:
                add_note(exc, f"aioloader.sources.read_files: while reading {os.fspath(path)!r}")  # type: ignore[arg-type]
                raise
            yield path, data
    finally:
        if next_path is not None:
            next_path.cancel()
            await asyncio.gather(next_path, return_exceptions=True)
        # Not cancelled: a read cancelled while aiofiles opens the file in its thread
        # would leave that file to the garbage collector.
        tasks = [t for _, t in pending]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        aclose = getattr(ait, "aclose", None)
        if aclose is not None:
            await aclose()


def follow_lines(
    path: StrPath,
    *,
    from_start: bool = False,
    poll_interval: float = 0.05,
    encoding: str = "utf-8",
    errors: str = "strict",
) -> AsyncIterator[str]:
    """Yield the lines of a text file as they are written, without their line ending.

    The starting point is fixed when ``follow_lines`` is *called*: the file's size at
    that moment (or its beginning with ``from_start=True``, or when the file does not
    exist yet). A line is yielded once its ``\\n`` is written; a trailing partial line
    waits. A truncated file is read again from its start; a replaced one (rotated: a new
    inode at ``path``) is read from the start of the new file once the old one is drained.
    Infinite: stop it by closing the generator or cancelling its task.

    Raises ``ValueError`` for a bad ``poll_interval`` (at call time) and ``OSError``
    from reading; ``UnicodeDecodeError`` under ``errors="strict"``.
    """
    interval = _check_interval("poll_interval", poll_interval)
    try:
        st = os.stat(path)
        start, inode = (0 if from_start else st.st_size), st.st_ino
    except FileNotFoundError:
        start, inode = 0, None
    return _follow(os.fspath(path), start, inode, interval, encoding, errors)


async def _follow(
    path: str, pos: int, inode: int | None, interval: float, encoding: str, errors: str
) -> AsyncIterator[str]:
    pending = b""
    while True:
        try:
            f = await aiofiles.open(path, "rb")
        except FileNotFoundError:
            await asyncio.sleep(interval)
            pos, inode = 0, None
            continue
        try:
            st = await aiofiles.os.stat(path)
            if inode is not None and st.st_ino != inode:
                pos = 0  # replaced between our calls
            inode = st.st_ino
            await f.seek(pos)
            while True:
                chunk: bytes = await f.read(1 << 16)
                if chunk:
                    pos += len(chunk)
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for raw in lines:
                        yield raw.rstrip(b"\r").decode(encoding, errors)
                    continue
                try:
                    now: os.stat_result | None = await aiofiles.os.stat(path)
                except FileNotFoundError:
                    now = None
                if now is None or now.st_ino != inode:
                    break  # rotated or removed: reopen whatever is at path now
                if now.st_size < pos:  # truncated
                    pos, pending = 0, b""
                    await f.seek(0)
                    continue
                await asyncio.sleep(interval)
        finally:
            await f.close()
        pos, pending, inode = 0, b"", None


def watch_folder(
    path: StrPath,
    *,
    pattern: str = "*",
    existing: bool = False,
    settle: bool = False,
    poll_interval: float = 0.1,
) -> AsyncIterator[Path]:
    """Yield the path of each regular file that appears in folder ``path``.

    Files already there when ``watch_folder`` is *called* are skipped, unless
    ``existing=True`` (then they come first, sorted by name). Only names matching
    ``pattern`` (``fnmatch``) count; sub-folders are not watched. Within one poll, new
    files come in name order. A file removed and later created again is reported again.
    With ``settle=True`` a file is reported only once its size and modification time
    are unchanged over one poll interval (for writers that do not rename into place);
    otherwise a file is reported as soon as it is seen, so writers should write under a
    name ``pattern`` does not match and rename.

    Raises ``FileNotFoundError``/``NotADirectoryError`` at call time when ``path`` is not
    a folder. Infinite: stop it by closing the generator or cancelling its task.
    """
    interval = _check_interval("poll_interval", poll_interval)
    folder = Path(path)
    names = set(os.listdir(folder))
    baseline = set() if existing else {n for n in names if fnmatch.fnmatch(n, pattern)}
    return _watch(folder, pattern, baseline, settle, interval)


async def _watch(
    folder: Path, pattern: str, seen: set[str], settle: bool, interval: float
) -> AsyncIterator[Path]:
    candidates: dict[str, tuple[int, int]] = {}  # settle: name -> (size, mtime_ns) last poll
    while True:
        names = {n for n in await aiofiles.os.listdir(folder) if fnmatch.fnmatch(n, pattern)}
        seen &= names  # forget removed files, so a re-created one is reported again
        for name in sorted(names - seen):
            p = folder / name
            try:
                st = await aiofiles.os.stat(p)
            except FileNotFoundError:
                continue
            if not _is_regular(st.st_mode):
                seen.add(name)
                continue
            if settle:
                sig = (st.st_size, st.st_mtime_ns)
                if candidates.get(name) != sig:
                    candidates[name] = sig
                    continue
                del candidates[name]
            seen.add(name)
            yield p
        for name in list(candidates):
            if name not in names:
                del candidates[name]
        await asyncio.sleep(interval)


def _is_regular(mode: int) -> bool:
    return stat.S_ISREG(mode)
