"""Scenarios that run on 2 CPU ranks under ``torchrun --standalone`` (gloo).

``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/_ddp.py SCENARIO OUT``
runs one scenario on each rank; each rank writes what it saw to ``OUT/rank{r}.json``,
and the test checks the ranks against each other. Run by tests/test_frameworks.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import aioloader  # noqa: E402
from tests._datasets import RangeDataset  # noqa: E402

N = 40  # samples: 20 a rank


class Tensors(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Sample ``i`` is ``(x, i)``: four floats from ``i`` and the index."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Any:
        return torch.full((4,), float(i)), i


def ids(loader: Any, face: str = "for", limit: int | None = None) -> list[int]:
    """The sample indices of one pass, through ``for`` or ``async for``."""
    out: list[int] = []

    def add(batch: Any) -> bool:
        out.extend(int(i) for i in batch[1])
        return limit is not None and len(out) >= limit

    if face == "for":
        for batch in loader:
            if add(batch):
                break
        return out

    async def main() -> None:
        async for batch in loader:
            if add(batch):
                break

    asyncio.run(main())
    return out


def warned(fn: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if "torch.distributed" in str(w.message)]


def plain() -> dict[str, Any]:
    """Plain torch.distributed: no sampler, no shard=."""
    early = aioloader.DataLoader(RangeDataset(N), 4, shuffle=True)  # before the process group
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    got: dict[str, Any] = {"rank": rank}
    with early:
        got["early"] = ids(early)
    with aioloader.DataLoader(RangeDataset(N), 4, shuffle=True, num_workers=2) as loader:
        got["shard"] = list(loader.shard)
        got["for"] = ids(loader, "for")
        got["async"] = ids(loader, "async for")  # epoch 1
    with aioloader.DataLoader(RangeDataset(N), 4, shuffle=True) as loader:
        it = iter(loader)
        head = [int(i) for _ in range(2) for i in next(it)[1]]  # two batches of epoch 0
        state = loader.state_dict()  # taken mid-epoch, as a checkpoint callback takes it
        it.close()
    shared = [state]
    dist.broadcast_object_list(shared, src=0)  # a framework saves rank 0's state for all
    with aioloader.DataLoader(RangeDataset(N), 4, shuffle=True) as loader:
        loader.load_state_dict(shared[0])
        got["resumed"] = head + ids(loader, "async for")
    with aioloader.DataLoader(RangeDataset(N), 4, shuffle=True, seed=7) as loader:
        got["seeded"] = ids(loader)
    got["warned"] = warned(lambda: aioloader.DataLoader(RangeDataset(N), 4, sampler=list(range(N))).close())
    sampler = torch.utils.data.DistributedSampler(RangeDataset(N), shuffle=False)
    got["dsampler_warned"] = warned(lambda: aioloader.DataLoader(RangeDataset(N), 4, sampler=sampler).close())
    with aioloader.DataLoader(RangeDataset(N), 4, sampler=sampler) as loader:
        got["dsampler"] = ids(loader)
    got["optout_warned"] = warned(lambda: aioloader.DataLoader(RangeDataset(N), 4, shard=(0, 1)).close())
    with aioloader.DataLoader(RangeDataset(N), 4, shard=(0, 1)) as loader:
        got["optout"] = ids(loader)
    return got


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    try:
        got = {"plain": plain}[scenario]()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(got))


if __name__ == "__main__":
    main()
