"""Datasets that use torch. torch is imported at module level, as a real torch dataset's
module would: aioloader seeds torch's generator only once torch is imported."""

from __future__ import annotations

from typing import Any

import torch

from ._datasets import RangeDataset


class TorchAugmentedDataset(RangeDataset):
    def __getitem__(self, i: int) -> Any:
        return torch.rand(3) + i, i
