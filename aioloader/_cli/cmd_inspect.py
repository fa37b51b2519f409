"""``python -m aioloader inspect``: summarise a record file.

Record count, key range (from the ``.idx`` beside the file), labels, the class names
(from an ``im2rec``/``pack`` ``.lst`` beside it) and the first records' headers and
image sizes.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt
from PIL import Image

from ..errors import RecordIOError
from ..recordio import MAGIC, IndexedRecordReader, RecordReader, unpack_header
from . import error, program, usage_error

__all__ = ["inspect_main"]

_INT = re.compile(rb"-?[0-9]+")
_FLOAT = re.compile(rb"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def _inspect_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{program()} inspect",
        description="Summarise a RecordIO file: records, keys, labels, classes, first image sizes.",
    )
    parser.add_argument(
        "file", metavar="FILE.rec", help="record file (the .idx and .lst beside it are used if present)"
    )
    parser.add_argument(
        "--first", type=int, default=5, metavar="N", help="describe the first N records (default 5)"
    )
    return parser


def _wrong_file(path: str) -> str | None:
    """Why ``path`` is an index or a list file rather than a record file, or ``None``.

    A record file starts with a part header (the magic word) unless it is empty; an
    ``.idx`` starts with a ``key<TAB>offset`` line, a ``.lst`` with
    ``index<TAB>label...<TAB>path``.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None  # the reader reports it, with its own message
    if head.startswith(struct.pack("<I", MAGIC)):
        return None
    fields = head.split(b"\n", 1)[0].rstrip(b"\r").split(b"\t")
    ext = os.path.splitext(path)[1].lower()
    if (len(fields) == 2 and all(_INT.fullmatch(f) for f in fields)) or (not head and ext == ".idx"):
        what = "an index file (.idx: key<TAB>offset lines)"
    elif (
        len(fields) >= 3 and _INT.fullmatch(fields[0]) and all(_FLOAT.fullmatch(f) for f in fields[1:-1])
    ) or (not head and ext == ".lst"):
        what = "an image list file (.lst: index<TAB>label<TAB>path lines)"
    else:
        return None
    rec = os.path.splitext(path)[0] + ".rec"
    hint = f"inspect {rec}" if rec != path and os.path.exists(rec) else "pass the .rec file it belongs to"
    return f"{path} is {what}, not a record file; {hint}"


def _describe(payload: bytes) -> tuple[str, Any]:
    """One line about an image record, and its header (``None`` when it is not one)."""
    try:
        header, body = unpack_header(payload)
    except RecordIOError:
        return f"{len(payload)} bytes, not an image record", None
    label = header.label
    shown = (
        "[" + ", ".join(f"{v:g}" for v in label.tolist()) + "]"
        if isinstance(label, np.ndarray)
        else f"{label:g}"
    )
    try:
        with Image.open(io.BytesIO(body)) as img:
            image = f"{img.format} {img.size[0]}x{img.size[1]} {img.mode}"
    except Exception:
        image = f"{len(body)} bytes, not a decodable image"
    return f"flag {header.flag}, label {shown}, id {header.id}, id2 {header.id2}, {image}", header


def _class_names(lst_path: str) -> dict[float, str] | None:
    """Label -> class folder name, from the first path component of each ``.lst`` line."""
    names: dict[float, str] = {}
    try:
        with open(lst_path, encoding="utf-8") as f:
            for line in f:
                fields = line.rstrip("\r\n").split("\t")
                if len(fields) < 3:
                    return None
                head, sep, _ = fields[-1].replace(os.sep, "/").partition("/")
                if sep:
                    names.setdefault(float(fields[1]), head)
    except (OSError, ValueError):
        return None
    return names or None


