"""The sdist and the wheel hold what they promise.

The sdist carries the test suite whole (conftest, helpers, fixtures), the examples and the
docs, so that the tests run from it; the wheel carries the package alone, typed. Both are
built from a copy of the working tree (tracked and untracked files that git does not
ignore), offline, with the build backend installed in this environment.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_DIRS = ("tests", "examples", "docs")
_NOT_SOURCE = {
    ".git",
    ".venv",
    "__pycache__",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    ".hypothesis",
    "build",
    "dist",
    "site",
}

pytestmark = pytest.mark.slow  # two builds and a collection: about 15 s


def _source_files() -> list[str]:
    """The files a release is made from: git's view when this is a checkout (an unpacked
    sdist is not), else everything but caches and build outputs."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return sorted(p for p in out.split("\0") if p and (ROOT / p).is_file())
    files = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in _NOT_SOURCE and not d.endswith(".egg-info")]
        files += [Path(dirpath, f).relative_to(ROOT).as_posix() for f in filenames if not f.endswith(".pyc")]
    return sorted(files)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path, Path]:
    pytest.importorskip("build", reason="the build frontend comes with the test extra")
    pytest.importorskip("setuptools", reason="the build backend comes with the test extra")
    files = _source_files()
    src = tmp_path_factory.mktemp("src")
    for rel in files:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    out = tmp_path_factory.mktemp("dist")
    # Without isolation: the backend installed here, no download. build makes the sdist,
    # then the wheel *from the sdist*, so the sdist is proven to build.
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return files, sdist, wheel


def _sdist_members(sdist: Path) -> tuple[str, set[str]]:
    with tarfile.open(sdist) as tar:
        names = [m.name for m in tar.getmembers() if m.isfile()]
    top = names[0].split("/", 1)[0]
    return top, {n.split("/", 1)[1] for n in names}


def test_sdist_carries_the_test_suite_whole_and_the_license(built: tuple[list[str], Path, Path]) -> None:
    files, sdist, _ = built
    _, members = _sdist_members(sdist)
    assert {"LICENSE", "README.md", "pyproject.toml", "mkdocs.yml", "aioloader/py.typed"} <= members
    assert {"tests/conftest.py", "tests/_datasets.py", "tests/fixtures/README.md"} <= members
    assert any(m.startswith("tests/fixtures/mxnet/") and m.endswith(".rec") for m in members)
    expected = {f for f in files if f.split("/", 1)[0] in SHIPPED_DIRS}
    assert expected - members == set(), "files of tests/, examples/ or docs/ missing from the sdist"
    assert not [m for m in members if "__pycache__" in m or m.endswith(".pyc")]


def test_sdist_metadata_says_apache_2_in_spdx_form(built: tuple[list[str], Path, Path]) -> None:
    _, sdist, _ = built
    top, _ = _sdist_members(sdist)
    with tarfile.open(sdist) as tar:
        f = tar.extractfile(f"{top}/PKG-INFO")
        assert f is not None
        meta = f.read().decode()
    assert "License-Expression: Apache-2.0" in meta
    assert "License-File: LICENSE" in meta


def test_wheel_holds_the_typed_package_and_no_tests(built: tuple[list[str], Path, Path]) -> None:
    _, _, wheel = built
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = zf.read(meta_name).decode()
    assert "aioloader/py.typed" in names
    assert "aioloader/__init__.py" in names
    assert not [n for n in names if n.startswith(("tests/", "examples/", "docs/"))]
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in meta
    # Users' torch: a range in the public extra; the exact pin only in the dev/bench sets.
    torch_reqs = [line for line in meta.splitlines() if line.startswith("Requires-Dist: torch")]
    assert any('torch>=2.0; extra == "torch"' in r for r in torch_reqs), torch_reqs
    pinned = {r.split("extra == ", 1)[1] for r in torch_reqs if "==" in r.split(";", 1)[0]}
    assert pinned == {'"dev"', '"bench"'}, torch_reqs


