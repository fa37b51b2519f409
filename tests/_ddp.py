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


def with_accelerate() -> dict[str, Any]:
    """accelerate's prepare(), a short training loop, then skip_first_batches."""
    from accelerate import Accelerator
    from accelerate import skip_first_batches as accelerate_skip

    from aioloader.integrations import skip_first_batches, to_device

    accelerator = Accelerator(cpu=True)  # starts the gloo process group (torchrun's env)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = to_device(aioloader.DataLoader(Tensors(), 4, shuffle=True, num_workers=1), accelerator.device)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    got: dict[str, Any] = {"rank": accelerator.process_index, "shard": list(loader.shard)}
    seen, devices = [], set()
    for x, i in loader:
        devices.add(str(x.device))
        opt.zero_grad()
        accelerator.backward(model(x).sum())
        opt.step()
        seen.extend(i.tolist())
    got["epoch0"], got["devices"], got["device"] = seen, sorted(devices), accelerator.device.type
    # Resuming epoch 1 two batches in: accelerate's way (a torch loader rebuilt from this
    # one's batch_sampler and attributes), then aioloader's (the loader itself).
    got["accelerate_skip"] = ids(accelerate_skip(loader, 2))
    got["epoch1"] = ids(loader, "async for")
    got["epoch2_planned"] = [i for b in loader.batch_sampler for i in b]
    got["aioloader_skip"] = ids(skip_first_batches(loader, 2))
    loader.close()
    return got


def with_lightning(out: Path) -> dict[str, Any]:
    """Trainer(devices=2, strategy="ddp"): fit 2 epochs with a checkpoint at step 7,
    then fit again from that checkpoint."""
    import lightning as L

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
            self.seen: list[list[int]] = []

        def training_step(self, batch: Any, k: int) -> Any:
            x, i = batch
            self.seen.append(i.tolist())
            return self.layer(x).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self) -> Any:
            return aioloader.DataLoader(Tensors(), 4, shuffle=True)

    def trainer(**kw: Any) -> Any:
        return L.Trainer(
            devices=2, strategy="ddp", accelerator="cpu", max_epochs=2, logger=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out), **kw,
        )  # fmt: skip

    every = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=str(out), filename="mid", every_n_train_steps=7, save_top_k=-1
    )
    full = Model()
    trainer(callbacks=[every]).fit(full)
    resumed = Model()
    trainer(enable_checkpointing=False).fit(resumed, ckpt_path=str(out / "mid.ckpt"))
    return {"rank": dist.get_rank(), "full": full.seen, "resumed": resumed.seen}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    try:
        if scenario == "accelerate":
            got = with_accelerate()
        elif scenario == "lightning":
            got = with_lightning(out)
        else:
            got = {"plain": plain}[scenario]()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(got))


if __name__ == "__main__":
    main()
