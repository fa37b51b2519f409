"""aioloader.sources against real files in a temporary folder.

The sources poll (documented); the tests never sleep: each waits for the next item with
a bound that only turns a hang into a failure.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from aioloader import sources
from aioloader.sources import follow_lines, read_files, watch_folder
from aioloader.stream import StreamLoader

from ._stream_helpers import STOP, WAIT, drive

T = TypeVar("T")
POLL = 0.01


async def next_item(agen: AsyncIterator[T]) -> T:
    return await asyncio.wait_for(agen.__anext__(), WAIT)


def open_fds_on(path: Path) -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)):
            out.append(target)
    return out


def make_files(folder: Path, n: int) -> list[Path]:
    paths = []
    for i in range(n):
        p = folder / f"f{i:02d}.bin"
        p.write_bytes(bytes([i]) * (i + 1))
        paths.append(p)
    return paths


# ----------------------------------------------------------------------- read_files
@pytest.mark.asyncio
async def test_read_files_yields_contents_in_order(tmp_path: Path) -> None:
    paths = make_files(tmp_path, 10)
    got = [item async for item in read_files(paths, concurrency=3)]
    assert got == [(p, p.read_bytes()) for p in paths]

    async def apaths() -> AsyncIterator[Path]:
        for p in paths:
            yield p

    got = [item async for item in read_files(apaths(), concurrency=2)]
    assert [p for p, _ in got] == paths


@pytest.mark.asyncio
async def test_read_files_bounds_reads_and_pulls_paths_lazily(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    concurrency = 3
    state = {"active": 0, "peak": 0, "taken": 0}
    all_in = asyncio.Event()

    async def fake_read(path: Any) -> bytes:
        state["active"] += 1
        state["peak"] = max(state["peak"], state["active"])
        if state["active"] == concurrency:
            all_in.set()
        await all_in.wait()  # the first reads wait for each other: proves they overlap
        state["active"] -= 1
        return str(path).encode()

    monkeypatch.setattr(sources, "_read_bytes", fake_read)

    def paths() -> Iterator[str]:
        for i in range(20):
            state["taken"] += 1
            yield f"p{i}"

    k = 0
    async for path, data in read_files(paths(), concurrency=concurrency):
        assert data == path.encode() and path == f"p{k}"
        assert state["taken"] <= k + concurrency  # lazy: never more than the window ahead
        k += 1
    assert k == 20
    assert state["peak"] == concurrency


@pytest.mark.asyncio
async def test_read_files_missing_file_names_the_path(tmp_path: Path) -> None:
    paths = [*make_files(tmp_path, 2), tmp_path / "missing.bin"]
    got = []
    with pytest.raises(FileNotFoundError) as info:
        async for item in read_files(paths):
            got.append(item)
    assert len(got) == 2
    assert "missing.bin" in "\n".join(getattr(info.value, "__notes__", []))


@pytest.mark.asyncio
async def test_read_files_closed_early_leaves_no_open_file(tmp_path: Path) -> None:
    paths = make_files(tmp_path, 30)
    agen = read_files(paths, concurrency=8)
    await next_item(agen)
    await agen.aclose()  # waits for the reads already started
    assert open_fds_on(tmp_path) == []


def payload_size(item: tuple[Path, bytes]) -> int:
    return len(item[1])


def test_read_files_feeds_a_stream(mode: str, tmp_path: Path) -> None:
    paths = make_files(tmp_path, 5)
    with StreamLoader(read_files(paths), payload_size, batch_size=2) as stream:
        got = drive(mode, stream)
    assert [b.tolist() for b in got] == [[1, 2], [3, 4], [5]]


@pytest.fixture(params=["for", "async-for"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# --------------------------------------------------------------------- follow_lines
@pytest.mark.asyncio
async def test_follow_lines_from_start_waits_for_complete_lines(tmp_path: Path) -> None:
    log = tmp_path / "app.log"
    log.write_text("a\nb\r\n")
    lines = follow_lines(log, from_start=True, poll_interval=POLL)
    try:
        assert [await next_item(lines), await next_item(lines)] == ["a", "b"]
        with log.open("a") as f:
            f.write("c\nd")
        assert await next_item(lines) == "c"
        pending = asyncio.ensure_future(next_item(lines))
        with log.open("a") as f:
            f.write("\n")  # completes "d"
        assert await pending == "d"
    finally:
        await lines.aclose()
    assert open_fds_on(log) == []


@pytest.mark.asyncio
async def test_follow_lines_starts_at_the_end_when_called(tmp_path: Path) -> None:
    log = tmp_path / "app.log"
    log.write_text("old 1\nold 2\n")
    lines = follow_lines(log, poll_interval=POLL)
    with log.open("a") as f:
        f.write("new\n")
    try:
        assert await next_item(lines) == "new"
    finally:
        await lines.aclose()


@pytest.mark.asyncio
async def test_follow_lines_survives_truncation_and_rotation(tmp_path: Path) -> None:
    log = tmp_path / "app.log"
    log.write_text("first line\n")
    lines = follow_lines(log, from_start=True, poll_interval=POLL)
    try:
        assert await next_item(lines) == "first line"
        log.write_text("t\n")  # truncated, then shorter content
        assert await next_item(lines) == "t"
        with log.open("a") as f:
            f.write("last of old\n")
        log.rename(tmp_path / "app.log.1")
        log.write_text("fresh\n")
        assert await next_item(lines) == "last of old"  # the old file is drained first
        assert await next_item(lines) == "fresh"
    finally:
        await lines.aclose()
    assert open_fds_on(tmp_path) == []


@pytest.mark.asyncio
async def test_follow_lines_waits_for_the_file_to_appear(tmp_path: Path) -> None:
    log = tmp_path / "later.log"
    lines = follow_lines(log, poll_interval=POLL)
    pending = asyncio.ensure_future(next_item(lines))
    log.write_text("hello\n")
    try:
        assert await pending == "hello"
    finally:
        await lines.aclose()


@pytest.mark.asyncio
async def test_follow_lines_cancellation_closes_the_file(tmp_path: Path) -> None:
    log = tmp_path / "app.log"
    log.write_text("x\n")
    lines = follow_lines(log, from_start=True, poll_interval=POLL)
    got = asyncio.Event()

    async def consume() -> None:
        async for _ in lines:
            got.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(got.wait(), WAIT)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert open_fds_on(log) == []


def test_follow_lines_validates_interval(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="poll_interval"):
        follow_lines(tmp_path / "x", poll_interval=0)


# --------------------------------------------------------------------- watch_folder
@pytest.mark.asyncio
async def test_watch_folder_reports_new_files_only(tmp_path: Path) -> None:
    (tmp_path / "old.jpg").write_bytes(b"1")
    files = watch_folder(tmp_path, pattern="*.jpg", poll_interval=POLL)
    try:
        (tmp_path / "skip.tmp").write_bytes(b"2")
        (tmp_path / "sub.jpg").mkdir()  # folders never count
        (tmp_path / "b.jpg").write_bytes(b"3")
        (tmp_path / "a.jpg").write_bytes(b"4")
        first = await next_item(files)
        second = await next_item(files)
        # Within one poll, name order; across polls, order of appearance.
        assert {first.name, second.name} == {"a.jpg", "b.jpg"}
        (tmp_path / "a.jpg").unlink()
        pending = asyncio.ensure_future(next_item(files))
        (tmp_path / "c.jpg").write_bytes(b"5")
        assert (await pending).name == "c.jpg"
    finally:
        await files.aclose()


@pytest.mark.asyncio
async def test_watch_folder_existing_and_settle(tmp_path: Path) -> None:
    (tmp_path / "b").write_bytes(b"1")
    (tmp_path / "a").write_bytes(b"2")
    files = watch_folder(tmp_path, existing=True, settle=True, poll_interval=POLL)
    try:
        assert [(await next_item(files)).name, (await next_item(files)).name] == ["a", "b"]
        (tmp_path / "c").write_bytes(b"3")
        assert (await next_item(files)).name == "c"
    finally:
        await files.aclose()


@pytest.mark.asyncio
async def test_watch_folder_is_cancellable(tmp_path: Path) -> None:
    files = watch_folder(tmp_path, poll_interval=POLL)
    task = asyncio.create_task(next_item(files))
    await asyncio.sleep(0)  # let it start polling (not synchronisation: any point will do)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await files.aclose()


def test_watch_folder_needs_a_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        watch_folder(tmp_path / "nope")
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        watch_folder(tmp_path / "file")


def test_watch_folder_feeds_a_stream(mode: str, tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    for i in range(3):
        (tmp_path / "in" / f"{i}.txt").write_text("x" * (i + 1))
    paths = watch_folder(tmp_path / "in", existing=True, poll_interval=POLL)
    with StreamLoader(read_files(paths), payload_size, batch_size=3) as stream:
        got = drive(mode, stream, lambda i, b: STOP)  # infinite: stop after one batch
        assert got[0].tolist() == [1, 2, 3]
