"""What a run is made of and gives back: the unit a source describes, the source itself,
the run's configuration, and a finished unit as the consumer receives it (see
:mod:`aioloader._engine.run`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from .._pool import WorkerPool
from .._stats import Recorder
from ..errors import LoaderClosedError, add_note
from .fetch import FetchConfig
from .group import GroupPolicy

__all__ = ["Delivery", "Failed", "RunConfig", "Unit", "UnitSource", "add_context", "closed_while_iterating"]


def closed_while_iterating(kind: str) -> LoaderClosedError:
    """The one error for "the loader was closed under a consumer"."""
    return LoaderClosedError(f"the {kind} was closed while it was being iterated")


class Unit(Protocol):
    """One pool task's worth of work, as a unit source describes it."""

    group: int  # the epoch (DataLoader) or iteration (StreamLoader) it belongs to
    size: int  # samples or items in it

    @property
    def fn(self) -> Callable[[Any], Any]: ...

    @property
    def label(self) -> str: ...  # names the unit in errors: "batch 3 of epoch 0"

    @property
    def indices(self) -> Sequence[int]: ...  # sample indices / source positions, for errors

    def make_task(self, task_id: int, with_payload: bool) -> Any: ...


class UnitSource(Protocol):
    async def next_unit(self) -> Unit | None:
        """The next unit (called while holding a window slot), or ``None`` at the end.
        An exception ends the run after the units returned before it."""
        ...

    async def aclose(self) -> None:
        """Stop producing and release what the source holds. Idempotent."""
        ...


@dataclass
class RunConfig:
    """What a run needs from its facade (never the facade itself: a loader dropped
    while work is pending must be collectable at once)."""

    kind: str  # the face ("DataLoader", "StreamLoader", "Batcher"), for messages
    pool: WorkerPool
    prefetch: int
    ordered: bool
    timeout: float | None
    max_retries: int
    decode: Callable[[Any], Any] | None
    recorder: Recorder
    is_closed: Callable[[], bool]
    fail_fast: bool = True  # a unit's error ends the run; False: it is delivered (serving, DataLoader)
    # Errors that end the run even when it does not fail fast: a DataLoader whose pool
    # cannot start must not start it again for each later batch.
    fatal: tuple[type[BaseException], ...] = ()
    fetch: FetchConfig | None = None  # a fetch stage between the window and the dispatcher
    group: GroupPolicy | None = None  # several units per pool task (units with no fetch stage)
    isolate: bool = False  # a lost micro-batch runs again one item a task (see isolate.py)


class Delivery(NamedTuple):
    unit: Unit
    data: Any  # None when every sample of the unit was skipped (or it failed)
    skipped: tuple[tuple[int, str], ...]
    error: BaseException | None = None  # what the unit raised (only without fail_fast; slot still held)
    slot: Any = None  # the ready-queue entry whose window slot Run.release frees (None: freed)
    waited_ns: int = 0  # how long take() waited for it


class Failed:
    """What a pass's ``accept`` returns for a unit that raised, when its run goes on:
    the face raises ``error`` to the consumer, whose next ``next()`` gets the next
    batch (as torch's iterator does)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def add_context(exc: BaseException, note: str) -> None:
    """Add ``note`` unless aioloader already said where ``exc`` came from."""
    if isinstance(exc, LoaderClosedError):
        return
    if any("aioloader:" in n for n in getattr(exc, "__notes__", ())):
        return
    add_note(exc, note)
