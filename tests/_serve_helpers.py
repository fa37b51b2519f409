"""Functions for the Batcher tests (module level: workers import them)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

# Thread mode (num_workers=0) runs fn in this process: tests steer it with these.
hold = threading.Event()  # set by the test: lets a call of held() return
entered = threading.Event()  # set by held() when it starts
calls: list[Any] = []  # every item fn saw, in call order


def reset() -> None:
    hold.clear()
    entered.clear()
    calls.clear()


def held(item: Any) -> Any:
    """Records the item; the item ``"hold"`` blocks until the test sets ``hold``."""
    calls.append(item)
    if item == "hold":
        entered.set()
        if not hold.wait(30):
            raise AssertionError("the test never released the held call")
    return item


class HoldsALock:
    """A callable that cannot be pickled, even by value (it holds a lock)."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()

    def __call__(self, x: Any) -> Any:
        return x


def square(x: int) -> int:
    if x < 0:
        raise ValueError(f"negative input {x}")
    return x * x


def squares(xs: list[int]) -> list[int]:
    if any(x < 0 for x in xs):
        raise ValueError("a negative input in the micro-batch")
    return [x * x for x in xs]


def too_few(xs: list[int]) -> list[int]:
    return xs[:-1]


class DieOnce:
    """Kills its own worker the first time it sees ``victim`` (a marker file records it)."""

    def __init__(self, folder: str, victim: int) -> None:
        self.folder = folder
        self.victim = victim

    def __call__(self, x: int) -> tuple[int, int]:
        marker = Path(self.folder, "died")
        if x == self.victim and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return x, os.getpid()


class Poison:
    """``x * 10``, except for the poison items: ``exit_on`` ends its worker with
    ``os._exit(3)``, ``hang_on`` never returns (the timeout kills its worker).

    ``log``: a file each call appends its item to first (what the workers ran, in
    order). ``go``: a file the exit waits for (a bounded poll), so a test can act while
    the micro-batch is at the worker; ``entered`` is the file it creates then."""

    def __init__(
        self,
        exit_on: Any = None,
        hang_on: Any = None,
        log: str | None = None,
        go: str | None = None,
        entered: str | None = None,
    ) -> None:
        self.exit_on, self.hang_on = exit_on, hang_on
        self.log, self.go, self.entered = log, go, entered

    def __call__(self, x: Any) -> Any:
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(f"{x}\n")
        if x == self.exit_on:
            if self.entered is not None:
                Path(self.entered).touch()
            if self.go is not None:
                for _ in range(6000):  # 30 s at most: a hang becomes a failure
                    if os.path.exists(self.go):
                        break
                    threading.Event().wait(0.005)
            os._exit(3)
        if x == self.hang_on:
            threading.Event().wait()
        return x * 10


def logged(path: str) -> list[int]:
    """The items a :class:`Poison` logged, in order."""
    with open(path) as f:
        return [int(line) for line in f.read().split()]


def decode_held(body: bytes) -> Any:
    """:func:`held` for web handlers, whose items are request bodies: ``b"hold"`` blocks
    until the test sets ``hold``; any other body is decoded as an image (RGB, 0..1)."""
    calls.append(body)
    if body == b"hold":
        entered.set()
        if not hold.wait(30):
            raise AssertionError("the test never released the held call")
        return b"held"
    import io

    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(body)) as im:
        return np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0


class Gated:
    """For worker processes: a body starting ``b"hold"`` blocks until the file ``gate``
    exists (at most ``limit`` seconds, then it raises); any other body returns its length."""

    def __init__(self, gate: str, limit: float = 60.0) -> None:
        self.gate = gate
        self.limit = limit

    def __call__(self, body: bytes) -> int:
        if body.startswith(b"hold"):
            import time

            deadline = time.monotonic() + self.limit
            while not os.path.exists(self.gate):  # (a worker has no event to wait on)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.gate} never appeared")
                time.sleep(0.01)
        return len(body)


def lock_for_minus_one(x: int) -> Any:
    """``x``, but a lock (a result that cannot be pickled) for ``-1``."""
    return threading.Lock() if x == -1 else x


class Unpicklable(Exception):
    """An exception that cannot travel back from a worker (it holds a lock)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


class Misbehaving:
    """An example service's ``preprocess`` with a failure for each of its error answers,
    for worker processes. By body: ``b"die"`` ends its worker (``os._exit(3)``);
    ``b"hang"`` never returns; ``b"hold"`` waits for the file ``gate`` (at most
    ``limit`` seconds), then answers like a black image; ``b"value"`` raises
    ``ValueError``; ``b"bug"`` raises ``KeyError`` (not the upload's fault);
    ``b"unpicklable"`` raises :class:`Unpicklable`. Any other body is decoded as an image
    (RGB, 0..1): Pillow raises for one that is not."""

    def __init__(self, gate: str, limit: float = 60.0) -> None:
        self.gate = gate
        self.limit = limit

    def __call__(self, body: bytes) -> Any:
        import io
        import time

        import numpy as np
        from PIL import Image

        if body == b"die":
            os._exit(3)
        if body == b"hang":
            threading.Event().wait()
        if body == b"hold":
            deadline = time.monotonic() + self.limit
            while not os.path.exists(self.gate):  # (a worker has no event to wait on)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.gate} never appeared")
                time.sleep(0.01)
            return np.zeros((8, 8, 3), dtype=np.float32)
        if body == b"value":
            raise ValueError("this upload is not acceptable\nsecond line, not for the client")
        if body == b"bug":
            raise KeyError("a bug in the service")
        if body == b"unpicklable":
            raise Unpicklable("cannot travel")
        with Image.open(io.BytesIO(body)) as im:
            return np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0
