"""Chrome trace-event files (open them in Perfetto or ``chrome://tracing``).

One track per worker process, with a span per batch it built; one track for the
consumer, with a span for every wait on the loader. All timestamps come from
``CLOCK_MONOTONIC`` (``time.monotonic_ns``), which on Linux is shared by every process,
so worker and consumer spans line up.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["Tracer"]


class Tracer:
    """Collects spans in memory and writes them as one JSON file.

    At most ``max_events`` spans are kept (the first ones); the file then says how many
    were dropped.
    """

    def __init__(self, path: str | os.PathLike[str], max_events: int = 1_000_000) -> None:
        self.path = Path(path)
        self.max_events = max_events
        self.events: list[dict[str, Any]] = []
        self.dropped = 0
        self._pids: set[int] = set()
        self._lock = threading.Lock()

    def span(
        self,
        name: str,
        pid: int,
        tid: str | int,
        start_ns: int,
        end_ns: int,
        args: dict[str, Any] | None = None,
    ) -> None:
        if len(self.events) >= self.max_events:
            self.dropped += 1
            return
        ev: dict[str, Any] = {
            "name": name,
            "ph": "X",
            "pid": pid,
            "tid": tid,
            "ts": start_ns / 1000.0,
            "dur": max(end_ns - start_ns, 0) / 1000.0,
        }
        if args:
            ev["args"] = args
        self.events.append(ev)
        self._pids.add(pid)

    def write(self) -> Path:
        """Write (or rewrite) the trace file; returns its path."""
        with self._lock:
            me = os.getpid()
            meta: list[dict[str, Any]] = []
            for pid in sorted(self._pids):
                label = "consumer (main process)" if pid == me else f"worker pid {pid}"
                meta.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": label}})
                meta.append(
                    {
                        "name": "process_sort_index",
                        "ph": "M",
                        "pid": pid,
                        "args": {"sort_index": 0 if pid == me else pid},
                    }
                )
            doc: dict[str, Any] = {"traceEvents": meta + list(self.events), "displayTimeUnit": "ms"}
            if self.dropped:
                doc["otherData"] = {"aioloader_dropped_events": self.dropped}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, self.path)
            return self.path
