"""Remote storage: aioloader.io.ObjectStore against real servers, read_file, RecordIO over the network.

The S3 server is moto's, the HTTP server a small range-capable one; both run in their own
processes, started (once for this file) by the fixtures of ``tests/_remote_fixtures.py``.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("obstore")

import aioloader
from aioloader import DataLoader
from aioloader._formats import rio_remote
from aioloader.datasets import ImageRecordDataset, RecordFileDataset
from aioloader.errors import RecordIOError, add_note
from aioloader.io import ObjectStore, ObjectStoreError, StoreTimeoutError, TransientStoreError, read_file
from aioloader.transforms import Resize
from tests._remote_fixtures import HTTPServer, S3Server, http_server, jpegs, s3
from tests._rio_helpers import MXNET_FIXTURES, write_numbered

__all__ = ["http_server", "jpegs", "s3"]  # fixtures, imported for pytest

NO_RETRY = {"retry_config": {"max_retries": 0}}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def same_sample(a: Any, b: Any) -> bool:
    if isinstance(a, bytes):
        return a == b
    return bool(
        np.array_equal(a[0], b[0])
        and np.array_equal(a[1], b[1])
        and np.asarray(a[1]).dtype == np.asarray(b[1]).dtype
    )


# -- ObjectStore


def test_s3_get_and_ranges(s3: S3Server, jpegs: dict[str, bytes]) -> None:
    store = ObjectStore(s3.url("jpegs"), **s3.options)
    assert store.url == f"s3://{s3.bucket}/jpegs"
    for name, data in jpegs.items():
        assert run(store.get(name)) == data == store.get_sync(name)
        assert run(store.get_range(name, 3, 11)) == data[3:11] == store.get_range_sync(name, 3, 11)
    name, data = next(iter(jpegs.items()))
    assert run(store.get_range(name, 5, len(data) + 100)) == data[5:]  # past the end: the rest
    assert run(store.get_range(name, 7, 7)) == b"" == store.get_range_sync(name, 7, 7)
    with pytest.raises(ValueError, match=r"invalid byte range \[9, 3\)"):
        run(store.get_range(name, 9, 3))
    with pytest.raises(ObjectStoreError, match="416") as info:
        store.get_range_sync(name, len(data) + 10, len(data) + 20)
    assert info.value.status == 416 and not info.value.transient and info.value.key == name


def test_many_requests_in_flight(s3: S3Server, jpegs: dict[str, bytes]) -> None:
    store = ObjectStore(s3.url("jpegs"), **s3.options)
    names = sorted(jpegs) * 8

    async def main() -> list[bytes]:
        return await asyncio.gather(*(store.get(n) for n in names))

    assert run(main()) == [jpegs[n] for n in names]


def test_missing_key_names_key_and_url(s3: S3Server) -> None:
    store = ObjectStore(s3.url("jpegs"), **s3.options)
    for call in (lambda: run(store.get("nope.jpg")), lambda: store.get_range_sync("nope.jpg", 0, 4)):
        with pytest.raises(
            FileNotFoundError, match=rf"no such object in s3://{s3.bucket}/jpegs: 'nope\.jpg'"
        ) as info:
            call()
        assert info.value.filename == "nope.jpg"
        cause = info.value.__cause__
        assert isinstance(cause, FileNotFoundError) and cause is not info.value  # obstore's own


def test_pickle_round_trip_makes_a_new_client(s3: S3Server, jpegs: dict[str, bytes]) -> None:
    store = ObjectStore(s3.url("jpegs"), **s3.options)
    copy = pickle.loads(pickle.dumps(store))
    assert copy.url == store.url and copy.options == store.options
    assert copy._client is None  # made on first use, in the unpickling process
    name = next(iter(jpegs))
    assert run(copy.get(name)) == jpegs[name]
    assert copy.client is not store.client


def test_file_url(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.bin").write_bytes(b"0123456789")
    store = ObjectStore(f"file://{tmp_path}")
    assert run(store.get("sub/a.bin")) == b"0123456789"
    assert run(store.get_range("sub/a.bin", 2, 5)) == b"234" == store.get_range_sync("sub/a.bin", 2, 5)
    with pytest.raises(FileNotFoundError, match="'sub/missing'"):
        store.get_sync("sub/missing")


def test_http_url_and_failure_classes(http_server: HTTPServer, jpegs: dict[str, bytes]) -> None:
    store = ObjectStore(http_server.base, allow_http=True, **NO_RETRY)
    name = next(iter(jpegs))
    assert run(store.get(f"jpegs/{name}")) == jpegs[name]
    assert run(store.get_range(f"jpegs/{name}", 1, 9)) == jpegs[name][1:9]
    with pytest.raises(FileNotFoundError, match=r"'jpegs/none\.jpg'"):
        run(store.get("jpegs/none.jpg"))
    for code in (500, 503, 429):
        with pytest.raises(TransientStoreError, match=f"'status/{code}/x' in {http_server.base}") as info:
            run(store.get(f"status/{code}/x"))
        assert isinstance(info.value, ConnectionError) and info.value.transient
        assert info.value.status == code and info.value.key == f"status/{code}/x"
        assert type(info.value.__cause__).__module__.startswith("obstore")
    for code in (403, 400):
        with pytest.raises(ObjectStoreError) as perm:
            store.get_sync(f"status/{code}/x")
        assert not isinstance(perm.value, ConnectionError) and not perm.value.transient
        assert perm.value.status == code
    with pytest.raises(TransientStoreError) as reset:
        store.get_sync("reset/x")
    assert reset.value.status is None
    # Errors travel from workers to the consumer by pickling, notes and all.
    add_note(info.value, "while loading sample 7")
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is TransientStoreError and again.status == 429 and str(again) == str(info.value)
    assert again.key == info.value.key and again.url == info.value.url
    assert getattr(again, "__notes__", None) == ["while loading sample 7"]


def test_timeouts_and_refused_connections_are_transient(http_server: HTTPServer) -> None:
    slow = ObjectStore(http_server.base, allow_http=True, timeout="300ms", **NO_RETRY)
    with pytest.raises(StoreTimeoutError) as info:
        run(slow.get("hang/x"))
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, ConnectionError)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        refused = ObjectStore(f"http://127.0.0.1:{port}", allow_http=True, **NO_RETRY)
        with pytest.raises(TransientStoreError, match=f"'a' in http://127.0.0.1:{port}"):
            refused.get_sync("a")


def test_bad_urls_and_options_fail_at_construction() -> None:
    with pytest.raises(ValueError, match=r"url must start with one of s3://"):
        ObjectStore("ftp://host/x")
    with pytest.raises(ValueError, match=r"url must start with one of"):
        ObjectStore("/local/path")
    with pytest.raises(ValueError, match=r"ObjectStore\('s3://bucket'\): .*bogus"):
        ObjectStore("s3://bucket", bogus=1)


def test_obstore_is_imported_lazily_and_its_absence_is_explained() -> None:
    code = (
        "import sys, aioloader.io, aioloader.datasets, aioloader.recordio\n"
        "assert 'obstore' not in sys.modules, 'imported eagerly'\n"
        "sys.modules['obstore'] = None\n"
        "try:\n    aioloader.io.ObjectStore('s3://bucket/x')\n"
        "except ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert 'pip install "aioloader[remote]"' in out.stdout


_FORK_SCRIPT = """
import os, sys
from aioloader.io import ObjectStore, ObjectStoreError
store = ObjectStore("file://" + sys.argv[1])
assert store.get_sync("a") == b"xyz"  # obstore's runtime now runs in this process
pid = os.fork()
if pid == 0:
    code = 3
    try:
        store.get_sync("a")
    except ObjectStoreError as err:
        code = 0 if "forkserver or spawn" in str(err) else 4
    finally:
        os._exit(code)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status))
