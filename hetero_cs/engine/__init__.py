"""The engine: the TensorFlow side of hetero_cs, the strategies and the exact weighted step they run.

Sub-packages, lowest first (each may import the ones before it, never one after; ``tests/unit/test_architecture.py``
checks it):

* :mod:`~hetero_cs.engine.step`: what a replica step knows and needs (its slice, ``b_i / B``, sub-steps, idle
  replicas, the fused host update, step errors), with no private TensorFlow or Keras name;
* :mod:`~hetero_cs.engine._compat`: every touch of a private TensorFlow or Keras name: the patches that run Keras'
  step per replica, the loss reader, XLA per replica;
* then :mod:`calibration` (timing the real step), and above it :mod:`~hetero_cs.engine.faults` (failing cards,
  backups, restarts) and :mod:`~hetero_cs.engine.memory` (out-of-memory recovery, micro-batches);
* the modules here: the central-storage strategy (``central_storage``, ``packed_values``, ``strategy_state``) and
  what both strategies share (``arguments``, ``calibrating``, ``callbacks``, ``replica_wrapping``);
* :mod:`~hetero_cs.engine.multi_worker`: the multi-worker strategy.

The modules here may import every sub-package but ``multi_worker``, and planning, devices and calibration.
Nothing is imported here, so ``import hetero_cs.engine`` alone does not load TensorFlow.
"""
