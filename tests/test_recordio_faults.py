"""aioloader.recordio under stress: malformed files, pickling, forked and pooled
processes, threads."""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import random
import struct
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioloader.errors import RecordIOError
from aioloader.recordio import MAGIC, IndexedRecordReader, IndexedRecordWriter, RecordReader, RecordWriter

try:
    from . import _rio_helpers as helpers
except ImportError:  # tests/ is not a package: pytest put it on sys.path
    import _rio_helpers as helpers  # type: ignore[no-redef]

MAGIC_BYTES = struct.pack("<I", MAGIC)
part, write_raw = helpers.part, helpers.write_raw
chunks = st.one_of(st.binary(max_size=9), st.just(MAGIC_BYTES), st.just(MAGIC_BYTES * 2))
payloads_st = st.lists(chunks, max_size=10).map(b"".join)


# --------------------------------------------------------------------------- malformed files


def good_pair(tmp_path: Path, n: int = 6) -> tuple[Path, Path, list[int]]:
    rec = tmp_path / "g.rec"
    helpers.write_numbered(rec, n)
    offsets = [int(line.split("\t")[1]) for line in (tmp_path / "g.idx").read_text().splitlines()]
    return rec, tmp_path / "g.idx", offsets


def test_bad_magic_names_file_key_offset(tmp_path: Path) -> None:
    rec, _, offsets = good_pair(tmp_path)
    data = bytearray(rec.read_bytes())
    data[offsets[2]] ^= 0xFF
    rec.write_bytes(bytes(data))
    with IndexedRecordReader(rec) as reader:
        assert reader.read(1) == helpers.payload_for(1)
        with pytest.raises(RecordIOError) as info:
            reader.read(2)
    err = info.value
    assert (err.path, err.key, err.offset) == (str(rec), 2, offsets[2])
    assert str(rec) in str(err) and "key 2" in str(err) and f"byte offset {offsets[2]}" in str(err)
    assert "magic" in str(err)
    with RecordReader(rec) as seq, pytest.raises(RecordIOError, match="magic") as info:
        list(seq)
    assert info.value.offset == offsets[2] and info.value.key == 2


def test_truncated_record(tmp_path: Path) -> None:
    rec, _, offsets = good_pair(tmp_path)
    rec.write_bytes(rec.read_bytes()[:-3])
    with IndexedRecordReader(rec) as reader:
        with pytest.raises(RecordIOError, match="truncated") as info:
            reader.read(5)
        assert (info.value.key, info.value.offset) == (5, offsets[5])
    with RecordReader(rec) as seq, pytest.raises(RecordIOError, match="truncated"):
        list(seq)


def test_truncated_header_at_end(tmp_path: Path) -> None:
    rec = tmp_path / "t.rec"
    rec.write_bytes(part(0, b"abcd") + MAGIC_BYTES)
    with RecordReader(rec) as seq:
        assert seq.read() == b"abcd"
        with pytest.raises(RecordIOError, match="truncated") as info:
            seq.read()
        assert info.value.offset == 12 and info.value.key == 1


def test_idx_offset_past_end(tmp_path: Path) -> None:
    rec, idx, _ = good_pair(tmp_path)
    size = rec.stat().st_size
    idx.write_text(idx.read_text() + f"77\t{size}\n")
    with pytest.raises(RecordIOError, match="past the end") as info:
        IndexedRecordReader(rec)
    assert (info.value.key, info.value.offset, info.value.path) == (77, size, str(rec))


def test_idx_offset_not_at_a_header(tmp_path: Path) -> None:
    rec, idx, offsets = good_pair(tmp_path)
    idx.write_text(idx.read_text() + f"77\t{offsets[1] + 4}\n")
    with IndexedRecordReader(rec) as reader, pytest.raises(RecordIOError) as info:
        reader.read(77)
    assert (info.value.key, info.value.offset) == (77, offsets[1] + 4)
    assert "does not point at a record header" in str(info.value)


