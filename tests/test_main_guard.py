"""A script without ``if __name__ == "__main__":`` whose workers import it again.

Each case is a real script run by a fresh interpreter: the re-import happens only in
worker processes started by spawn (or forked from multiprocessing's forkserver). Workers
that come from aioloader's own fork server never import the script: that server is a
copy of the consumer, or, if threads ran before aioloader was imported, a fresh
interpreter that gets what ``__main__`` defined by value.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .conftest import SHM_PREFIX, alive, wait_until

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import os, threading
    with open({marks!r}, "a") as f:  # one line per run of this body, in any process
        f.write(f"{{os.getpid()}}\\n")
    if {thread} == "before":  # a thread that runs before aioloader is imported
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    import aioloader
    if {thread} == "after":  # a logger's or a metrics client's thread, started at import
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    loader = aioloader.DataLoader(list(range(8)), batch_size=2, num_workers=2{context})
    {guard}
        print("batches", sum(len(b) for b in loader))
    """
)

CASES = [pytest.param("", ', multiprocessing_context="spawn"', id="spawn")]
OWN_SERVER = [pytest.param("after", "", id="thread-after-import"), pytest.param("before", "", id="thread-before-import")]


def _run(tmp_path: Path, thread: str, context: str, guard: bool) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    marks = tmp_path / "runs"
    script = tmp_path / "train.py"
    head = 'if __name__ == "__main__":' if guard else "if True:  # no guard"
    script.write_text(SCRIPT.format(marks=str(marks), thread=repr(thread), context=context, guard=head))
    (tmp_path / "tmp").mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(ROOT),
        "TMPDIR": str(tmp_path / "tmp"),  # the forkserver's socket folder: checked below
        "LC_ALL": "C.UTF-8",
    }
    # A forkserver and a resource tracker inherit stderr: the run ends once they have exited.
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=100
    )
    return proc, [int(p) for p in marks.read_text().split()]


@pytest.mark.parametrize("thread,context", CASES)
def test_an_unguarded_script_gets_one_error_naming_the_guard(tmp_path: Path, thread: str, context: str) -> None:
    proc, runs = _run(tmp_path, thread, context, guard=False)
    err = proc.stderr
    assert proc.returncode == 1, err
    errors = [line for line in err.splitlines() if line.startswith("aioloader.errors.")]
    assert len(errors) == 1 and errors[0].startswith("aioloader.errors.PoolBrokenError: "), err
    assert str(tmp_path / "train.py") in errors[0] and 'if __name__ == "__main__":' in errors[0], err
    # one traceback, the consumer's; nothing from the workers, no retried generations
    assert err.count("Traceback") == 1 and "RuntimeError" not in err and "bootstrapping" not in err, err
    assert "leaked" not in err and "Lost" not in err and "batches" not in proc.stdout, err
    # the consumer once, then each worker of the first generation at most once
    assert 1 < len(runs) <= 3, runs
    wait_until(lambda: not any(alive(p) for p in runs), 20.0, "the script's processes to exit")
    left = [n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX) and any(f"_{p}_" in n for p in runs)]
    assert not left and not list((tmp_path / "tmp").iterdir()), (left, list((tmp_path / "tmp").iterdir()))


@pytest.mark.parametrize("thread,context", CASES)
def test_a_module_level_loader_iterated_under_the_guard_still_works(
    tmp_path: Path, thread: str, context: str
) -> None:
    # Each worker re-imports the script and builds the loader, but starts nothing.
    proc, runs = _run(tmp_path, thread, context, guard=True)
    assert proc.returncode == 0 and proc.stdout == "batches 8\n", proc.stderr
    assert proc.stderr == "" and len(runs) == 3, (proc.stderr, runs)


@pytest.mark.parametrize("guard", [False, True], ids=["unguarded", "guarded"])
@pytest.mark.parametrize("thread,context", OWN_SERVER)
def test_workers_from_aioloaders_server_never_run_the_script_again(
    tmp_path: Path, thread: str, context: str, guard: bool
) -> None:
    """As with torch's fork start, a script needs no guard: its body runs once."""
    proc, runs = _run(tmp_path, thread, context, guard=guard)
    assert proc.returncode == 0 and proc.stdout == "batches 8\n", proc.stderr
    assert proc.stderr == "" and len(runs) == 1, (proc.stderr, runs)
