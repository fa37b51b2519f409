"""Map-style image datasets: a folder tree, MXNet record files, and the demo's JPEGs.

Every dataset here is cheap to send to worker processes: per-sample metadata lives in a
few numpy arrays (not in Python lists of strings or tuples), and record readers pickle
as their paths. Each dataset is safe to use after a fork and from several threads.

Images are decoded with Pillow to RGB. Without a ``transform`` a sample's image is a
``uint8`` array of shape ``(H, W, 3)``; with one, the transform receives the decoded
``PIL.Image.Image`` (RGB) and whatever it returns is the image. That is the calling
convention of torchvision's transforms and of :mod:`aioloader.transforms`.

:class:`SyntheticJpegDataset` is the data set of ``python -m aioloader demo``: synthetic
JPEGs written once to a cache folder, a dataset factory ``bench`` can measure
(``python -m aioloader bench aioloader.datasets:SyntheticJpegDataset``).

The implementation lives in :mod:`aioloader._formats`; this module is its public face.
"""

from __future__ import annotations

from ._formats import publish
from ._formats.datasets import IMG_EXTENSIONS as IMG_EXTENSIONS
from ._formats.datasets import ImageFolder as ImageFolder
from ._formats.datasets import ImageRecordDataset as ImageRecordDataset
from ._formats.datasets import Label as Label
from ._formats.datasets import RecordFileDataset as RecordFileDataset
from ._formats.datasets import Transform as Transform
from ._formats.image_record import unpack_header as unpack_header
from ._formats.rio_files import StrPath as StrPath
from ._formats.rio_index import IndexedRecordReader as IndexedRecordReader
from ._formats.synthetic import SyntheticJpegDataset as SyntheticJpegDataset
from .errors import ImageDecodeError as ImageDecodeError
from .errors import RecordIOError as RecordIOError

__all__ = [
    "IMG_EXTENSIONS",
    "ImageDecodeError",
    "ImageFolder",
    "ImageRecordDataset",
    "RecordFileDataset",
    "SyntheticJpegDataset",
]

publish(globals(), __all__)
