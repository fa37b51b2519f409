"""``python -m aioloader pack``: an ``im2rec``-style packer.

It reads an image folder (one sub-folder per class) and writes an MXNet-compatible
``.rec`` + ``.idx`` pair whose records carry the class index as their label, and the
``.lst`` list file ``im2rec`` writes beside them (``index<TAB>label<TAB>relative path``,
the relative path starting with the class folder's name). As with ``im2rec``, images are
re-encoded as JPEG by default and stored byte for byte with ``--pass-through``. The work
runs on the aioloader pool (``DataLoader`` over :class:`EncodeDataset`), on every worker.
"""

from __future__ import annotations

import argparse
import io
import os
from collections.abc import Generator, Sequence
from typing import Any

from .._formats.datasets import verify_image
from .._formats.progress import progress_bar
from ..datasets import ImageDecodeError, ImageFolder
from ..recordio import IndexedRecordWriter, IRHeader, pack_header
from ..transforms import Resize
from . import error, program, usage_error

__all__ = ["EncodeDataset", "pack_main"]


class EncodeDataset:
    """Map-style dataset: sample ``i`` is ``(i, record)``, the image record of image ``i``.

    The record is an image-record header (``flag`` 0, ``label`` the class index,
    ``id`` = ``i``, ``id2`` = 0) followed by the image: with ``pass_through`` its file's
    bytes as they are (checked to decode), otherwise the image re-encoded as an RGB JPEG
    at ``quality``, after resizing its shorter side to ``resize`` pixels when given.
    Defined in a module (not in a function) so that worker processes can import it.
    Raises :class:`~aioloader.datasets.ImageDecodeError` for a file that does not decode.
    """

    def __init__(
        self,
        folder: ImageFolder,
        *,
        resize: int | None = None,
        quality: int = 95,
        pass_through: bool = False,
    ) -> None:
        if pass_through and resize is not None:
            raise ValueError("pass_through stores the file as it is: it cannot resize")
        self.folder = folder
        self.resize = None if resize is None else Resize(resize)
        self.quality = int(quality)
        self.pass_through = bool(pass_through)

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, index: int) -> tuple[int, bytes]:
        i = int(index)
        if self.pass_through:
            path = self.folder.path(i)
            with open(path, "rb") as f:
                body = f.read()
            verify_image(body, path=path)
        else:
            img = self.folder.open_image(i)
            if self.resize is not None:
                img = self.resize(img)
            out = io.BytesIO()
            img.save(out, format="JPEG", quality=self.quality)
            body = out.getvalue()
        label = float(self.folder.labels[i])
        return i, pack_header(IRHeader(0, label, i, 0), body)


def _encoded_batches(
    dataset: EncodeDataset, workers: int, batch_size: int
) -> Generator[list[tuple[int, bytes]], None, None]:
    if workers > 0:
        from ..loader import DataLoader

        with DataLoader(dataset, batch_size=batch_size, num_workers=workers, collate_fn=list) as loader:
            yield from loader
        return
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
        prog=f"{program()} pack",
        description=(
            "Pack an image folder (one sub-folder per class) into an MXNet-compatible "
            ".rec + .idx pair and im2rec's .lst list; labels are class indices in sorted "
            "folder-name order."
        ),
    )
    parser.add_argument("image_dir", metavar="IMAGE_DIR", help="root folder of the images")
    parser.add_argument("output", metavar="OUT.rec", help="record file to write (.idx and .lst beside it)")
    parser.add_argument(
        "--pass-through",
        "--no-reencode",
        dest="pass_through",
        action="store_true",
        help="store each file's bytes as they are (im2rec's --pass-through); default: re-encode as JPEG",
    )
    parser.add_argument(
        "--resize", type=int, default=None, metavar="N", help="resize the shorter side to N pixels"
    )
    parser.add_argument(
        "--quality", type=int, default=None, metavar="Q", help="JPEG quality, 1-100 (default 95)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=min(4, os.cpu_count() or 1),
        metavar="N",
        help="encoding worker processes; 0 encodes in this process (default: min(4, CPUs))",
    )
    parser.add_argument("--batch-size", type=int, default=32, metavar="B", help="images per worker task")
    return parser


def _output_problem(rec_path: str) -> str | None:
    """Why ``rec_path`` (and the files beside it) cannot be written, or ``None``."""
    ext = os.path.splitext(rec_path)[1].lower()
    if ext in (".idx", ".lst"):
        return f"{rec_path}: the record file must not end in {ext}, pack writes that file beside it"
    folder = os.path.dirname(os.path.abspath(rec_path))
    if os.path.isdir(rec_path):
        return f"{rec_path} is a folder; name the record file to write, e.g. {os.path.join(rec_path, 'data.rec')}"
    if not os.path.exists(folder):
        return f"cannot write {rec_path}: folder {folder} does not exist"
    if not os.path.isdir(folder):
        return f"cannot write {rec_path}: {folder} is not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot write {rec_path}: folder {folder} is not writable"
    return None


