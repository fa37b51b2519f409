"""The command line: ``aioloader {demo,pack,inspect,bench} ...`` (or ``python -m aioloader``).

The top of the layering: the commands use the public loaders and the formats layer,
and nothing imports them. Each command lives in its own ``cmd_*`` module, imported only
when it runs, so ``--help`` and ``inspect`` never pay for the loader's imports.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

__all__ = ["error", "main", "program", "usage", "usage_error"]

_USAGE = """usage: {prog} COMMAND [ARGS]

commands:
  demo      two epochs of JPEG decode + augmentation on a synthetic dataset
  pack      pack an image folder into an MXNet-compatible .rec/.idx pair (and im2rec's .lst)
  inspect   summarise a .rec file
  bench     measure a dataset factory under several num_workers/prefetch settings

'{prog} COMMAND --help' describes a command's arguments.
"""


def program() -> str:
    """The name the user typed: ``aioloader`` for the console script, else ``python -m aioloader``.

    The console script's ``sys.argv[0]`` is its own path, so its name is kept as it is.
    Under ``-m`` it is ``.../aioloader/__main__.py``; a caller of :func:`main` from
    another program (a test, a notebook) also gets the ``-m`` form, which works anywhere.
    """
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name.startswith("aioloader") and not name.endswith(".py") else "python -m aioloader"


def usage() -> str:
    """The top-level usage text, under the name the user typed."""
    return _USAGE.format(prog=program())


# command -> (module, function); the module is imported only when its command runs
_COMMANDS = {
    "demo": ("cmd_demo", "demo_main"),
    "pack": ("cmd_pack", "pack_main"),
    "inspect": ("cmd_inspect", "inspect_main"),
    "bench": ("cmd_bench", "bench_main"),
}


def error(command: str, message: object) -> None:
    """Tell the user what went wrong, in one line on stderr (no traceback)."""
    print(f"{command}: error: {message}", file=sys.stderr)


def usage_error(command: str, message: object) -> int:
    """:func:`error`, then the status of a usage error (2) to return."""
    error(command, message)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command named by ``argv[0]`` (default: ``sys.argv[1:]``); return the exit status.

    Status 0 on success, 1 when a command fails on its input (a bad image, a malformed
    file), 2 for a usage error (an unknown command, an invalid argument or path).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    cmd, rest = args[0], args[1:]
    if cmd not in _COMMANDS:
        print(f"unknown command {cmd!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, function = _COMMANDS[cmd]
    run = getattr(importlib.import_module(f"{__name__}.{module}"), function)
    status: int = run(rest)
    return status
