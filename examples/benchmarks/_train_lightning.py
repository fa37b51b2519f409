"""The Lightning benchmark's child: a small Lightning training script, run in a fresh process.

A linear model fits 2 epochs of 2,048 samples of 16 floats (batch 64, 2 workers) on the
CPU, with a val loader of the same size. The loaders are aioloader's or torch's
(persistent workers; both give tensors, as the dataset is a torch ``Dataset``). The
dataset lives in this script, as it does in many training scripts::

    python _train_lightning.py --loader aioloader
    python _train_lightning.py --loader torch --progress-bar

The last line is ``RESULT {json}``: the wall time of ``fit``, and the times from the call
to ``fit`` to the first val batch (Lightning's sanity check) and to the first training batch.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from typing import Any

import lightning as L
import torch
import torch.utils.data


class Floats(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``n`` samples: 16 floats and their sum (the target).

    With 2,048 samples, the sum runs over 32,768 elements: torch's grain size, so torch
    runs it on its intra-op pool (OpenMP). Those native threads stay up, and are running
    when the loaders start, as in most training scripts. ``--intra-op-threads 1`` keeps
    them from starting."""

    def __init__(self, n: int, seed: int) -> None:
        self.x = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def make_loader(kind: str, dataset: Floats, batch_size: int, shuffle: bool) -> Any:
    if kind == "torch":
        return torch.utils.data.DataLoader(
            dataset, batch_size=batch_size, shuffle=shuffle, num_workers=2, persistent_workers=True
        )
    import aioloader

    return aioloader.DataLoader(dataset, batch_size, shuffle=shuffle, num_workers=2)


class Model(L.LightningModule):
    def __init__(self, kind: str, samples: int, batch_size: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)
        self.kind, self.samples, self.batch_size = kind, samples, batch_size

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch: Any, index: int) -> None:
        x, y = batch
        torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        return make_loader(self.kind, Floats(self.samples, 0), self.batch_size, True)

    def val_dataloader(self) -> Any:
        return make_loader(self.kind, Floats(self.samples, 1), self.batch_size, False)


class FirstBatches(L.Callback):
    """When the first val batch and the first training batch start."""

    def __init__(self) -> None:
        self.first_val: float | None = None
        self.first_train: float | None = None
        self.train_batches = 0
        self.threads_at_first_train = 0

    def on_validation_batch_start(self, *args: Any, **kwargs: Any) -> None:
        if self.first_val is None:
            self.first_val = time.perf_counter()

    def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
        if self.first_train is None:
            self.first_train = time.perf_counter()
            self.threads_at_first_train = threading.active_count()
        self.train_batches += 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loader", choices=("aioloader", "torch"), required=True)
    ap.add_argument("--progress-bar", action="store_true", help="Lightning's tqdm bar (a thread)")
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--intra-op-threads", type=int, default=None, help="torch.set_num_threads, first")
    args = ap.parse_args()
    if args.intra_op_threads:
        torch.set_num_threads(args.intra_op_threads)
    if args.loader == "aioloader":
        import aioloader  # noqa: F401  (imported before the clock, as a script imports it)
    with tempfile.TemporaryDirectory() as root:
        marks = FirstBatches()
        trainer = L.Trainer(
            max_epochs=args.epochs,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=args.progress_bar,
            enable_model_summary=False,
            callbacks=[marks],
            default_root_dir=root,
        )
        model = Model(args.loader, args.samples, args.batch_size)
        native_threads = len(os.listdir("/proc/self/task"))  # Python's and native ones (Linux)
        t0 = time.perf_counter()
        trainer.fit(model)
        fit_s = time.perf_counter() - t0
    assert marks.first_train is not None, "no training batch"
    result = {
        "loader": args.loader,
        "progress_bar": args.progress_bar,
        "fit_s": fit_s,
        "first_train_batch_s": marks.first_train - t0,
        "first_val_batch_s": None if marks.first_val is None else marks.first_val - t0,
        "train_batches": marks.train_batches,
        "threads_at_first_train": marks.threads_at_first_train,
        "native_threads_before_fit": native_threads,
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
