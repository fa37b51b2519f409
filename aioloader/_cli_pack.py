"""``python -m aioloader pack`` and ``python -m aioloader inspect``.

``pack`` is an ``im2rec``-style packer: it reads an image folder (one sub-folder per
class), re-encodes every image as JPEG, and writes an MXNet-compatible ``.rec`` + ``.idx``
pair whose records carry the class index as their label. The encoding runs on the
aioloader pool (``DataLoader`` over :class:`EncodeDataset`), so it uses every worker.

``inspect`` summarises a record file: record count, key range, labels and the sizes of
the first images.
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import sys
from collections.abc import Generator, Sequence
from typing import Any, TextIO

import numpy as np
from PIL import Image

from .datasets import ImageDecodeError, ImageFolder
from .errors import RecordIOError
from .recordio import (
    IndexedRecordReader,
    IndexedRecordWriter,
    IRHeader,
    RecordReader,
    pack_header,
    unpack_header,
)
from .transforms import Resize

__all__ = ["EncodeDataset", "inspect_main", "pack_main"]


class EncodeDataset:
    """Map-style dataset: sample ``i`` is ``(i, record)``, an encoded image record.

    The record is an image-record header (``flag`` 0, ``label`` the class index,
    ``id`` = ``i``, ``id2`` = 0) followed by the image re-encoded as RGB JPEG at
    ``quality``, after resizing its shorter side to ``resize`` pixels when given. It is
    defined in a module (not in a function) so that worker processes can import it.
    Raises :class:`~aioloader.datasets.ImageDecodeError` for a file that does not decode.
    """

    def __init__(self, folder: ImageFolder, *, resize: int | None = None, quality: int = 95) -> None:
        self.folder = folder
        self.resize = None if resize is None else Resize(resize)
        self.quality = int(quality)

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, index: int) -> tuple[int, bytes]:
        i = int(index)
        img = self.folder.open_image(i)
        if self.resize is not None:
            img = self.resize(img)
        out = io.BytesIO()
        img.save(out, format="JPEG", quality=self.quality)
        label = float(self.folder.labels[i])
        return i, pack_header(IRHeader(0, label, i, 0), out.getvalue())


def _find_loader() -> Any:
    """``aioloader.DataLoader`` when the package provides it, else ``None``."""
    try:
        return getattr(importlib.import_module("aioloader"), "DataLoader", None)
    except ImportError:
        return None


def _encoded_batches(
    dataset: EncodeDataset, workers: int, batch_size: int, err: TextIO
) -> Generator[list[tuple[int, bytes]], None, None]:
    if workers > 0:
        loader_cls = _find_loader()
        if loader_cls is not None:
            loader = loader_cls(
                dataset, batch_size=batch_size, num_workers=workers, collate_fn=list
            )
            try:
                yield from loader
            finally:
                close = getattr(loader, "close", None)
                if callable(close):
                    close()
            return
        print(
            "pack: warning: aioloader.DataLoader is not available; encoding in this process",
            file=err,
        )
    # --workers 0: encode in this process, same batches, no pool.
    for start in range(0, len(dataset), batch_size):
        stop = min(start + batch_size, len(dataset))
        yield [dataset[i] for i in range(start, stop)]


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _pack_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m aioloader pack",
        description=(
            "Pack an image folder (one sub-folder per class) into an MXNet-compatible "
            ".rec + .idx pair; labels are class indices in sorted folder-name order."
        ),
    )
    parser.add_argument("image_dir", metavar="IMAGE_DIR", help="root folder of the images")
    parser.add_argument("output", metavar="OUT.rec", help="record file to write (.idx beside it)")
    parser.add_argument(
        "--resize", type=int, default=None, metavar="N", help="resize the shorter side to N pixels"
    )
    parser.add_argument(
        "--quality", type=int, default=95, metavar="Q", help="JPEG quality, 1-100 (default 95)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=min(4, os.cpu_count() or 1),
        metavar="N",
        help="encoding worker processes; 0 encodes in this process (default: min(4, CPUs))",
    )
    parser.add_argument(
        "--batch-size", type=int, default=32, metavar="B", help="images per worker task"
    )
    return parser


def pack_main(argv: Sequence[str] | None = None) -> int:
    """Run ``pack`` with command-line arguments ``argv``; return the exit status.

    Writes ``OUT.rec`` and ``OUT.idx`` (keys 0..N-1 in sorted path order), first under
    temporary names that replace the outputs only once everything is written, so a
    failed run leaves no half-written pair. Prints a progress bar on stderr and a summary
    on stdout. Returns 1 (with a message on stderr) for a missing folder or an image that
    does not decode; exits with status 2 for invalid arguments.
    """
    parser = _pack_parser()
    args = parser.parse_args(argv)
    if args.resize is not None and args.resize <= 0:
        parser.error(f"--resize must be positive, got {args.resize}")
    if not 1 <= args.quality <= 100:
        parser.error(f"--quality must be between 1 and 100, got {args.quality}")
    if args.workers < 0:
        parser.error(f"--workers must be 0 or more, got {args.workers}")
    if args.batch_size <= 0:
        parser.error(f"--batch-size must be positive, got {args.batch_size}")

    from tqdm import tqdm

    class _Bar(tqdm):  # type: ignore[misc]
        # No monitor thread: the bar is updated after every batch anyway.
        monitor_interval = 0

    rec_path = os.fspath(args.output)
    idx_path = os.path.splitext(rec_path)[0] + ".idx"
    try:
        folder = ImageFolder(args.image_dir)
    except (FileNotFoundError, NotADirectoryError) as err:
        print(f"pack: error: {err}", file=sys.stderr)
        return 1
    if len(folder) == 0:
        print(f"pack: error: no image files under {folder.root}", file=sys.stderr)
        return 1
    dataset = EncodeDataset(folder, resize=args.resize, quality=args.quality)

    tmp_rec, tmp_idx = rec_path + ".partial", idx_path + ".partial"
    writer = IndexedRecordWriter(tmp_rec, tmp_idx)
    batches = _encoded_batches(dataset, args.workers, args.batch_size, sys.stderr)
    done = False
    try:
        with _Bar(total=len(dataset), unit="img", desc="pack", file=sys.stderr) as bar:
            for batch in batches:
                for index, record in batch:
                    writer.write(index, record)
                bar.update(len(batch))
        writer.close()
        os.replace(tmp_rec, rec_path)
        os.replace(tmp_idx, idx_path)
        done = True
    except ImageDecodeError as err:
        print(f"pack: error: {err}", file=sys.stderr)
        return 1
    finally:
        batches.close()
        writer.close()
        if not done:
            _remove_quietly(tmp_rec)
            _remove_quietly(tmp_idx)
    size = os.path.getsize(rec_path)
    print(
        f"packed {len(dataset)} images in {len(folder.classes)} classes into {rec_path} "
        f"({size:,} bytes) and {idx_path}"
    )
    return 0


def _inspect_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m aioloader inspect",
        description="Summarise a RecordIO file: records, keys, labels, first image sizes.",
    )
    parser.add_argument("file", metavar="FILE.rec", help="record file (its .idx is used if present)")
    parser.add_argument(
        "--first", type=int, default=5, metavar="N", help="describe the first N records (default 5)"
    )
    return parser


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


def inspect_main(argv: Sequence[str] | None = None) -> int:
    """Run ``inspect`` with command-line arguments ``argv``; print to stdout; return the status.

    Reads the whole file once (sequentially) to count records and summarise labels.
    Returns 1 with a message on stderr when the file is missing or malformed.
    """
    parser = _inspect_parser()
    args = parser.parse_args(argv)
    rec_path = os.fspath(args.file)
    idx_path = os.path.splitext(rec_path)[0] + ".idx"
    out = sys.stdout
    try:
        keys = None
        if os.path.exists(idx_path):
            with IndexedRecordReader(rec_path, idx_path) as indexed:
                keys = indexed.keys.copy()
        scalar: list[float] = []
        vector_sizes: dict[int, int] = {}
        other = 0
        first: list[str] = []
        count = 0
        with RecordReader(rec_path) as reader:
            for payload in reader:
                if count < args.first:
                    line, header = _describe(payload)
                    first.append(line)
                else:
                    try:
                        header, _ = unpack_header(payload)
                    except RecordIOError:
                        header = None
                if header is None:
                    other += 1
                elif header.flag > 0:
                    vector_sizes[header.flag] = vector_sizes.get(header.flag, 0) + 1
                else:
                    scalar.append(float(header.label))
                count += 1
    except (RecordIOError, OSError) as err:
        print(f"inspect: error: {err}", file=sys.stderr)
        return 1

    print(f"file:     {rec_path} ({os.path.getsize(rec_path):,} bytes)", file=out)
    if keys is None:
        print("index:    none (no .idx beside the file)", file=out)
        print(f"records:  {count}", file=out)
    else:
        print(f"index:    {idx_path}", file=out)
        note = "" if len(keys) == count else f" (the .rec holds {count})"
        print(f"records:  {len(keys)}{note}", file=out)
        if len(keys):
            unique = len(np.unique(keys))
            dup = "" if unique == len(keys) else f", {len(keys) - unique} repeated"
            print(f"keys:     {int(keys.min())} .. {int(keys.max())}{dup}", file=out)
    if scalar:
        values, counts = np.unique(np.asarray(scalar, np.float32), return_counts=True)
        pairs = list(zip(values.tolist(), counts.tolist(), strict=True))[:10]
        shown = ", ".join(f"{v:g}: {c}" for v, c in pairs)
        more = "" if len(values) <= 10 else f", ... ({len(values)} distinct)"
        print(f"labels:   {len(scalar)} scalar; counts {{{shown}{more}}}", file=out)
    for size, n in sorted(vector_sizes.items()):
        print(f"labels:   {n} vectors of {size} float32", file=out)
    if other:
        print(f"labels:   {other} records are not image records", file=out)
    if first:
        print(f"first {len(first)} records:", file=out)
        for i, line in enumerate(first):
            key = f"key {int(keys[i])}" if keys is not None and i < len(keys) else f"#{i}"
            print(f"  {key}: {line}", file=out)
    return 0
