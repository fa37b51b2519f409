"""Record files in Apache MXNet's RecordIO format (``.rec`` + ``.idx``), both directions.

The format, in short (the full description is in ``docs/recordio.md``):

* A record is stored as one or more *parts*. Each part is an 8-byte header, two
  little-endian ``uint32`` words: the magic ``0xCED7230A`` and ``lrec``, whose top three
  bits are the continuation flag (``cflag``) and whose low 29 bits are the part's length.
  The part's bytes follow, zero-padded to a multiple of four.
* A payload that contains the magic word at an offset divisible by four is cut there:
  the magic word is left out and the pieces become parts with ``cflag`` 1 (first),
  2 (middle) and 3 (last). A record that was not cut is a single part with ``cflag`` 0.
  Readers put the magic word back between the pieces. Occurrences at other offsets are
  stored as they are. This keeps every 4-aligned magic word in the file a part header,
  so a reader that lost its place can find the next record by scanning for it.
* A record must be shorter than ``2**29`` bytes.
* The ``.idx`` file is text, one ``key<TAB>offset`` line per record in the order they
  were written; the offset is that of the record's first part header in the ``.rec``.
* Image records (what ``im2rec`` writes) start with a 24-byte header, ``<IfQQ``:
  ``flag``, ``label``, ``id``, ``id2``; when ``flag > 0`` it counts the ``float32``
  labels that follow the header (and ``label`` is unused). See :func:`pack_header`.

Readers are safe to use from several threads and from several processes: every read is
an ``os.pread`` at an absolute offset, so no file position is shared; the file is opened
lazily and again whenever ``os.getpid()`` changes (after a fork the child gets its own
descriptor and never touches the parent's); a reader pickles as its paths, so sending
one to a spawned or forkserver worker costs a few hundred bytes and the parent's
descriptor stays open. A parsed index is kept (as numpy arrays) across those reopenings.

Every malformed input raises :class:`aioloader.errors.RecordIOError`, whose message
names the file, the key and the byte offset, also available as attributes.

The implementation lives in :mod:`aioloader._formats` (``rio_*.py``, ``image_record.py``);
this module is its public face.
"""

from __future__ import annotations

from ._formats import publish
from ._formats.image_record import IRHeader as IRHeader
from ._formats.image_record import pack_header as pack_header
from ._formats.image_record import unpack_header as unpack_header
from ._formats.rio_files import MAGIC as MAGIC
from ._formats.rio_files import MAX_RECORD_SIZE as MAX_RECORD_SIZE
from ._formats.rio_files import Buffer as Buffer
from ._formats.rio_files import StrPath as StrPath
from ._formats.rio_index import IndexedRecordReader as IndexedRecordReader
from ._formats.rio_read import RecordReader as RecordReader
from ._formats.rio_write import IndexedRecordWriter as IndexedRecordWriter
from ._formats.rio_write import RecordWriter as RecordWriter
from .errors import RecordIOError as RecordIOError

__all__ = [
    "MAGIC",
    "MAX_RECORD_SIZE",
    "IRHeader",
    "IndexedRecordReader",
    "IndexedRecordWriter",
    "RecordReader",
    "RecordWriter",
    "pack_header",
    "unpack_header",
]

publish(globals(), __all__)
