"""A static file server with byte ranges, on 127.0.0.1, in a process of its own.

Run as ``python tests/_range_http_server.py <folder>``: it serves the files of ``<folder>``,
answers ``Range: bytes=a-b`` with 206 (Python's own ``http.server`` ignores ranges),
prints ``PORT <n>`` once it listens, and stops when its standard input is closed.
Paths under ``/status/<code>/`` answer with that HTTP status instead (to test how
clients classify failures); ``/reset/`` closes the connection without an answer;
``/hang/`` never answers (until the server stops), for client timeouts.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


STOP = threading.Event()


class Handler(BaseHTTPRequestHandler):
    root = "."
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def _fail(self) -> bool:
        m = re.match(r"^/status/(\d{3})/", self.path)
        if m:
            body = b"injected failure"
            self.send_response(int(m.group(1)))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return True
        if self.path.startswith("/hang/"):
            STOP.wait(60)
            self.close_connection = True
            return True
        if self.path.startswith("/reset/"):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
            self.close_connection = True
            self.connection.close()
            return True
        return False

    def _send(self, head_only: bool) -> None:
        if self._fail():
            return
        path = os.path.join(self.root, self.path.split("?", 1)[0].lstrip("/"))
        if not os.path.isfile(path):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        with open(path, "rb") as f:
            data = f.read()
        size = len(data)
        m = _RANGE.match(self.headers.get("Range", ""))
        if m:
            start = int(m.group(1))
            end = min(int(m.group(2)) + 1 if m.group(2) else size, size)
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            data = data[start:end]
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Last-Modified", "Tue, 01 Dec 2026 00:00:00 GMT")
        self.send_header("ETag", f'"{size}"')
        self.end_headers()
        if not head_only:
            self.wfile.write(data)

    def do_GET(self) -> None:
        self._send(head_only=False)

    def do_HEAD(self) -> None:
        self._send(head_only=True)


def main() -> None:
    Handler.root = sys.argv[1]
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    print(f"PORT {server.server_address[1]}", flush=True)
    try:
        sys.stdin.read()
    finally:
        STOP.set()
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    main()
