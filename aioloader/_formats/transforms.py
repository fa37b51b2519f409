"""The image transforms (the contract is in :mod:`aioloader.transforms`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, TypeAlias, TypeVar

import numpy as np
import numpy.typing as npt
from PIL import Image

from .._seeding import sample_rng

Interpolation: TypeAlias = Literal["nearest", "bilinear", "bicubic", "lanczos", "box", "hamming"]
ImageLike: TypeAlias = "Image.Image | npt.NDArray[np.uint8]"
_I = TypeVar("_I", Image.Image, "npt.NDArray[np.uint8]")

_RESAMPLE: dict[str, Image.Resampling] = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
    "box": Image.Resampling.BOX,
    "hamming": Image.Resampling.HAMMING,
}


def _resample(name: str) -> Image.Resampling:
    try:
        return _RESAMPLE[name]
    except KeyError:
        raise ValueError(f"interpolation must be one of {sorted(_RESAMPLE)}, got {name!r}") from None


def _pair(size: int | Sequence[int], name: str) -> tuple[int, int]:
    """``size`` as ``(height, width)``; a single int means a square."""
    if isinstance(size, (int, np.integer)):
        h = w = int(size)
    else:
        values = tuple(int(v) for v in size)
        if len(values) != 2:
            raise ValueError(f"{name} must be an int or (height, width), got {size!r}")
        h, w = values
    if h <= 0 or w <= 0:
        raise ValueError(f"{name} must be positive, got {size!r}")
    return h, w


def _to_pil(img: Any) -> tuple[Image.Image, bool]:
    """Return ``img`` as a Pillow image and whether it was a numpy array."""
    if isinstance(img, Image.Image):
        return img, False
    if isinstance(img, np.ndarray):
        if img.dtype != np.uint8 or img.ndim not in (2, 3):
            raise TypeError(
                f"expected a uint8 array of shape (H, W) or (H, W, C), got {img.dtype} "
                f"{img.shape}; geometric transforms come before ToArray/Normalize"
            )
        if img.ndim == 3 and img.shape[2] == 1:
            return Image.fromarray(np.ascontiguousarray(img[:, :, 0])), True
        return Image.fromarray(np.ascontiguousarray(img)), True
    raise TypeError(f"expected a PIL.Image.Image or a uint8 numpy array, got {type(img).__name__}")


def _from_pil(img: Image.Image, like: Any) -> Any:
    """Give ``img`` back in the kind ``like`` was (a Pillow image or an array)."""
    if not isinstance(like, np.ndarray):
        return img
    arr = np.array(img)
    if like.ndim == 3 and arr.ndim == 2:
        arr = arr[:, :, None]
    return arr


class Compose:
    """Apply ``transforms`` one after the other; the output of each feeds the next."""

    def __init__(self, transforms: Iterable[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, img: Any) -> Any:
        for t in self.transforms:
            img = t(img)
        return img

    def __repr__(self) -> str:
        inner = ", ".join(repr(t) for t in self.transforms)
        return f"Compose([{inner}])"


class Resize:
    """Resize to ``size``.

    An int resizes the shorter side to ``size`` and keeps the aspect ratio (the longer
    side is truncated to an int, as torchvision does); ``(height, width)`` resizes to
    exactly that. Pillow's reducing filters antialias when shrinking.
    """

    def __init__(self, size: int | Sequence[int], interpolation: Interpolation = "bilinear") -> None:
        if isinstance(size, (int, np.integer)):
            if size <= 0:
                raise ValueError(f"size must be positive, got {size!r}")
            self.size: int | tuple[int, int] = int(size)
        else:
            self.size = _pair(size, "size")
        self.interpolation = interpolation
        self._resample = _resample(interpolation)

    def output_size(self, width: int, height: int) -> tuple[int, int]:
        """``(width, height)`` after resizing an image of ``width`` x ``height``."""
        if isinstance(self.size, tuple):
            return self.size[1], self.size[0]
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.size, int(self.size * long / short)
        return (new_short, new_long) if width <= height else (new_long, new_short)

    def __call__(self, img: _I) -> _I:
        pil, _ = _to_pil(img)
        size = self.output_size(*pil.size)
        if size == pil.size:
            return img
        out: _I = _from_pil(pil.resize(size, self._resample), img)
        return out

    def __repr__(self) -> str:
        return f"Resize({self.size!r}, interpolation={self.interpolation!r})"


class CenterCrop:
    """Crop the centre ``size`` (an int for a square, or ``(height, width)``).

    An image smaller than ``size`` is padded with zeros to it (the crop box extends past
    its edges), so the output always has exactly ``size``.
    """

    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = _pair(size, "size")

    def __call__(self, img: _I) -> _I:
        pil, _ = _to_pil(img)
        th, tw = self.size
        w, h = pil.size
        if (w, h) == (tw, th):
            return img
        left = round((w - tw) / 2.0)
        top = round((h - th) / 2.0)
        out: _I = _from_pil(pil.crop((left, top, left + tw, top + th)), img)
        return out

    def __repr__(self) -> str:
        return f"CenterCrop({self.size!r})"


class RandomResizedCrop:
    """Crop a random area and aspect ratio, then resize it to ``size`` (Inception style).

    The crop covers a fraction of the image's area drawn uniformly from ``scale`` and
    has an aspect ratio (width / height) drawn log-uniformly from ``ratio``; after ten
    draws that do not fit, the largest centred crop with a ratio inside ``ratio`` is
    taken. Numbers come from :func:`~aioloader._seeding.sample_rng`.
    """

    def __init__(
        self,
        size: int | Sequence[int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
        interpolation: Interpolation = "bilinear",
    ) -> None:
        self.size = _pair(size, "size")
        if not 0 < scale[0] <= scale[1]:
            raise ValueError(f"scale must satisfy 0 < min <= max, got {scale!r}")
        if not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"ratio must satisfy 0 < min <= max, got {ratio!r}")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.interpolation = interpolation
        self._resample = _resample(interpolation)

    def crop_box(self, width: int, height: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
        """Draw the crop as ``(left, top, crop_width, crop_height)`` for a given image size."""
        area = width * height
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        for _ in range(10):
            target = area * rng.uniform(self.scale[0], self.scale[1])
            aspect = math.exp(rng.uniform(log_lo, log_hi))
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                top = int(rng.integers(0, height - h + 1))
                left = int(rng.integers(0, width - w + 1))
                return left, top, w, h
        # Fallback: the whole image, trimmed to the nearest allowed aspect ratio.
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            w, h = width, round(width / self.ratio[0])
        elif in_ratio > self.ratio[1]:
            w, h = round(height * self.ratio[1]), height
        else:
            w, h = width, height
        w, h = max(1, min(w, width)), max(1, min(h, height))
        return (width - w) // 2, (height - h) // 2, w, h

    def __call__(self, img: _I) -> _I:
        pil, _ = _to_pil(img)
        left, top, w, h = self.crop_box(pil.size[0], pil.size[1], sample_rng())
        th, tw = self.size
        resized = pil.resize((tw, th), self._resample, box=(left, top, left + w, top + h))
        out: _I = _from_pil(resized, img)
        return out

    def __repr__(self) -> str:
        return (
            f"RandomResizedCrop({self.size!r}, scale={self.scale!r}, ratio={self.ratio!r}, "
            f"interpolation={self.interpolation!r})"
        )


class RandomHorizontalFlip:
    """Mirror left-right with probability ``p`` (drawn from ``sample_rng()``)."""

    def __init__(self, p: float = 0.5) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {p!r}")
        self.p = float(p)

    def __call__(self, img: _I) -> _I:
        # Always draw, so the stream of numbers a sample sees does not depend on p.
        if sample_rng().random() >= self.p:
            return img
        if isinstance(img, np.ndarray):
            flipped: _I = np.ascontiguousarray(img[:, ::-1])
            return flipped
        if isinstance(img, Image.Image):
            return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        raise TypeError(f"expected a PIL.Image.Image or a numpy array, got {type(img).__name__}")

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p!r})"


class ToArray:
    """Turn an image into a numpy array.

    By default the result is ``uint8`` ``(H, W, C)`` (a grayscale image gets ``C = 1``).
    With ``float_chw=True`` it is ``float32`` ``(C, H, W)`` scaled to ``[0, 1]``, the
    layout torchvision's ``ToTensor`` produces. Arrays are accepted too (``(H, W)`` or
    ``(H, W, C)`` ``uint8``). The result is always a fresh, writable, contiguous array.
    """

    def __init__(self, *, float_chw: bool = False) -> None:
        self.float_chw = bool(float_chw)

    def __call__(self, img: ImageLike) -> npt.NDArray[Any]:
        if isinstance(img, Image.Image):
            arr = np.array(img)
        elif isinstance(img, np.ndarray):
            arr = np.array(img, copy=True)
        else:
            raise TypeError(f"expected a PIL.Image.Image or a numpy array, got {type(img).__name__}")
        if arr.ndim == 2:
            arr = arr[:, :, None]
        if arr.ndim != 3:
            raise ValueError(f"expected an image of shape (H, W) or (H, W, C), got {arr.shape}")
        if not self.float_chw:
            return arr
        if arr.dtype != np.uint8:
            raise TypeError(f"float_chw=True expects uint8 input, got {arr.dtype}")
        out = np.empty((arr.shape[2], arr.shape[0], arr.shape[1]), np.float32)
        np.multiply(arr.transpose(2, 0, 1), np.float32(1.0 / 255.0), out=out)
        return out

    def __repr__(self) -> str:
        return f"ToArray(float_chw={self.float_chw!r})"


class Normalize:
    """``(x - mean) / std`` per channel, on an array; returns ``float32``.

    ``channel_axis`` says where the channels are: 0 for ``(C, H, W)`` (what
    ``ToArray(float_chw=True)`` gives, the default), -1 for ``(H, W, C)``. Mean and std
    are in the input's units (e.g. ``[0.485, 0.456, 0.406]`` after ``float_chw``, or
    ``[123.7, 116.3, 103.5]`` on ``uint8``). Raises :class:`ValueError` when the number
    of channels does not match ``mean``.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float], *, channel_axis: int = 0) -> None:
        self.mean = np.asarray(mean, dtype=np.float32).ravel()
        self.std = np.asarray(std, dtype=np.float32).ravel()
        if self.mean.size == 0 or self.mean.shape != self.std.shape:
            raise ValueError(f"mean and std must be non-empty and of the same length, got {mean!r}, {std!r}")
        if np.any(self.std == 0):
            raise ValueError(f"std must not contain zeros, got {std!r}")
        self.channel_axis = int(channel_axis)

    def __call__(self, arr: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"Normalize expects a numpy array (use ToArray first), got {type(arr).__name__}")
        axis = self.channel_axis % arr.ndim if arr.ndim else 0
        if arr.ndim == 0 or arr.shape[axis] != self.mean.size:
            raise ValueError(
                f"expected {self.mean.size} channels on axis {self.channel_axis}, got shape {arr.shape}"
            )
        shape = [1] * arr.ndim
        shape[axis] = self.mean.size
        out: npt.NDArray[np.float32] = np.subtract(arr, self.mean.reshape(shape), dtype=np.float32)
        out /= self.std.reshape(shape)
        return out

    def __repr__(self) -> str:
        return (
            f"Normalize(mean={self.mean.tolist()!r}, std={self.std.tolist()!r}, "
            f"channel_axis={self.channel_axis})"
        )
