"""Load generator for ``examples/serve.py``: N image uploads over loopback, C at a time.

    python examples/serve_load.py --port 8080 --requests 2000 --concurrency 32

Opens ``--concurrency`` keep-alive connections and sends ``--requests`` uploads in
total (random-noise JPEGs, plus solid-colour PNGs whose answer is known exactly and
checked, plus ``--invalid`` bodies that are not images and must get 400). Prints the
latency percentiles and throughput, and a final JSON line; exits 1 if any answer was
wrong. Bounded by construction: it stops after ``--requests`` answers, and every read
has a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image


@dataclass
class Upload:
    body: bytes
    expect_mean: list[float] | None  # known answer for solid images (up to float32 rounding)
    valid: bool = True


@dataclass
class Results:
    latencies: list[float] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)


def make_uploads(n_distinct: int, size: int, invalid: int, seed: int = 0) -> list[Upload]:
    rng = np.random.default_rng(seed)
    out: list[Upload] = []
    for k in range(n_distinct):
        buf = io.BytesIO()
        if k % 2 == 0:
            arr = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            Image.fromarray(arr).save(buf, format="JPEG", quality=85)
            out.append(Upload(buf.getvalue(), None))
        else:
            colour = [int(c) for c in rng.integers(0, 256, 3)]
            Image.new("RGB", (size, size), tuple(colour)).save(buf, format="PNG")  # type: ignore[arg-type]
            out.append(Upload(buf.getvalue(), [c / 255 for c in colour]))
    out.extend(Upload(b"not an image %d" % i, None, valid=False) for i in range(invalid))
    return out


async def request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, body: bytes, timeout: float
) -> tuple[int, dict[str, Any]]:
    writer.write(
        f"POST /predict HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/octet-stream\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode("latin-1")
        + body
    )
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    payload = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), timeout)
    return status, json.loads(payload)


async def connection(
    host: str, port: int, jobs: asyncio.Queue[Upload], results: Results, timeout: float
) -> None:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        while True:
            try:
                upload = jobs.get_nowait()
            except asyncio.QueueEmpty:
                return
            t0 = time.perf_counter()
            status, payload = await request(reader, writer, host, upload.body, timeout)
            results.latencies.append(time.perf_counter() - t0)
            check(upload, status, payload, results)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except ConnectionError:
            pass


def check(upload: Upload, status: int, payload: dict[str, Any], results: Results) -> None:
    if not upload.valid:
        if status != 400 or "error" not in payload:
            results.wrong.append(f"invalid body answered {status} {payload}")
        return
    if status != 200:
        results.wrong.append(f"answered {status} {payload}")
        return
    results.batch_sizes.append(int(payload["batch"]))
    if upload.expect_mean is not None and not np.allclose(payload["mean_rgb"], upload.expect_mean, atol=1e-3):
        results.wrong.append(f"mean {payload['mean_rgb']} != {upload.expect_mean}")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    uploads = make_uploads(args.distinct, args.size, args.invalid)
    valid = [u for u in uploads if u.valid]
    rng = random.Random(0)
    plan = [u for u in uploads if not u.valid]
    plan += [rng.choice(valid) for _ in range(args.requests - len(plan))]
    rng.shuffle(plan)
    jobs: asyncio.Queue[Upload] = asyncio.Queue()
    for u in plan:
        jobs.put_nowait(u)
    results = Results()
    t0 = time.perf_counter()
    await asyncio.gather(
        *(connection(args.host, args.port, jobs, results, args.timeout) for _ in range(args.concurrency))
    )
    elapsed = time.perf_counter() - t0
    lat = np.array(results.latencies) * 1e3
    return {
        "requests": len(results.latencies),
        "concurrency": args.concurrency,
        "seconds": round(elapsed, 3),
        "requests_per_s": round(len(lat) / elapsed, 1) if elapsed > 0 else None,
        "p50_ms": round(float(np.percentile(lat, 50)), 2) if len(lat) else None,
        "p99_ms": round(float(np.percentile(lat, 99)), 2) if len(lat) else None,
        "mean_batch": round(float(np.mean(results.batch_sizes)), 2) if results.batch_sizes else None,
        "wrong": results.wrong[:10],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Send image uploads to examples/serve.py and time them.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--size", type=int, default=256, help="side of the generated images, pixels")
    ap.add_argument("--distinct", type=int, default=16, help="distinct images to cycle through")
    ap.add_argument("--invalid", type=int, default=0, help="how many uploads are not images (expect 400)")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for any one answer")
    args = ap.parse_args(argv)
    if args.requests < args.invalid or args.concurrency < 1:
        ap.error("need --requests >= --invalid and --concurrency >= 1")
    summary = asyncio.run(run(args))
    print(
        f"{summary['requests']} requests, {summary['concurrency']} connections: "
        f"p50 {summary['p50_ms']} ms, p99 {summary['p99_ms']} ms, {summary['requests_per_s']} requests/s, "
        f"mean batch {summary['mean_batch']}"
    )
    if summary["wrong"]:
        print("WRONG ANSWERS:", *summary["wrong"], sep="\n  ")
    print(json.dumps({"load": summary}), flush=True)
    return 1 if summary["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
