"""The worker side: what runs inside a worker process (or the loader's own thread).

The consumer's pool (:mod:`aioloader._pool`) starts a worker and talks to it over its
channel; everything the worker does on the other end lives here:

* :mod:`.tasks`: the worker's life (:func:`~.tasks.worker_main`), loader contexts, the
  one task entry (:func:`~.tasks.run_task`) and DataLoader batches and groups.
* :mod:`.stream`, :mod:`.serve`, :mod:`.shard`: the build steps of a stream
  micro-batch, a serving request, and an iterable dataset's shard.
* :mod:`.channel`: the frames of a channel and the serve loop.
* :mod:`.reply`: how an outcome, exceptions included, travels home.
* :mod:`.slots`: the worker's row of the slot table (what it holds, for a death).
* :mod:`.orphan`: exit when the consumer is gone.
* :mod:`.info`: ``torch.utils.data.get_worker_info()`` for this worker.
* :mod:`.byvalue`, :mod:`.culprit`, :mod:`.unpicklable`: pickling by value, and naming
  what does not pickle.

Imports flow down only: this package needs shared memory (:mod:`aioloader._shm`),
seeding and the errors, never the pool, the engine or a face (``tests/test_layout.py``).
None of it imports asyncio.
"""
