"""aioloader.recordio: MXNet byte compatibility, round trips, bad files, processes, threads."""

from __future__ import annotations

import gc
import hashlib
import io
import json
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

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from aioloader.errors import RecordIOError
from aioloader.recordio import (
    MAGIC,
    MAX_RECORD_SIZE,
    IndexedRecordReader,
    IndexedRecordWriter,
    IRHeader,
    RecordReader,
    RecordWriter,
    pack_header,
    unpack_header,
)

try:
    from . import _rio_helpers as helpers
except ImportError:  # tests/ is not a package: pytest put it on sys.path
    import _rio_helpers as helpers  # type: ignore[no-redef]

FIX = helpers.MXNET_FIXTURES
MAGIC_BYTES = struct.pack("<I", MAGIC)
MANIFEST: dict[str, Any] = json.loads((FIX / "manifest.json").read_text())


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def reference_encode(payload: bytes) -> bytes:
    """The on-disk bytes of one record, written straight from the format description.

    Deliberately simple and independent of aioloader's writer: check every 4-aligned
    word, cut at the magic ones, flag the pieces, pad only the last.
    """
    cuts = [i for i in range(0, len(payload) - 3, 4) if payload[i : i + 4] == MAGIC_BYTES]
    pieces, prev = [], 0
    for c in cuts:
        pieces.append(payload[prev:c])
        prev = c + 4
    pieces.append(payload[prev:])
    out = bytearray()
    for j, piece in enumerate(pieces):
        if len(pieces) == 1:
            flag = 0
        else:
            flag = 1 if j == 0 else 3 if j == len(pieces) - 1 else 2
        out += struct.pack("<II", MAGIC, flag << 29 | len(piece)) + piece
    out += b"\0" * (-len(pieces[-1]) % 4)
    return bytes(out)