@pytest.mark.parametrize(
    "line",
    ["abc\t0", "1 0", "1\t", "\t0", "", "1\t2\t3", "1\t-8", "-\t0", "1\t0x10", "9" * 19 + "\t0"],
    ids=[
        "letters",
        "space",
        "no-offset",
        "no-key",
        "blank",
        "three-fields",
        "negative-offset",
        "bare-sign",
        "hex",
        "huge",
    ],
)
def test_malformed_idx_line(tmp_path: Path, line: str) -> None:
    rec, idx, _ = good_pair(tmp_path, 3)
    lines = idx.read_text().splitlines()
    lines.insert(1, line)
    idx.write_text("\n".join(lines) + "\n")
    with pytest.raises(RecordIOError, match=r"malformed \.idx line 2") as info:
        IndexedRecordReader(rec)
    assert info.value.path == str(idx)
    assert info.value.offset == len(lines[0]) + 1  # the line's byte offset in the .idx


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (part(2, b"abcd") + part(3, b"x"), "cflag 2 where a record should start"),
        (part(3, b"x"), "cflag 3 where a record should start"),
        (part(1, b"abcd") + part(0, b"x"), "has cflag 0"),
        (part(1, b"abcd") + part(1, b"x"), "has cflag 1"),
        (part(5, b"x"), "cflag 5"),
        (part(1, b"abcd"), "truncated"),
        (part(1, b"abcd") + b"\0" * 8, "continuation part"),
        (struct.pack("<II", MAGIC, 100) + b"short", "truncated"),
        (struct.pack("<II", MAGIC, (1 << 29) - 1), "truncated"),  # huge length, tiny file
    ],
    ids=[
        "starts-middle",
        "starts-last",
        "first-then-whole",
        "first-then-first",
        "cflag-5",
        "missing-last",
        "bad-continuation-magic",
        "short-data",
        "absurd-length",
    ],
)
def test_bad_part_sequences(tmp_path: Path, data: bytes, match: str) -> None:
    rec = write_raw(tmp_path / "b.rec", data)
    (tmp_path / "b.idx").write_text("9\t0\n")
    with IndexedRecordReader(rec) as reader, pytest.raises(RecordIOError, match=match) as info:
        reader.read(9)
    assert (info.value.key, info.value.offset) == (9, 0)
    with RecordReader(rec) as seq, pytest.raises(RecordIOError, match=match):
        seq.read()


# The fuzz test: mutate and cut valid files; the readers may only raise RecordIOError.
interesting = st.sampled_from([0x00, 0xFF, 0x0A, 0x23, 0xD7, 0xCE, 0x20, 0x40, 0x60, 0xE0, 0x1F])
idx_chars = st.sampled_from(list(b"\t\n\r -+0123456789ax"))


def corrupt(path: Path, edits: list[tuple[int, int]], cut: int | None) -> None:
    """Overwrite bytes of ``path`` (positions wrap around), then cut it short."""
    data = bytearray(path.read_bytes())
    for pos, value in edits:
        data[pos % len(data)] = value
    if cut is not None:
        del data[cut % (len(data) + 1) :]
    path.write_bytes(bytes(data))


@settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    records=st.lists(payloads_st, min_size=1, max_size=6),
    edits=st.lists(st.tuples(st.integers(0, 2**20), st.one_of(interesting, st.integers(0, 255))), max_size=4),
    cut=st.one_of(st.none(), st.integers(0, 2**20)),
    idx_edits=st.lists(st.tuples(st.integers(0, 2**16), idx_chars), max_size=2),
    idx_cut=st.one_of(st.none(), st.integers(0, 2**16)),
)
def test_fuzz_only_recordio_errors(
    records: list[bytes],
    edits: list[tuple[int, int]],
    cut: int | None,
    idx_edits: list[tuple[int, int]],
    idx_cut: int | None,
) -> None:
    with tempfile.TemporaryDirectory() as d:
        rec, idx = Path(d) / "f.rec", Path(d) / "f.idx"
        with IndexedRecordWriter(rec) as writer:
            for k, payload in enumerate(records):
                writer.write(k, payload)
        corrupt(rec, edits, cut)
        corrupt(idx, idx_edits, idx_cut)

        try:
            reader = IndexedRecordReader(rec)
        except RecordIOError:
            pass
        else:
            with reader:
                for p in range(len(reader)):
                    try:
                        reader.read_position(p)
                    except RecordIOError:
                        pass
        with RecordReader(rec) as seq:
            try:
                for _ in seq:
                    pass
            except RecordIOError:
                pass


# --------------------------------------------------------------------------- pickling


def test_pickle_sends_paths_and_keeps_parent_fd(tmp_path: Path) -> None:
    written = helpers.write_numbered(tmp_path / "p.rec", 200)
    reader = IndexedRecordReader(tmp_path / "p.rec")
    assert reader.read(3) == written[3]
    fd = reader._handle._cell[0]
    assert fd is not None
    blob = pickle.dumps(reader)
    assert len(blob) < 600  # paths, not the index
    copy = pickle.loads(blob)
    assert copy.read(199) == written[199]
    assert copy.keys.tolist() == reader.keys.tolist()
    assert copy._handle._cell[0] != fd
    copy.close()
    del copy
    gc.collect()
    os.fstat(fd)  # still open
    assert reader._handle._cell[0] == fd
    assert reader.read(150) == written[150]
    reader.close()

    seq = RecordReader(tmp_path / "p.rec")
    seq.read()
    seq2 = pickle.loads(pickle.dumps(seq))
    assert seq2.read() == seq.read() == written[1]
    seq.close()
    seq2.close()


