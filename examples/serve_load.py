"""Load generator for ``examples/serve.py`` (an aiohttp client): image uploads over
loopback, either closed-loop (``--concurrency`` requests outstanding) or open-loop
(``--rate`` arrivals per second, whatever the answers do).

    python examples/serve_load.py --port 8080 --requests 2000 --concurrency 32
    python examples/serve_load.py --port 8080 --requests 2000 --rate 400

Sends random-noise JPEGs, solid-colour PNGs whose answer is known exactly and checked,
and ``--invalid`` bodies that are not images and must get 400. A 503 (the service's
admission control) or a 504 (a deadline missed) is counted, not wrong, if it says why in
JSON; a 503 must also carry ``Retry-After`` in whole seconds, at least 1. Any body with a
traceback in it is wrong. Prints the latency percentiles and throughput and a final JSON
line; exits 1 if any answer was wrong. Every request has a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
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
    statuses: Counter[int] = field(default_factory=Counter)
    retry_after: Counter[str] = field(default_factory=Counter)  # the 503s' Retry-After values


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


async def send(session: aiohttp.ClientSession, url: str, upload: Upload, results: Results) -> None:
    t0 = time.perf_counter()
    async with session.post(url, data=upload.body) as resp:
        text = await resp.text()
        status = resp.status
        retry_after = resp.headers.get("Retry-After")
    results.latencies.append(time.perf_counter() - t0)
    results.statuses[status] += 1
    if "Traceback" in text:
        results.wrong.append(f"a traceback in an answer {status}: {text[:200]}")
        return
    try:
        payload = json.loads(text)
    except ValueError:
        results.wrong.append(f"answered {status} with a body that is not JSON: {text[:200]}")
        return
    if status == 503:
        results.retry_after[str(retry_after)] += 1
        if retry_after is None or not retry_after.isdigit() or int(retry_after) < 1:
            results.wrong.append(f"503 with Retry-After {retry_after!r}: {payload}")
    check(upload, status, payload, results)


def check(upload: Upload, status: int, payload: dict[str, Any], results: Results) -> None:
    if status in (503, 504):  # admission control said "busy", or the deadline passed
        if "error" not in payload:  # answers, not wrong ones, if they say why
            results.wrong.append(f"answered {status} without an error message: {payload}")
        return
    if not upload.valid:
        if status != 400 or "error" not in payload:
            results.wrong.append(f"invalid body answered {status} {payload}")
        return
    if status != 200:
        results.wrong.append(f"answered {status} {payload}")
        return
    if upload.expect_mean is not None and not np.allclose(payload["mean_rgb"], upload.expect_mean, atol=1e-3):
        results.wrong.append(f"mean {payload['mean_rgb']} != {upload.expect_mean}")


def plan_uploads(args: argparse.Namespace) -> list[Upload]:
    uploads = make_uploads(args.distinct, args.size, args.invalid)
    valid = [u for u in uploads if u.valid]
    rng = random.Random(0)
    plan = [u for u in uploads if not u.valid]
    plan += [rng.choice(valid) for _ in range(args.requests - len(plan))]
    rng.shuffle(plan)
    return plan


async def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = plan_uploads(args)
    url = f"http://{args.host}:{args.port}/predict"
    results = Results()
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    connector = aiohttp.TCPConnector(limit=0 if args.rate else args.concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.perf_counter()
        if args.rate:  # open loop: arrivals on a fixed schedule, answers or not
            tasks = []
            for k, upload in enumerate(plan):
                delay = t0 + k / args.rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)  # pacing the arrivals, not synchronisation
                tasks.append(asyncio.ensure_future(send(session, url, upload, results)))
            await asyncio.gather(*tasks)
        else:
            jobs = iter(plan)

            async def worker() -> None:
                for upload in jobs:
                    await send(session, url, upload, results)

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - t0
    lat = np.array(results.latencies) * 1e3
    return {
        "requests": len(results.latencies),
        "concurrency": None if args.rate else args.concurrency,
        "rate": args.rate or None,
        "seconds": round(elapsed, 3),
        "requests_per_s": round(len(lat) / elapsed, 1) if elapsed > 0 else None,
        "p50_ms": round(float(np.percentile(lat, 50)), 2) if len(lat) else None,
        "p99_ms": round(float(np.percentile(lat, 99)), 2) if len(lat) else None,
        "statuses": {str(k): v for k, v in sorted(results.statuses.items())},
        "retry_after": dict(sorted(results.retry_after.items())),
        "wrong": results.wrong[:10],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Send image uploads to examples/serve.py and time them.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16, help="closed loop: requests outstanding")
    ap.add_argument(
        "--rate", type=float, default=0.0, help="open loop: arrivals per second (overrides concurrency)"
    )
    ap.add_argument("--size", type=int, default=256, help="side of the generated images, pixels")
    ap.add_argument("--distinct", type=int, default=16, help="distinct images to cycle through")
    ap.add_argument("--invalid", type=int, default=0, help="how many uploads are not images (expect 400)")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for any one answer")
    args = ap.parse_args(argv)
    if args.requests < args.invalid or args.concurrency < 1 or args.rate < 0:
        ap.error("need --requests >= --invalid, --concurrency >= 1 and --rate >= 0")
    summary = asyncio.run(run(args))
    print(
        f"{summary['requests']} requests: p50 {summary['p50_ms']} ms, p99 {summary['p99_ms']} ms, "
        f"{summary['requests_per_s']} requests/s, statuses {summary['statuses']}"
    )
    if summary["wrong"]:
        print("WRONG ANSWERS:", *summary["wrong"], sep="\n  ")
    print(json.dumps({"load": summary}), flush=True)
    return 1 if summary["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
