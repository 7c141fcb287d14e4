"""Every private Keras / TensorFlow name the patches need, checked before any is installed.

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches.

A release that renames or drops one of them would otherwise fail with an AttributeError (or ImportError) while
the patches are installed or, worse, in the middle of a step. :func:`check_private_symbols` looks every one up
first and raises :class:`~hetero_cs.errors.UnsupportedVersionError` naming all that are missing, the installed
versions and the supported range. Names read from instances at run time (``_iterations``, ``_value``, a replica
context's ``_replica_id_in_sync_group``, the extended object's ``_worker_device``) are not classes' attributes and
are not listed; the multi-worker strategy's own patch (``multi_worker.patch_local_devices``) and the module-level
imports of ``distribute.py`` are not covered either.
"""

import functools
import importlib

# Keras' pluggable-backend refactor (keras#23397, in keras-nightly 3.16.0.dev since 2026-10) moved these homes. Each
# is looked up where the supported releases keep it first, then where the refactor put it (resolve), so the
# patches reach the same classes on both.
MOVED_MODULES = {"keras.src.backend.tensorflow.core": "keras.src.backend.tensorflow.ops.core"}
RENAMED_CLASSES = {
    ("keras.src.trainers.trainer", "Trainer"): "BaseTrainer",
    ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer"): "Trainer",
}

# (module, class or None for the module itself, the attributes the patches read or replace)
REQUIRED = (
    ("keras.src.backend.tensorflow.optimizer", "TFOptimizer", (
        "apply", "apply_gradients", "assign", "_clip_gradients", "_all_reduce_sum_gradients",
        "_distributed_tf_update_step", "_apply_weight_decay", "_use_weight_decay")),
    ("keras.src.optimizers.loss_scale_optimizer", "LossScaleOptimizer", ("apply", "_tf_apply")),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer", ("_backend_apply_gradients", "_backend_update_step")),
    ("keras.src.losses.loss", None, (
        "scale_loss_for_distribution", "unscale_loss_for_distribution", "reduce_weighted_values",
        "standardize_reduction", "squeeze_or_expand_to_same_rank")),
    ("keras.src.losses.loss", "Loss", ("__call__",)),
    ("keras.src.trainers.trainer", "Trainer", ("compile", "compute_loss", "_compute_loss",
                                               "_resolve_auto_jit_compile")),
    ("keras.src.metrics.reduction_metrics", "Mean", ("update_state",)),
    ("keras.src.metrics.reduction_metrics", "Sum", ("update_state",)),
    ("keras.src.backend.common.stateless_scope", None, ("in_stateless_scope", "StatelessScope")),
    ("keras.src.trainers.data_adapters", "data_adapter_utils", ("unpack_x_y_sample_weight",)),
    ("keras.src.backend.tensorflow.core", "Variable", ("assign", "assign_add", "assign_sub")),
    ("keras.src.random.seed_generator", "SeedGenerator", ("next",)),
    ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer", (
        "fit", "evaluate", "predict", "train_step", "make_train_function", "make_test_function",
        "make_predict_function", "_maybe_symbolic_build", "_symbolic_build")),
    ("keras.src.backend.tensorflow.trainer", None, ("reduce_per_replica",)),
    ("tensorflow.python.distribute.parameter_server_strategy", "ParameterServerStrategyExtended", (
        "_create_variable", "_call_for_each_replica")),
    ("tensorflow.python.distribute.input_lib", None, ("InputWorkers", "DistributedDatasetsFromFunction")),
    ("tensorflow.python.distribute.values", None, ("PerReplica", "PerReplicaSpec")),
    ("tensorflow.python.ops.nn_impl_distribute", None, ("compute_average_loss", "scale_regularization_loss")),
    ("keras.src.layers.normalization.batch_normalization", "BatchNormalization", ("_moments",)),
    ("keras.src.layers.layer", "Layer", ("add_loss", "_get_own_losses", "_clear_losses", "_flatten_layers")),
    ("tensorflow.python.eager.def_function", "Function", ("_clone", "python_function")),
)


def resolve(module_name: str, class_name: str | None = None):
    """The module ``module_name`` (or its class ``class_name``) at its home in the installed Keras, moved or renamed
    (:data:`MOVED_MODULES`, :data:`RENAMED_CLASSES`); None when neither home has it."""
    for module in filter(None, (module_name, MOVED_MODULES.get(module_name))):
        try:
            owner = importlib.import_module(module)
        except ImportError:
            continue
        if class_name is None:
            return owner
        for name in filter(None, (class_name, RENAMED_CLASSES.get((module_name, class_name)))):
            found = getattr(owner, name, None)
            if found is not None:
                return found
    return None


def require(module_name: str, class_name: str | None = None):
    """:func:`resolve`, for the patches: the name must exist (``install`` checked it already)."""
    found = resolve(module_name, class_name)
    if found is None:  # not reached after check_private_symbols; a clear error all the same
        check_private_symbols()
        raise ImportError(f"{module_name}.{class_name}")
    return found


def patch(owner, name: str):
    """Decorator: replaces ``owner.name`` (a class's method or a module's function) by the decorated function, which
    is called with the original first, then the original's arguments. The replacement wraps the original
    (``functools.wraps``: its ``__wrapped__`` is Keras' or TensorFlow's own)."""
    original = getattr(owner, name)

    def install(function):
        @functools.wraps(original)
        def patched(*args, **kwargs):
            return function(original, *args, **kwargs)

        setattr(owner, name, patched)
        return patched

    return install


def check_private_symbols() -> None:
    """Raises UnsupportedVersionError naming every private name of :data:`REQUIRED` that the installed Keras /
    TensorFlow lacks."""
    missing = []
    for module_name, class_name, attributes in REQUIRED:
        owner, prefix = resolve(module_name, class_name), f"{module_name}.{class_name}" if class_name else module_name
        missing.extend([prefix] if owner is None else
                       [f"{prefix}.{name}" for name in attributes if not hasattr(owner, name)])
    if not missing:
        return
    from hetero_cs._supported import version_advice
    from hetero_cs.errors import UnsupportedVersionError

    raise UnsupportedVersionError(
        f"hetero_cs patches private parts of Keras and TensorFlow, and the installed versions lack "
        f"{len(missing)} of them: {', '.join(missing)}. {version_advice()}"
    )
