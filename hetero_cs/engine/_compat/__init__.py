"""The one place that touches private TensorFlow and Keras internals.

Stock ``CentralStorageStrategy`` under Keras 3 is wrong or crashes in several places (see docs/stock_fixes.md,
"What hetero_cs fixes"). Each fix below is reached only through objects that belong to a
:class:`~hetero_cs.HeteroCentralStorageStrategy`: a patched Keras function first checks that the current strategy
(or the variable's strategy) is one of ours and otherwise calls the original unchanged, so plain Keras and every
other strategy behave exactly as before. Patches are installed once, when the first strategy is constructed.

Every use of a private name is commented with why it is needed and what it relies on; the versions this was
checked against are TensorFlow 2.21 and Keras 3.15.

The touches are grouped by what they touch: ``context`` (which of our strategies runs, in which Keras entry point;
the parts of a per-replica value), ``layers`` (a model's sublayers), ``distribute`` (tf.distribute's extended object
and input), ``variables`` (Keras variables and seeds), ``losses`` (loss reduction, compute_loss, loss tracking),
``tape`` (``tf.GradientTape.gradient`` of a loss the user reduced), ``optimizer`` (Keras' TensorFlow optimizer),
``loss_scale`` (its LossScaleOptimizer: mixed_float16), ``batch_norm`` (BatchNormalization's statistics over the
global batch), ``trainer`` (fit, evaluate, predict), ``on_batch`` (``train_on_batch`` and the others as those),
``replica_pass`` (Keras' train step cut at each replica's forward and backward pass), ``replica_xla`` (that pass
under XLA), ``multi_worker`` (Keras on the multi-worker strategy), ``input_state`` (reading a first batch without
moving the dataset) and ``graph_patterns``. The loss reader (``loss_reader``, on the batch-flow analysis of
``batch_flow``, ``batch_kinds``, ``batch_rules`` and ``batch_shapes``) reads traced graphs through TensorFlow's
private graph attributes. Nothing outside this package imports a private TensorFlow or Keras name.

This package may import :mod:`hetero_cs.engine.step` and the layers below it (planning, devices), never the rest of
the engine.

The patches check themselves: ``symbols`` looks up every private name they need before any is installed, and
``hooks`` checks at the end of each traced step that every patched hook the step needed ran. Either raises
``UnsupportedVersionError`` naming what is missing, the installed versions and the supported range
(``hetero_cs/_supported.py``).
"""

import logging
import threading

from hetero_cs._supported import supported_range, unsupported_installed
from hetero_cs.errors import HeteroCSError
from hetero_cs.engine._compat import (
    batch_norm, distribute, loss_scale, losses, multi_worker, on_batch, optimizer, replica_pass, tape, trainer,
    variables,
)
from hetero_cs.engine._compat.context import (
    components, global_batch_size_of, id_in_cluster, in_keras_entry_point, keras_entry_point, MULTI_WORKER_MARKER,
    per_replica, replica_id_in_sync_group, STRATEGY_MARKER,
)
from hetero_cs.engine._compat.distribute import (
    clone_function, DeepcopiedStrategy, distribute_on_host, HeteroExtended, is_tf_function, ReplicaCountStrategy,
)
from hetero_cs.engine._compat.input_state import FirstBatchReader
from hetero_cs.engine._compat.multi_worker import local_cpu_replicas, skip_partial_batch_agreement
from hetero_cs.engine._compat.optimizer import iteration_counter
from hetero_cs.engine._compat.symbols import check_private_symbols
from hetero_cs.engine._compat.trainer import reduced_step_outputs, set_initial_epoch

__all__ = [
    "MULTI_WORKER_MARKER", "STRATEGY_MARKER", "DeepcopiedStrategy", "FirstBatchReader", "HeteroExtended",
    "ReplicaCountStrategy", "check_private_symbols", "clone_function", "components", "distribute_on_host",
    "global_batch_size_of", "id_in_cluster", "in_keras_entry_point", "install",
    "is_tf_function", "iteration_counter", "keras_entry_point", "local_cpu_replicas", "per_replica",
    "reduced_step_outputs", "replica_id_in_sync_group", "set_initial_epoch", "skip_partial_batch_agreement",
]

logger = logging.getLogger(__name__)

_install_lock = threading.Lock()
_installed = False


def install() -> None:
    """Installs the dispatching patches once per process (thread-safe, idempotent)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        # Every private name the patches below need, before any is touched: a clear error naming the installed
        # and the supported versions instead of an AttributeError half-way through patching or mid-step.
        check_private_symbols()
        outside = unsupported_installed()
        if outside:
            logger.warning(
                "hetero_cs: %s is outside the tested range %s; hetero_cs checks that every Keras hook it patches "
                "still runs (UnsupportedVersionError if not), but results were not tested on this pair.",
                " and ".join(outside), supported_range())
        # Private: AutoGraph (tf.function's default conversion) re-raises an exception raised while tracing as a new
        # exception of the same type when it can rebuild it from a message alone, else as TensorFlow's StagingError;
        # ours take keyword arguments, so `except hetero_cs.ConfigError` around a custom loop's tf.function would not
        # catch them. AutoGraph passes an exception with an `ag_pass_through` attribute through unchanged
        # (tensorflow/python/autograph/impl/api.py, _attach_error_metadata).
        HeteroCSError.ag_pass_through = True
        for install_patches in (
                distribute.register_replica_count_conversion, losses.patch_loss_module,
                losses.patch_compute_average_loss, losses.patch_layer_losses,
                losses.patch_compute_loss, losses.patch_mean_metric, tape.patch_gradient_tape,
                batch_norm.patch_batch_normalization, variables.patch_variable_assign_add, optimizer.patch_optimizer,
                loss_scale.patch_loss_scale_optimizer, variables.patch_seed_generator, trainer.patch_entry_points,
                trainer.patch_make_train_function, trainer.patch_inference_functions, trainer.patch_symbolic_build,
                on_batch.patch_on_batch, replica_pass.patch_train_step, replica_pass.patch_inference_steps,
                multi_worker.patch_reduce_per_replica):
            install_patches()
        _installed = True
        logger.debug("hetero_cs: Keras patches installed (they act only under HeteroCentralStorageStrategy)")
