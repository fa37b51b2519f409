"""Mappings of slab files, and numpy views of them that keep the mapping alive.

Slabs are mapped with libc's ``mmap`` rather than :class:`mmap.mmap`: before 3.13,
``mmap.mmap`` keeps a ``dup()`` of the file descriptor for every mapping, so a consumer
with many workers would hold one fd per slab and run into the fd limit (torch's "too many
open files"). A raw mapping needs no fd once made; numpy sees it through
``__array_interface__``.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import weakref
from typing import Any

import numpy as np
import numpy.typing as npt

HEADER = 4096  # one page: keeps the data page-aligned
ALIGN = 64  # every leaf starts on a cache line

_libc: Any = None


def _lib() -> Any:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int64,
        ]
        lib.munmap.restype = ctypes.c_int
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = lib
    return _libc


def _munmap(addr: int, size: int) -> None:
    _lib().munmap(addr, size)


class _Mapping:
    """A read-write mapping of a whole file, shared (``MAP_SHARED``) or copy-on-write
    (``private``: writes stay in this process); unmapped when this object dies.

    Everything that reads or writes the memory holds this object (directly or through
    a numpy ``base`` chain), so the memory cannot be unmapped under an array.
    """

    __slots__ = ("__weakref__", "addr", "size")

    def __init__(self, fd: int, size: int, *, populate: bool, private: bool = False) -> None:
        flags = (mmap.MAP_PRIVATE if private else mmap.MAP_SHARED) | (
            getattr(mmap, "MAP_POPULATE", 0) if populate else 0
        )
        addr = _lib().mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
        self.addr: int = addr
        self.size = size
        # Not at interpreter exit: arrays may still be read while it shuts down, and
        # the process's mappings die with it anyway.
        weakref.finalize(self, _munmap, addr, size).atexit = False


class _Export:
    """Exports ``nbytes`` at ``addr`` to numpy and keeps ``owner`` (the mapping, or the
    consumer's slab) alive for as long as any array derived from it lives. The consumer
    creates one per batch and frees the slab in its finalizer (rule 3)."""

    __slots__ = ("__array_interface__", "__weakref__", "owner")

    def __init__(self, addr: int, nbytes: int, owner: object) -> None:
        self.owner = owner
        self.__array_interface__ = {"data": (addr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}


def bytes_at(addr: int, nbytes: int, owner: object) -> npt.NDArray[np.uint8]:
    return np.asarray(_Export(addr, nbytes, owner))


def map_file(fd: int, *, populate: bool) -> tuple[_Mapping, npt.NDArray[np.int64]]:
    """Map an open slab file; returns the mapping and its header's state words."""
    size = os.fstat(fd).st_size
    m = _Mapping(fd, size, populate=populate)
    return m, bytes_at(m.addr, 64, m).view(np.int64)


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def typed(
    raw: npt.NDArray[np.uint8], offset: int, shape: tuple[int, ...], dtype: np.dtype[Any], fortran: bool
) -> Any:
    """The array of ``shape`` and ``dtype`` stored at ``offset`` of the raw bytes ``raw``
    (a view: its ``base`` chain keeps ``raw``'s owner alive)."""
    n = math.prod(shape) * dtype.itemsize
    return raw[offset : offset + n].view(dtype).reshape(shape, order="F" if fortran else "C")
