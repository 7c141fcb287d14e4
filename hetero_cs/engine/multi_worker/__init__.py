"""The multi-worker strategy: :class:`~hetero_cs.HeteroMultiWorkerMirroredStrategy` (``strategy``) on
``tf.distribute.MultiWorkerMirroredStrategy``, its input (``input``: every worker reads the same global batches and
keeps its replicas' slices), every worker's split of each step (``agreement``), the chief's plans
(``cluster_planner``), micro-batches and out of memory on several machines (``micro_batches``, ``oom``) and fit's
callback (``callback``).

This package may import everything else in the engine, and planning, devices and calibration. Nothing is imported
here.
"""
