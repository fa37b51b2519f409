"""Notebooks, REPLs and lambdas: objects that worker processes cannot import travel by value.

A dataset class defined in an interactive ``__main__`` (a Jupyter cell, ``python -``,
``python -c``), a lambda ``collate_fn`` or a closure must reach forkserver workers, and a
worker that cannot unpickle what it was sent must say why, not die in a crash loop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import aioloader
from aioloader.errors import DatasetPickleError

ROOT = Path(__file__).resolve().parent.parent

# Everything here is defined in the script's own (interactive) __main__.
SCRIPT = textwrap.dedent(
    """
    import asyncio, dataclasses, json, aioloader

    @dataclasses.dataclass
    class Pair:
        i: int
        sq: int

    class Squares:
        def __len__(self):
            return 10
        def __getitem__(self, i):
            return Pair(i, i * i)

    def squares_only(batch):
        return [p.sq for p in batch]

    def shifted(offset):
        return lambda batch: [p.sq + offset for p in batch]

    out = {}
    # Plain pickle takes these (by reference to __main__), but workers lack __main__'s names.
    with aioloader.DataLoader(Squares(), batch_size=5, num_workers=2, collate_fn=squares_only) as dl:
        out["by name"] = list(dl)
    with aioloader.DataLoader(Squares(), batch_size=4, num_workers=2, collate_fn=shifted(100)) as dl:
        out["for"] = list(dl)
        async def consume():
            return [b async for b in dl]
        out["async for"] = asyncio.run(consume())
    # Samples of a class defined in __main__ come back as that very class.
    with aioloader.DataLoader(Squares(), batch_size=3, num_workers=2, collate_fn=lambda b: b) as dl:
        got = [p for batch in dl for p in batch]
        out["pairs"] = [[p.i, p.sq] for p in got]
        out["same class"] = all(type(p) is Pair for p in got)
    with aioloader.StreamLoader(range(7), lambda x: -x, batch_size=3, num_workers=2,
                                collate_fn=list) as stream:
        out["stream"] = list(stream)
    async def serve():
        async with aioloader.Batcher(lambda x: Pair(x, x * 3), batch_size=4, num_workers=2) as batcher:
            return [p.sq for p in await batcher.submit_many([1, 2, 3])]
    out["batcher"] = asyncio.run(serve())
    print("RESULT " + json.dumps(out))
    """
)

EXPECTED = {
    "by name": [[0, 1, 4, 9, 16], [25, 36, 49, 64, 81]],
    "for": [[100, 101, 104, 109], [116, 125, 136, 149], [164, 181]],
    "async for": [[100, 101, 104, 109], [116, 125, 136, 149], [164, 181]],
    "pairs": [[i, i * i] for i in range(10)],
    "same class": True,
    "stream": [[0, -1, -2], [-3, -4, -5], [-6]],
    "batcher": [3, 6, 9],
}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _result(proc: subprocess.CompletedProcess[str]) -> Any:
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.parametrize("how", ["stdin", "-c"])
def test_interactive_main_lambdas_and_closures_reach_workers(how: str, tmp_path: Path) -> None:
    if how == "stdin":
        cmd, stdin = [sys.executable, "-"], SCRIPT
    else:
        cmd, stdin = [sys.executable, "-c", SCRIPT], ""
    proc = subprocess.run(
        cmd, input=stdin, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=100
    )
    assert _result(proc) == EXPECTED


def _explode(message: str) -> None:
    raise ValueError(message)


class Unloadable:
    """A dataset (or stream fn) that pickles fine; unpickling it (in a worker) raises."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i

    def __call__(self, x: int) -> int:
        return x

    def __reduce__(self) -> Any:
        return (_explode, ("boom: this dataset cannot be rebuilt in a worker",))


@pytest.mark.parametrize("face", ["DataLoader", "StreamLoader"])
def test_a_worker_that_cannot_unpickle_its_payload_says_why(face: str) -> None:
    loader: Any
    if face == "DataLoader":
        loader = aioloader.DataLoader(Unloadable(), batch_size=2, num_workers=2)
    else:
        loader = aioloader.StreamLoader(range(4), Unloadable(), batch_size=2, num_workers=2)
    with loader, pytest.raises(DatasetPickleError) as info:
        list(loader)
    err = info.value
    assert "could not unpickle" in str(err)
    assert "ValueError: boom: this dataset cannot be rebuilt in a worker" in str(err)
    assert "_explode" in err.remote_traceback  # the worker's own traceback
    assert "boom" in str(err.__cause__)  # the executor's copy of the worker traceback


# ------------------------------------------------------------------- a real Jupyter kernel

CELLS = [
    # 1: a dataset class defined in the notebook, the default collate
    """
    import asyncio, aioloader
    class Squares:
        def __len__(self):
            return 10
        def __getitem__(self, i):
            return i * i
    with aioloader.DataLoader(Squares(), batch_size=4, num_workers=2) as plain:
        print("FOR", [b.tolist() for b in plain])
    dl = aioloader.DataLoader(Squares(), batch_size=4, num_workers=2, collate_fn=lambda b: [x + 1 for x in b])
    """,
    # 2: top-level await on the kernel's own loop, which keeps running other tasks meanwhile
    """
    other = asyncio.ensure_future(asyncio.sleep(0, result="other task ran"))
    got = [b async for b in dl]
    print("ASYNC", got, other.done() and other.result())
    """,
    # 3: the loop still serves the next cell
    """
    await asyncio.sleep(0)
    dl.close()
    print("CLOSED", dl.closed)
    """,
]


def _kernelspec(tmp_path: Path) -> Path:
    # Our own kernelspec, so that the kernel runs this interpreter whatever the machine
    # has installed (CI starts from a fresh venv with no user kernelspec).
    spec = tmp_path / "jupyter" / "kernels" / "aioloader-test"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "aioloader", "language": "python"})
    )
    return tmp_path / "jupyter"


def test_jupyter_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUPYTER_PATH", str(_kernelspec(tmp_path)))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    pytest.importorskip("ipykernel")  # both come with the test extra
    manager = pytest.importorskip("jupyter_client.manager")
    # TMPDIR: the kernel is stopped with a signal (see docs/api.md, "Shutting a kernel
    # down"), so multiprocessing's folder for its spawned forkserver stays, here.
    env = {
        **_env(),
        "JUPYTER_PATH": str(tmp_path / "jupyter"),
        "IPYTHONDIR": str(tmp_path / "ipython"),
        "TMPDIR": str(tmp_path),
    }
    km, kc = manager.start_new_kernel(
        kernel_name="aioloader-test", startup_timeout=60, env=env, cwd=str(tmp_path)
    )
    outputs: list[str] = []
    try:
        for cell in CELLS:
            texts: list[str] = []

            def hook(msg: dict[str, Any], texts: list[str] = texts) -> None:
                content = msg["content"]
                if msg["msg_type"] == "stream":
                    texts.append(content["text"])
                elif msg["msg_type"] == "error":
                    texts.append("ERROR " + "\n".join(content["traceback"]))

            reply = kc.execute_interactive(textwrap.dedent(cell), output_hook=hook, timeout=60)
            assert reply["content"]["status"] == "ok", "".join(texts)
            outputs.append("".join(texts))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    assert "FOR [[0, 1, 4, 9], [16, 25, 36, 49], [64, 81]]" in outputs[0], outputs
    assert "ASYNC [[1, 2, 5, 10], [17, 26, 37, 50], [65, 82]] other task ran" in outputs[1], outputs
    assert "CLOSED True" in outputs[2], outputs
