"""num_workers="auto" and prefetch="auto": chosen from the CPUs this process may use
(affinity mask and cgroup quota), and reported by stats()."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

import aioloader
from aioloader import _cpus

from ._datasets import RangeDataset


def _cgroup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, str], rel: str = "/a/b"
) -> Path:
    """A fake /sys/fs/cgroup tree with ``files`` (path -> content), this process in ``rel``."""
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    real = Path.read_text

    def read_text(self: Path, *args: object, **kwargs: object) -> str:
        if str(self) == "/proc/self/cgroup":
            return f"0::{rel}\n"
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", read_text)
    return tmp_path


def test_the_tightest_v2_quota_on_the_path_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cpus, "_affinity", lambda: 8)
    root = _cgroup(
        tmp_path,
        monkeypatch,
        {"cpu.max": "max 100000\n", "a/cpu.max": "250000 100000\n", "a/b/cpu.max": "max 100000\n"},
    )
    n, why = _cpus.available_cpus(root)
    assert n == 3 and "quota of 2.5 CPUs" in why and "8 CPUs" in why


def test_affinity_bounds_a_larger_quota_and_no_quota_means_affinity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_cpus, "_affinity", lambda: 2)
    root = _cgroup(tmp_path, monkeypatch, {"a/b/cpu.max": "800000 100000\n"})
    assert _cpus.available_cpus(root)[0] == 2
    empty = _cgroup(tmp_path / "none", monkeypatch, {"x": ""})
    n, why = _cpus.available_cpus(empty)
    assert n == 2 and "no cgroup CPU quota" in why


def test_a_v1_quota_is_read_when_there_is_no_v2_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cpus, "_affinity", lambda: 16)
    root = _cgroup(
        tmp_path,
        monkeypatch,
        {"cpu,cpuacct/cpu.cfs_quota_us": "150000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
    )
    assert _cpus.available_cpus(root)[0] == 2
    # a quota below one CPU still gets one worker
    (root / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("20000\n")
    assert _cpus.available_cpus(root)[0] == 1


@pytest.mark.parametrize("face", ["for", "async-for"])
def test_auto_settings_build_the_pool_and_say_why(face: str) -> None:
    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with aioloader.DataLoader(RangeDataset(16), 4, num_workers="auto", prefetch="auto") as loader:
        if face == "for":
            got = [b[1].tolist() for b in loader]
        else:

            async def main() -> list[list[int]]:
                return [b[1].tolist() async for b in loader]

            got = asyncio.run(main())
        stats = loader.stats()
        assert got == [list(range(k, k + 4)) for k in range(0, 16, 4)]
        assert loader.num_workers == _cpus.available_cpus()[0] <= (expected or 1)
        assert len(loader.worker_pids()) == loader.num_workers
        assert loader.prefetch == max(2, 2 * loader.num_workers)
    assert stats.settings[0].startswith(f"num_workers='auto' chose {loader.num_workers}: ")
    assert stats.settings[1].startswith(f"prefetch='auto' starts at {loader.prefetch}: ")
    assert loader.prefetch <= stats.window
    assert "num_workers='auto' chose" in str(stats)
    assert all(len(line) <= 100 for line in str(stats).splitlines()), str(stats)  # fits a terminal


def test_auto_is_the_only_word_accepted() -> None:
    with pytest.raises(ValueError, match="num_workers"):
        aioloader.DataLoader(RangeDataset(4), 2, num_workers="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefetch"):
        aioloader.DataLoader(RangeDataset(4), 2, prefetch="lots")  # type: ignore[arg-type]
    with aioloader.WorkerPool(1) as pool, pytest.raises(ValueError, match="conflict with pool="):
        aioloader.DataLoader(RangeDataset(4), 2, num_workers="auto", pool=pool)
    assert aioloader.DataLoader(RangeDataset(4), 2).stats().settings == ()
