"""Chrome trace-event files (open them in Perfetto or ``chrome://tracing``).

One process per worker, with a ``batches`` thread track holding a span per batch it
built; in the main process, a ``consumer`` track with a span for every wait on the
loader. All timestamps come from ``CLOCK_MONOTONIC`` (``time.monotonic_ns``), which on
Linux is shared by every process, so worker and consumer spans line up.

The file follows the Trace Event Format: integer ``pid`` and ``tid`` on every event,
tracks named by ``process_name`` / ``thread_name`` metadata (``"ph": "M"``) events,
spans as complete events (``"ph": "X"``) with ``ts`` and ``dur`` in microseconds, sorted
by ``ts``. Importers draw one thread's spans as a stack, so spans of one track that
overlap without nesting (batches built by several threads of one process, or two
consumers iterating at once) are spread over extra tracks (``batches (2)``, ...).
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
        # (name, pid, track, start_ns, end_ns, args): tids are given out when writing,
        # once every span of a track is known
        self.spans: list[tuple[str, int, str, int, int, dict[str, Any] | None]] = []
        self.dropped = 0
        self._lock = threading.Lock()

    def span(
        self,
        name: str,
        pid: int,
        track: str,
        start_ns: int,
        end_ns: int,
        args: dict[str, Any] | None = None,
    ) -> None:
        """Record a span on the track named ``track`` of process ``pid``."""
        if len(self.spans) >= self.max_events:
            self.dropped += 1
            return
        self.spans.append((name, pid, track, start_ns, max(end_ns, start_ns), args or None))

    def events(self) -> list[dict[str, Any]]:
        """The trace's events: metadata first, then the spans in ``ts`` order."""
        spans = sorted(list(self.spans), key=lambda s: (s[3], -s[4]))
        # lanes[(pid, track)]: for each lane, the end of its last span
        lanes: dict[tuple[int, str], list[int]] = {}
        tids: dict[tuple[int, str, int], int] = {}
        out: list[dict[str, Any]] = []
        for name, pid, track, start, end, args in spans:
            ends = lanes.setdefault((pid, track), [])
            lane = next((k for k, e in enumerate(ends) if e <= start), len(ends))
            if lane == len(ends):
                ends.append(end)
            else:
                ends[lane] = end
            tid = tids.setdefault((pid, track, lane), len(tids) + 1)
            ev: dict[str, Any] = {
                "name": name,
                "ph": "X",
                "pid": pid,
                "tid": tid,
                "ts": start / 1000,
                "dur": (end - start) / 1000,
            }
            if args:
                ev["args"] = args
            out.append(ev)
        return self._metadata(tids) + out

    @staticmethod
    def _metadata(tids: dict[tuple[int, str, int], int]) -> list[dict[str, Any]]:
        me = os.getpid()
        meta: list[dict[str, Any]] = []
        first_tid: dict[int, int] = {}
        for (pid, track, lane), tid in sorted(tids.items(), key=lambda kv: kv[1]):
            first_tid.setdefault(pid, tid)
            label = track if lane == 0 else f"{track} ({lane + 1})"
            meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": label}})
            meta.append(
                {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
            )
        # process metadata carries the tid of one of the process's own tracks, so that no
        # importer invents an empty thread for it
        for pid in sorted(first_tid, key=lambda p: (p != me, p)):
            label = "consumer (main process)" if pid == me else f"worker pid {pid}"
            tid = first_tid[pid]
            meta.append({"name": "process_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": label}})
            order = 0 if pid == me else pid
            meta.append(
                {
                    "name": "process_sort_index",
                    "ph": "M",
                    "pid": pid,
                    "tid": tid,
                    "args": {"sort_index": order},
                }
            )
        return meta

    def write(self) -> Path:
        """Write (or rewrite) the trace file; returns its path."""
        with self._lock:
            doc: dict[str, Any] = {"traceEvents": self.events(), "displayTimeUnit": "ms"}
            if self.dropped:
                doc["otherData"] = {"aioloader_dropped_events": self.dropped}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, self.path)
            return self.path
