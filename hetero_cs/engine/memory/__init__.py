"""Memory: a step that runs out of memory is retried within lower caps (``oom_recovery``), and a global batch larger
than the cards hold trains as exact micro-batched sub-steps (``micro_batches``, with ``micro_batch_trials`` timing
whether their overlapped form pays).

This package may import :mod:`hetero_cs.engine.faults` (a failing card is handled in the same retry loop) and the
layers below it. Nothing is imported here.
"""
