"""Fixtures for the remote tests: a real S3 server (moto) and a real HTTP server.

Each server runs in a process of its own (``tests/_s3_server.py``, ``tests/_range_http_server.py``),
bound to 127.0.0.1 on a free port that it prints once it listens; the fixture reads that
line under a deadline (no fixed sleep), and after the last test of the module that uses
it closes the server's standard input and waits for it to exit (terminating it only if
it does not). Module scope, not session scope: a server must not outlive its test file,
since later files check that the test process has no child at all (tests/test_shm.py).
Test files import the fixtures they use from here.
"""

from __future__ import annotations

import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests._rio_helpers import MXNET_FIXTURES

HERE = Path(__file__).resolve().parent
BUCKET = "aioloader-test"
START_TIMEOUT = 60.0  # moto imports a lot; on two busy cores that takes a while


def _start(script: str, *args: str) -> tuple[subprocess.Popen[bytes], int]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    # stderr to a file, not a pipe: a server that logs a lot must never block on it.
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / script), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            env=env,
        )
        try:
            return proc, _read_port(proc, script)
        except BaseException as exc:
            _stop(proc)
            if not isinstance(exc, Exception):
                raise
            errors.seek(0)
            raise RuntimeError(
                f"{script} did not start (exit code {proc.returncode}): "
                f"{errors.read().decode(errors='replace')[-2000:]}"
            ) from None


def _read_port(proc: subprocess.Popen[bytes], script: str) -> int:
    assert proc.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT
    line = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no port from {script} after {START_TIMEOUT} s")
            if sel.select(timeout=left):
                chunk = os.read(proc.stdout.fileno(), 256)
                if not chunk:
                    raise EOFError(f"{script} exited before it printed its port")
                line += chunk
    word, port = line.decode().split()
    assert word == "PORT", line
    return int(port)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.stdin is not None and not proc.stdin.closed:
        try:
            proc.stdin.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


@dataclass
class S3Server:
    """The running server: its endpoint and what an ObjectStore needs to talk to it."""

    endpoint: str
    bucket: str
    options: dict[str, Any] = field(default_factory=dict)

    def url(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}"

    def put(self, key: str, data: bytes) -> None:
        import obstore

        from aioloader.io import ObjectStore

        obstore.put(ObjectStore(self.url(), **self.options).client, key, data)


def small_jpegs(folder: Path, n: int = 4) -> dict[str, bytes]:
    """Write ``n`` small JPEGs of different sizes and colours; return name -> bytes."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, bytes] = {}
    for i in range(n):
        path = folder / f"{i:03d}.jpg"
        Image.new("RGB", (8 + 4 * i, 6 + 2 * i), (40 * i, 255 - 30 * i, 90)).save(path, quality=90)
        out[path.name] = path.read_bytes()
    return out


@pytest.fixture(scope="session")
def jpegs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return small_jpegs(tmp_path_factory.mktemp("jpegs"))


@pytest.fixture(scope="module")
def s3(jpegs: dict[str, bytes]) -> Iterator[S3Server]:
    """moto's S3 server holding ``mxnet/*`` (the MXNet-written fixtures) and ``jpegs/*``."""
    pytest.importorskip("obstore")
    pytest.importorskip("moto")
    proc, port = _start("_s3_server.py")
    try:
        endpoint = f"http://127.0.0.1:{port}"
        urllib.request.urlopen(
            urllib.request.Request(f"{endpoint}/{BUCKET}", method="PUT"), timeout=30
        ).close()
        server = S3Server(
            endpoint,
            BUCKET,
            {
                "endpoint": endpoint,
                "region": "us-east-1",
                "access_key_id": "testing",
                "secret_access_key": "testing",
                "virtual_hosted_style_request": False,
                "allow_http": True,
            },
        )
        for path in sorted(MXNET_FIXTURES.iterdir()):
            server.put(f"mxnet/{path.name}", path.read_bytes())
        for name, data in jpegs.items():
            server.put(f"jpegs/{name}", data)
        yield server
    finally:
        _stop(proc)


@dataclass
class HTTPServer:
    base: str  # http://127.0.0.1:<port>
    root: Path  # the folder it serves


@pytest.fixture(scope="module")
def http_server(tmp_path_factory: pytest.TempPathFactory, jpegs: dict[str, bytes]) -> Iterator[HTTPServer]:
    """A range-capable HTTP server over a folder holding ``mxnet/*`` and ``jpegs/*``."""
    root = tmp_path_factory.mktemp("http-root")
    shutil.copytree(MXNET_FIXTURES, root / "mxnet")
    (root / "jpegs").mkdir()
    for name, data in jpegs.items():
        (root / "jpegs" / name).write_bytes(data)
    proc, port = _start("_range_http_server.py", str(root))
    try:
        yield HTTPServer(f"http://127.0.0.1:{port}", root)
    finally:
        _stop(proc)
