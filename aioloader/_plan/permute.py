"""A seeded bijection on ``[0, n)`` that is evaluated position by position.

An epoch's shuffled order is never stored: the sample at position ``p`` is
``IndexShuffle(n, seed, epoch)(p)``, computed for a whole batch of positions with a few
dozen numpy operations. Memory and set-up time do not depend on ``n``.

The permutation is the composition of two keyed stages:

1. A Feistel network over ``Z_a x Z_b`` with ``a * b >= n`` and ``a, b ~ sqrt(n)`` (the
   FE1 construction of Black and Rogaway, "Ciphers with arbitrary finite domains"), each
   round adding a keyed hash of one half to the other, modulo that half's size. It is a
   bijection on ``[0, a * b)``; cycle-walking (apply it again while the result is
   ``>= n``) restricts it to a bijection on ``[0, n)``. Because ``a * b - n < a``, a walk
   is rarely needed (probability about ``1 / sqrt(n)`` per position).
2. A few swap-or-not rounds on ``Z_n`` itself (Hoang, Morris and Rogaway, 2012): each
   round pairs ``x`` with ``pivot - x`` and swaps the pair when a keyed hash of the pair
   says so; every round is an involution, hence a bijection. Feistel networks over tiny
   halves only reach a structured subset of the permutations (on ``n = 7`` a 24-round
   network still misses some of the 5040), and these rounds remove that bias on small
   ``n``; on large ``n`` they cost a little time and change nothing measurable.

Round keys come from ``numpy.random.SeedSequence([seed, epoch, n, salt])``, so the order is
a pure function of ``(seed, epoch, n)``. All arithmetic is on ``uint64`` (``n < 2**63``,
so ``a * b`` and ``pivot + n`` fit). ``tests/test_plan.py`` checks that the result is a
bijection and that, over seeds, its position frequencies, pairwise orders and (for
``n <= 5``) whole-permutation frequencies are those of a uniform shuffle.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["MAX_LENGTH", "IndexShuffle", "round_keys"]

MAX_LENGTH = 2**63 - 1  # the largest n the uint64 arithmetic below supports
FEISTEL_ROUNDS = 6
SWAP_ROUNDS = 4
_SALT = 0x0D0E  # keeps the order stream apart from the per-sample seeds

_U64 = np.uint64
_M1 = _U64(0xBF58476D1CE4E5B9)
_M2 = _U64(0x94D049BB133111EB)
_S29, _S32 = _U64(29), _U64(32)

Keys = NDArray[np.uint64]  # shape (rounds, 1), or (rounds, len(x)): one column per element


def round_keys(seed: int, epoch: int, n: int) -> NDArray[np.uint64]:
    """The ``FEISTEL_ROUNDS + 2 * SWAP_ROUNDS`` keys of epoch ``epoch`` (a 1-d array)."""
    state = np.random.SeedSequence([seed, epoch, n, _SALT]).generate_state(
        FEISTEL_ROUNDS + 2 * SWAP_ROUNDS, np.uint64
    )
    return np.asarray(state, dtype=np.uint64)


def _halves(n: int) -> tuple[int, int]:
    a = math.isqrt(n - 1) + 1 if n > 1 else 1
    return a, -(-n // a)


def _hash(z: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """A 64-bit multiply-xorshift mixer, in place on ``z`` (which must be a fresh array)."""
    z *= _M1
    z ^= z >> _S32
    z *= _M2
    z ^= z >> _S29
    return z


# numpy divides an integer array by a scalar with a precomputed reciprocal (libdivide),
# about 1.7 ns an element here, but its ``%`` and ``divmod`` on uint64 do a hardware division
# per element, about 17 ns: so the remainders below are computed from the quotient (the
# same values, bit for bit).
def _divmod(x: NDArray[np.uint64], d: np.uint64) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
    q = x // d
    return q, x - q * d  # x may be a scalar (one position)


def _mod(z: NDArray[np.uint64], d: np.uint64) -> NDArray[np.uint64]:
    """``z % d``, in place when ``z`` is an array."""
    q = z // d
    q *= d
    z -= q
    return z


def _column(keys: Keys, rows: slice, cols: NDArray[np.intp] | None) -> Keys:
    part = keys[rows]
    return part if cols is None or part.shape[1] == 1 else part[:, cols]


def _feistel(x: NDArray[np.uint64], a: int, b: int, keys: Keys) -> NDArray[np.uint64]:
    # x = left * (size of right) + right; the halves swap roles every round. The halves are
    # carried from round to round as two arrays, so there is one split at the start.
    m, k = _U64(a), _U64(b)
    left, right = _divmod(x, k)
    for key in keys:
        z = _hash(right ^ key)
        z = _mod(z, m)
        left += z  # < 2m: one conditional subtraction instead of a modulus
        np.minimum(left, left - m, out=left)  # left - m wraps round to a huge value if left < m
        left, right = right, left
        m, k = k, m
    left *= k
    left += right
    return left


def _feistel_inverse(x: NDArray[np.uint64], a: int, b: int, keys: Keys) -> NDArray[np.uint64]:
    # The rounds backwards: (left, right) after round r are (right, left + h(right)) before it.
    rounds = len(keys)
    m, k = (_U64(a), _U64(b)) if rounds % 2 == 0 else (_U64(b), _U64(a))
    left, right = _divmod(x, k)
    for key in keys[::-1]:
        m, k = k, m  # the sizes of this round's (left, right)
        z = _hash(left ^ key)  # left is this round's right half
        z = _mod(z, m)
        right += m - z
        np.minimum(right, right - m, out=right)
        left, right = right, left
    left *= k
    left += right
    return left


def _walk(x: NDArray[np.uint64], n: int, keys: Keys, inverse: bool) -> NDArray[np.uint64]:
    """Apply the Feistel stage (or its inverse) until every element lands below ``n``."""
    a, b = _halves(n)
    step = _feistel_inverse if inverse else _feistel
    y = step(x, a, b, keys)
    out = np.flatnonzero(y >= n)
    while out.size:
        y[out] = step(y[out], a, b, _column(keys, slice(None), out))
        out = out[y[out] >= n]
    return y


def _swap_or_not(x: NDArray[np.uint64], n: int, keys: Keys, inverse: bool) -> NDArray[np.uint64]:
    un = _U64(n)
    pivots, hashes = keys[:SWAP_ROUNDS] % un, keys[SWAP_ROUNDS:]
    order = range(SWAP_ROUNDS - 1, -1, -1) if inverse else range(SWAP_ROUNDS)
    for r in order:
        partner = (pivots[r] + un) - x  # in (pivot, pivot + n]: below n after one subtraction
        np.minimum(partner, partner - un, out=partner)
        z = _hash(np.maximum(x, partner) ^ hashes[r])
        z &= _U64(1)
        x = np.where(z, partner, x)
    return x


def permute(x: NDArray[np.uint64], n: int, keys: Keys, *, inverse: bool = False) -> NDArray[np.uint64]:
    """The bijection (or its inverse) keyed by ``keys`` at the positions ``x`` (all ``< n``).

    ``keys`` has one row per round and either one column (one permutation for every
    element) or one column per element (a different permutation for each, which is how
    the statistical tests draw thousands of permutations in one call).
    """
    if n <= 1:
        return np.zeros(x.shape, dtype=np.uint64)
    feistel, swaps = keys[:FEISTEL_ROUNDS], keys[FEISTEL_ROUNDS:]
    if inverse:
        return _walk(_swap_or_not(x, n, swaps, True), n, feistel, True)
    return _swap_or_not(_walk(x, n, feistel, False), n, swaps, False)


class IndexShuffle:
    """The shuffled order of ``range(n)`` for one ``(seed, epoch)``, computed on demand.

    ``shuffle(p)`` is the sample at position ``p`` (``p`` an int or an integer array, every
    element in ``[0, n)``); ``shuffle.inverse(i)`` is the position of sample ``i``. Costs
    O(1) memory and set-up time whatever ``n`` (``0 <= n <= 2**63 - 1``).
    """

    __slots__ = ("_keys", "epoch", "n", "seed")

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        if not 0 <= n <= MAX_LENGTH:
            raise ValueError(f"n must be in [0, 2**63 - 1], got {n!r}")
        self.n, self.seed, self.epoch = n, seed, epoch
        self._keys: Keys = round_keys(seed, epoch, n)[:, None]

    def _apply(self, positions: Any, inverse: bool) -> NDArray[np.int64]:
        x = np.asarray(positions)
        if x.dtype.kind not in "iu":
            raise TypeError(f"positions must be integers, got dtype {x.dtype}")
        if x.size and (int(x.min()) < 0 or int(x.max()) >= self.n):
            raise IndexError(f"positions must be in [0, {self.n}), got [{int(x.min())}, {int(x.max())}]")
        return permute(x.astype(np.uint64), self.n, self._keys, inverse=inverse).astype(np.int64)

    def apply(self, positions: NDArray[np.uint64]) -> NDArray[np.uint64]:
        """The unchecked fast path: ``positions`` must already be ``uint64`` and ``< n``."""
        return permute(positions, self.n, self._keys)

    def __call__(self, positions: Any) -> NDArray[np.int64]:
        return self._apply(positions, False)

    def inverse(self, indices: Any) -> NDArray[np.int64]:
        return self._apply(indices, True)

    def __repr__(self) -> str:
        return f"IndexShuffle(n={self.n}, seed={self.seed}, epoch={self.epoch})"
