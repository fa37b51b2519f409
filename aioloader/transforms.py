"""Small image transforms on Pillow images and ``uint8`` numpy arrays.

Enough for the demo, the benchmarks and ``pack``; for anything richer use torchvision or
albumentations (``docs/recordio.md`` shows how). Every transform is a picklable callable
object, so it can travel to worker processes inside a dataset.

Image arguments are a ``PIL.Image.Image`` or a ``uint8`` numpy array of shape
``(H, W)`` or ``(H, W, C)``; the geometric transforms return the same kind they were
given. :class:`ToArray` turns images into arrays and :class:`Normalize` works on arrays.

Random transforms take their numbers from :func:`aioloader.sample_rng`: inside a loader
that generator is seeded from ``(seed, epoch, sample index)``, so a sample gets the same
augmentation whichever worker loads it and whatever ``num_workers`` is; outside a loader
it is drawn from numpy's global generator (``numpy.random.seed`` makes a script
reproducible).

The implementation lives in :mod:`aioloader._formats`; this module is its public face.
"""

from __future__ import annotations

from ._formats import publish
from ._formats.transforms import (
    CenterCrop,
    Compose,
    Interpolation,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    ToArray,
)
from ._formats.transforms import ImageLike as ImageLike
from ._seeding import sample_rng as sample_rng

__all__ = [
    "CenterCrop",
    "Compose",
    "Interpolation",
    "Normalize",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "Resize",
    "ToArray",
]

publish(globals(), __all__)
