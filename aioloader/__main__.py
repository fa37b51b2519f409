"""``python -m aioloader`` and the ``aioloader`` console script; the commands are in
:mod:`aioloader._cli`."""

from __future__ import annotations

import sys

from ._cli import main as main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