@dataclass
class _Summary:
    count: int = 0
    scalar: list[float] = field(default_factory=list)
    vector_sizes: dict[int, int] = field(default_factory=dict)
    other: int = 0
    first: list[str] = field(default_factory=list)

    def add(self, payload: bytes, describe: bool) -> None:
        if describe:
            line, header = _describe(payload)
            self.first.append(line)
        else:
            try:
                header, _ = unpack_header(payload)
            except RecordIOError:
                header = None
        if header is None:
            self.other += 1
        elif header.flag > 0:
            self.vector_sizes[header.flag] = self.vector_sizes.get(header.flag, 0) + 1
        else:
            self.scalar.append(float(header.label))
        self.count += 1


def inspect_main(argv: Sequence[str] | None = None) -> int:
    """Run ``inspect`` with command-line arguments ``argv``; print to stdout; return the status.

    Reads the whole file once (sequentially) to count records and summarise labels.
    Returns 1 with a message on stderr when the file is missing or malformed, 2 when it
    is an ``.idx`` or ``.lst`` rather than a record file; exits with status 2 for
    invalid arguments (``--first`` below 0).
    """
    parser = _inspect_parser()
    args = parser.parse_args(argv)
    if args.first < 0:
        parser.error(f"--first must be 0 or more, got {args.first}")
    rec_path = os.fspath(args.file)
    wrong = _wrong_file(rec_path)
    if wrong is not None:
        return usage_error("inspect", wrong)
    idx_path, lst_path = (os.path.splitext(rec_path)[0] + ext for ext in (".idx", ".lst"))
    summary = _Summary()
    try:
        keys = None
        if os.path.exists(idx_path):
            with IndexedRecordReader(rec_path, idx_path) as indexed:
                keys = indexed.keys.copy()
        with RecordReader(rec_path) as reader:
            for payload in reader:
                summary.add(payload, summary.count < args.first)
    except (RecordIOError, OSError) as err:
        error("inspect", err)
        return 1
    classes = _class_names(lst_path) if os.path.exists(lst_path) else None
    _report(sys.stdout, rec_path, idx_path, lst_path, keys, classes, summary)
    return 0


def _report(
    out: TextIO,
    rec_path: str,
    idx_path: str,
    lst_path: str,
    keys: npt.NDArray[np.int64] | None,
    classes: dict[float, str] | None,
    s: _Summary,
) -> None:
    print(f"file:     {rec_path} ({os.path.getsize(rec_path):,} bytes)", file=out)
    if keys is None:
        print("index:    none (no .idx beside the file)", file=out)
        print(f"records:  {s.count}", file=out)
    else:
        print(f"index:    {idx_path}", file=out)
        note = "" if len(keys) == s.count else f" (the .rec holds {s.count})"
        print(f"records:  {len(keys)}{note}", file=out)
        if len(keys):
            unique = len(np.unique(keys))
            dup = "" if unique == len(keys) else f", {len(keys) - unique} repeated"
            print(f"keys:     {int(keys.min())} .. {int(keys.max())}{dup}", file=out)
    if s.scalar:
        values, counts = np.unique(np.asarray(s.scalar, np.float32), return_counts=True)
        pairs = list(zip(values.tolist(), counts.tolist(), strict=True))[:10]
        shown = ", ".join(f"{v:g}: {c}" for v, c in pairs)
        more = "" if len(values) <= 10 else f", ... ({len(values)} distinct)"
        print(f"labels:   {len(s.scalar)} scalar; counts {{{shown}{more}}}", file=out)
    for size, n in sorted(s.vector_sizes.items()):
        print(f"labels:   {n} vectors of {size} float32", file=out)
    if s.other:
        print(f"labels:   {s.other} records are not image records", file=out)
    if classes:
        named = sorted(classes.items())
        shown = ", ".join(f"{label:g}: {name}" for label, name in named[:10])
        more = "" if len(named) <= 10 else ", ..."
        print(f"classes:  {len(named)} (from {lst_path}): {shown}{more}", file=out)
    if s.first:
        records = "record" if len(s.first) == 1 else "records"
        print(f"first {len(s.first)} {records}:", file=out)
        for i, line in enumerate(s.first):
            key = f"key {int(keys[i])}" if keys is not None and i < len(keys) else f"#{i}"
            print(f"  {key}: {line}", file=out)
