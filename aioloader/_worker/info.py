"""Who this worker is, and ``torch.utils.data.get_worker_info()`` as torch's own workers
answer it (id, num_workers, seed, dataset).

An owned worker sets :data:`worker_id` and :data:`num_workers` as it starts;
elsewhere (threads, borrowed executors) they stay ``0`` and torch's answer stays
``None``, as in torch's main process. This module never imports torch (torch keeps the
answer in a module global, set here only where torch is already imported) nor asyncio.
"""

from __future__ import annotations

import sys
from typing import Any

from .. import _seeding

__all__ = ["num_workers", "publish", "publish_shard", "worker_id"]

worker_id = 0  # this worker's slot in its owned pool
num_workers = 0  # the owned pool's size; 0 elsewhere

_TORCH_WORKER = "torch.utils.data._utils.worker"


def publish(ctx: Any, seed: int) -> None:
    """Make ``get_worker_info()`` describe this worker and ``ctx``'s dataset.

    Only in a worker of an owned pool (its id and the pool's size are known), and only
    when torch is already imported here: a torch dataset's module imports it while the
    dataset is unpickled, and code that never imported torch cannot ask. Set again for
    every batch: loaders sharing a pool have different datasets. ``ctx.torch_info``
    caches the answer for one seed.
    """
    if not num_workers:
        return
    module: Any = sys.modules.get(_TORCH_WORKER)
    if module is None:
        return
    info = ctx.torch_info
    want = _seeding.worker_seed(seed, worker_id)
    if info is None or info.seed != want:
        info = ctx.torch_info = module.WorkerInfo(
            id=worker_id, num_workers=num_workers, seed=want, dataset=ctx.dataset
        )
    module._worker_info = info


def publish_shard(ctx: Any, shard: int, num_shards: int, seed: int) -> bool:
    """Make ``get_worker_info()`` describe shard ``shard`` of an iterable dataset's
    epoch (its id is the shard's, ``0 <= id < num_shards``, whichever process runs it).
    Only in a process pool's worker, and only where torch is imported (as
    :func:`publish`); returns whether it did."""
    module: Any = sys.modules.get(_TORCH_WORKER) if num_workers else None
    if module is None:
        return False
    module._worker_info = module.WorkerInfo(id=shard, num_workers=num_shards, seed=seed, dataset=ctx.dataset)
    return True
