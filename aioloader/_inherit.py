"""What a process forked to outlive its parent's moment must not inherit.

The forkserver that :mod:`aioloader._forkserver` forks from the consumer lives as long
as the consumer. A fork copies every open fd, so it would keep open the consumer's end
of each pipe or socket the consumer shares with a child process (a ``subprocess.Popen``
with ``stdin=PIPE``, a ``multiprocessing`` pipe). A child that waits for the end of its
input (``communicate()`` with a filter such as ``sort``, a server told to stop by its
stdin) would then wait for ever, and so would the consumer that waits for it. The server
closes those fds as it starts (its workers get what they need from multiprocessing).

This module never imports asyncio.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["shared_with_children"]


def shared_with_children() -> list[int]:
    """This process's fds (but stdin, stdout and stderr) that are pipes or sockets a
    child process of its also holds. Best effort: a child whose fds cannot be read (it
    exited, another user's) is skipped."""
    ends: set[str] = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                kids = f.read().split()
        except OSError:
            continue
        for kid in kids:
            ends.update(_ends(f"/proc/{kid}/fd").values())
    if not ends:
        return []
    return sorted(int(fd) for fd, end in _ends("/proc/self/fd").items() if end in ends and int(fd) > 2)


def _ends(folder: str) -> dict[str, str]:
    """fd -> ``pipe:[inode]`` or ``socket:[inode]`` for the pipes and sockets open in
    ``folder`` (a /proc fd folder)."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for fd in os.listdir(folder):
            with contextlib.suppress(OSError):
                link = os.readlink(f"{folder}/{fd}")
                if link.startswith(("pipe:", "socket:")):
                    found[fd] = link
    return found
