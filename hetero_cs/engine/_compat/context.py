"""Where a call runs: which of our strategies is current, in which Keras entry point, on which worker; and the
parts of a per-replica value.

Part of :mod:`hetero_cs.engine._compat`. The rest of the package builds on these reads; this module imports no other
module of it. The strategies are told apart by marker attributes, so that nothing here imports them.
"""

import threading
from typing import Any

import tensorflow as tf

from hetero_cs.engine.step import replica_state
from hetero_cs.engine.step.replica_state import set_locally
from hetero_cs.engine.step.input_slicing import is_unbatched_marker
from hetero_cs.errors import ConfigError

STRATEGY_MARKER = "_is_hetero_central_storage_strategy"
MULTI_WORKER_MARKER = "_is_hetero_multi_worker_strategy"
_current_model = threading.local()  # the model whose fit/evaluate/predict runs in this thread


def is_multi_worker_strategy(strategy: Any) -> bool:
    """True when ``strategy`` is a HeteroMultiWorkerMirroredStrategy (checked by marker: no import cycle)."""
    return bool(getattr(strategy, MULTI_WORKER_MARKER, False))


def current_multi_worker_strategy():
    """The current strategy if it is our multi-worker one running a replica step in this thread, else None."""
    return _current(is_multi_worker_strategy)


def in_keras_entry_point() -> bool:
    """True inside a Keras ``fit``, ``evaluate`` or ``predict`` of a model under the multi-worker strategy (this
    thread), False in a custom loop."""
    return current_keras_model() is not None


def current_keras_model():
    """The model whose ``fit``, ``evaluate`` or ``predict`` runs under the multi-worker strategy here, or None."""
    return getattr(_current_model, "model", None)


def entered(model, entry_point: str):
    """Within: this thread runs ``model``'s ``entry_point`` (a context manager)."""
    return set_locally(_current_model, model=model, entry_point=entry_point)


def keras_entry_point() -> str | None:
    """``"fit"``, ``"evaluate"`` or ``"predict"`` while one runs under the multi-worker strategy (this thread)."""
    return getattr(_current_model, "entry_point", None) if in_keras_entry_point() else None


def id_in_cluster(strategy) -> int:
    # Private: CollectiveAllReduceExtended._id_in_cluster is the worker's rank (the chief first), the number TF's
    # own replica ids are built from (_get_replica_id_in_sync_group); there is no public accessor.
    return int(getattr(strategy.extended, "_id_in_cluster", 0))


def is_hetero_strategy(strategy: Any) -> bool:
    """True when ``strategy`` is a HeteroCentralStorageStrategy (checked by marker to avoid an import cycle)."""
    return bool(getattr(strategy, STRATEGY_MARKER, False))


def is_ours(strategy: Any) -> bool:
    """True under either of our strategies (the b_i / B weighting applies under both)."""
    return is_hetero_strategy(strategy) or is_multi_worker_strategy(strategy)


def strategy_of(model) -> Any:
    """The strategy whose scope created ``model``, or None."""
    # Private: Keras keeps the strategy whose scope created a model in _distribute_strategy (None: none).
    return getattr(model, "_distribute_strategy", None)


def _current(accept) -> Any:
    strategy = tf.distribute.get_strategy() if replica_state.current_replica_step() is not None else None
    return strategy if accept(strategy) else None


def current_weighting_strategy():
    """The current strategy if it is one of ours running a replica step in this thread, else None."""
    return _current(is_ours)


def current_hetero_strategy():
    """The current strategy if it is our central-storage one running a replica step in this thread, else None."""
    return _current(is_hetero_strategy)


def in_stateless_scope() -> bool:
    """Whether Keras' stateless API runs here (``metric.stateless_update_state``, Keras' ``stateless_call``): it records
    assignments instead of applying them, and the patches that reroute writes or losses step aside in it."""
    # Private: Keras' StatelessScope, which its Variable methods check first.
    from keras.src.backend.common.stateless_scope import in_stateless_scope as in_keras_stateless_scope

    return in_keras_stateless_scope()


