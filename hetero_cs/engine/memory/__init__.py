"""Memory: a step that runs out of memory is retried within lower caps (``oom_recovery``), and a global batch larger
than the cards hold trains as exact micro-batched sub-steps (``micro_batches``; ``micro_batch_state`` holds
what their traced steps read, ``trace_findings`` what the traces found (shared with the multi-worker strategy),
``overlapped_calls`` runs a step's micro-batches in one traced call, ``micro_batch_trials`` times whether that
overlapped form pays).

This package may import :mod:`hetero_cs.engine.faults` (a failing card is handled in the same retry loop) and the
layers below it. Nothing is imported here.
"""
