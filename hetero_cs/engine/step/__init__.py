"""The replica step's own parts: what a replica knows while it runs, and what its step is made of.

``replica_state`` (the replica's slice ``b_i``, the global batch ``B``, its weight ``b_i / B``, the hand-off between
replica threads and merges), ``input_slicing`` and ``input_roles`` (cutting each global batch by the plan),
``idle_replicas`` (steps in which some replicas hold 0 examples), ``sub_steps`` (what a micro-batched step's
sub-steps share), ``fused_update`` (the host update as one XLA function), ``model_state`` (putting a failed step's
state back), ``step_errors`` (what a failed step is reported as) and ``tensors``.

This package may import :mod:`hetero_cs.errors`, :mod:`hetero_cs.planning` and :mod:`hetero_cs.devices` only; it
touches no private TensorFlow or Keras name (that is :mod:`hetero_cs.engine._compat`'s).
"""
