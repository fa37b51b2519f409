"""Remote data: the suite's JPEG workload over HTTP with 0, 10 and 50 ms latency per request.

The synthetic JPEGs of ``bench_suite.py`` (2,048 by default; 320-512 px; decode +
RandomResizedCrop(224) + flip; batch 64) are served by a local HTTP server in a process of
its own (``_bench_http.py``: the files from memory, ``?latency_ms=N`` added per request).
Contenders, each in a fresh process, interleaved (the order rotates every repetition):

- ``torch-2`` and ``torch-16``: ``torch.utils.data.DataLoader`` (persistent workers, fork)
  over a map-style dataset whose ``__getitem__`` does a blocking GET on a keep-alive
  ``http.client`` connection per worker, then the decode + augment;
- ``aioloader-fetch``: ``aioloader.DataLoader`` with ``fetch=`` (an aiohttp GET on the
  loader's event loop, ``io_concurrency`` in flight) and ``transform=`` (decode + augment
  in the 2 workers);
- ``aioloader-local``: aioloader over the same JPEGs as local files (``ImageFolder``), 2
  workers: the ceiling (it does not depend on the latency, so it runs once per repetition).

Per run: a short warm-up (the first batches, worker start included), then images/s and
main-process CPU (``time.process_time()``: all its threads, not its workers) over the
measured batches (``--epochs`` epochs at most, ``--max-seconds`` at most); the total PSS
and RSS of the contender's process tree (main + workers, not the server), read from
``/proc/PID/smaps_rollup`` by this parent process every 0.2 s (peak); and the server's CPU
time during the run. Tables print medians of the repetitions, then the ratios the issue
asks for.

Usage (the full run takes about 5 minutes on 2 cores)::

    python examples/benchmarks/bench_remote.py --json remote.json --png docs/remote.png
    python examples/benchmarks/bench_remote.py --images 512 --repeat 1     # a quick look
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bench_suite import _cpu_by_thread, _thread_cpu, _thread_names  # noqa: E402

CONTENDERS = ("torch-2", "torch-16", "aioloader-fetch", "aioloader-local")
# Not in the default run: aioloader-fetch on a minimal asyncio-streams client, to tell
# aiohttp's share of the main process's CPU time from the loader's; and on an in-memory
# source with the same added latency (no client, no server), to tell the loader's own
# fetch path from the HTTP traffic's.
EXTRA = ("aioloader-fetch-raw", "aioloader-fetch-mem")
FETCHERS = ("aioloader-fetch", "aioloader-fetch-raw", "aioloader-fetch-mem")
TORCH_WORKERS = {"torch-2": 2, "torch-16": 16}
LOCAL = "aioloader-local"
AIO_WORKERS = 2

# --------------------------------------------------------------------------- child side


def _make_loader(spec: dict[str, Any]) -> Any:
    import _remote_datasets as rd

    kind, bs = spec["contender"], spec["batch_size"]
    s3 = spec.get("s3")
    if kind in TORCH_WORKERS:
        import torch.utils.data as tud

        items = rd.jpeg_items(spec["root"])
        ds: Any = (
            rd.TorchS3Jpegs(s3["url"], s3["options"], items)
            if s3
            else rd.TorchHttpJpegs("127.0.0.1", spec["port"], items, spec["latency_ms"])
        )
        return tud.DataLoader(
            ds, batch_size=bs, shuffle=True, num_workers=TORCH_WORKERS[kind], persistent_workers=True
        )
    import aioloader

    if kind == LOCAL:
        import _bench_datasets as bd

        return aioloader.DataLoader(
            bd.jpeg_dataset(spec["root"]), bs, shuffle=True, num_workers=AIO_WORKERS, seed=0
        )
    if kind == "aioloader-fetch-mem":  # no server: the loader's own fetch path alone
        fetch: Any = rd.MemoryFetch(spec["root"], spec["latency_ms"])
    elif s3:
        fetch = rd.S3Fetch(s3["url"], s3["options"])
    else:
        client = rd.RawHttpFetch if kind == "aioloader-fetch-raw" else rd.HttpFetch
        fetch = client(f"http://127.0.0.1:{spec['port']}", spec["latency_ms"])
    return aioloader.DataLoader(
        rd.jpeg_items(spec["root"]), bs, shuffle=True, num_workers=AIO_WORKERS, seed=0,
        fetch=fetch, transform=rd.decode_train, io_concurrency=spec["io_concurrency"],
        **({"io_buffer": int(spec["io_buffer_mib"] * 2**20)} if spec.get("io_buffer_mib") else {}),
    )  # fmt: skip


def _batches(loader: Any, epochs: int) -> Any:
    for _ in range(epochs):
        yield from loader


def child_main(spec: dict[str, Any]) -> int:
    """One contender: warm up, then measure until ``epochs`` epochs or ``max_s`` seconds."""
    t_make = time.perf_counter()
    loader = _make_loader(spec)
    first = None
    warm = samples = batches = 0
    t0 = c0 = t_last = 0.0
    measuring = False
    threads: dict[int, float] = {}
    for batch in _batches(loader, spec["epochs"]):
        now = time.perf_counter()
        if not measuring:
            first = now - t_make if first is None else first
            warm += 1
            if warm >= spec["warmup_batches"] or now - t_make >= spec["warmup_s"]:
                measuring, t0, c0 = True, now, time.process_time()
                threads = _thread_cpu()
            continue
        samples += len(batch[1])
        batches += 1
        t_last = now
        del batch
        if now - t0 >= spec["max_s"]:
            break
    cpu = time.process_time() - c0
    by_thread = _cpu_by_thread(threads, _thread_cpu(), _thread_names())
    if not samples:
        raise SystemExit("no batch was measured: give more images, epochs, or a smaller --batch-size")
    result: dict[str, Any] = {
        "samples": samples, "batches": batches, "wall_s": t_last - t0, "cpu_s": cpu,
        "first_batch_s": first, "warmup_batches": warm, "cpu_by_thread_s": by_thread,
    }  # fmt: skip
    if spec["contender"].startswith("aioloader"):
        st = loader.stats()
        result["worker_busy"] = st.worker_busy
        if spec["contender"] != LOCAL:
            result["fetch_peak_in_flight"] = st.fetch_peak_in_flight
            result["fetch_wait_s"] = st.fetch_wait_s
        loader.close()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# -------------------------------------------------------------------------- parent side


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    return kids


def _role(pid: int, root: int, parent: str) -> str:
    if pid == root:
        return "main"
    if parent == "forkserver":
        return "worker"  # forked by the forkserver: its command line is the forkserver's
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return "?"
    for role in (b"forkserver", b"resource_tracker"):
        if role in cmd:
            return role.decode()
    return "worker"


def tree_memory_mb(pid: int) -> tuple[float, float, dict[str, list[float]]]:
    """(PSS, RSS, PSS of each process by role) over ``pid`` and all its descendants."""
    kids = _children()
    todo, pss, rss = [(pid, "")], 0.0, 0.0
    roles: dict[str, list[float]] = {}
    while todo:
        p, parent = todo.pop()
        role = _role(p, pid, parent)
        todo.extend((k, role) for k in kids.get(p, ()))
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                fields = {
                    k: int(v.split()[0]) / 1024
                    for k, _, v in (line.partition(":") for line in f)
                    if k in ("Pss", "Rss")
                }
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        pss += fields.get("Pss", 0.0)
        rss += fields.get("Rss", 0.0)
        roles.setdefault(role, []).append(round(fields.get("Pss", 0.0), 1))
    return pss, rss, roles


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_child(spec: dict[str, Any], server_pid: int, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    server_cpu0 = proc_cpu_s(server_pid)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak: dict[str, Any] = {"pss_mb": 0.0, "rss_mb": 0.0, "processes": 0, "pss_by_role_mb": {}}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):  # often: a short run starts its workers and ends within 0.2 s
            pss, rss, roles = tree_memory_mb(proc.pid)
            # the most processes the run had at once (a worker that starts late still counts)
            peak["processes"] = max(peak["processes"], sum(map(len, roles.values())))
            if pss > peak["pss_mb"]:
                peak.update(pss_mb=pss, rss_mb=rss, pss_by_role_mb=roles)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        done.set()
        sampler.join()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    for line in reversed(out.splitlines()):
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            result.update(peak)
            result["server_cpu_s"] = proc_cpu_s(server_pid) - server_cpu0
            return result
    raise RuntimeError(
        f"benchmark child failed ({spec['contender']}, {spec['latency_ms']} ms), exit code {proc.returncode}:\n"
        f"{out[-2000:]}\n{err[-4000:]}"
    )


class Server:
    """``_bench_http.py`` in a process of its own; the port comes back on its stdout."""

    def __init__(self, root: Path, kind: str) -> None:
        cmd = [sys.executable, str(HERE / "_bench_http.py"), str(root), "--kind", kind]
        # stdin: a pipe that only this process holds; when it exits, the server does too
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.strip():
            self.stop()
            raise RuntimeError("the benchmark's HTTP server did not start")
        self.port = int(line)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class S3Store:
    """moto's S3 server (the test suite's ``tests/_s3_server.py``) in a process of its
    own, holding the JPEGs under their ``ImageFolder`` paths; no latency is added."""

    BUCKET = "bench"

    def __init__(self, root: Path) -> None:
        import urllib.request

        script = HERE.parents[1] / "tests" / "_s3_server.py"
        self.proc = subprocess.Popen(
            [sys.executable, str(script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # werkzeug logs every request
            text=True,
        )
        assert self.proc.stdout is not None
        word, _, port = self.proc.stdout.readline().partition(" ")
        if word != "PORT":
            self.stop()
            raise RuntimeError("moto's S3 server did not start (pip install 'moto[server]')")
        endpoint = f"http://127.0.0.1:{int(port)}"
        urllib.request.urlopen(
            urllib.request.Request(f"{endpoint}/{self.BUCKET}", method="PUT"), timeout=30
        ).close()
        self.options = {
            "endpoint": endpoint, "region": "us-east-1", "access_key_id": "bench", "secret_access_key": "bench",
            "virtual_hosted_style_request": False, "allow_http": True,
        }  # fmt: skip
        self.url = f"s3://{self.BUCKET}"
        import _remote_datasets as rd
        import obstore

        from aioloader.io import ObjectStore

        client = ObjectStore(self.url, **self.options).client
        for path, _label in rd.jpeg_items(str(root)):
            obstore.put(client, path.lstrip("/"), (root / path.lstrip("/")).read_bytes())
        self.port = int(port)

    def stop(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


def summarize(raw: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Medians per (contender, latency) cell."""
    rows: dict[str, dict[str, Any]] = {}
    for cell, reps in raw.items():
        if not reps:
            continue
        med = statistics.median
        rows[cell] = {
            "images_per_s": med(r["samples"] / r["wall_s"] for r in reps),
            "main_cpu_s_per_1k": med(1000 * r["cpu_s"] / r["samples"] for r in reps),
            "peak_pss_mb": med(r["pss_mb"] for r in reps),
            "peak_rss_mb": med(r["rss_mb"] for r in reps),
            "processes": max(r["processes"] for r in reps),
            "server_cpu_s": med(r["server_cpu_s"] for r in reps),
            "first_batch_s": med(r["first_batch_s"] for r in reps),
            "reps": len(reps),
        }
        mid = sorted(reps, key=lambda r: r["pss_mb"])[len(reps) // 2]  # the run of the median PSS
        rows[cell]["pss_by_role_mb"] = {k: round(sum(v), 1) for k, v in mid["pss_by_role_mb"].items()}
        for key in ("worker_busy", "fetch_peak_in_flight", "fetch_wait_s"):
            if key in reps[0]:
                rows[cell][key] = med(r[key] for r in reps)
    return rows


def cell(contender: str, latency: float | None) -> str:
    return contender if latency is None else f"{contender}@{latency:g}ms"


def ratios(rows: dict[str, dict[str, Any]], latencies: list[float]) -> dict[str, dict[str, float]]:
    """Each fetch contender against the local ceiling and torch, per latency."""
    out: dict[str, dict[str, float]] = {}
    local = rows.get(LOCAL)
    for who in FETCHERS:
        for lat in latencies:
            aio = rows.get(cell(who, lat))
            if aio is None:
                continue
            r: dict[str, float] = {}
            if local:
                r["vs_local"] = aio["images_per_s"] / local["images_per_s"]
            for t in TORCH_WORKERS:
                other = rows.get(cell(t, lat))
                if other:
                    r[f"vs_{t}"] = aio["images_per_s"] / other["images_per_s"]
                    r[f"pss_vs_{t}"] = aio["peak_pss_mb"] / other["peak_pss_mb"]
                    r[f"rss_vs_{t}"] = aio["peak_rss_mb"] / other["peak_rss_mb"]
            out[cell(who, lat)] = r
    return out


def fmt_table(rows: dict[str, dict[str, Any]], rat: dict[str, dict[str, float]]) -> str:
    lines = [
        "| contender | latency | images/s | main-process CPU (s per 1,000 images) | peak total PSS (MiB) "
        "| peak total RSS (MiB) | processes | server CPU (s per run) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        who, _, lat = name.partition("@")
        lines.append(
            f"| {who} | {lat.replace('ms', ' ms') or 'local files'} | {row['images_per_s']:,.0f} "
            f"| {row['main_cpu_s_per_1k']:.3f} | {row['peak_pss_mb']:,.0f} | {row['peak_rss_mb']:,.0f} "
            f"| {row['processes']} | {row['server_cpu_s']:.2f} |"
        )
    lines.append("")
    for name, r in rat.items():
        parts = [f"{r['vs_local']:.2f}x local files"] if "vs_local" in r else []
        for t in TORCH_WORKERS:
            if f"vs_{t}" in r:
                parts.append(f"{r[f'vs_{t}']:.2f}x {t}")
        if "pss_vs_torch-16" in r:
            parts.append(
                f"memory {r['pss_vs_torch-16']:.2f}x torch-16 (PSS; RSS {r['rss_vs_torch-16']:.2f}x)"
            )
        who, _, lat = name.partition("@")
        lines.append(f"{who} at {lat.replace('ms', ' ms')}: " + ", ".join(parts))
    return "\n".join(lines)


def draw_png(rows: dict[str, dict[str, Any]], latencies: list[float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "aioloader-fetch": "#2a7ab0",
        "aioloader-fetch-raw": "#7fb3d5",
        "aioloader-fetch-mem": "#9bc59d",
        "torch-2": "#f2c14e",
        "torch-16": "#e08a2c",
    }
    colors = {k: v for k, v in colors.items() if any(cell(k, lat) in rows for lat in latencies)}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(colors)
    for ax, key, label in (
        (axes[0], "images_per_s", "images/s"),
        (axes[1], "peak_pss_mb", "peak total PSS (MiB)"),
    ):
        for j, who in enumerate(colors):
            xs = [
                i + (j - (len(colors) - 1) / 2) * width
                for i, lat in enumerate(latencies)
                if cell(who, lat) in rows
            ]
            vs = [rows[cell(who, lat)][key] for lat in latencies if cell(who, lat) in rows]
            bars = ax.bar(xs, vs, width, label=who, color=colors[who])
            for bar, v in zip(bars, vs, strict=True):
                ax.annotate(
                    f"{v:,.0f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=7
                )
        if key == "images_per_s" and LOCAL in rows:
            ax.axhline(rows[LOCAL][key], color="#555", ls="--", lw=1, label="aioloader, local files")
        ax.set_xticks(range(len(latencies)))
        ax.set_xticklabels([f"{lat:g} ms" for lat in latencies])
        ax.set_xlabel("latency added per request")
        ax.set_title(label, fontsize=10)
        ax.margins(y=0.15)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=2048, help="synthetic JPEGs (default 2,048)")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions per cell (default 3)")
    parser.add_argument("--latency", default="0,10,50", help="comma-separated ms added per request")
    parser.add_argument(
        "--contenders", default=",".join(CONTENDERS), help="comma-separated: " + ", ".join(CONTENDERS + EXTRA)
    )
    parser.add_argument("--io-concurrency", type=int, default=128, help="aioloader-fetch's io_concurrency")
    parser.add_argument(
        "--server", choices=("raw", "aiohttp"), default="raw", help="HTTP server implementation"
    )
    parser.add_argument(
        "--store",
        choices=("http", "s3"),
        default="http",
        help="where the JPEGs are served from: the HTTP server (with --latency), or moto's S3 server "
        "(no added latency; shown as 0 ms)",
    )
    parser.add_argument(
        "--io-buffer-mib",
        type=float,
        default=None,
        help="the fetch contenders' io_buffer (default: the loader's)",
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2, help="most epochs per run (warm-up included)")
    parser.add_argument("--max-seconds", type=float, default=5.0, help="most measured seconds per run")
    parser.add_argument("--cache", type=Path, default=None, help="JPEG folder (default ~/.cache/aioloader)")
    parser.add_argument("--json", type=Path, default=None, help="write all results here")
    parser.add_argument("--png", type=Path, default=None, help="draw the chart here (e.g. docs/remote.png)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # Every contender runs as users' programs do, with bytecode caching: where the environment
    # turns it off (PYTHONDONTWRITEBYTECODE, as on this project's machine), each fresh
    # interpreter (the contenders' processes, a spawned forkserver) compiles its modules
    # from source, which weighs on start-up times and on memory.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    if args.child is not None:
        return child_main(json.loads(args.child))

    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(contenders) - set(CONTENDERS + EXTRA))
    if unknown:
        parser.error(
            f"--contenders: unknown {', '.join(unknown)} (choose from {', '.join(CONTENDERS + EXTRA)})"
        )
    if any(c in TORCH_WORKERS for c in contenders) and importlib.util.find_spec("torch") is None:
        sys.exit(
            'torch is not installed: pip install -e ".[bench]" (pins torch==2.13.0), or leave out the torch contenders'
        )
    latencies = [float(x) for x in args.latency.split(",") if x.strip()] if args.store == "http" else [0.0]
    from aioloader._formats.synthetic import default_cache, make_synthetic_jpegs

    root = (args.cache or default_cache()) / f"bench-jpegs-{args.images}"
    make_synthetic_jpegs(root, args.images)
    base = {
        "root": str(root), "batch_size": args.batch_size, "epochs": args.epochs, "max_s": args.max_seconds,
        "warmup_batches": 4, "warmup_s": 2.0, "io_concurrency": args.io_concurrency,
        "io_buffer_mib": args.io_buffer_mib,
    }  # fmt: skip
    cells = [
        (c, None) if c == LOCAL else (c, lat)
        for c in contenders
        for lat in ([None] if c == LOCAL else latencies)
    ]
    raw: dict[str, list[dict[str, Any]]] = {cell(c, lat): [] for c, lat in cells}
    started = time.perf_counter()
    server: Server | S3Store = Server(root, args.server) if args.store == "http" else S3Store(root)
    if isinstance(server, S3Store):
        base["s3"] = {"url": server.url, "options": server.options}
    try:
        for rep in range(args.repeat):
            order = cells[rep % len(cells) :] + cells[: rep % len(cells)]  # rotate: no cell always first
            for who, lat in order:
                spec = {**base, "contender": who, "latency_ms": lat or 0.0, "port": server.port}
                res = run_child(spec, server.proc.pid, timeout=600)
                raw[cell(who, lat)].append(res)
                print(
                    f"[{time.perf_counter() - started:6.1f} s] rep {rep + 1}/{args.repeat} {cell(who, lat):<24} "
                    f"{res['samples'] / res['wall_s']:7,.0f} images/s, PSS {res['pss_mb']:,.0f} MiB",
                    flush=True,
                )
    finally:
        server.stop()
    rows = summarize(raw)
    rat = ratios(rows, latencies)
    print()
    print(fmt_table(rows, rat))
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    results = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "config": {**base, "images": args.images, "repeat": args.repeat, "latencies_ms": latencies, "server": args.server,
                   "store": args.store},
        "rows": rows, "ratios": rat, "raw": raw,
    }  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
        print(f"wrote {args.json}")
    if args.png:
        title = (
            f"JPEG workload over HTTP, {args.images} images, {os.cpu_count()} cores shared with the server "
            f"(medians of {args.repeat}); aioloader {AIO_WORKERS} workers, io_concurrency {args.io_concurrency}"
        )
        draw_png(rows, latencies, args.png, title)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
