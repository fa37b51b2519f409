"""examples/serve.py and examples/serve_load.py, run for real over loopback for a few
seconds: every upload answered correctly, undecodable ones with 400, and the server
stops by itself (``--max-requests``) leaving no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _last_json(text: str, key: str) -> dict[str, object]:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            doc = json.loads(line)
            if key in doc:
                return dict(doc[key])
    raise AssertionError(f"no {key!r} summary in output:\n{text}")


def _serve_under_load(
    script: str, server_args: list[str], load_args: list[str], *, interrupt: bool
) -> tuple[dict[str, object], dict[str, object]]:
    """Start ``examples/<script>`` on a free port, run serve_load.py against it, then
    SIGINT it (``interrupt``) or wait for it to stop by itself. The load's summary and
    the server's, once the server exited cleanly."""
    server = subprocess.Popen(
        [sys.executable, str(EXAMPLES / script), "--port", "0", *server_args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        first = server.stdout.readline()  # blocks until the server listens (test timeout bounds it)
        assert first.startswith("listening on http://127.0.0.1:"), first + (
            server.stderr.read() if server.stderr else ""
        )
        port = first.strip().rsplit(":", 1)[1]
        load = subprocess.run(
            [sys.executable, str(EXAMPLES / "serve_load.py"), "--port", port, *load_args, "--timeout", "30"],
            capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=90,
        )  # fmt: skip
        assert load.returncode == 0, load.stdout + load.stderr
        if interrupt:
            server.send_signal(2)  # SIGINT: the server stops cleanly and reports
        out, err = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert server.returncode == 0, err
    assert "Traceback" not in err, err
    return _last_json(load.stdout, "load"), _last_json(out, "server")


def test_serve_and_load_over_loopback() -> None:
    requests, invalid = 300, 3
    summary, stats = _serve_under_load(
        "serve.py",
        ["--workers", "2", "--batch-size", "8", "--max-latency", "0.005", "--max-requests", str(requests),
         "--duration", "60"],
        ["--requests", str(requests), "--concurrency", "8", "--size", "96", "--invalid", str(invalid)],
        interrupt=False,  # it stops by itself after --max-requests
    )  # fmt: skip
    assert summary["requests"] == requests and summary["wrong"] == []
    assert float(summary["p50_ms"]) > 0 and float(summary["requests_per_s"]) > 0  # type: ignore[arg-type]
    assert stats["answered"] == requests and stats["failed"] == invalid
    assert stats["restarts"] == 0 and stats["overloaded"] == 0
    assert stats["completed"] == requests - invalid + 2  # the two warm-up images
    assert sum(int(k) * v for k, v in stats["batch_sizes"].items()) == requests + 2  # type: ignore[attr-defined]


def test_overload_answers_503_at_once_and_nothing_wrong() -> None:
    """Open-loop arrivals far above what one worker decodes, each with a deadline:
    admitted uploads are answered correctly, the rest get 503 (or 504 if one still ran
    late), counted the same on both sides."""
    requests = 200
    summary, stats = _serve_under_load(
        "serve.py",
        ["--workers", "1", "--batch-size", "1", "--max-pending", "2", "--deadline-ms", "200",
         "--max-requests", "1000000", "--duration", "60"],
        ["--requests", str(requests), "--rate", "2000", "--size", "512"],
        interrupt=True,
    )  # fmt: skip
    statuses = summary["statuses"]
    assert isinstance(statuses, dict)
    assert statuses.get("503", 0) > 0 and statuses.get("200", 0) > 0
    assert sum(statuses.values()) == requests
    assert stats["overloaded"] == statuses["503"] == stats["rejected"]
    assert stats["answered"] == statuses["200"]
    assert stats["late"] == statuses.get("504", 0) == stats["expired"]  # a deadline missed: 504


def test_fastapi_example_serves_the_load_and_stops_at_sigint() -> None:
    """examples/serve_fastapi.py (uvicorn) answers what serve.py answers, and SIGINT
    stops it cleanly with its summary."""
    requests, invalid = 200, 3
    summary, stats = _serve_under_load(
        "serve_fastapi.py",
        ["--workers", "2", "--batch-size", "8"],
        ["--requests", str(requests), "--concurrency", "8", "--size", "96", "--invalid", str(invalid)],
        interrupt=True,  # uvicorn shuts down, the lifespan closes the Batcher
    )
    assert summary["requests"] == requests and summary["wrong"] == []
    assert stats["answered"] == requests and stats["failed"] == invalid
    assert stats["completed"] == requests - invalid + 2  # the two warm-up images
    assert (stats["waiting"], stats["in_flight"], stats["restarts"]) == (0, 0, 0)
