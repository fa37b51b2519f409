"""ImageFolder and the record-file datasets (the contract is in :mod:`aioloader.datasets`)."""

from __future__ import annotations

import io
import os
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
from PIL import Image

from ..errors import ImageDecodeError, RecordIOError
from .image_record import unpack_header
from .objstore import is_url
from .rio_files import StrPath
from .rio_index import IndexedRecordReader
from .rio_remote import RecordDecoder, RecordSpan, RemoteRecordFile

IMG_EXTENSIONS: tuple[str, ...] = (
    ".bmp",
    ".gif",
    ".jpeg",
    ".jpg",
    ".pgm",
    ".png",
    ".ppm",
    ".tif",
    ".tiff",
    ".webp",
)
"""File extensions :class:`ImageFolder` picks up by default (compared case-insensitively)."""

Transform: TypeAlias = Callable[[Image.Image], Any]
Label: TypeAlias = "np.float32 | npt.NDArray[np.float32]"


def _decode_rgb(source: str | bytes, *, path: str, key: int | None, reduced: bool = False) -> Image.Image:
    """Decode ``source`` (a file path or encoded bytes) to a loaded RGB Pillow image.

    ``reduced`` lets a JPEG decode at an eighth of its size (other formats ignore it):
    every byte of the compressed stream is still read, so damage is still found.
    """
    try:
        with Image.open(source if isinstance(source, str) else io.BytesIO(source)) as img:
            if reduced:
                img.draft("RGB", (1, 1))
            return img.convert("RGB")  # convert() loads the pixels: errors surface here
    except MemoryError:
        raise
    except Exception as err:
        # Pillow reports bad data with many types (OSError, ValueError, SyntaxError,
        # struct.error, DecompressionBombError...); one type with the location is more
        # useful to a caller, and the original stays attached as the cause.
        where = path if key is None else f"{path}, key {key}"
        raise ImageDecodeError(
            f"{where}: cannot decode image ({type(err).__name__}: {err})", path=path, key=key
        ) from err


def verify_image(data: bytes, *, path: str) -> None:
    """Raise :class:`ImageDecodeError` naming ``path`` unless ``data`` decodes as an image."""
    _decode_rgb(data, path=path, key=None, reduced=True)


def _finish(img: Image.Image, transform: Transform | None) -> Any:
    if transform is None:
        return np.array(img)  # a writable (H, W, 3) uint8 copy
    return transform(img)


def _normalize_index(index: int, n: int) -> int:
    i = int(index)
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"index {index} out of range for a dataset of {n} samples")
    return i


