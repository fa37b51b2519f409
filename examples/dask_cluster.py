"""Build batches on a dask.distributed cluster and train a stand-in model from them.

Run it as is and it starts a throwaway ``LocalCluster`` (two worker processes, listening
on 127.0.0.1 only), trains a linear regression with plain numpy SGD for a few epochs,
and shuts everything down::

    pip install "aioloader[dask]"
    python examples/dask_cluster.py

The same code runs against a real cluster: start a scheduler and workers yourself::

    dask scheduler                              # prints tcp://HOST:8786
    dask worker tcp://HOST:8786 --nworkers 8 --nthreads 1   # on each preprocessing host

and pass its address::

    python examples/dask_cluster.py --scheduler tcp://HOST:8786

Then the cluster is left running; only the client is closed. The workers must be able
to import the dataset's class: on a real cluster install your package on them; for
this file, ``client.upload_file`` ships it (see ``main``). ``pure=False`` is what the
loader wants: every batch is new work, never a cached result.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

import aioloader

FEATURES = 16


class SyntheticRegression:
    """Sample ``i``: features drawn from a generator seeded with ``i`` and a noisy
    linear target. Cheap to pickle (no arrays held), so it ships in a few bytes."""

    def __init__(self, n: int, true_seed: int = 1234) -> None:
        self.n = n
        self.true_seed = true_seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.float32]:
        w = np.random.default_rng(self.true_seed).normal(size=FEATURES)
        x = np.random.default_rng(i).normal(size=FEATURES)
        # augmentation noise from the per-sample RNG: the same for a given (seed, epoch, i)
        noise = aioloader.sample_rng().normal(scale=0.01)
        return x.astype(np.float32), np.float32(x @ w + noise)


@contextlib.contextmanager
def connect(scheduler: str | None) -> Iterator[Any]:
    """A dask ``Client``: to ``scheduler`` if given, else to a fresh loopback cluster."""
    import distributed

    dd: Any = distributed  # only partly typed; keeps a strict type checker quiet here
    if scheduler is not None:
        with dd.Client(scheduler) as client:
            yield client
        return
    with (
        dd.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",  # loopback only: nothing outside this machine can connect
            # loopback too, on a free port: with None the scheduler still serves its HTTP
            # endpoint on the fixed port 8787, and a second cluster on this host would clash
            dashboard_address="127.0.0.1:0",
        ) as cluster,
        dd.Client(cluster) as client,
    ):
        yield client


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        default=None,
        help="a running dask scheduler, e.g. tcp://10.0.0.5:8786 (default: start a LocalCluster)",
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)

    # Import the dataset by its module name, not as __main__.SyntheticRegression, so that
    # it pickles as a name the workers can import once this file is uploaded to them.
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    dataset_cls = importlib.import_module("dask_cluster").SyntheticRegression

    with connect(args.scheduler) as client:
        if args.scheduler is not None:
            client.upload_file(__file__)
        print(f"dask scheduler {client.scheduler.address}, {len(client.scheduler_info()['workers'])} workers")
        loader = aioloader.DataLoader(
            dataset_cls(args.samples),
            batch_size=args.batch_size,
            shuffle=True,
            seed=0,
            executor=client.get_executor(pure=False),
            prefetch=8,  # batches in flight on the cluster at once
            # No speculative batches of an epoch that will never run once training ends
            # (closing the loader would cancel them; dask logs each cancelled result).
            prefetch_next_epoch=False,
        )
        w = np.zeros(FEATURES, dtype=np.float64)
        lr = 0.05
        first_loss: float | None = None
        loss = float("nan")
        with loader:
            for epoch in range(args.epochs):
                t0 = time.perf_counter()
                losses = []
                for x, y in loader:  # a training step per batch (a model on an accelerator, in real life)
                    err = x @ w - y
                    losses.append(float(np.mean(err**2)))
                    w -= lr * 2 * (x.T @ err) / len(y)
                loss = float(np.mean(losses))
                first_loss = loss if first_loss is None else first_loss
                stats = loader.stats()
                print(
                    f"epoch {epoch}: {len(losses)} batches in {time.perf_counter() - t0:.2f} s, "
                    f"mean loss {loss:.4f}, consumer stalled {stats.epochs[-1].stall_s:.2f} s"
                )
        # The executor is the client's; the loader left it (and the cluster) running.
        print(f"final loss {loss:.4f} (first epoch {first_loss:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
