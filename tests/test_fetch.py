"""The fetch stage (``fetch=``, ``transform=``) against a real HTTP server in its own process.

Every loader's batches are compared with a reference that reads the same files locally,
inside the worker, through the same ``transform``; the server counts requests per key and
the peak of concurrent ones, so bounds and refetches are measured where they happen.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import aioloader
from aioloader import LoaderTimeout
from aioloader._engine.fetch import Then, is_transient, nbytes

from ._fetch_helpers import (
    FILE_SIZE,
    LIVE_BLOBS,
    MISSING,
    CrashOnce,
    HttpFetch,
    LocalFiles,
    LockedKeys,
    RemoteFiles,
    Server,
    add_one,
    batches_key,
    big_value,
    blob_key,
    decode,
    decode_plain,
    describe_value,
    fetch_big,
    fetch_blob,
    make_files,
)
from .conftest import ctrl_c, wait_until, wait_until_async

Files = tuple[Path, list[tuple[str, int]]]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    root = tmp_path_factory.mktemp("served")
    return root, make_files(root)


@pytest.fixture(scope="module")
def server(files: Files) -> Iterator[Server]:
    s = Server(files[0])
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(autouse=True)
def fresh_server(server: Server) -> None:
    server.reset()


def reference(files: Files, transform: Callable[[Any], Any] = decode, **kw: Any) -> list[Any]:
    root, items = files
    with aioloader.DataLoader(LocalFiles(root, items), transform=transform, **kw) as dl:
        return batches_key(list(dl))


def one_each(items: list[tuple[str, int]]) -> dict[str, int]:
    return {name: 1 for name, _ in items}


@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "unordered"])
def test_batches_equal_the_local_reference(
    collect: Callable[..., list[Any]], server: Server, files: Files, ordered: bool
) -> None:
    kw: dict[str, Any] = {"batch_size": 4, "shuffle": True, "seed": 7}
    ref = reference(files, **kw)  # one thread: the per-sample seeds must not care
    fetch = HttpFetch(server.base)
    with aioloader.DataLoader(
        LockedKeys(files[1]), fetch=fetch, transform=decode, num_workers=2, ordered=ordered,
        prefetch_next_epoch=False, io_concurrency=16, **kw,
    ) as dl:  # fmt: skip
        got = batches_key(collect(dl))
        st = dl.stats()
    assert (got if ordered else sorted(got)) == (ref if ordered else sorted(ref))
    assert server.stats()["counts"] == one_each(files[1])
    assert st.fetches == len(files[1])
    assert st.fetch_bytes == sum(nbytes((b"x" * FILE_SIZE, label)) for _, label in files[1])
    assert 1 <= st.fetch_peak_in_flight <= 16
    assert f"fetches: {len(files[1])} " in str(st)
    assert fetch.closed >= 1 and not fetch.sessions  # the run closed its session on its loop


def test_resume_mid_epoch_from_state_dict(server: Server, files: Files) -> None:
    kw: dict[str, Any] = {"batch_size": 4, "shuffle": True, "seed": 3}
    ref = reference(files, **kw)
    with aioloader.DataLoader(files[1], fetch=HttpFetch(server.base), transform=decode, **kw) as dl:
        it = iter(dl)
        head = [next(it) for _ in range(3)]
        state = dl.state_dict()
        it.close()
    with aioloader.DataLoader(files[1], fetch=HttpFetch(server.base), transform=decode, **kw) as dl2:
        dl2.load_state_dict(state)
        rest = list(dl2)
    assert batches_key(head + rest) == ref


def test_sharding_splits_like_the_reference(server: Server, files: Files) -> None:
    seen: list[int] = []
    for rank in (0, 1):
        kw: dict[str, Any] = {"batch_size": 4, "shuffle": True, "seed": 11, "shard": (rank, 2)}
        with aioloader.DataLoader(files[1], fetch=HttpFetch(server.base), transform=decode, **kw) as dl:
            got = batches_key(list(dl))
        assert got == reference(files, **kw)
        seen.extend(label for _, labels in got for label in labels)
    assert sorted(seen) == list(range(len(files[1])))


def test_io_concurrency_is_reached_and_never_exceeded(server: Server, files: Files) -> None:
    # Each request waits at the server until 8 were in flight at once: the loader must
    # reach 8 (across batches) to proceed at all, and the server's peak shows any excess.
    server.config(hold=8)
    with aioloader.DataLoader(
        files[1], batch_size=4, prefetch=4, fetch=HttpFetch(server.base), transform=decode_plain,
        io_concurrency=8, prefetch_next_epoch=False,
    ) as dl:  # fmt: skip
        labels = [int(x) for _, b in dl for x in b]
        st = dl.stats()
    assert labels == list(range(len(files[1])))
    assert server.stats()["peak"] == 8
    assert st.fetch_peak_in_flight == 8


def test_byte_budget_holds_under_a_slow_consumer(server: Server, files: Files) -> None:
    item = max(nbytes((b"x" * FILE_SIZE, label)) for _, label in files[1])  # sizeof(0) is smaller
    batch, prefetch = 8, 5
    budget = batch * item  # the bound is budget + one batch (>= io_concurrency items at the start)
    total = len(files[1])
    with aioloader.DataLoader(
        files[1], batch_size=batch, prefetch=prefetch, fetch=HttpFetch(server.base), transform=decode_plain,
        io_concurrency=16, io_buffer=budget, prefetch_next_epoch=False,
    ) as dl:  # fmt: skip
        got = 0
        for k, _ in enumerate(dl):
            got += 1
            # a slow consumer: it takes the next batch only once the whole window is fetched
            want = min(total, (k + 1 + prefetch) * batch)
            wait_until(lambda: dl.stats().fetches >= want, what="the window to be fetched")  # noqa: B023
        st = dl.stats()
    assert got == total // batch
    assert st.fetches == total
    assert 0 < st.fetch_buffer_peak_bytes <= budget + batch * item


def test_transient_failures_are_retried(server: Server, files: Files) -> None:
    name = files[1][5][0]
    server.config(fail={name: [500, 429, "reset", "reset"]})
    with aioloader.DataLoader(
        files[1], batch_size=4, fetch=HttpFetch(server.base), transform=decode, seed=1,
        fetch_retries=4, prefetch_next_epoch=False,
    ) as dl:  # fmt: skip
        got = batches_key(list(dl))
        st = dl.stats()
    assert got == reference(files, batch_size=4, seed=1)
    assert server.stats()["counts"][name] == 5
    # aiohttp itself retries a request once when a reused connection was reset
    assert st.fetch_retries in (3, 4)


def test_retries_run_out_with_the_last_error(server: Server, files: Files) -> None:
    name = files[1][2][0]
    server.config(fail={name: [503] * 5})
    with aioloader.DataLoader(files[1], batch_size=4, fetch=HttpFetch(server.base), fetch_retries=1) as dl:
        with pytest.raises(aiohttp.ClientResponseError) as info:
            list(dl)
    assert info.value.status == 503
    assert any("sample index 2" in n and name in n and "after 1 retries" in n for n in info.value.__notes__)
    assert server.stats()["counts"][name] == 2


def test_permanent_failure_names_the_index_and_the_key(
    collect: Callable[..., list[Any]], server: Server, files: Files
) -> None:
    items = list(files[1][:8])
    items[5] = (MISSING, 5)
    # prefetch_next_epoch=False: the for face goes on after the error, so the next
    # epoch's prefetch would fetch the missing key again (a new epoch, not a retry)
    with aioloader.DataLoader(
        items, batch_size=4, fetch=HttpFetch(server.base), transform=decode, prefetch_next_epoch=False
    ) as dl:
        with pytest.raises(aiohttp.ClientResponseError) as info:
            collect(dl)
    assert info.value.status == 404
    notes = "\n".join(info.value.__notes__)
    assert "sample index 5" in notes and MISSING in notes
    assert server.stats()["counts"][MISSING] == 1  # a 404 is not retried


def test_on_error_skip_drops_samples_whose_fetch_failed(server: Server, files: Files) -> None:
    items = list(files[1][:8])
    items[5] = (MISSING, 5)
    with aioloader.DataLoader(
        items, batch_size=4, fetch=HttpFetch(server.base), transform=decode_plain, on_error="skip",
        prefetch_next_epoch=False,
    ) as dl:  # fmt: skip
        labels = [[int(x) for x in b] for _, b in dl]
        st = dl.stats()
    assert labels == [[0, 1, 2, 3], [4, 6, 7]]
    assert st.skipped == 1 and st.samples == 7


class _Keys:
    """Keys of which one cannot be read (in the main process, where fetch= reads them)."""

    def __init__(self, items: list[tuple[str, int]], bad: int) -> None:
        self.items, self.bad = items, bad

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[str, int]:
        if i == self.bad:
            raise KeyError(f"no key {i}")
        return self.items[i]


def test_a_key_that_cannot_be_read_is_named_or_skipped(server: Server, files: Files) -> None:
    keys = _Keys(files[1][:8], bad=6)
    with aioloader.DataLoader(keys, batch_size=4, fetch=HttpFetch(server.base)) as dl:
        with pytest.raises(KeyError) as info:
            list(dl)
    assert any("dataset[6] (sample index 6) in the main process" in n for n in info.value.__notes__)
    with aioloader.DataLoader(keys, batch_size=4, fetch=HttpFetch(server.base), on_error="skip") as dl:
        labels = [[int(x) for x in b] for _, b in dl]
        assert dl.stats().skipped == 1
    assert labels == [[0, 1, 2, 3], [4, 5, 7]]


def test_timeout_bounds_each_fetch(server: Server, files: Files) -> None:
    items = list(files[1][:4])
    items[1] = (items[1][0] + "?latency_ms=60000", 1)  # answered only by the server's reset
    with aioloader.DataLoader(
        items, batch_size=4, fetch=HttpFetch(server.base), timeout=2.0, fetch_retries=0
    ) as dl:
        with pytest.raises(LoaderTimeout) as info:
            list(dl)
    assert info.value.indices == [1]
    assert "sample index 1" in str(info.value) and "timeout=2.0" in str(info.value)


def test_worker_crash_resubmits_without_refetch(tmp_path: Path, server: Server, files: Files) -> None:
    with aioloader.DataLoader(
        files[1], batch_size=4, shuffle=True, seed=5, fetch=HttpFetch(server.base),
        transform=CrashOnce(tmp_path / "crashed", label=9), num_workers=2, prefetch_next_epoch=False,
    ) as dl:  # fmt: skip
        got = batches_key(list(dl))
        st = dl.stats()
    assert (tmp_path / "crashed").exists()
    assert got == reference(files, batch_size=4, shuffle=True, seed=5)
    assert server.stats()["counts"] == one_each(files[1])  # the crashed batch was not fetched again
    assert st.restarts >= 1 and st.fetches == len(files[1])


def _no_blob_alive() -> bool:
    gc.collect()
    return not LIVE_BLOBS


@pytest.mark.parametrize("face", ["for", "async-for"])
def test_a_built_batch_waiting_for_its_consumer_keeps_no_fetched_values(face: str) -> None:
    # The consumer takes one batch and stops: the window's other units are fetched, built
    # and wait for it. A resubmission would need their fetched values only while they are
    # at the pool; once built, the main process must not hold them until they are taken.
    keys = list(range(20))
    expected = [list(range(k, k + 4)) for k in range(0, 20, 4)]
    LIVE_BLOBS.clear()
    with aioloader.DataLoader(
        keys, 4, num_workers=1, prefetch=3, fetch=fetch_blob, transform=blob_key, prefetch_next_epoch=False
    ) as dl:
        if face == "for":
            it = iter(dl)
            got = [next(it).tolist()]
            wait_until(_no_blob_alive, 30.0, "the built batches' fetched values to be dropped")
            got += [b.tolist() for b in it]
        else:

            async def consume() -> list[list[int]]:
                ait = dl.__aiter__()
                first = [(await ait.__anext__()).tolist()]
                await wait_until_async(_no_blob_alive, 30.0, "the built batches' fetched values to be dropped")
                return first + [b.tolist() async for b in ait]

            got = asyncio.run(consume())
        assert dl.stats().fetches == len(keys)
    assert got == expected


def _described(keys: list[int]) -> list[tuple[str, int, int, int]]:
    import zlib

    return [("bytes", len(d), zlib.crc32(d), k) for d, k in map(big_value, keys)]


@pytest.mark.parametrize("pool", ["processes", "thread", "borrowed"])
def test_fetched_bytes_reach_the_worker_as_bytes(collect: Callable[..., list[Any]], pool: str) -> None:
    # A fetched body of 64 KiB or more travels beside the task's pickle on an owned
    # pool's channel (uncopied in the main process), in the pickle of a borrowed
    # executor, and as it is to a thread. The worker gets the same bytes every way.
    import concurrent.futures as cf
    import multiprocessing as mp

    keys = list(range(10))
    ex = cf.ProcessPoolExecutor(2, mp_context=mp.get_context("forkserver")) if pool == "borrowed" else None
    workers = {"processes": 2, "thread": 0, "borrowed": 0}[pool]
    try:
        with aioloader.DataLoader(
            keys, 4, num_workers=workers, executor=ex, fetch=fetch_big,
            transform=describe_value, collate_fn=list, prefetch_next_epoch=False,
        ) as dl:  # fmt: skip
            got = [s for batch in collect(dl) for s in batch]
        with aioloader.StreamLoader(
            iter(keys), fetch=fetch_big, transform=describe_value, batch_size=3, collate_fn=list,
            num_workers=workers, executor=ex,
        ) as stream:  # fmt: skip
            streamed = [s for batch in collect(stream) for s in batch]
    finally:
        if ex is not None:
            ex.shutdown()
    assert got == _described(keys)
    assert streamed == _described(keys)


def _slow_items(files: Files, n: int) -> list[tuple[str, int]]:
    # the first batch answers at once, the rest only when the server is reset
    root_items = files[1]
    return [(name if i < 4 else f"{name}?latency_ms=60000", i) for i, (name, _) in enumerate(root_items * 5)][
        :n
    ]


@pytest.mark.parametrize("how", ["for-break", "async-break", "async-cancelled", "close-from-thread"])
def test_break_and_close_with_many_fetches_in_flight(server: Server, files: Files, how: str) -> None:
    fetch = HttpFetch(server.base)
    dl = aioloader.DataLoader(
        _slow_items(files, 200), batch_size=4, prefetch=40, fetch=fetch, io_concurrency=100
    )
    in_flight = lambda: server.stats()["current"] == 100  # noqa: E731
    if how == "for-break":
        for _ in dl:
            wait_until(in_flight, 60.0, "100 requests at the server")
            break
        dl.close()
    elif how == "async-break":

        async def main() -> None:
            async for _ in dl:
                await asyncio.to_thread(wait_until, in_flight, 60.0, "100 requests at the server")
                break
            await dl.aclose()
            assert asyncio.all_tasks() == {asyncio.current_task()}

        asyncio.run(main())
    elif how == "async-cancelled":  # what Ctrl-C does to asyncio.run's main task

        async def consume() -> None:
            async for _ in dl:
                pass

        async def main() -> None:
            task = asyncio.create_task(consume())
            await asyncio.to_thread(wait_until, in_flight, 60.0, "100 requests at the server")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await dl.aclose()
            assert asyncio.all_tasks() == {asyncio.current_task()}

        asyncio.run(main())
    else:

        def close_when_busy() -> None:
            try:
                wait_until(in_flight, 60.0, "100 requests")
            finally:  # whatever happened, the loop below must end
                dl.close()

        closer = threading.Thread(target=close_when_busy)
        closer.start()
        with pytest.raises(aioloader.LoaderClosedError):
            for _ in dl:
                pass
        closer.join()
    assert fetch.closed >= 1 and not fetch.sessions
    assert dl.stats().fetch_peak_in_flight == 100


CTRL_C_SCRIPT = """
import asyncio, pathlib, signal, sys
sys.path.insert(0, {root!r})
import aioloader
from tests._fetch_helpers import HttpFetch