class ImageFolder:
    """Images in ``root/<class name>/**/<file>``, one class per sub-folder of ``root``.

    Classes are the sub-folders' names in sorted order, numbered from 0; the files of a
    class are found recursively (symbolic links followed) and sorted by path. Files and
    folders whose names start with a dot are skipped, as are files whose extension is not
    in ``extensions`` (pass ``None`` to take every file). A sample is ``(image, label)``
    with ``label`` an ``int``; see the module docstring for ``transform``.

    Raises :class:`FileNotFoundError` when ``root`` has no class folder, and (when a
    sample is loaded) :class:`ImageDecodeError`, an :class:`OSError` naming the file, for
    an unreadable or non-image file.
    """

    def __init__(
        self,
        root: StrPath,
        transform: Transform | None = None,
        *,
        extensions: Iterable[str] | None = IMG_EXTENSIONS,
    ) -> None:
        self.root = os.fsdecode(os.fspath(root))
        self.transform = transform
        exts = None if extensions is None else tuple(e.lower() for e in extensions)
        try:
            entries = sorted(
                e.name for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith(".")
            )
        except FileNotFoundError:
            raise FileNotFoundError(f"image folder root not found: {self.root}") from None
        if not entries:
            raise FileNotFoundError(f"no class folders (sub-directories) in {self.root}")
        self.classes: list[str] = entries
        self.class_to_idx: dict[str, int] = {name: i for i, name in enumerate(entries)}

        # Relative paths are stored as one UTF-8 blob plus offsets: a million paths cost
        # two arrays, not a million str objects to pickle for every worker.
        blob = bytearray()
        bounds = [0]
        labels: list[int] = []
        for label, name in enumerate(entries):
            for rel in self._walk(name, exts):
                blob += os.fsencode(rel)
                bounds.append(len(blob))
                labels.append(label)
        self._blob = np.frombuffer(bytes(blob), dtype=np.uint8)
        self._bounds = np.asarray(bounds, dtype=np.int64)
        self._labels = np.asarray(labels, dtype=np.int64)
        for a in (self._blob, self._bounds, self._labels):
            a.setflags(write=False)

    def _walk(self, class_name: str, exts: tuple[str, ...] | None) -> list[str]:
        found: list[str] = []
        top = os.path.join(self.root, class_name)
        for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for fname in sorted(filenames):
                if fname.startswith("."):
                    continue
                if exts is not None and not fname.lower().endswith(exts):
                    continue
                found.append(os.path.relpath(os.path.join(dirpath, fname), self.root))
        return found

    @property
    def labels(self) -> npt.NDArray[np.int64]:
        """The class index of every sample (a read-only ``int64`` array)."""
        return self._labels

    def path(self, index: int) -> str:
        """The file path of sample ``index`` (joined to :attr:`root`)."""
        i = _normalize_index(index, len(self))
        rel = self._blob[self._bounds[i] : self._bounds[i + 1]].tobytes()
        return os.path.join(self.root, os.fsdecode(rel))

    def open_image(self, index: int) -> Image.Image:
        """Sample ``index``'s image, decoded to RGB, before any transform."""
        path = self.path(index)
        return _decode_rgb(path, path=path, key=None)

    def __len__(self) -> int:
        return len(self._labels)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        img = self.open_image(index)
        return _finish(img, self.transform), int(self._labels[_normalize_index(index, len(self))])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r}, classes={len(self.classes)}, samples={len(self)})"


RemoteParts: TypeAlias = (
    "tuple[Sequence[RecordSpan], Callable[[RecordSpan], Awaitable[Any]], Callable[[Any], Any]]"
)
"""What ``__aioloader_remote__()`` returns: ``(items, fetch, transform)``."""


class _RecordDataset:
    """What both record datasets share: one indexed reader (local or remote), used by position."""

    reader: IndexedRecordReader | RemoteRecordFile

    def __init__(
        self,
        path: StrPath,
        idx_path: StrPath | None = None,
        *,
        store_options: dict[str, Any] | None = None,
    ) -> None:
        if is_url(path):
            self.reader = RemoteRecordFile(str(path), idx_path, store_options)
        elif store_options is not None:
            raise ValueError(
                f"store_options is for record files at an object-store URL (s3://, gs://, az://, "
                f"http(s)://, file://); {os.fspath(path)!r} is a local path"
            )
        else:
            self.reader = IndexedRecordReader(path, idx_path)

    @property
    def keys(self) -> npt.NDArray[np.int64]:
        """The record keys, in ``.idx`` order."""
        return self.reader.keys

    def __len__(self) -> int:
        return len(self.reader)

    def close(self) -> None:
        """Close the underlying reader's descriptor in this process (copies keep theirs)."""
        self.reader.close()

    @property
    def __aioloader_remote__(self) -> Callable[[], RemoteParts]:
        """For a record file at a URL: the method that splits reading for the fetch stage.

        Calling it returns ``(items, fetch, transform)``: ``items[i]`` describes record
        ``i`` (a small picklable :class:`RecordSpan`), ``await fetch(item)`` range-reads
        its bytes on the event loop, and ``transform(raw)`` (picklable, run in a worker)
        turns them into exactly what ``dataset[i]`` returns. The attribute does not exist
        (:class:`AttributeError`; ``hasattr`` is False) for a local file: there is
        nothing to fetch, and workers read the file directly.
        """
        reader = self.reader
        if not isinstance(reader, RemoteRecordFile):
            raise AttributeError(f"{type(self).__name__} over a local file has no fetch stage")
        return self._remote_parts

    def _remote_parts(self) -> RemoteParts:
        reader = self.reader
        assert isinstance(reader, RemoteRecordFile)
        return reader.spans, reader.fetcher, self._from_raw(reader.decoder)

    def _from_raw(self, decoder: RecordDecoder) -> Callable[[Any], Any]:
        return decoder

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.reader.path!r}, records={len(self)})"


