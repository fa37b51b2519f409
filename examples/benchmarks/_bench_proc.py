"""Running one benchmark child so that the next one starts on a quiet machine.

A child's helper processes (a forkserver, a resource tracker, a peer's worker pool) can
outlive it by some milliseconds: they notice its exit and clean up, or close their copy
of its output pipes before they exit. On 2 cores, a child that starts meanwhile shares
the CPUs with them, which skews a figure measured in milliseconds (a cold start). So
each child runs in a session of its own, and :func:`run` returns only once no process of
that session is left (Linux; elsewhere it returns at once).
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any


def run(cmd: list[str], *, timeout: float, settle: float = 10.0, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a new session, then
    wait (at most ``settle`` seconds) until every process of that session has exited."""
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    ) as popen:
        try:
            out, err = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.communicate()
            raise
    deadline = time.monotonic() + settle
    while _members(popen.pid) and time.monotonic() < deadline:  # the child leads its session: sid == pid
        time.sleep(0.01)  # a poll of the process table between two runs, outside any measurement
    return subprocess.CompletedProcess(cmd, popen.returncode, out, err)


def _members(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``."""
    out = []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        fields = stat_fields(f"/proc/{pid}/stat")
        if fields and fields[0] != "Z" and int(fields[3]) == sid:
            out.append(pid)
    return out


def stat_fields(path: str) -> list[str] | None:
    """The fields of a ``/proc/.../stat`` file after the command name (field 3 first:
    the state), or ``None`` when it is gone."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
