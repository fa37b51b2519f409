"""Helpers for the RecordIO, dataset and command-line tests that child processes must be
able to import (record payloads, readers run in children, small image trees).

Kept in a module of their own (not in a test file) so that forkserver and spawn children
unpickle them without importing pytest test modules.
"""

from __future__ import annotations

import hashlib
import os
import struct
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from PIL import Image

from aioloader.recordio import MAGIC, IndexedRecordReader, IndexedRecordWriter

MXNET_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "mxnet"  # see fixtures/README.md


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def payload_for(key: int) -> bytes:
    """A deterministic payload of varied length, some with aligned magic words inside."""
    body = hashlib.sha256(str(key).encode()).digest() * (1 + key % 7)
    if key % 3 == 0:
        body = b"\x0a\x23\xd7\xce" + body[: 4 * (key % 5)] + b"\x0a\x23\xd7\xce" + body
    return body[: len(body) - key % 4]


def write_raw(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def part(cflag: int, data: bytes) -> bytes:
    """One part as it lies on disk: header, data, zero padding to four bytes."""
    return struct.pack("<II", MAGIC, cflag << 29 | len(data)) + data + b"\0" * (-len(data) % 4)


def write_numbered(path: Path, n: int, first_key: int = 0) -> dict[int, bytes]:
    """Write records ``payload_for(k)`` under keys ``first_key..``; return them."""
    written: dict[int, bytes] = {}
    with IndexedRecordWriter(path) as writer:
        for k in range(first_key, first_key + n):
            written[k] = payload_for(k)
            writer.write(k, written[k])
    return written


def read_keys(reader: IndexedRecordReader, keys: list[int]) -> tuple[int, list[str]]:
    """Pool task: read ``keys`` through a reader that arrived by pickling."""
    return os.getpid(), [digest(reader.read(k)) for k in keys]


def child_reads_inherited(reader: IndexedRecordReader, conn: Connection) -> None:
    """Process target (fork): read through a reader inherited from the parent.

    Reports the digests, whether the index arrays survived the reopen untouched and
    which process opened the descriptor used.
    """
    result: dict[str, Any] = {}
    try:
        keys_before = reader.keys
        result["digests"] = [digest(reader.read(int(k))) for k in reader.keys]
        result["same_index"] = reader.keys is keys_before
        result["opened_by"] = reader._handle._cell[1]
        result["pid"] = os.getpid()
        reader.close()
    except BaseException as err:  # report, so the parent's assertion shows it
        result["error"] = repr(err)
    conn.send(result)
    conn.close()


def solid(path: Path, size: tuple[int, int], color: tuple[int, int, int], mode: str = "RGB") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", size, color)
    if mode != "RGB":
        img = img.convert(mode)
    img.save(path)


def make_tree(root: Path) -> dict[str, list[str]]:
    """Three classes, nested folders, a grayscale PNG and files that must be skipped."""
    layout = {
        "cat": ["a.png", "b.jpg", "sub/c.png"],
        "dog": ["x.PNG", "y.png"],
        "ant": ["only.png"],
    }
    for i, (cls, files) in enumerate(sorted(layout.items())):
        for j, name in enumerate(files):
            solid(root / cls / name, (10 + j, 8 + i), (40 * i, 20 * j, 200))
    solid(root / "dog" / "gray.png", (6, 5), (90, 90, 90), mode="L")
    layout["dog"].insert(0, "gray.png")
    (root / "cat" / "README.txt").write_text("not an image")
    (root / "cat" / ".hidden.png").write_bytes(b"")
    (root / ".cache").mkdir()
    (root / "loose.png").write_bytes(b"")  # files directly in root are not a class
    return layout
