"""``examples/serve_fastapi.py``'s app under uvicorn, over a gated ``fn``, for tests/test_web.py.

Run as ``python tests/_asgi_server.py GATE`` from the repository root: two worker
processes run :class:`tests._serve_helpers.Gated` (a body starting ``hold`` blocks until
the file ``GATE`` exists), one request to a micro-batch, two micro-batches dispatched at
once. It prints ``listening on http://127.0.0.1:<port>``, serves until SIGINT and
prints the example's JSON summary line.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import serve_fastapi  # noqa: E402

import aioloader  # noqa: E402
from tests._serve_helpers import Gated  # noqa: E402


def main() -> None:
    gate = sys.argv[1]

    def make_batcher() -> aioloader.Batcher[int]:
        return aioloader.Batcher(Gated(gate), batch_size=1, max_latency=0, num_workers=2, prefetch=2)

    serve_fastapi.run(serve_fastapi.create_app(make_batcher, warm_up=2), "127.0.0.1", 0)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
