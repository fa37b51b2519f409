"""The engine that every facade drives: one bounded window of work per run
(:mod:`.run`), fed by a unit source: an epoch plan (:mod:`.epochs`) or a stream's
batcher (:mod:`.batcher`, over the feeds of :mod:`.feeds`)."""