"""


def test_a_child_forked_after_requests_refuses_instead_of_hanging(tmp_path: Path) -> None:
    # obstore's runtime threads do not survive fork: without the check the child waits forever.
    (tmp_path / "a").write_bytes(b"xyz")
    out = subprocess.run(
        [sys.executable, "-c", _FORK_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "child exit 0" in out.stdout, out.stdout + out.stderr


_EXIT_SCRIPT = """
import asyncio, sys
from aioloader.io import ObjectStore
store = ObjectStore("file://" + sys.argv[1])
asyncio.run(store.get("a"))  # and exit at once
"""


@pytest.mark.slow  # 40 interpreters, 4 at a time: about 10 s
def test_exit_right_after_an_async_request_is_clean(tmp_path: Path) -> None:
    # Without the exit hook about one run in twelve died with SIGABRT (obstore's threads
    # taking the GIL during finalization: 5 of 60 here); 40 clean runs then had a 3% chance.
    (tmp_path / "a").write_bytes(b"xyz")
    codes: list[int] = []
    for _ in range(10):
        procs = [
            subprocess.Popen([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path)], stdout=subprocess.DEVNULL)
            for _ in range(4)
        ]
        codes += [proc.wait(timeout=60) for proc in procs]
    assert codes == [0] * 40


# -- read_file


def test_read_file(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(100)))
    assert run(read_file(path)) == bytes(range(100))
    assert run(read_file(str(path), 10, 20)) == bytes(range(10, 20))
    assert run(read_file(path, 90, 200)) == bytes(range(90, 100))
    assert run(read_file(path, 5)) == bytes(range(5, 100))
    assert run(read_file(path, 7, 7)) == b""
    with pytest.raises(ValueError, match="end must be an integer >= start"):
        run(read_file(path, 5, 2))
    with pytest.raises(ValueError, match="start must be an integer >= 0"):
        run(read_file(path, -1))
    with pytest.raises(FileNotFoundError, match="nope"):
        run(read_file(tmp_path / "nope"))


# -- RecordIO over the network


def _pair(kind: str, s3: S3Server) -> tuple[Any, Any]:
    if kind == "raw":
        return RecordFileDataset(MXNET_FIXTURES / "raw.rec"), RecordFileDataset(
            s3.url("mxnet/raw.rec"), store_options=s3.options
        )
    return ImageRecordDataset(MXNET_FIXTURES / "images.rec"), ImageRecordDataset(
        s3.url("mxnet/images.rec"), store_options=s3.options
    )


@pytest.mark.parametrize("kind", ["raw", "images"])
def test_record_datasets_from_s3_equal_the_local_file(kind: str, s3: S3Server) -> None:
    local, remote = _pair(kind, s3)
    assert len(remote) == len(local) and list(remote.keys) == list(local.keys)
    for i in range(len(local)):
        assert same_sample(remote[i], local[i]), i
    assert same_sample(remote[-1], local[-1])
    with pytest.raises(IndexError):
        remote[len(local)]
    if kind == "images":
        assert remote.header(3)[::2] == local.header(3)[::2]
    copy = pickle.loads(pickle.dumps(remote))
    assert all(same_sample(copy[i], local[i]) for i in range(len(local)))
    assert f"s3://{s3.bucket}/mxnet/" in repr(remote)


@pytest.mark.parametrize("kind", ["raw", "images"])
def test_record_datasets_from_s3_through_the_loader(kind: str, s3: S3Server, collect: Any) -> None:
    local, remote = _pair(kind, s3)
    with DataLoader(
        remote, batch_size=3, num_workers=2, collate_fn=list, prefetch_next_epoch=False
    ) as loader:
        batches = collect(loader)
        # the records were range reads on the event loop (the fetch stage), not in workers
        assert loader.stats().fetches == len(local)
    got = [sample for batch in batches for sample in batch]
    assert len(got) == len(local)
    assert all(same_sample(got[i], local[i]) for i in range(len(local)))


def test_shuffled_epochs_over_s3_equal_the_local_ones(s3: S3Server, tmp_path: Path, collect: Any) -> None:
    # 60 records of varied length, a third of them split into parts by the magic word.
    written = write_numbered(tmp_path / "many.rec", 60)
    s3.put("many/many.rec", (tmp_path / "many.rec").read_bytes())
    s3.put("many/many.idx", (tmp_path / "many.idx").read_bytes())
    remote = RecordFileDataset(s3.url("many/many.rec"), store_options=s3.options)
    local = RecordFileDataset(tmp_path / "many.rec")
    epochs = []
    for dataset in (remote, local):
        with DataLoader(
            dataset, batch_size=7, shuffle=True, seed=11, num_workers=2, collate_fn=list
        ) as loader:
            epochs.append(collect(loader))
    assert epochs[0] == epochs[1]
    flat = [r for batch in epochs[0] for r in batch]
    assert sorted(flat) == sorted(written.values()) and flat != list(written.values())  # shuffled


def test_a_read_failing_in_a_worker_names_the_key(http_server: HTTPServer, collect: Any) -> None:
    gone = http_server.root / "gone"
    gone.mkdir(exist_ok=True)
    for name in ("raw.rec", "raw.idx"):
        (gone / name).write_bytes((MXNET_FIXTURES / name).read_bytes())
    dataset = RecordFileDataset(f"{http_server.base}/gone/raw.rec", store_options={"allow_http": True})
    (gone / "raw.rec").unlink()  # after the dataset read its size and .idx
    with DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=list) as loader:
        with pytest.raises(
            FileNotFoundError, match=rf"no such object in {http_server.base}/gone: 'raw\.rec'"
        ):
            collect(loader)


@pytest.mark.parametrize("kind", ["raw", "images"])
def test_remote_contract_matches_getitem(kind: str, s3: S3Server) -> None:
    local, remote = _pair(kind, s3)
    assert not hasattr(local, "__aioloader_remote__")
    items, fetch, transform = remote.__aioloader_remote__()
    items = pickle.loads(pickle.dumps(items))
    transform = pickle.loads(pickle.dumps(transform))
    assert len(items) == len(remote)

    async def main() -> list[Any]:
        raws = await asyncio.gather(*(fetch(items[i]) for i in range(len(items))))
        return [transform(pickle.loads(pickle.dumps(raw))) for raw in raws]

    got = run(main())
    for i in range(len(remote)):
        assert same_sample(got[i], remote[i]) and same_sample(got[i], local[i]), i


def test_record_dataset_over_http(http_server: HTTPServer) -> None:
    local = RecordFileDataset(MXNET_FIXTURES / "raw.rec")
    remote = RecordFileDataset(f"{http_server.base}/mxnet/raw.rec", store_options={"allow_http": True})
    assert [remote[i] for i in range(len(local))] == [local[i] for i in range(len(local))]


def test_remote_contract_applies_the_dataset_transform(s3: S3Server) -> None:
    remote = ImageRecordDataset(s3.url("mxnet/images.rec"), Resize(5), store_options=s3.options)
    items, fetch, transform = remote.__aioloader_remote__()
    sample = transform(run(fetch(items[2])))
    assert sample[0].size == (5, 5)
    assert np.array_equal(np.asarray(sample[0]), np.asarray(remote[2][0]))


def test_long_and_multipart_records_past_the_first_read(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A first read of 12 bytes sees only the first part header: the rest of every record
    # (including the split ones and the 70,001-byte one) comes from further range reads.
    monkeypatch.setattr(rio_remote, "SPAN_LIMIT", 12)
    local = RecordFileDataset(MXNET_FIXTURES / "raw.rec")
    remote = RecordFileDataset(s3.url("mxnet/raw.rec"), store_options=s3.options)
    items, fetch, transform = remote.__aioloader_remote__()
    assert all(item.end - item.offset <= 12 for item in items)
    for i in range(len(local)):
        assert remote[i] == local[i] == transform(run(fetch(items[i]))), i


def test_idx_elsewhere_and_missing(s3: S3Server, tmp_path: Path) -> None:
    local = RecordFileDataset(MXNET_FIXTURES / "raw.rec")
    s3.put("elsewhere/raw-index.idx", (MXNET_FIXTURES / "raw.idx").read_bytes())
    by_url = RecordFileDataset(
        s3.url("mxnet/raw.rec"), s3.url("elsewhere/raw-index.idx"), store_options=s3.options
    )
    by_path = RecordFileDataset(s3.url("mxnet/raw.rec"), MXNET_FIXTURES / "raw.idx", store_options=s3.options)
    assert [by_url[i] for i in range(len(local))] == [local[i] for i in range(len(local))]
    assert [by_path[i] for i in range(len(local))] == [local[i] for i in range(len(local))]
    s3.put("lonely/data.rec", (MXNET_FIXTURES / "raw.rec").read_bytes())
    with pytest.raises(FileNotFoundError, match=rf"index file of s3://{s3.bucket}/lonely/data.rec"):
        RecordFileDataset(s3.url("lonely/data.rec"), store_options=s3.options)
    with pytest.raises(FileNotFoundError, match=r"'missing\.rec'"):
        RecordFileDataset(s3.url("mxnet/missing.rec"), store_options=s3.options)
    with pytest.raises(ValueError, match="store_options is for record files at an object-store URL"):
        RecordFileDataset(MXNET_FIXTURES / "raw.rec", store_options={})


def _damaged() -> dict[str, tuple[bytes, bytes]]:
    """Damaged copies of raw.rec, each with its .idx: name -> (rec, idx)."""
    rec = (MXNET_FIXTURES / "raw.rec").read_bytes()
    lines = (MXNET_FIXTURES / "raw.idx").read_bytes().splitlines(keepends=True)
    offsets = [int(line.split()[1]) for line in lines]
    long_one = max(range(len(offsets) - 1), key=lambda i: offsets[i + 1] - offsets[i])
    bad_magic = bytearray(rec)
    bad_magic[offsets[3] : offsets[3] + 4] = b"XXXX"
    # The long record cut off 1,000 bytes in; the .idx lists nothing after it.
    truncated = rec[: offsets[long_one] + 1000], b"".join(lines[: long_one + 1])
    return {"truncated": truncated, "bad-magic": (bytes(bad_magic), b"".join(lines))}


def _remote_errors(remote: RecordFileDataset, i: int) -> list[RecordIOError]:
    """The errors reading record ``i`` raises: by ``dataset[i]`` and through the fetch stage's parts."""
    items, fetch, transform = remote.__aioloader_remote__()
    out = []
    with pytest.raises(RecordIOError) as blocking:
        remote[i]
    out.append(blocking.value)
    with pytest.raises(RecordIOError) as staged:
        transform(run(fetch(items[i])))
    out.append(staged.value)
    return out


