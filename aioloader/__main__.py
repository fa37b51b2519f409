"""Command line: ``python -m aioloader {demo,pack,inspect,bench} ...``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: python -m aioloader COMMAND [ARGS]

commands:
  demo      two epochs of JPEG decode + augmentation on a synthetic dataset
  pack      pack an image folder into an MXNet-compatible .rec/.idx pair
  inspect   summarise a .rec file
  bench     measure a dataset factory under several num_workers/prefetch settings
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    cmd, rest = args[0], args[1:]
    if cmd == "demo":
        from ._demo import demo_main

        return demo_main(rest)
    if cmd == "pack":
        from ._cli_pack import pack_main

        return pack_main(rest)
    if cmd == "bench":
        from ._bench import bench_main

        return bench_main(rest)
    if cmd == "inspect":
        from ._cli_pack import inspect_main

        return inspect_main(rest)
    print(f"unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
