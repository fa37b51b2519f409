"""The drop-in contract: a short torch training loop, written for
``torch.utils.data.DataLoader``, runs unchanged on ``aioloader.DataLoader`` and sees
the same multiset of samples as on torch's own loader."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import Dataset, IterableDataset, get_worker_info  # noqa: E402

import aioloader  # noqa: E402

pytestmark = pytest.mark.torch

OFFSET = 1000  # what worker_init_fn sets in each worker: a sample shows that it ran
_worker_state: dict[str, int] = {}


def init_worker(worker_id: int) -> None:
    info = get_worker_info()
    assert info is not None and info.id == worker_id and info.num_workers == 2
    _worker_state["offset"] = OFFSET


def offset() -> int:
    return _worker_state["offset"] if get_worker_info() is not None else OFFSET


class Numbers(Dataset):  # type: ignore[type-arg]
    """Sample ``i`` is ``(tensor([i.]), i + OFFSET)``; the indices in ``bad`` raise."""

    def __init__(self, n: int, bad: frozenset[int] = frozenset()) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, int]:
        if i in self.bad:
            raise ValueError(f"sample {i} is corrupt")
        return torch.tensor([float(i)]), i + offset()


class Bulk(Dataset):  # type: ignore[type-arg]
    """torch's bulk pattern: ``dataset[list of indices]`` returns the whole batch."""

    def __len__(self) -> int:
        return 30

    def __getitem__(self, keys: list[int]) -> Any:
        return torch.tensor(keys) + offset()


class Chunks:
    """A sampler of lists of indices (for ``batch_size=None``)."""

    def __iter__(self) -> Iterator[list[int]]:
        return iter([list(range(k, min(k + 7, 30))) for k in range(0, 30, 7)])

    def __len__(self) -> int:
        return 5


class Stream(IterableDataset):  # type: ignore[type-arg]
    """``0..n-1`` split between the workers by ``get_worker_info()``, as torch's docs show."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(worker, self.n, workers):
            yield torch.tensor(i + offset())


def train(DataLoader: Any) -> tuple[Counter[tuple[str, int]], int]:
    """The torch code: nothing in it knows which DataLoader it runs on."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    seen: Counter[tuple[str, int]] = Counter()
    errors = 0

    # positional arguments, torch's shuffle=None, a worker_init_fn, an error-skipping loop
    loader = DataLoader(Numbers(40, frozenset({13})), 4, None, None, None, 2, None, False, False, 0, init_worker)
    it = iter(loader)
    while True:
        try:
            x, y = next(it)
        except StopIteration:
            break
        except ValueError:
            errors += 1  # a corrupt batch: skip it and go on
            continue
        loss = ((model(x).squeeze(1) - y.float()) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen.update(("map", int(v)) for v in y)

    # no automatic batching, a sampler of index lists: whole batches from the dataset
    for batch in DataLoader(Bulk(), batch_size=None, sampler=Chunks(), num_workers=2, worker_init_fn=init_worker):
        seen.update(("bulk", int(v)) for v in batch)

    # an IterableDataset split by get_worker_info(), shuffled with torch's default
    for batch in DataLoader(Stream(23), batch_size=5, shuffle=None, num_workers=2, worker_init_fn=init_worker):
        seen.update(("iterable", int(v)) for v in batch)
    return seen, errors


def test_a_torch_training_loop_runs_unchanged_and_sees_torchs_samples() -> None:
    ours = train(aioloader.DataLoader)
    theirs = train(torch.utils.data.DataLoader)
    assert ours == theirs
    seen, errors = ours
    assert errors == 1
    assert {i for kind, i in seen if kind == "map"} == {OFFSET + i for i in range(40)} - {
        OFFSET + i for i in range(12, 16)  # the batch of the corrupt sample
    }
    assert sorted(i for kind, i in seen if kind == "bulk") == [OFFSET + i for i in range(30)]
    assert sorted(i for kind, i in seen if kind == "iterable") == [OFFSET + i for i in range(23)]