# --------------------------------------------------------------------------- processes


def test_reader_inherited_by_fork_reopens(tmp_path: Path) -> None:
    written = helpers.write_numbered(tmp_path / "f.rec", 60)
    reader = IndexedRecordReader(tmp_path / "f.rec")
    assert reader.read(0) == written[0]
    parent_fd = reader._handle._cell[0]
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=helpers.child_reads_inherited, args=(reader, send))
    proc.start()
    send.close()
    try:
        assert recv.poll(60), "child sent nothing"
        result = recv.recv()
    finally:
        recv.close()
        proc.join(60)
        if proc.is_alive():  # pragma: no cover - only on a hang
            proc.kill()
            proc.join()
    assert "error" not in result, result["error"]
    assert result["digests"] == [helpers.digest(written[k]) for k in range(60)]
    assert result["same_index"] is True
    assert result["opened_by"] == result["pid"] != os.getpid()
    assert proc.exitcode == 0
    # The child closed its copy; the parent's descriptor is the same and still works.
    assert reader._handle._cell[0] == parent_fd
    assert reader.read(59) == written[59]
    reader.close()


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_reader_in_pool_workers(tmp_path: Path, method: str) -> None:
    written = helpers.write_numbered(tmp_path / "w.rec", 80)
    reader = IndexedRecordReader(tmp_path / "w.rec")
    reader.read(0)  # the parent's descriptor is open while workers use theirs
    keys = list(range(80))
    ctx = multiprocessing.get_context(method)
    pool = ctx.Pool(2)
    try:
        results = pool.starmap(helpers.read_keys, [(reader, keys[0::2]), (reader, keys[1::2])])
    finally:
        pool.close()
        pool.join()
    assert results[0][1] == [helpers.digest(written[k]) for k in keys[0::2]]
    assert results[1][1] == [helpers.digest(written[k]) for k in keys[1::2]]
    assert all(pid != os.getpid() for pid, _ in results)
    assert reader.read(79) == written[79]
    reader.close()


def _child_tries_to_write(writer: RecordWriter, conn: Any) -> None:
    try:
        writer.write(b"from the child")
        conn.send("wrote")
    except RuntimeError as err:
        conn.send(f"refused: {err}")
    finally:
        writer.close()  # must not flush the parent's pending bytes
        conn.close()


def test_writer_inherited_by_fork_writes_nothing(tmp_path: Path) -> None:
    writer = RecordWriter(tmp_path / "c.rec")
    writer.write(b"pending in the parent's buffer")
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_tries_to_write, args=(writer, send))
    proc.start()
    send.close()
    try:
        assert recv.poll(60)
        answer = recv.recv()
    finally:
        recv.close()
        proc.join(60)
    assert answer.startswith("refused")
    writer.write(b"second")
    writer.close()
    with RecordReader(tmp_path / "c.rec") as reader:
        assert list(reader) == [b"pending in the parent's buffer", b"second"]


# --------------------------------------------------------------------------- threads


def test_threads_share_one_reader(tmp_path: Path) -> None:
    written = helpers.write_numbered(tmp_path / "t.rec", 300)
    keys = list(written)
    with IndexedRecordReader(tmp_path / "t.rec") as reader, RecordReader(tmp_path / "t.rec") as seq:

        def work(seed: int) -> bool:
            order = random.Random(seed).sample(keys, len(keys))
            ok = all(reader.read(k) == written[k] for k in order)
            return ok and list(seq) == [written[k] for k in keys]

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(work, range(8)))


def test_close_while_threads_read(tmp_path: Path) -> None:
    written = helpers.write_numbered(tmp_path / "c.rec", 50)
    reader = IndexedRecordReader(tmp_path / "c.rec")
    started = threading.Barrier(5)
    outcomes: list[str] = []
    lock = threading.Lock()

    def work(seed: int) -> None:
        rng = random.Random(seed)
        started.wait()
        try:
            while True:
                k = rng.randrange(50)
                if reader.read(k) != written[k]:
                    outcome = "wrong data"
                    break
        except ValueError as err:
            outcome = "closed" if "closed" in str(err) else repr(err)
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait()
    reader.close()
    for t in threads:
        t.join(60)
    assert outcomes == ["closed"] * 4
