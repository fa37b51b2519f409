"""The cold-start workload's dataset: its module imports torch, as most real dataset
modules do (a transform, a tensor conversion), so that a worker that imports it afresh
pays for torch's import before its first batch."""

from __future__ import annotations

import torch  # noqa: F401  (the import is the point)
from _bench_datasets import IntDataset


class TorchModuleInts(IntDataset):
    """Ints, from a module that imports torch."""
