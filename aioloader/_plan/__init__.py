"""The plan layer: which sample indices go into which batch, epoch by epoch.

``sampler.py`` (the planner, lazy epoch plans, sharding, ``DistributedSampler``),
``permute.py`` (the seeded index shuffle: a bijection on ``[0, N)`` evaluated per batch),
``indices.py`` (what user samplers and lengths are checked against). Pure functions of
their inputs; no asyncio, no engine.
"""