def test_damaged_remote_records_fail_as_the_local_ones(s3: S3Server, tmp_path: Path) -> None:
    compared = 0
    for name, (data, idx) in _damaged().items():
        (tmp_path / f"{name}.rec").write_bytes(data)
        (tmp_path / f"{name}.idx").write_bytes(idx)
        s3.put(f"damaged/{name}.rec", data)
        s3.put(f"damaged/{name}.idx", idx)
        local = RecordFileDataset(tmp_path / f"{name}.rec")
        remote = RecordFileDataset(s3.url(f"damaged/{name}.rec"), store_options=s3.options)
        for i in range(len(local)):
            try:
                expected = local[i]
            except RecordIOError as err:
                want = (
                    str(err).replace(str(tmp_path / f"{name}.rec"), remote.reader.path),
                    err.key,
                    err.offset,
                )
                for got in _remote_errors(remote, i):
                    assert (str(got), got.key, got.offset) == want
                    assert got.path == remote.reader.path
                compared += 1
            else:
                assert remote[i] == expected
    assert compared >= 2  # both kinds of damage were hit


def test_idx_offsets_past_the_end_fail_at_construction_as_locally(s3: S3Server, tmp_path: Path) -> None:
    data, _ = _damaged()["truncated"]
    idx = (MXNET_FIXTURES / "raw.idx").read_bytes()
    (tmp_path / "short.rec").write_bytes(data)
    (tmp_path / "short.idx").write_bytes(idx)
    s3.put("damaged/short.rec", data)
    s3.put("damaged/short.idx", idx)
    with pytest.raises(RecordIOError) as local:
        RecordFileDataset(tmp_path / "short.rec")
    with pytest.raises(RecordIOError) as remote:
        RecordFileDataset(s3.url("damaged/short.rec"), store_options=s3.options)
    assert (remote.value.key, remote.value.offset) == (local.value.key, local.value.offset)
    assert str(remote.value) == str(local.value).replace(str(tmp_path), f"s3://{s3.bucket}/damaged")