def test_tests_collect_from_the_unpacked_sdist(built: tuple[list[str], Path, Path], tmp_path: Path) -> None:
    """Collection imports every test module, conftest and helper: a missing one fails here."""
    _, sdist, _ = built
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):  # 3.10.12+: refuse paths outside tmp_path
            tar.extractall(tmp_path, filter="data")
        else:
            tar.extractall(tmp_path)
    (unpacked,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    env = {**os.environ, "PYTHONPATH": str(unpacked)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=unpacked,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "test_packaging.py" in proc.stdout and "test_core.py" in proc.stdout


def test_benchmark_suite_installs_nothing_when_torch_is_missing(tmp_path: Path) -> None:
    """The benchmark once ran ``pip install torch`` by itself; now it says what to install
    and stops (torch is hidden from the child; pip is made to fail loudly if called)."""
    bench = ROOT / "examples" / "benchmarks" / "bench_suite.py"
    code = (
        "import subprocess, sys, runpy\n"
        "sys.modules['torch'] = None\n"
        "def no_pip(*a, **k): raise SystemExit('PIP WAS CALLED')\n"
        "subprocess.run = subprocess.check_call = no_pip\n"
        f"sys.argv = [{str(bench)!r}, '--quick']\n"
        f"runpy.run_path({str(bench)!r}, run_name='__main__')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert proc.returncode != 0
    assert "PIP WAS CALLED" not in proc.stderr
    assert "torch is not installed" in proc.stderr and '".[dev]"' in proc.stderr


def test_benchmark_suite_names_a_missing_peer_in_its_tables(tmp_path: Path) -> None:
    """Grain and SPDL are optional contenders: hidden, each is reported as not installed
    (by the package to install) instead of failing the suite or vanishing from its tables."""
    bench_dir = ROOT / "examples" / "benchmarks"
    code = (
        "import sys\n"
        "sys.modules['grain'] = None\n"
        "sys.modules['spdl'] = None\n"
        f"sys.path.insert(0, {str(bench_dir)!r})\n"
        "import _bench_peers, bench_suite\n"
        "missing = {k: _bench_peers.missing_package(k) for k in ('grain', 'spdl', 'aioloader')}\n"
        "assert missing == {'grain': 'grain', 'spdl': 'spdl', 'aioloader': None}, missing\n"
        "summary = {'rows': {}, 'ratios': {}, 'skipped': {'grain': 'grain', 'spdl': 'spdl'}}\n"
        "print(bench_suite.fmt_table('t', summary, 'images/s'))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| grain | not installed (`pip install grain`) |" in proc.stdout
    assert "| spdl | not installed (`pip install spdl`) |" in proc.stdout


def test_benchmark_suite_epoch_boundary_figure_does_not_depend_on_the_workers_phase() -> None:
    """Two workers deliver in staggered pairs (a short wait, then a long one). An epoch start
    that lands on the long wait is no slower a boundary than one that lands on the short
    wait: the suite's boundary figure (the first two waits against two mean waits) is 1.0
    for both, while the first wait alone reads 0.5x or 1.5x."""
    sys.path.insert(0, str(ROOT / "examples" / "benchmarks"))
    try:
        import bench_suite
    finally:
        sys.path.pop(0)

    def epoch(first: float, waits: list[float]) -> dict[str, float]:
        return {"wall_s": first + sum(waits), "cpu_s": 0.0, "first_batch_s": first,
                "second_batch_wait_s": waits[0], "wait_after_first_s": sum(waits), "samples": 4 * (1 + len(waits))}  # fmt: skip

    def run(first: float, waits: list[float]) -> dict[str, object]:
        return {"epochs": [epoch(first, waits)] * 3, "peak_rss_mb": 1.0, "rss_base_mb": 1.0}

    short, long = 0.05, 0.15
    runs = {
        "aioloader": [run(short, [long, short] * 8)],  # the epoch starts on a short wait
        "aioloader-auto": [run(long, [short, long] * 8)],  # ... or on a long one
    }
    for rep in runs.values():
        rep[0]["epochs"][0] = dict(rep[0]["epochs"][0], cold_start_s=0.5)
    rows = bench_suite.summarize("jpeg", runs, 4)["rows"]
    assert rows["aioloader"]["boundary_vs_two_gaps"] == pytest.approx(1.0)
    assert rows["aioloader-auto"]["boundary_vs_two_gaps"] == pytest.approx(1.0)
    gap_ms = 1000 * (short + long) / 2
    assert rows["aioloader"]["first_batch_epoch2plus_ms"] == pytest.approx(0.5 * gap_ms)
    assert rows["aioloader-auto"]["first_batch_epoch2plus_ms"] == pytest.approx(1.5 * gap_ms)


def _bench_ab(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    bench = ROOT / "examples" / "benchmarks" / "bench_ab.py"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(bench), *args], capture_output=True, text=True, timeout=150, cwd=cwd, env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_ab_benchmark_measures_both_checkouts(tmp_path: Path) -> None:
    """bench_ab.py runs each checkout in its own process and reports its figures: the
    same tree twice here, on a few hundred batches."""
    args = ["--workload", "dispatch", "--samples", "300", "--epochs", "2", "--pairs", "1"]
    proc = _bench_ab(tmp_path, str(ROOT), str(ROOT), *args)
    lines = [line for line in proc.stdout.splitlines() if "batches/s" in line and line[:2] in ("A ", "B ")]
    assert [line[0] for line in lines] == ["A", "B"], proc.stdout
    assert "B/A:" in proc.stdout, proc.stdout  # the ratio of the medians
    for line in lines:
        rate = float(line.split()[1])
        assert rate > 0 and "main" in line and "workers" in line, line


@pytest.mark.torch
def test_ab_benchmark_times_the_cold_start_against_torch(tmp_path: Path) -> None:
    """bench_ab.py's cold workload: the same tree and torch's DataLoader, each in a fresh
    process that imported a dataset module importing torch; per-run times and a median
    per side."""
    proc = _bench_ab(tmp_path, str(ROOT), str(ROOT), "torch", "--workload", "cold", "--pairs", "1")
    runs = [line for line in proc.stdout.splitlines() if "cold start" in line]
    assert sorted(line[0] for line in runs) == ["A", "B", "C"], proc.stdout
    assert all(float(line.split()[3]) > 0 for line in runs), runs
    medians = [line for line in proc.stdout.splitlines() if ": median" in line]
    assert [m.split()[0] for m in medians] == ["A", "B", "C"] and "(torch)" in medians[2], proc.stdout
