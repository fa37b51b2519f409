"""The shared-memory transport: exact batches, lifetime, bounded reuse, every ownership case."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import gc
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aioloader import DataLoader, _shm
from aioloader._shm import ShmFallbackWarning
from aioloader._transport import make_transport

from . import _shm_datasets as D
from ._shm_datasets import assert_same, shm_backed
from .conftest import _label, descendant_workers, descendants, is_tracker, wait_until

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(_shm.unavailable_reason() is not None, reason="needs a usable /dev/shm")


# ----------------------------------------------------------------------------- helpers
def mine(pid: int | None = None) -> set[str]:
    """/dev/shm names of the consumer ``pid`` (default: this process)."""
    prefix = f"{_shm.PREFIX}{os.getpid() if pid is None else pid}_"
    return {n for n in os.listdir(_shm.SHM_DIR) if n.startswith(prefix)}


def expected_images(indices: list[int], shape: tuple[int, ...] = (3, 64, 64)) -> np.ndarray:
    return np.stack([D.image(i, shape) for i in indices])


def check_image_batches(batches: list[Any], batch_size: int, n: int) -> None:
    assert len(batches) == -(-n // batch_size)
    for k, b in enumerate(batches):
        idx = list(range(k * batch_size, min(n, (k + 1) * batch_size)))
        assert b["img"].dtype == np.float32
        assert b["img"].tobytes() == expected_images(idx).tobytes(), f"batch {k} corrupted"
        assert b["label"].tolist() == idx


def loader(ds: Any, **kw: Any) -> DataLoader:
    opts: dict[str, Any] = {"batch_size": 8, "num_workers": 2, "prefetch": 4, "transport": "shm"}
    opts.update(kw)
    return DataLoader(ds, **opts)


# ------------------------------------------------------------------------ transport choice
def test_auto_picks_shm_only_for_own_process_pools() -> None:
    assert make_transport("auto", pool_kind="process", prefetch=4).kind == "shm"
    assert make_transport("auto", pool_kind="thread", prefetch=4).kind == "pickle"
    assert make_transport("auto", pool_kind="external", prefetch=4).kind == "pickle"
    assert make_transport("shm", pool_kind="thread", prefetch=4).kind == "pickle"
    assert make_transport("shm", pool_kind="external", prefetch=4).kind == "shm"
    assert make_transport("pickle", pool_kind="process", prefetch=4).kind == "pickle"


def test_no_dev_shm_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_shm._names, "SHM_DIR", "/nonexistent/shm")
    assert make_transport("auto", pool_kind="process", prefetch=4).kind == "pickle"
    with pytest.warns(ShmFallbackWarning, match="does not exist"):
        assert make_transport("shm", pool_kind="process", prefetch=4).kind == "pickle"


def test_bad_capacity_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_shm.CAPACITY_ENV, "lots")
    with pytest.raises(ValueError, match=_shm.CAPACITY_ENV):
        make_transport("shm", pool_kind="process", prefetch=4)
    monkeypatch.setenv(_shm.CAPACITY_ENV, "1.5M")
    assert _shm.capacity_limit() == 3 << 19


# ---------------------------------------------------------------------------- exactness
def test_batches_match_pickle_byte_for_byte(collect: Callable[..., list[Any]]) -> None:
    ds = D.NestedDataset(20)
    with loader(ds, transport="pickle") as ref_loader:
        ref = collect(ref_loader)
    with loader(ds) as shm_loader:
        got = collect(shm_loader)
    assert len(got) == len(ref) == 3
    for a, b in zip(got, ref, strict=True):
        assert_same(a, b)
    first = got[0]
    # Large leaves view shared memory; small ones were pickled inline.
    assert shm_backed(first["img"]) and shm_backed(first["pair"][1]) and shm_backed(first["meta"].vec)
    assert shm_backed(first["od"]["z"]) and shm_backed(first["lst"][0])
    assert not shm_backed(first["pair"][0]) and not shm_backed(first["label"])


def test_user_collate_output_goes_through_shm(collect: Callable[..., list[Any]]) -> None:
    ds = D.ImageDataset(24)
    with loader(ds, transport="pickle", collate_fn=D.odd_collate) as ref_loader:
        ref = collect(ref_loader)
    with loader(ds, collate_fn=D.odd_collate) as shm_loader:
        got = collect(shm_loader)
    for a, b in zip(got, ref, strict=True):
        assert_same(a, b)
        assert shm_backed(a["fortran"]) and a["fortran"].flags.f_contiguous
        assert shm_backed(a["strided"]) and shm_backed(a["nested"][0][0])
        assert a["again"] is a["plain"] and b["again"] is b["plain"]  # one array, as pickle keeps it


def test_collate_errors_are_unchanged() -> None:
    """The shm collate delegates mismatches to default_collate: same error, same note."""

    class _Bad:  # not used in workers: num_workers=0 shares nothing, so test the collate itself
        pass

    enc = _shm.ShmEncoder(_shm.ShmConfig(consumer_pid=-1, host=_shm.host_key(), window=2, max_slabs=2))
    coll = _shm.ShmCollate(enc)
    from aioloader import CollateError, default_collate

    samples = [np.zeros((3, 4)), np.zeros((3, 5))]
    with pytest.raises(CollateError) as ours:
        coll(samples)
    with pytest.raises(CollateError) as theirs:
        default_collate(samples)
    assert str(ours.value) == str(theirs.value)


# ----------------------------------------------------------------------------- lifetime
def test_holding_three_windows_of_batches_keeps_every_byte(collect: Callable[..., list[Any]]) -> None:
    prefetch = 4
    n = 8 * (3 * prefetch + 2)
    with loader(D.ImageDataset(n), prefetch=prefetch) as dl:
        held = collect(dl)  # every batch of the epoch stays alive
        assert sum(shm_backed(b["img"]) for b in held) >= 2 * prefetch
        again = collect(dl)  # the workers keep producing while all of them are held
        check_image_batches(held, 8, n)
        check_image_batches(again, 8, n)


def test_consumer_may_write_into_batches(collect: Callable[..., list[Any]]) -> None:
    n = 8 * 12
    with loader(D.ImageDataset(n)) as dl:
        held = collect(dl)
        for k, b in enumerate(held):
            assert b["img"].flags.writeable
            b["img"][...] = -k
        later = collect(dl)  # produced while the written batches are still held
        for k, b in enumerate(held):
            assert (b["img"] == -k).all(), f"batch {k} was overwritten while held"
        check_image_batches(later, 8, n)
        del held, later, b
        gc.collect()
        check_image_batches(collect(dl), 8, n)  # slabs freed and reused: fresh data


def test_views_outlive_the_loader() -> None:
    with loader(D.ImageDataset(32)) as dl:
        batches = list(dl)
        part = batches[1]["img"][2:4]  # a view of a view keeps the slab too
    del batches
    gc.collect()
    assert shm_backed(part)
    assert part.tobytes() == expected_images([10, 11]).tobytes()
    assert not mine()


def test_forked_child_dropping_batches_does_not_free_slabs() -> None:
    """mp_context="fork" workers inherit the consumer's batches; when the child lets
    them go, the consumer's slabs must stay busy."""
    with loader(D.ImageDataset(32)) as dl:
        batches = list(dl)
    base: Any = batches[0]["img"]
    while type(base) is not _shm._Export:
        base = base.base
    slab = base.owner
    del base
    ticket = int(slab.state[0])
    assert ticket != 0
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            del batches
            gc.collect()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert int(slab.state[0]) == ticket, "a forked child freed the consumer's slab"
    check_image_batches(batches, 8, 32)
    del batches
    gc.collect()
    assert int(slab.state[0]) == 0, "the consumer's own release still works"


