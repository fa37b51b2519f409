"""aioloader.recordio: MXNet byte compatibility, round trips, keys, image headers.

Bad files, pickling, processes and threads are in test_recordio_faults.py."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import random
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
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
part, write_raw = helpers.part, helpers.write_raw
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
