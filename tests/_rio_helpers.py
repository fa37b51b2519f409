"""Helpers for the RecordIO tests that child processes must be able to import.

Kept in a module of their own (not in a test file) so that forkserver and spawn children
unpickle them without importing pytest test modules.
"""

from __future__ import annotations

import hashlib
import os
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from aioloader.recordio import IndexedRecordReader, IndexedRecordWriter

MXNET_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "mxnet"  # see fixtures/README.md


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def payload_for(key: int) -> bytes:
    """A deterministic payload of varied length, some with aligned magic words inside."""
    body = hashlib.sha256(str(key).encode()).digest() * (1 + key % 7)
    if key % 3 == 0:
        body = b"\x0a\x23\xd7\xce" + body[: 4 * (key % 5)] + b"\x0a\x23\xd7\xce" + body
    return body[: len(body) - key % 4]


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