def test_abandoned_epochs_release_their_slabs(collect: Callable[..., list[Any]]) -> None:
    """Batches that arrive but are never taken (a `break`) must free their slabs, or the
    arenas fill up and everything falls back to pickle."""
    n = 8 * 8  # 12 abandoned epochs would pin ~36 slabs if undecoded batches leaked
    with loader(D.ImageDataset(n)) as dl:
        for _ in range(12):
            assert len(collect(dl, limit=1)) == 1
        gc.collect()
        full = collect(dl)
        assert all(shm_backed(b["img"]) for b in full)
        check_image_batches(full, 8, n)


# ------------------------------------------------------------------ bounded, flat resources
def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _shm_maps(pid: int, rings: bool = False) -> int:
    """Mappings of our slabs in ``pid`` (with ``rings``: of spill rings instead, one
    per worker that spilled a pickled batch; see ``aioloader/_spill.py``)."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if f"/{_shm.PREFIX}" in line and ("_ring" in line) == rings)


def test_resources_stay_flat_over_many_epochs(collect: Callable[..., list[Any]]) -> None:
    prefetch, workers_n = 4, 2
    cap = workers_n * (2 * prefetch + 2)  # slabs: max_slabs per worker arena
    with loader(D.ImageDataset(8 * 8), prefetch=prefetch, num_workers=workers_n) as dl:
        fds, maps, rings = [], [], []
        for epoch in range(30):
            batches = collect(dl)
            if epoch == 0:
                workers = dl.worker_pids()
            if epoch % 10 == 0:
                check_image_batches(batches, 8, 64)
            del batches
            # The next epoch is already being built (prefetch_next_epoch): a slab created
            # for it keeps its name until its first batch lands in this process. The
            # window is full soon and then nothing is created: every name must go.
            wait_until(lambda: not mine(), 10.0, "in-flight slabs to reach the consumer")
            fds.append((_fd_count(os.getpid()), *(_fd_count(w) for w in workers)))
            maps.append((_shm_maps(os.getpid()), _shm.mapped_slabs(), *(_shm_maps(w) for w in workers)))
            rings.append((_shm_maps(os.getpid(), True), *(_shm_maps(w, True) for w in workers)))
        assert dl.worker_pids() == workers
        # +1 at most: a sample may catch a slab being created or attached (fd open for
        # microseconds); any per-batch or per-slab leak would climb well past that.
        for col in zip(*fds[3:], strict=True):
            assert max(col) <= min(col) + 1, f"file descriptors grew after warm-up: {fds}"
        assert all(m <= cap for row in maps for m in row), maps
        # At most one spill ring per worker, in the consumer and in its worker.
        assert all(r[0] <= workers_n and max(r[1:]) <= 1 for r in rings), rings


# ---------------------------------------------------------------------- ownership cases
def test_close_and_gc_leave_nothing(collect: Callable[..., list[Any]]) -> None:
    dl = loader(D.ImageDataset(64))
    check_image_batches(collect(dl), 8, 64)
    dl.close()
    assert not mine()
    # Without next-epoch prefetch: with it, a loader iterated by `for` is kept alive by
    # its speculative run on the portal loop (a core issue, reported, not shm's).
    dl2 = loader(D.ImageDataset(64), prefetch_next_epoch=False)
    check_image_batches(collect(dl2), 8, 64)
    del dl2  # never closed: the finalizer shuts the pool and sweeps
    gc.collect()
    wait_until(lambda: not descendant_workers(), 15.0, "the collected loader's workers to exit")
    assert not mine()


def _kill_when_marked(marker: Path, seen: list[set[str]]) -> threading.Thread:
    def run() -> None:
        wait_until(marker.exists, 60.0, "the worker to block mid-write")
        wait_until(lambda: marker.read_text() != "", 5.0, "the marker's pid")
        pid = int(marker.read_text())
        seen.append({n for n in mine() if f"_{pid}_" in n})
        os.kill(pid, signal.SIGKILL)

    t = threading.Thread(target=run, name="test-killer")
    t.start()
    return t


def test_worker_killed_mid_write(tmp_path: Path, collect: Callable[..., list[Any]]) -> None:
    marker = tmp_path / "marker"
    seen: list[set[str]] = []
    n = 64
    with loader(D.BombDataset(n, str(marker), bomb_index=0)) as dl:
        killer = _kill_when_marked(marker, seen)
        try:
            batches = collect(dl)
        finally:
            killer.join()
        assert seen and seen[0], "the killed worker had a slab that never reached the consumer"
        assert dl.stats().restarts >= 1
        check_image_batches(batches, 8, n)
        assert batches[0]["tag"][0] == "bomb"
        check_image_batches(collect(dl), 8, n)
    assert not mine()


def _stop_orphans(pids: set[int]) -> None:
    """Stop what a killed consumer left running. Its resource tracker is left to exit on
    its own once the others are gone: it then unlinks the dead run's semaphores. So is a
    forked forkserver, which ends as soon as its consumer has (and forks the tracker
    then if it had not yet: killing it first would lose what the tracker was to clean)."""
    tracker = {p for p in pids if is_tracker(p) or "aioloader-fsrv" in _label(p)}
    for p in pids - tracker:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    try:
        wait_until(lambda: not any(_alive(p) for p in tracker), 20.0, "the orphaned tracker and forkserver to exit")
    finally:
        for p in tracker:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


def _alive(pid: int) -> bool:
    return _shm._pid_alive(pid)


def test_consumer_killed(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with open(tmp_path / "stderr", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", D.CONSUMER_SCRIPT, str(marker)], cwd=REPO, env=env, stderr=err
        )
    helpers: set[int] = set()
    try:
        wait_until(
            lambda: (marker.exists() and marker.read_text() != "") or proc.poll() is not None, 60.0, "marker"
        )
        assert proc.poll() is None, (tmp_path / "stderr").read_text()
        blocked = int(marker.read_text())
        assert any(f"_{blocked}_" in n for n in mine(proc.pid)), "a slab was created and not yet attached"
        helpers = descendants(proc.pid)
        proc.kill()
        proc.wait()
        # Orphaned workers unlink every name they created, then exit (aioloader's orphan
        # watch in each worker runs the shared-memory cleanup before it ends the process).
        assert blocked in helpers
        wait_until(lambda: not mine(proc.pid), 20.0, "the orphaned workers to unlink their slabs")
        wait_until(lambda: not _alive(blocked), 20.0, "the orphaned worker to exit")
        # Every other orphan (the other worker, the forkserver) exits on its own too. Wait
        # for that before the last check: the other worker may still create a slab after
        # the check above, and it unlinks it before it exits, unless it is killed first.
        others = {p for p in helpers if not is_tracker(p)}
        wait_until(lambda: not any(_alive(p) for p in others), 20.0, "every orphan to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _stop_orphans(helpers)
    assert not mine(proc.pid)


def test_sweep_removes_stale_names_of_dead_runs() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = Path(_shm.SHM_DIR) / f"{_shm.PREFIX}{dead.pid}_{dead.pid}_deadbeef_0"
    fresh = Path(_shm.SHM_DIR) / f"{_shm.PREFIX}{dead.pid}_{dead.pid}_deadbeef_1"
    try:
        stale.write_bytes(b"x")
        fresh.write_bytes(b"x")
        old = time.time() - 2 * _shm.FOREIGN_GRACE_S
        os.utime(stale, (old, old))
        _shm.sweep()
        assert not stale.exists() and fresh.exists()
    finally:
        for p in (stale, fresh):
            p.unlink(missing_ok=True)


# ---------------------------------------------------------------------------- fallback
def test_tiny_capacity_falls_back_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, collect: Callable[..., list[Any]]
) -> None:
    monkeypatch.setenv(_shm.CAPACITY_ENV, "1M")  # a window of 400 KiB batches needs more
    n = 8 * 10
    with loader(D.ImageDataset(n), transport="auto") as dl:
        with pytest.warns(ShmFallbackWarning) as record:
            batches = collect(dl)
            batches += collect(dl)
    msgs = [str(w.message) for w in record if issubclass(w.category, ShmFallbackWarning)]
    assert len(msgs) == 1, msgs
    assert "--shm-size" in msgs[0] and "remount" in msgs[0]
    check_image_batches(batches[:10], 8, n)
    check_image_batches(batches[10:], 8, n)
    assert not any(shm_backed(b["img"]) for b in batches)
    assert not mine()


def test_foreign_worker_pickles_and_warns() -> None:
    """A worker that is not on the consumer's host/namespace must not use shm."""
    cfg = _shm.ShmConfig(consumer_pid=-1, host=("another-boot", 0, 0, 0), window=2, max_slabs=2)
    enc = pickle.loads(pickle.dumps(_shm.ShmEncoder(cfg)))
    batch = {"x": np.ones((256, 256), np.float32)}
    arrived = pickle.loads(pickle.dumps(enc(batch)))
    dec = _shm.ShmDecoder()
    with pytest.warns(ShmFallbackWarning, match="cannot share memory"):
        out = dec(arrived)
    assert_same(out, batch)


def test_borrowed_process_executor_with_explicit_shm(collect: Callable[..., list[Any]]) -> None:
    import multiprocessing as mp

    ex = cf.ProcessPoolExecutor(2, mp_context=mp.get_context("forkserver"))
    try:
        with DataLoader(D.ImageDataset(48), batch_size=8, executor=ex, transport="shm") as dl:
            batches = collect(dl)
        check_image_batches(batches, 8, 48)
        assert all(shm_backed(b["img"]) for b in batches)
    finally:
        ex.shutdown(wait=True)
    del batches
    assert not mine()


@pytest.fixture(autouse=True)
def _no_names_of_ours() -> Iterator[None]:
    yield
    gc.collect()
    assert not mine(), sorted(mine())
