"""An S3-compatible server (moto's) on 127.0.0.1, in a process of its own, for the remote tests.

Run as ``python tests/_s3_server.py``: it binds a free port, prints ``PORT <n>`` on one
line once it accepts connections, and serves until its standard input is closed (the
test fixture closes it to stop the server, and terminates it only if that fails).
Buckets are created with a plain ``PUT /<bucket>``; moto checks no credentials.
"""

from __future__ import annotations

import sys

from moto.server import ThreadedMotoServer


def main() -> None:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()  # returns once the socket is bound and listening
    _host, port = server.get_host_and_port()
    print(f"PORT {port}", flush=True)
    try:
        sys.stdin.read()  # EOF: the test session is over
    finally:
        server.stop()


if __name__ == "__main__":
    main()