if __name__ == "__main__":
    # Python's own Ctrl-C handler: the inherited disposition may be "ignored" (nohup, CI).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    items = {items!r}
    ready = pathlib.Path({ready!r})
    loader = aioloader.DataLoader(items, batch_size=4, prefetch=40, fetch=HttpFetch({base!r}), io_concurrency=100)
    if {face!r} == "for":
        for batch in loader:
            ready.touch()
    else:
        async def main():
            async for batch in loader:
                ready.touch()
        asyncio.run(main())
"""


# slow: on 3.10 (CI runs it the suite minus slow) the async face once outlived Ctrl-C by
# over 60 s in a fresh CI venv; not reproduced locally in 4 runs, open in issue 13.
@pytest.mark.slow
@pytest.mark.parametrize("face", ["for", "async-for"])
def test_ctrl_c_with_many_fetches_in_flight(tmp_path: Path, server: Server, files: Files, face: str) -> None:
    ready = tmp_path / "ready"
    script = tmp_path / "script.py"
    root = str(Path(__file__).resolve().parents[1])
    script.write_text(CTRL_C_SCRIPT.format(root=root, items=_slow_items(files, 200), ready=str(ready),
                                           base=server.base, face=face))  # fmt: skip
    proc, text = ctrl_c(
        script, lambda: ready.exists() and server.stats()["current"] == 100, "100 requests at the server"
    )
    assert proc.returncode != 0 and text.rstrip().endswith("KeyboardInterrupt"), text
    # asyncio.run (3.11+) cancels the main task first: its CancelledError is chained in
    assert text.count("Traceback (most recent call last)") <= (1 if face == "for" else 2), text
    # no unclosed session or connector, no task destroyed while pending
    assert "Unclosed" not in text and "destroyed" not in text and "never awaited" not in text, text


def test_stream_loader_fetches_items(collect: Callable[..., list[Any]], server: Server, files: Files) -> None:
    fetch = HttpFetch(server.base)
    with aioloader.StreamLoader(
        iter(files[1]), fetch=fetch, transform=decode_plain, fn=add_one, batch_size=4, io_concurrency=8
    ) as stream:
        got = batches_key(collect(stream))
        st = stream.stats()
    assert got == reference(files, transform=Then(decode_plain, add_one), batch_size=4)
    assert st.fetches == len(files[1]) and server.stats()["counts"] == one_each(files[1])


def test_stream_loader_skips_failed_fetches(server: Server, files: Files) -> None:
    items = list(files[1][:6])
    items[2] = (MISSING, 2)
    with aioloader.StreamLoader(items, fetch=HttpFetch(server.base), transform=decode_plain, batch_size=3,
                                on_error="skip") as stream:  # fmt: skip
        labels = [[int(x) for x in b] for _, b in stream]
        st = stream.stats()
    assert labels == [[0, 1], [3, 4, 5]] and st.skipped == 1


def test_a_dataset_can_bring_its_own_fetch(server: Server, files: Files) -> None:
    ds = RemoteFiles(server.base, files[1])
    with aioloader.DataLoader(ds, batch_size=4, transform=add_one, seed=2, num_workers=0) as dl:
        assert ds.calls == 1 and dl.dataset is ds
        got = batches_key(list(dl))
    assert got == reference(files, transform=Then(decode, add_one), batch_size=4, seed=2)
    assert ds.calls == 1


def test_transform_without_fetch_applies_to_dataset_samples(files: Files) -> None:
    a = reference(files, batch_size=4, shuffle=True, seed=9)
    b = reference(files, batch_size=4, shuffle=True, seed=9, num_workers=2)
    assert a == b  # and the same per-sample randomness for any num_workers


def test_bad_fetch_arguments_are_named() -> None:
    def plain(x: Any) -> Any:
        return x

    with pytest.raises(TypeError, match="async function"):
        aioloader.DataLoader([1], fetch=plain)  # type: ignore[arg-type]
    for name, value in (("io_concurrency", 0), ("io_buffer", -1), ("fetch_retries", -1)):
        with pytest.raises(ValueError, match=name):
            aioloader.DataLoader([1], fetch=HttpFetch("http://x"), **{name: value})
    with pytest.raises(TypeError, match="transform"):
        aioloader.StreamLoader([1], transform=3)  # type: ignore[arg-type]


def test_transient_errors_are_told_apart() -> None:
    class Status(Exception):
        def __init__(self, status: int) -> None:
            self.status = status

    assert is_transient(ConnectionResetError()) and is_transient(asyncio.TimeoutError())
    assert (
        is_transient(aiohttp.ServerDisconnectedError())
        and is_transient(Status(502))
        and is_transient(Status(429))
    )
    assert (
        not is_transient(Status(404))
        and not is_transient(FileNotFoundError())
        and not is_transient(ValueError())
    )