class RecordFileDataset(_RecordDataset):
    """The raw payloads of an indexed record file, by position in its ``.idx``.

    ``dataset[i]`` is the bytes of the record on line ``i`` of the ``.idx`` (negative
    indices count from the end). ``idx_path`` defaults to the ``.rec`` path with its
    extension replaced by ``.idx``. Errors are those of
    :class:`~aioloader.recordio.IndexedRecordReader`.

    ``path`` may be an object-store URL (``"s3://bucket/train.rec"``, ``gs://``,
    ``az://``, ``http(s)://``, ``file://``); ``store_options`` are then the
    :class:`aioloader.io.ObjectStore` options (``endpoint``, ``region``,
    ``skip_signature``...), and ``idx_path`` may be a URL or a local path. The ``.idx``
    is read once, here; each record is a range read, blocking in a worker for
    ``dataset[i]``, or on the event loop through ``__aioloader_remote__``.
    """

    def __getitem__(self, index: int) -> bytes:
        return self.reader.read_position(index)


class ImageRecordDataset(_RecordDataset):
    """Image records (as written by ``im2rec`` or ``python -m aioloader pack``).

    ``dataset[i]`` is ``(image, label)`` for the record on line ``i`` of the ``.idx``.
    Labels follow MXNet: when the record header's ``flag`` is 0 the label is the header's
    value as a ``numpy.float32``; when ``flag > 0`` it is a ``float32`` array of the
    ``flag`` values stored after the header. Images are decoded to RGB (MXNet's own
    helpers give BGR; reverse the last axis for that). See the module docstring for
    ``transform``. ``path`` may be an object-store URL, with ``store_options``, as for
    :class:`RecordFileDataset`.

    Raises :class:`~aioloader.errors.RecordIOError` for a malformed file or header and
    :class:`ImageDecodeError` when the image bytes do not decode.
    """

    def __init__(
        self,
        path: StrPath,
        transform: Transform | None = None,
        *,
        idx_path: StrPath | None = None,
        store_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(path, idx_path, store_options=store_options)
        self.transform = transform

    def header(self, index: int) -> tuple[int, Label, int, int]:
        """``(flag, label, id, id2)`` of sample ``index``, without decoding the image."""
        i = _normalize_index(index, len(self))
        record = self.reader.read_position(i)
        h, _ = unpack_header(record, path=self.reader.path, key=int(self.reader.keys[i]))
        return h.flag, _label(h.flag, h.label), h.id, h.id2

    def __getitem__(self, index: int) -> tuple[Any, Label]:
        i = _normalize_index(index, len(self))
        record = self.reader.read_position(i)
        return image_sample(
            record, path=self.reader.path, key=int(self.reader.keys[i]), transform=self.transform
        )

    def _from_raw(self, decoder: RecordDecoder) -> Callable[[Any], Any]:
        return _ImageFromRaw(decoder, self.transform)


def image_sample(record: bytes, *, path: str, key: int, transform: Transform | None) -> tuple[Any, Label]:
    """An image record's ``(image, label)``, as :class:`ImageRecordDataset` returns it."""
    head, encoded = unpack_header(record, path=path, key=key)
    img = _decode_rgb(encoded, path=path, key=key)
    return _finish(img, transform), _label(head.flag, head.label)


class _ImageFromRaw:
    """The fetch stage's transform for image records: fetched bytes -> ``(image, label)``."""

    def __init__(self, decoder: RecordDecoder, transform: Transform | None) -> None:
        self.decoder = decoder
        self.transform = transform

    def __call__(self, raw: tuple[RecordSpan, bytes]) -> tuple[Any, Label]:
        record = self.decoder(raw)
        return image_sample(record, path=self.decoder.path, key=raw[0].key, transform=self.transform)


def _label(flag: int, value: Any) -> Label:
    if flag > 0:
        if not isinstance(value, np.ndarray):  # pragma: no cover - unpack_header's contract
            raise RecordIOError(f"image-record label with flag {flag} is not an array")
        return value
    return np.float32(value)
