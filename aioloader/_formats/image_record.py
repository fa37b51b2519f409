"""Image records: the 24-byte header ``im2rec`` puts before each encoded image."""

from __future__ import annotations

import numbers
import struct
from typing import Any, NamedTuple, TypeAlias

import numpy as np
import numpy.typing as npt

from .rio_files import Buffer, as_view, fail

__all__ = ["IRHeader", "pack_header", "unpack_header"]

_IR = struct.Struct("<IfQQ")


class IRHeader(NamedTuple):
    """The header of an image record (MXNet's ``IRHeader``).

    ``flag``: 0 for a single label, otherwise the number of ``float32`` labels stored
    after the header. ``label``: the label as a float, or (when ``flag > 0``) a
    ``float32`` array of the labels. ``id``, ``id2``: two free unsigned 64-bit integers
    (``im2rec`` puts the image's index in ``id``).
    """

    flag: int
    label: float | npt.NDArray[np.float32]
    id: int
    id2: int


_HeaderLike: TypeAlias = "IRHeader | tuple[int, Any, int, int]"


def pack_header(header: _HeaderLike, payload: Buffer = b"") -> bytes:
    """Return the 24-byte image-record header, any extra labels, then ``payload``.

    As in MXNet's ``recordio.pack``: a numeric ``label`` is stored in the header and
    ``flag`` is written as 0 whatever it was; any other label (a sequence or an array,
    even of one element) is converted to ``float32``, ``flag`` becomes its length, the
    header's label is 0 and the values follow the header. Raises :class:`ValueError` for
    ``id``/``id2`` outside ``[0, 2**64)``.
    """
    flag, label, ident, ident2 = header
    if isinstance(label, numbers.Number) and not isinstance(label, (complex, np.complexfloating)):
        flag, head_label, extra = 0, float(label), b""  # type: ignore[arg-type]
    else:
        labels = np.asarray(label, dtype=np.float32).ravel()
        flag, head_label, extra = labels.size, 0.0, labels.astype("<f4").tobytes()
        if flag == 0:
            raise ValueError("a vector label needs at least one value")
    try:
        head = _IR.pack(flag, head_label, int(ident), int(ident2))
    except (struct.error, OverflowError) as err:
        raise ValueError(f"cannot pack image-record header {tuple(header)!r}: {err}") from None
    return head + extra + as_view(payload).tobytes()


def unpack_header(
    record: Buffer, *, path: str | None = None, key: int | None = None
) -> tuple[IRHeader, bytes]:
    """Split an image record into its :class:`IRHeader` and the bytes after the labels.

    When ``flag > 0`` the header's ``label`` is a fresh ``float32`` array of ``flag``
    values read from after the header; otherwise it is the header's float. Raises
    :class:`~aioloader.errors.RecordIOError` (naming ``path`` and ``key`` when given)
    when the record is too short for its header or its labels.
    """
    view = as_view(record)
    if view.nbytes < _IR.size:
        raise fail(
            f"record of {view.nbytes} bytes is too short for an image-record header ({_IR.size} bytes)",
            path,
            key,
            None,
        )
    flag, label, ident, ident2 = _IR.unpack_from(view)
    body_start = _IR.size
    value: float | npt.NDArray[np.float32] = label
    if flag > 0:
        body_start += 4 * flag
        if view.nbytes < body_start:
            raise fail(
                f"image-record header announces {flag} float32 labels, but the record has "
                f"only {view.nbytes - _IR.size} bytes after its header",
                path,
                key,
                None,
            )
        value = np.frombuffer(view, dtype="<f4", count=flag, offset=_IR.size).astype(np.float32)
    return IRHeader(flag, value, ident, ident2), view[body_start:].tobytes()