def _list_lines(folder: ImageFolder) -> list[str]:
    """im2rec's ``.lst``: ``index<TAB>label<TAB>path`` (label as ``%f``, path relative to the root)."""
    lines = []
    for i in range(len(folder)):
        rel = os.path.relpath(folder.path(i), folder.root)
        if "\t" in rel or "\n" in rel or "\r" in rel:
            raise ValueError(f"{folder.path(i)}: a tab or line break in a file name cannot go in a .lst")
        lines.append(f"{i}\t{float(folder.labels[i]):f}\t{rel}\n")
    return lines


def _input_problem(image_dir: str) -> str | None:
    """Why ``IMAGE_DIR`` cannot be read as an image folder, or None when it is a folder."""
    if not os.path.exists(image_dir):
        return f"IMAGE_DIR {image_dir} does not exist"
    if not os.path.isdir(image_dir):
        return f"IMAGE_DIR {image_dir} is not a folder"
    return None


def pack_main(argv: Sequence[str] | None = None) -> int:
    """Run ``pack`` with command-line arguments ``argv``; return the exit status.

    Writes ``OUT.rec``, ``OUT.idx`` (keys 0..N-1 in sorted path order) and ``OUT.lst``,
    first under temporary names that replace the outputs only once everything is written,
    so a failed run leaves nothing half-written. Prints a progress bar on stderr and a
    summary on stdout. Returns 2 (one line on stderr) when the outputs cannot be written
    or ``IMAGE_DIR`` is not a folder, checked before any image is read; 1 for a folder
    without images or an image that does not decode; exits with status 2 for invalid
    arguments.
    """
    parser = _pack_parser()
    args = parser.parse_args(argv)
    if args.pass_through and (args.resize is not None or args.quality is not None):
        parser.error("--pass-through stores the files as they are: it excludes --resize and --quality")
    if args.resize is not None and args.resize <= 0:
        parser.error(f"--resize must be positive, got {args.resize}")
    quality = 95 if args.quality is None else args.quality
    if not 1 <= quality <= 100:
        parser.error(f"--quality must be between 1 and 100, got {quality}")
    if args.workers < 0:
        parser.error(f"--workers must be 0 or more, got {args.workers}")
    if args.batch_size <= 0:
        parser.error(f"--batch-size must be positive, got {args.batch_size}")

    rec_path = os.fspath(args.output)
    stem = os.path.splitext(rec_path)[0]
    outputs = (rec_path, stem + ".idx", stem + ".lst")
    problem = _output_problem(rec_path) or _input_problem(args.image_dir)
    if problem is not None:
        return usage_error("pack", problem)
    try:
        folder = ImageFolder(args.image_dir)
        if len(folder) == 0:
            raise FileNotFoundError(f"no image files under {folder.root}")
        lines = _list_lines(folder)
    except (OSError, ValueError) as err:
        error("pack", err)
        return 1
    dataset = EncodeDataset(folder, resize=args.resize, quality=quality, pass_through=args.pass_through)
    status = _write(dataset, lines, outputs, args.workers, args.batch_size)
    if status == 0:
        size = os.path.getsize(rec_path)
        how = "stored as they are" if args.pass_through else "re-encoded as JPEG"
        print(
            f"packed {len(dataset)} images ({how}) in {len(folder.classes)} classes into "
            f"{rec_path} ({size:,} bytes), {outputs[1]} and {outputs[2]}"
        )
    return status


def _write(
    dataset: EncodeDataset, lines: list[str], outputs: tuple[str, str, str], workers: int, batch_size: int
) -> int:
    tmp = [p + ".partial" for p in outputs]
    done = False
    batches: Any = None
    try:
        writer = IndexedRecordWriter(tmp[0], tmp[1])
        try:
            batches = _encoded_batches(dataset, workers, batch_size)
            with progress_bar(len(dataset), "pack") as bar:
                for batch in batches:
                    for index, record in batch:
                        writer.write(index, record)
                    bar.update(len(batch))
        finally:
            writer.close()
        with open(tmp[2], "w", encoding="utf-8", newline="\n") as f:
            f.writelines(lines)
        for src, dst in zip(tmp, outputs, strict=True):
            os.replace(src, dst)
        done = True
    except ImageDecodeError as err:
        error("pack", err)
        return 1
    except OSError as err:  # the disk filled up, the folder went away...
        error("pack", f"writing {outputs[0]}: {err}")
        return 1
    finally:
        if batches is not None:
            batches.close()
        if not done:
            for p in tmp:
                _remove_quietly(p)
    return 0
