"""Grain and SPDL as ``bench_suite.py`` contenders, driven like the other loaders.

Each adapter is an object whose ``iter()`` yields one epoch of batches, so the suite's
measuring loop (``iter(loader)`` per epoch, ``next()`` per batch) runs unchanged, and whose
``close()`` stops its workers. Batches have the same shape as aioloader's: a tuple
``(images, labels)`` of numpy arrays for the JPEG workloads, one int64 array for the tiny one.

Configurations (2 workers everywhere, as for the other contenders):

- ``grain``: ``grain.MapDataset.source(dataset).shuffle(seed=0).batch(batch_size)
  .repeat(epochs).to_iter_dataset(ReadOptions(num_threads=2, prefetch_buffer_size=2))
  .mp_prefetch(MultiprocessingOptions(num_workers=2, per_worker_buffer_size=2))``. Grain runs
  several epochs as one pass (``repeat``), so the adapter opens one iterator for the whole
  run and cuts it into epochs by sample count; its workers live for the whole run (a fresh
  iterator per epoch would restart them). The read-ahead is bounded on purpose: Grain's
  default ``ReadOptions`` (16 threads, 500 elements per worker) read hundreds of batches
  ahead (gigabytes of JPEG batches), so epochs 2+ came from a buffer filled during epoch 1
  and measured the buffer, not the loader. With 2 threads and 2 elements per worker it
  holds about as many batches in flight as the others. The older ``grain.python.DataLoader``
  (``IndexSampler`` + ``Batch`` operation) was 10-20x slower than this on the tiny workload
  in trials here, so it is not used.
- ``spdl``: ``spdl.pipeline`` with a *continuous* source of shuffled index batches (one
  pipeline for the whole run, one ``get_iterator()`` per epoch, so the pipeline reads ahead
  across the epoch boundary), then ``pipe(load_batch, executor=ProcessPoolExecutor(2),
  concurrency=4)``: each task builds and collates a whole batch in a worker process with
  ``aioloader.default_collate`` (numpy), and the batch comes back pickled. Four tasks in
  flight for two workers is what the other loaders keep in flight; in trials here 2 left the
  workers idle between tasks and 8 was no faster. Whole batches per task, not samples: one
  pipe round trip per sample costs more than the tiny workload's samples themselves.
- ``spdl-threads`` (not in the suite's default workloads): the same pipeline with per-sample
  ``pipe(dataset.__getitem__, concurrency=2)`` on SPDL's thread pool, then
  ``aggregate(batch_size)`` and a collate stage, all in the consumer's process. PIL releases the GIL while decoding and resizing, so this
  is SPDL's usual way to decode images; the random crop and flip are the same Python
  transform as everyone else's (SPDL's own decoder does not apply to it). In trials here it
  reached about half the process pool's JPEG rate, with 2 s of main-process CPU per epoch:
  the crop, flip and collate hold the GIL. So ``spdl`` uses processes.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import _bench_datasets as bd
import numpy as np

PEER_PACKAGES = {"grain": "grain", "spdl": "spdl", "spdl-threads": "spdl"}


def missing_package(kind: str) -> str | None:
    """The package a peer contender needs and that is not installed, or ``None``."""
    pkg = PEER_PACKAGES.get(kind)
    if pkg is None:
        return None
    try:
        found = importlib.util.find_spec(pkg) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else pkg


def _count(batch: Any) -> int:
    return len(batch[1]) if isinstance(batch, (tuple, list)) else len(batch)


class GrainLoader:
    """One Grain iterator over ``epochs`` epochs, handed out one epoch per ``iter()``."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        epochs: int,
        workers: int,
        buffer: int,
        threads: int,
        prefetch: int,
    ) -> None:
        import grain.python as gp

        self.n = len(dataset)
        read = gp.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch)
        ds = gp.MapDataset.source(dataset).shuffle(seed=0).batch(batch_size).repeat(epochs)
        self._loader = ds.to_iter_dataset(read).mp_prefetch(
            gp.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=buffer)
        )
        self._it: Any = None
        self._seen = 0
        self._epoch = 0

    def __iter__(self) -> Iterator[Any]:
        if self._it is None:
            self._it = iter(self._loader)
        self._epoch += 1
        return self._one_epoch(self._epoch * self.n)

    def _one_epoch(self, until: int) -> Iterator[Any]:
        while self._seen < until:
            try:
                batch = next(self._it)
            except StopIteration:
                return
            self._seen += _count(batch)
            yield batch

    def close(self) -> None:
        it, self._it = self._it, None
        if it is not None and hasattr(it, "close"):
            it.close()  # stops Grain's worker processes


class _EpochBatches:
    """Re-iterable source: every pass is a fresh shuffle of the indices, cut into batches
    (or, with ``batch_size=None``, the shuffled indices themselves)."""

    def __init__(self, n: int, batch_size: int | None, seed: int = 0) -> None:
        self.n, self.batch_size, self.seed, self.epoch = n, batch_size, seed, 0

    def __iter__(self) -> Iterator[Any]:
        order = np.random.default_rng((self.seed, self.epoch)).permutation(self.n)
        self.epoch += 1
        if self.batch_size is None:
            yield from (int(i) for i in order)
        else:
            for start in range(0, self.n, self.batch_size):
                yield order[start : start + self.batch_size]


class SpdlLoader:
    """An SPDL pipeline with a continuous source, one ``get_iterator()`` per epoch."""

    def __init__(self, dataset: Any, batch_size: int, workers: int, threads: bool, concurrency: int) -> None:
        from spdl.pipeline import PipelineBuilder

        from aioloader import default_collate

        self._pool: ProcessPoolExecutor | None = None
        n = len(dataset)
        if threads:
            builder = (
                PipelineBuilder()
                .add_source(_EpochBatches(n, None), continuous=True)
                .pipe(dataset.__getitem__, concurrency=workers, output_order="input")
                .aggregate(batch_size)
                .pipe(default_collate)
                .add_sink(concurrency)
            )
        else:
            self._pool = ProcessPoolExecutor(
                workers, initializer=bd.set_worker_dataset, initargs=(dataset,)
            )
            builder = (
                PipelineBuilder()
                .add_source(_EpochBatches(n, batch_size), continuous=True)
                .pipe(bd.load_batch, executor=self._pool, concurrency=concurrency)
                .add_sink(concurrency)
            )
        self._pipeline = builder.build(num_threads=workers)
        self._pipeline.start()

    def __iter__(self) -> Iterator[Any]:
        return iter(self._pipeline.get_iterator())

    def close(self) -> None:
        self._pipeline.stop()
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)


def make_peer(kind: str, dataset: Any, spec: dict[str, Any], workers: int) -> Any:
    """The contender ``kind`` (``grain``, ``spdl``, ``spdl-threads``) over ``dataset``."""
    if kind == "grain":
        return GrainLoader(
            dataset,
            spec["batch_size"],
            spec["epochs"],
            workers,
            buffer=spec.get("grain_buffer", 2),
            threads=spec.get("grain_threads", 2),
            prefetch=spec.get("grain_prefetch", 2),
        )
    if kind in ("spdl", "spdl-threads"):
        return SpdlLoader(
            dataset,
            spec["batch_size"],
            workers,
            threads=kind == "spdl-threads",
            concurrency=spec.get("spdl_concurrency", 4),
        )
    raise ValueError(f"unknown peer contender {kind!r}")
