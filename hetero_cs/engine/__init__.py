"""The engine layer: the TensorFlow side of hetero_cs.

``central_storage`` (the strategy, a thin adapter from tf.distribute's hooks to the plan lifecycle in
:mod:`hetero_cs.planning.balancer`), ``input_slicing`` (cutting each global batch by the plan), ``step_timing``
(per-replica clocks and emulated waits in the graph), ``training`` (what a replica step knows: b_i, B),
``callbacks`` (fit's logs) and ``_compat``, the one module that touches private TensorFlow/Keras internals.
Nothing is imported here, so ``import hetero_cs.engine`` alone does not load TensorFlow.
"""
