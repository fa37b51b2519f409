"""Synthetic photo-like JPEGs: the demo's and the benchmarks' data set.

:func:`make_synthetic_jpegs` writes the files once into a folder tree that
:class:`~aioloader.datasets.ImageFolder` reads; :class:`SyntheticJpegDataset` is that
folder, ready to load, and is what ``python -m aioloader bench
aioloader.datasets:SyntheticJpegDataset`` measures.

Image ``k`` is a pure function of ``(seed, k)``: a size of 320-512 pixels a side, a
colour gradient and Gaussian noise (standard deviation 12) cut from a noise field drawn
once per process. The noise makes the JPEGs compress and decode like photographs, not
like flat colour; taking it from one field instead of drawing it per image makes writing
about five times faster. The files can be written by several processes at once (see
``run`` in :func:`make_synthetic_jpegs`): which process writes an image does not change it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from PIL import Image

from .datasets import ImageFolder, Transform
from .progress import progress_bar
from .rio_files import StrPath
from .transforms import Compose, RandomHorizontalFlip, RandomResizedCrop, ToArray

__all__ = [
    "JpegWriter",
    "SyntheticJpegDataset",
    "default_cache",
    "make_synthetic_jpegs",
    "synthetic_image",
    "train_transform",
]

# Part of the folder's completion marker: when the generator changes, folders written
# by an older version are written again instead of being mistaken for this version's.
_GENERATOR = "v2"
_FIELD = 1024  # side of the noise field; images are at most 512 pixels a side
_noise_fields: dict[int, npt.NDArray[np.float32]] = {}


def default_cache() -> Path:
    """``$AIOLOADER_CACHE``, else ``$XDG_CACHE_HOME/aioloader``, else ``~/.cache/aioloader``."""
    base = os.environ.get("AIOLOADER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "aioloader"
    )
    return Path(base)


def _noise_field(seed: int) -> npt.NDArray[np.float32]:
    field = _noise_fields.get(seed)
    if field is None:
        rng = np.random.default_rng([seed, 0x5EED])
        field = rng.normal(0.0, 12.0, (_FIELD, _FIELD, 3)).astype(np.float32)
        _noise_fields[seed] = field
    return field


def synthetic_image(k: int, seed: int = 0) -> Image.Image:
    """Image ``k`` of the synthetic set drawn from ``seed`` (RGB, 320-512 px a side)."""
    rng = np.random.default_rng([seed, k])
    h, w = (int(v) for v in rng.integers(320, 513, size=2))
    oy, ox = (int(v) for v in rng.integers(0, _FIELD - 512 + 1, size=2))
    c = rng.random(3, dtype=np.float32)
    y = np.linspace(0, 127.5, h, dtype=np.float32)
    x = np.linspace(0, 127.5, w, dtype=np.float32)
    # Built as (h, w * 3) so that numpy's inner loops run along whole rows, not along
    # the three channels (ten times faster than broadcasting (h, 1, 3) with (1, w, 3)).
    img = np.multiply.outer(y, np.tile(1 - c, w))
    img += (x[:, None] * c).ravel()
    img = img.reshape(h, w, 3)
    img += _noise_field(seed)[oy : oy + h, ox : ox + w]
    np.clip(img, 0, 255, out=img)
    return Image.fromarray(img.astype(np.uint8))


class JpegWriter:
    """Map-style dataset whose sample ``k`` writes image ``k`` and returns its size in bytes.

    Load it with any loader to write the set in parallel. Each file is written under a
    hidden temporary name of its own writer (process and thread) and renamed into place,
    so an interrupted run never leaves a truncated JPEG where
    :class:`~aioloader.datasets.ImageFolder` would find it, and two writers of the same
    image (a loader that builds the next epoch ahead of time) never trip over each other.
    """

    def __init__(self, root: StrPath, count: int, classes: int, seed: int) -> None:
        self.root = Path(root)
        self.count = int(count)
        self.classes = int(classes)
        self.seed = int(seed)

    def __len__(self) -> int:
        return self.count

    def path(self, k: int) -> Path:
        """Where image ``k`` goes: ``root/class_NN/kkkkk.jpg``, class ``k % classes``."""
        return self.root / f"class_{k % self.classes:02d}" / f"{k:05d}.jpg"

    def __getitem__(self, k: int) -> int:
        if not 0 <= k < self.count:
            raise IndexError(f"image {k} out of range for {self.count} images")
        path = self.path(k)
        tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
        synthetic_image(k, self.seed).save(tmp, format="JPEG", quality=90)
        os.replace(tmp, path)
        return path.stat().st_size


def _in_process(writer: JpegWriter) -> Iterable[Sequence[int]]:
    for start in range(0, len(writer), 32):
        yield [writer[k] for k in range(start, min(start + 32, len(writer)))]


def _remove_strays(writer: JpegWriter) -> None:
    # A folder written with other parameters may hold images (or whole class folders)
    # this set does not have; ImageFolder would count them.
    for folder in writer.root.glob("class_*"):
        if not folder.is_dir():
            continue
        for f in folder.iterdir():
            if f.name.startswith(".") and f.suffix == ".tmp":  # left by an interrupted run
                f.unlink(missing_ok=True)
                continue
            if f.suffix != ".jpg" or not f.stem.isdigit():
                continue
            k = int(f.stem)
            if k >= writer.count or writer.path(k) != f:
                f.unlink()
        if not any(folder.iterdir()):
            folder.rmdir()


def make_synthetic_jpegs(
    root: StrPath,
    count: int = 1024,
    classes: int = 8,
    seed: int = 0,
    *,
    progress: bool = True,
    run: Callable[[JpegWriter], Iterable[Sequence[int]]] | None = None,
) -> Path:
    """Write ``count`` JPEGs in ``classes`` folders under ``root``; return ``root``.

    Idempotent: a folder completed earlier with the same ``count``, ``classes`` and
    ``seed`` (by this version of the generator) is reused as it is. ``run`` loads a
    :class:`JpegWriter` and yields its results in batches (a ``DataLoader`` with
    ``collate_fn=list`` writes in parallel); by default the files are written in this
    process. ``progress`` shows a bar on stderr while files are written.
    """
    root = Path(root)
    done = root / ".complete"
    marker = f"{_GENERATOR} {count} {classes} {seed}"
    if done.exists() and done.read_text() == marker:
        return root
    writer = JpegWriter(root, count, classes, seed)
    if root.is_dir():
        _remove_strays(writer)
    for c in range(min(classes, count)):
        writer.path(c).parent.mkdir(parents=True, exist_ok=True)
    batches = (run or _in_process)(writer)
    with progress_bar(count, f"writing {count} JPEGs", disable=not progress) as bar:
        for batch in batches:
            bar.update(len(batch))
    done.write_text(marker)
    return root


def train_transform(size: int = 224) -> Compose:
    """The demo's and benchmarks' augmentation: RandomResizedCrop, random flip, to array."""
    return Compose([RandomResizedCrop(size), RandomHorizontalFlip(), ToArray()])


class SyntheticJpegDataset(ImageFolder):
    """The demo's data set: synthetic JPEGs, decoded and augmented like a training set.

    The ``count`` JPEGs (see :func:`make_synthetic_jpegs`) are written on first use to
    ``root``, by default ``default_cache() / f"demo-jpegs-{count}"``, the folder
    ``python -m aioloader demo`` uses, and reused afterwards. A sample is ``(image,
    label)``: with ``transform="train"`` (the default) the image is a ``uint8`` array of
    shape ``(224, 224, 3)``, randomly cropped and flipped; with ``None`` it is the whole
    decoded image; any other callable is applied to the decoded ``PIL`` image. Every
    argument has a default, so the class itself is a dataset factory for ``bench``.
    """

    def __init__(
        self,
        count: int = 1024,
        *,
        root: StrPath | None = None,
        classes: int = 8,
        seed: int = 0,
        transform: Transform | Literal["train"] | None = "train",
        progress: bool = True,
    ) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be a positive int, got {count!r}")
        if isinstance(classes, bool) or not isinstance(classes, int) or not 1 <= classes <= count:
            raise ValueError(f"classes must be an int between 1 and count ({count}), got {classes!r}")
        if isinstance(transform, str) and transform != "train":
            raise ValueError(f"transform must be a callable, None or 'train', got {transform!r}")
        folder = default_cache() / f"demo-jpegs-{count}" if root is None else Path(root)
        make_synthetic_jpegs(folder, count, classes, seed, progress=progress)
        chosen: Any = train_transform() if transform == "train" else transform
        super().__init__(folder, chosen)