def write_raw(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def part(cflag: int, data: bytes) -> bytes:
    return struct.pack("<II", MAGIC, cflag << 29 | len(data)) + data + b"\0" * (-len(data) % 4)


# --------------------------------------------------------------------------- MXNet fixtures


def raw_payloads() -> dict[int, bytes]:
    """Every raw payload: from the manifest's hex where given, else read (and verified)."""
    small = {int(k): bytes.fromhex(v) for k, v in MANIFEST["raw_payload_hex_small"].items()}
    with IndexedRecordReader(FIX / "raw.rec") as reader:
        out = {}
        for entry in MANIFEST["raw"]:
            key = entry["key"]
            data = small[key] if key in small else reader.read(key)
            assert sha(data) == entry["sha256"]
            out[key] = data
    return out


def test_fixture_raw_records_match_manifest() -> None:
    small = MANIFEST["raw_payload_hex_small"]
    with IndexedRecordReader(FIX / "raw.rec") as reader:
        assert reader.keys.tolist() == [e["key"] for e in MANIFEST["raw"]]
        assert len(reader) == len(MANIFEST["raw"]) == 10
        for entry in MANIFEST["raw"]:
            data = reader.read(entry["key"])
            assert len(data) == entry["len"]
            assert sha(data) == entry["sha256"]
            if str(entry["key"]) in small:
                assert data.hex() == small[str(entry["key"])]
        lines = (FIX / "raw.idx").read_text().splitlines()
        assert reader.offsets.tolist() == [int(line.split("\t")[1]) for line in lines]


def test_fixture_raw_sequential_reader() -> None:
    expected = [e["sha256"] for e in MANIFEST["raw"]]
    with IndexedRecordReader(FIX / "raw.rec") as indexed, RecordReader(FIX / "raw.rec") as seq:
        scanned = list(seq.scan())
        assert [off for off, _ in scanned] == indexed.offsets.tolist()
        assert [sha(p) for p in seq] == expected
        got = []
        while (rec := seq.read()) is not None:
            got.append(sha(rec))
        assert got == expected
        assert seq.tell() == (FIX / "raw.rec").stat().st_size
        seq.reset()
        assert seq.tell() == 0
        first = seq.read()
        assert first is not None and sha(first) == expected[0]
        assert seq.read_at(int(indexed.offsets[7])) == indexed.read(7)


def test_fixture_images_match_manifest() -> None:
    with IndexedRecordReader(FIX / "images.rec") as reader:
        assert reader.keys.tolist() == [e["key"] for e in MANIFEST["images"]]
        for entry in MANIFEST["images"]:
            header, jpeg = unpack_header(reader.read(entry["key"]))
            assert header.flag == entry["mxnet_flag"]
            assert (header.id, header.id2) == (entry["id"], entry["id2"])
            if isinstance(entry["label"], list):
                assert isinstance(header.label, np.ndarray)
                assert header.label.dtype == np.float32
                assert header.label.tolist() == entry["label"]
                assert header.flag == len(entry["label"])
            else:
                assert header.label == entry["label"]
            assert len(jpeg) == entry["jpeg_len"]
            assert sha(jpeg) == entry["jpeg_sha256"]
            with Image.open(io.BytesIO(jpeg)) as img:
                assert img.size == (entry["width"], entry["height"])


def test_writer_bytes_equal_mxnet_raw(tmp_path: Path) -> None:
    # Keys 0-6 come from the manifest's hex; 7-9 (70,001, 4,096 and 776 bytes, given
    # only as sha256) come from our reader and are checked against the digests first.
    payloads = raw_payloads()
    rec, idx = tmp_path / "raw.rec", tmp_path / "raw.idx"
    with IndexedRecordWriter(rec) as writer:
        for entry in MANIFEST["raw"]:
            writer.write_idx(entry["key"], payloads[entry["key"]])
    assert rec.read_bytes() == (FIX / "raw.rec").read_bytes()
    assert idx.read_bytes() == (FIX / "raw.idx").read_bytes()
    # The same, one record at a time, from the format description alone.
    expected = b"".join(reference_encode(payloads[e["key"]]) for e in MANIFEST["raw"])
    assert expected == (FIX / "raw.rec").read_bytes()


def test_writer_bytes_equal_mxnet_images(tmp_path: Path) -> None:
    rec = tmp_path / "images.rec"
    with IndexedRecordReader(FIX / "images.rec") as reader, IndexedRecordWriter(rec) as writer:
        for entry in MANIFEST["images"]:
            _, jpeg = unpack_header(reader.read(entry["key"]))
            assert sha(jpeg) == entry["jpeg_sha256"]
            header = IRHeader(0, entry["label"], entry["id"], entry["id2"])
            writer.write(entry["key"], pack_header(header, jpeg))
    assert rec.read_bytes() == (FIX / "images.rec").read_bytes()
    assert (tmp_path / "images.idx").read_bytes() == (FIX / "images.idx").read_bytes()


def test_plain_writer_writes_the_same_rec(tmp_path: Path) -> None:
    payloads = raw_payloads()
    with RecordWriter(tmp_path / "plain.rec") as writer:
        offsets = [writer.write(payloads[k]) for k in sorted(payloads)]
        assert writer.tell() == (FIX / "raw.rec").stat().st_size
    assert (tmp_path / "plain.rec").read_bytes() == (FIX / "raw.rec").read_bytes()
    with IndexedRecordReader(FIX / "raw.rec") as reader:
        assert offsets == reader.offsets.tolist()


# --------------------------------------------------------------------------- round trips

chunks = st.one_of(st.binary(max_size=9), st.just(MAGIC_BYTES), st.just(MAGIC_BYTES * 2))
payloads_st = st.lists(chunks, max_size=10).map(b"".join)


@settings(max_examples=120, deadline=None, database=None)
@given(records=st.lists(payloads_st, min_size=1, max_size=8), keys_seed=st.integers(0, 2**16))
@example(records=[MAGIC_BYTES, b"x" + MAGIC_BYTES, b"ab" + MAGIC_BYTES + b"cd"], keys_seed=0)
@example(records=[b"abcd" + MAGIC_BYTES * 3 + b"e", b"", MAGIC_BYTES[:3]], keys_seed=1)
def test_round_trip_with_planted_magic(records: list[bytes], keys_seed: int) -> None:
    keys = random.Random(keys_seed).sample(range(-50, 1000), len(records))
    with tempfile.TemporaryDirectory() as d:
        rec = Path(d) / "x.rec"
        with IndexedRecordWriter(rec) as writer:
            for k, payload in zip(keys, records, strict=True):
                writer.write(k, payload)
        # Byte-exact against the format description, record by record.
        assert rec.read_bytes() == b"".join(reference_encode(p) for p in records)
        with IndexedRecordReader(rec) as reader:
            assert reader.keys.tolist() == keys
            for k, payload in zip(keys, records, strict=True):
                assert reader.read(k) == payload
            assert list(reader) == records
        with RecordReader(rec) as seq:
            assert list(seq) == records


def test_magic_split_only_at_aligned_offsets(tmp_path: Path) -> None:
    aligned = b"abcd" + MAGIC_BYTES + b"ef"
    unaligned = b"abc" + MAGIC_BYTES + b"ef"
    with RecordWriter(tmp_path / "a.rec") as writer:
        writer.write(aligned)
        second = writer.write(unaligned)
    data = (tmp_path / "a.rec").read_bytes()
    assert data[:second] == part(1, b"abcd") + part(3, b"ef")
    assert data[second:] == part(0, unaligned)
    with RecordReader(tmp_path / "a.rec") as reader:
        assert list(reader) == [aligned, unaligned]


def test_numpy_and_memoryview_payloads(tmp_path: Path) -> None:
    arr = np.arange(10, dtype=np.uint32)
    arr[4] = MAGIC
    with IndexedRecordWriter(tmp_path / "n.rec") as writer:
        writer.write(0, arr)
        writer.write(1, memoryview(b"hello"))
        writer.write(np.int64(2), bytearray(b"xyz"))
    with IndexedRecordReader(tmp_path / "n.rec") as reader:
        assert reader.read(0) == arr.tobytes()
        assert reader.read(1) == b"hello"
        assert reader.read(2) == b"xyz"


def test_record_of_2_29_bytes_is_refused(tmp_path: Path) -> None:
    huge = np.zeros(MAX_RECORD_SIZE + 1, dtype=np.uint8)  # calloc'd: no pages touched
    with RecordWriter(tmp_path / "big.rec") as writer:
        with pytest.raises(ValueError, match=r"2\*\*29"):
            writer.write(huge)
        assert writer.tell() == 0
        writer.write(b"ok")
    with RecordReader(tmp_path / "big.rec") as reader:
        assert list(reader) == [b"ok"]


# --------------------------------------------------------------------------- keys and API


def test_unsorted_and_repeated_keys(tmp_path: Path) -> None:
    rec = tmp_path / "k.rec"
    with RecordWriter(rec) as writer:
        offsets = [writer.write(p) for p in (b"a", b"b", b"c", b"d")]
    lines = [(5, 0), (-3, 1), (5, 2), (2, 3)]  # key 5 twice: the later line wins
    (tmp_path / "k.idx").write_text("".join(f"{k}\t{offsets[i]}\n" for k, i in lines))
    with IndexedRecordReader(rec) as reader:
        assert reader.keys.tolist() == [5, -3, 5, 2]
        assert reader.read(5) == b"c"
        assert reader.read(-3) == b"b"
        assert reader.read(np.int32(2)) == b"d"
        assert reader.read_position(0) == b"a"
        assert reader.read_position(-1) == b"d"
        assert reader.position(2) == 3
        assert 2 in reader and 7 not in reader and "x" not in reader
        with pytest.raises(KeyError):
            reader.read(7)
        with pytest.raises(IndexError):
            reader.read_position(4)
        with pytest.raises(TypeError):
            reader.read("5")  # type: ignore[arg-type]
        assert not reader.keys.flags.writeable


def test_consecutive_and_sparse_keys(tmp_path: Path) -> None:
    written = helpers.write_numbered(tmp_path / "c.rec", 5, first_key=-2)  # keys -2..2
    with IndexedRecordReader(tmp_path / "c.rec") as reader:
        assert [reader.read(k) for k in range(-2, 3)] == [written[k] for k in range(-2, 3)]
        for missing in (-3, 3):
            with pytest.raises(KeyError):
                reader.read(missing)
    with IndexedRecordReader(FIX / "images.rec") as reader:  # keys 1000, 1007, ...
        assert reader.position(1007) == 1
        with pytest.raises(KeyError):
            reader.read(1001)


def test_idx_with_crlf_and_no_final_newline(tmp_path: Path) -> None:
    helpers.write_numbered(tmp_path / "c.rec", 3)
    idx = tmp_path / "c.idx"
    text = idx.read_bytes().replace(b"\n", b"\r\n").rstrip(b"\r\n")
    idx.write_bytes(text)
    with IndexedRecordReader(tmp_path / "c.rec") as reader:
        assert reader.read(2) == helpers.payload_for(2)


def test_empty_files(tmp_path: Path) -> None:
    with IndexedRecordWriter(tmp_path / "e.rec"):
        pass
    with IndexedRecordReader(tmp_path / "e.rec") as reader:
        assert len(reader) == 0 and list(reader) == []
    with RecordReader(tmp_path / "e.rec") as seq:
        assert seq.read() is None and list(seq) == []


def test_writer_misuse(tmp_path: Path) -> None:
    writer = IndexedRecordWriter(tmp_path / "w.rec")
    writer.write(1, b"a")
    with pytest.raises(ValueError, match="already written"):
        writer.write(1, b"b")
    with pytest.raises(TypeError):
        writer.write("2", b"b")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pickle.dumps(writer)
    writer.close()
    writer.close()
    assert writer.closed
    with pytest.raises(ValueError, match="closed"):
        writer.write(3, b"c")
    with IndexedRecordReader(tmp_path / "w.rec") as reader:
        assert reader.keys.tolist() == [1]


def test_reader_close_and_context_manager() -> None:
    reader = IndexedRecordReader(FIX / "raw.rec")
    with reader:
        assert reader.read(2) == b"hello recordio"
    assert reader.closed
    reader.close()
    with pytest.raises(ValueError, match="closed"):
        reader.read(2)


def test_missing_idx_is_file_not_found(tmp_path: Path) -> None:
    (tmp_path / "lonely.rec").write_bytes(part(0, b"x"))
    with pytest.raises(FileNotFoundError):
        IndexedRecordReader(tmp_path / "lonely.rec")


# --------------------------------------------------------------------------- image headers


def test_pack_unpack_header() -> None:
    rec = pack_header(IRHeader(7, 3.5, 11, 12), b"img")
    assert len(rec) == 24 + 3
    header, body = unpack_header(rec)
    assert header == IRHeader(0, 3.5, 11, 12)  # a scalar label forces flag 0
    assert body == b"img"

    rec = pack_header((0, np.array([1.0, -2.5], np.float64), 1, 2), b"jpg")
    header, body = unpack_header(rec)
    assert header.flag == 2 and body == b"jpg"
    assert isinstance(header.label, np.ndarray) and header.label.dtype == np.float32
    assert header.label.tolist() == [1.0, -2.5]
    assert struct.unpack_from("<f", rec, 4)[0] == 0.0  # the header's own label is 0

    assert unpack_header(pack_header((0, np.float32(2), 0, 0)))[0].label == 2.0
    assert unpack_header(pack_header((0, [4.0], 0, 0)))[0].flag == 1  # a list stays a vector


def test_bad_headers() -> None:
    with pytest.raises(RecordIOError, match="too short"):
        unpack_header(b"\0" * 23, path="f.rec", key=4)
    short = struct.pack("<IfQQ", 3, 0.0, 0, 0) + b"\0" * 8
    with pytest.raises(RecordIOError, match="3 float32 labels") as info:
        unpack_header(short, path="f.rec", key=4)
    assert info.value.key == 4 and info.value.path == "f.rec"
    with pytest.raises(ValueError):
        pack_header((0, 1.0, -1, 0))
    with pytest.raises(ValueError):
        pack_header((0, [], 0, 0))


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
    ids=["letters", "space", "no-offset", "no-key", "blank", "three-fields", "negative-offset",
         "bare-sign", "hex", "huge"],
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
    ids=["starts-middle", "starts-last", "first-then-whole", "first-then-first", "cflag-5",
         "missing-last", "bad-continuation-magic", "short-data", "absurd-length"],
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


@settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    records=st.lists(payloads_st, min_size=1, max_size=6),
    edits=st.lists(st.tuples(st.integers(0, 2**20), st.one_of(interesting, st.integers(0, 255))),
                   max_size=4),
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
        data = bytearray(rec.read_bytes())
        for pos, value in edits:
            data[pos % len(data)] = value
        if cut is not None:
            del data[cut % (len(data) + 1) :]
        rec.write_bytes(bytes(data))
        text = bytearray(idx.read_bytes())
        for pos, value in idx_edits:
            text[pos % len(text)] = value
        if idx_cut is not None:
            del text[idx_cut % (len(text) + 1) :]
        idx.write_bytes(bytes(text))

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