# -- stores that stall: every layer of retries bounded, the error says what happened


@pytest.fixture
def silent_port() -> Any:
    """A port that accepts connections (the kernel's backlog does) and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield sock.getsockname()[1]


def _refused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again: connections are refused


# Small explicit settings, so that the test is fast; the defaults are pinned below.
QUICK = {"allow_http": True, "timeout": 0.2, "connect_timeout": 0.2, "retry_config": {"max_retries": 1}}


def test_a_store_that_never_answers_fails_the_fetch_naming_store_key_and_why(
    silent_port: int, collect: Any
) -> None:
    url = f"http://127.0.0.1:{silent_port}/bucket"
    store = ObjectStore(url, **QUICK)
    loader = DataLoader(["a", "b"], batch_size=2, fetch=store.get, fetch_retries=1, fetch_timeout=30)
    with loader, pytest.raises(StoreTimeoutError) as info:
        collect(loader)
    text = str(info.value)
    assert f"'a' in {url}" in text or f"'b' in {url}" in text, text
    assert "no answer from http://127.0.0.1" in text and "within 0.2 s (2 tries over" in text, text
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "after 1 retries" in notes, notes


def test_a_refused_connection_says_so(collect: Any) -> None:
    port = _refused_port()
    store = ObjectStore(f"http://127.0.0.1:{port}", **QUICK)
    with pytest.raises(TransientStoreError, match=f"'k' in http://127.0.0.1:{port}: connection refused by"):
        store.get_sync("k")
    loader = DataLoader(["k"], batch_size=1, fetch=store.get, fetch_retries=0)
    with loader, pytest.raises(TransientStoreError, match="connection refused"):
        collect(loader)


def test_fetch_timeout_bounds_every_try_together(silent_port: int, collect: Any) -> None:
    # Each try of the store could last long (60 s, retried); the loader's one knob ends it.
    url = f"http://127.0.0.1:{silent_port}"
    store = ObjectStore(url, allow_http=True, timeout=60, retry_config={"max_retries": 5})
    loader = DataLoader(["k"], batch_size=1, fetch=store.get, fetch_timeout=0.3)
    with loader, pytest.raises(aioloader.LoaderTimeout, match=r"got no answer within fetch_timeout=0.3 s \(1 try\)"):
        collect(loader)


def test_default_options_bound_a_fetch_well_under_90_s() -> None:
    store = ObjectStore("http://127.0.0.1:1/b", allow_http=True)
    client, retry = store.client.client_options, store.client.retry_config
    assert retry is not None and retry["max_retries"] == 2
    assert retry["retry_timeout"].total_seconds() == 30
    assert client is not None and str(client["timeout"]) in ("20s", "0:00:20")
    loader = DataLoader(["k"], batch_size=1, fetch=store.get)
    assert loader._fetch is not None and loader._fetch.total == 60.0
    # Options given win, key by key.
    store = ObjectStore("http://127.0.0.1:1/b", allow_http=True, retry_config={"max_retries": 0})
    assert store.client.retry_config["max_retries"] == 0  # type: ignore[index]


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"retry_config": {"retries": 1}}, ValueError, r"retry_config has no key 'retries'"),
        ({"retry_config": {"max_retries": "3"}}, TypeError, r'retry_config\["max_retries"\] must be an int'),
        ({"retry_config": {"backoff": {"initial": 1}}}, ValueError, r'retry_config\["backoff"\] has no key'),
        ({"retry_config": 3}, TypeError, r"retry_config must be a dict"),
        ({"timeout": "ten seconds"}, ValueError, r"timeout must be seconds .* got 'ten seconds'"),
        ({"timeout": 0}, ValueError, r"timeout must be more than 0 s"),
        ({"connect_timeout": "0s"}, ValueError, r"connect_timeout must be more than 0 s"),
    ],
)
def test_option_mistakes_name_the_parameter(options: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ObjectStore("http://127.0.0.1:1/b", allow_http=True, **options)


@pytest.mark.parametrize("value", [0, -1, "60"])
def test_fetch_timeout_is_checked(value: Any) -> None:
    with pytest.raises(ValueError, match="fetch_timeout"):
        DataLoader(["k"], batch_size=1, fetch=_never, fetch_timeout=value)


async def _never(item: Any) -> bytes:
    await asyncio.Event().wait()
    return b""