def replica_id_in_sync_group(replica_context) -> int:
    # Private attribute: the public `replica_id_in_sync_group` is a tensor; the Python int is needed to pick the
    # replica's device, emulated profile and monitor slot while tracing. Under CentralStorageStrategy it is an int.
    return int(replica_context._replica_id_in_sync_group)  # noqa: SLF001


def components(value) -> tuple | None:
    """The components of a per-replica value (one per replica, or one for a global batch's leaf), else None."""
    # Private: PerReplica._values holds the components; experimental_local_results is overridden by the strategy
    # to return the unpacked slices, so it cannot be used here.
    return tuple(getattr(value, "_values", ())) if isinstance(value, tf.distribute.DistributedValues) else None


def per_replica(components) -> Any:
    """A per-replica value holding ``components`` (one per replica, in replica order)."""
    # Private: there is no public constructor of PerReplica; tf.distribute builds them the same way from iterators.
    from tensorflow.python.distribute import values as values_lib

    return values_lib.PerReplica(tuple(components))


# --------------------------------------------------------------------------------------------------------------
# Keras patches. Each one dispatches on our strategy and otherwise calls the original.
# --------------------------------------------------------------------------------------------------------------


def global_batch_size_of(data: Any) -> int | None:
    """The number of examples of a distributed-dataset element held in hand (read on the host), or None."""
    for value in tf.nest.flatten(data, expand_composites=False):
        parts = components(value)
        if parts and len(parts) == 1 and not is_unbatched_marker(parts[0]):
            return int(parts[0].nrows() if isinstance(parts[0], tf.RaggedTensor) else parts[0].shape[0])
    return None


def note_for_micro_batches(finding: str) -> None:
    """Tells the strategy's micro-batching (while a step is traced) what it could not keep exact."""
    micro = getattr(current_weighting_strategy(), "_micro_batching", None)
    if micro is not None:
        micro.note(finding)


def refuse_a_model_from_outside_the_scope(model, model_strategy) -> None:
    """A ConfigError when fit runs inside one of our strategies' scope on a model created outside any scope.

    Keras then trains under the strategy in scope, on variables that belong to none: TensorFlow fails inside the
    step ("Mixing different tf.distribute.Strategy objects") once the optimizer makes a variable, and with
    emulated devices our advice to call strategy.calibrate comes first and leads there.
    """
    # Private: a Keras optimizer keeps the strategy whose scope created it in _distribution_strategy.
    compiled_under = getattr(getattr(model, "optimizer", None), "_distribution_strategy", None)
    if model_strategy is None and is_ours(compiled_under):  # TensorFlow: 'Need to be inside "with strategy.scope()"'
        raise ConfigError(create_and_compile_in_scope(
            "This model's variables were created outside `with strategy.scope():` (it was built outside the scope "
            "and compiled inside it)", compiled_under))
    if is_ours(model_strategy) and compiled_under is not None and compiled_under is not model_strategy:
        # TensorFlow fails only once the optimizer makes a slot variable (Adam); one without (SGD) would count each
        # replica's update as a step of its own: its iterations and a learning-rate schedule R times too fast.
        raise ConfigError(create_and_compile_in_scope(
            "This model's optimizer was created outside `with strategy.scope():` (when the model was compiled "
            "outside it, or an optimizer object made outside it was passed to compile)", model_strategy))
    current = tf.distribute.get_strategy()
    if model_strategy is None and is_ours(current):
        raise ConfigError(create_and_compile_in_scope(
            f"This model ({type(model).__name__}) was created outside `with strategy.scope():`, so its variables "
            f"belong to no strategy, but model.fit runs inside the scope of a {type(current).__name__}", current))


def create_and_compile_in_scope(what: str, strategy) -> str:
    return (
        f"{what}. TensorFlow cannot train variables of one strategy under another (it fails with 'Mixing different "
        f"tf.distribute.Strategy objects'). Create and compile the model inside the strategy's scope, then fit:\n"
        f"    strategy = {type(strategy).__name__}(...)\n"
        f"    with strategy.scope():\n"
        f"        model = build_model()\n"
        f"        model.compile(optimizer=..., loss=...)\n"
        f"    model.fit(...)"
    )
