"""Private touches of Keras variables: aggregated metric updates, writes behind the failure barrier,
per-replica dropout seeds.

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches.
"""

import threading

import tensorflow as tf

from hetero_cs.engine.step import replica_state
from hetero_cs.engine._compat import hooks, symbols
from hetero_cs.engine._compat.context import (
    current_weighting_strategy, in_stateless_scope, is_hetero_strategy, set_locally, strategy_of,
)
from hetero_cs.engine._compat.batch_flow import flow_of
from hetero_cs.engine._compat.batch_kinds import AGG, REP
from hetero_cs.engine._compat.graph_patterns import accumulated_terms, linear_terms
from hetero_cs.engine._compat.loss_reader import share_of
from hetero_cs.engine._compat.loss_scale import iterations_increment
from hetero_cs.engine._compat.symbols import patch
from hetero_cs.errors import LossPatternError

# The barrier token and the deferred weight decay of a step go from its replica threads to the merge that applies
# the update on the step's replica_state.StepHandoff (one per strategy.run call), not in module globals.


def patch_variable_assign_add() -> None:
    # Keras' Variable.assign_add(v) is assign(self + v). On a SUM-aggregated central variable in replica context,
    # each replica's `old + d_i` is then summed: new = N*old + sum(d_i), so metrics and the logged loss drift from
    # step 2 on. tf.Variable's native assign_add aggregates the deltas instead: new = old + sum(d_i).
    core = symbols.require("keras.src.backend.tensorflow.core")

    def _route(original, self, value):
        inner = _central_in_replica_context(self)
        if inner is None:
            return original(self, value)
        if inner.aggregation == tf.VariableAggregation.SUM:
            value = _replica_weighted(value, inner.dtype)
        return _write(self, inner, original.__name__, value)

    def _write(variable, inner, name, value):
        hooks.fired(hooks.VARIABLE_WRITE)
        if name == "assign_add":  # a loss-scaled step that was skipped counts no iteration
            value = iterations_increment(variable, tf.cast(value, inner.dtype))
        return getattr(inner, name)(_behind_barrier(value, inner.dtype))

    for name in ("assign_add", "assign_sub"):
        patch(core.Variable, name)(_route)

    # Many Keras metrics (TruePositives, Precision, Recall, AUC, IoU, R2Score, ...) accumulate with
    # assign(self.var + delta) instead, the pattern Keras' Metric docstring shows. On a SUM-aggregated central
    # variable in replica context that gives N*old + sum(d_i). When the assigned value is visibly `var + delta` in
    # the graph, in any linear form (var + a + b, tf.add_n([var, a, b]), var - (-d): graph_patterns), it becomes
    # assign_add(delta): new = old + sum(d_i). Any other assign (setting the state to this
    # batch's statistic, or to 0) keeps the SUM semantics, sum_i v_i, which is right for additive statistics.
    # Eager values carry no graph: there the accumulate form is assumed (every built-in metric uses it).
    @patch(core.Variable, "assign")
    def assign(original_assign, self, value):
        inner = _central_in_replica_context(self)
        aggregation = getattr(inner, "aggregation", None)
        terms = accumulated_terms(value, inner) if aggregation == tf.VariableAggregation.SUM else None
        if aggregation == tf.VariableAggregation.SUM and (tf.executing_eagerly() or terms is not None):
            delta = tf.cast(_replica_weighted(value, inner.dtype, terms), inner.dtype) - inner.read_value()
            return _write(self, inner, "assign_add", delta)  # aggregated deltas, behind the barrier
        if aggregation == tf.VariableAggregation.NONE:
            # A trainable variable (aggregation NONE) assigned in replica context: Keras' optimizer applies weight
            # constraints (kernel_constraint=MaxNorm, ...) this way after the update, and every replica computes the
            # same value from the same central variable. Stock CentralStorageStrategy raises "You must specify an
            # aggregation method"; here replica 0's value is written once, behind the failure barrier.
            value = _behind_barrier(value, inner.dtype)
            return tf.distribute.get_replica_context().merge_call(_assign_first_replica, args=(inner, value))
        if aggregation == tf.VariableAggregation.MEAN:
            # A layer's own floating-point state set in a training step (a moving average of its inputs): micro-
            # batches would each set it from their own examples (hetero_cs.engine.memory.micro_batches).
            micro = getattr(current_weighting_strategy(), "_micro_batching", None)
            if micro is not None:
                micro.note_layer_state(getattr(self, "path", None) or getattr(self, "name", "?"))
        return original_assign(self, value)

    # Keras' TFOptimizer.assign writes the tf.Variable behind a Keras variable directly (variable.value.assign),
    # past the reroute above. Nadam does that in replica context (its _u_product, every step), where the central
    # AggregatingVariable (aggregation NONE) raises "You must specify an aggregation method"; every replica computes
    # the same value from the same central state, so it goes through the Keras variable's assign: replica 0's
    # value, written once, behind the failure barrier.
    @patch(symbols.require("keras.src.backend.tensorflow.optimizer", "TFOptimizer"), "assign")
    def optimizer_assign(original, self, variable, value):
        if (isinstance(variable, core.Variable) and not isinstance(value, tf.IndexedSlices)
                and _central_in_replica_context(variable) is not None):
            return variable.assign(value)
        return original(self, variable, value)


def _central_in_replica_context(variable):
    """The central variable behind Keras ``variable`` when it is one of our strategy's, written in replica context
    outside Keras' stateless scope (the case the patches above reroute); else None."""
    inner = getattr(variable, "_value", None)
    central = (inner is not None and tf.distribute.in_cross_replica_context() is False
               and is_hetero_strategy(strategy_of(inner))
               # Outside every strategy scope TensorFlow's default replica context also reports "not cross-replica":
               # a reset there (metric.reset_state() after fit, Keras' reset_metrics) is a plain assign, not a delta
               # (a NaN total would otherwise stay NaN: NaN + (0 - NaN)).
               and is_hetero_strategy(getattr(tf.distribute.get_replica_context(), "strategy", None))
               and not in_stateless_scope())
    return inner if central else None


def _replica_weighted(value, dtype, terms=None):
    """A delta of a SUM-aggregated variable (a metric's state) made of this replica's shares of its terms.

    The replicas' deltas are summed. A term that sums over the replica's examples (a total, a count of examples)
    sums to one device's as it is. A replicated one (a count of steps, a constant, another variable's value: the
    batch-flow analysis proves it) would count once per replica that runs (per micro-batch under micro-batching),
    and a mean over the replica's examples (``keras.metrics.Sum`` of a batch's mean loss, a ``Mean`` weighed by a
    tensor) would add R slices' means: both are weighed ``b_i / B`` (the loss reader reads an aggregate's share), so
    they add up to one device's. ``terms``: the delta's terms when the caller read them (``assign(var + delta)``:
    graph_patterns.accumulated_terms), else ``value``'s own (graph_patterns.linear_terms); a value that does not
    read as a linear form, an eager one, integer state, and an aggregate the reader cannot read (AUC's buckets, a
    segment sum) stay as they are.
    """
    if tf.executing_eagerly() or not tf.as_dtype(dtype).is_floating or current_weighting_strategy() is None:
        return value
    step = replica_state.current_replica_step()
    if step is None or step.global_batch_size is None or step.batch_size is None:
        return value
    value = tf.cast(value, dtype)  # a Python number: a constant
    if terms is None:
        read = linear_terms(value)
        terms = [] if read is None else read[1]
    flow, weight = flow_of(step), tf.cast(step.batch_size, dtype) / tf.cast(step.global_batch_size, dtype)
    corrections = []
    for c, term in terms:
        term = tf.cast(term, dtype)
        share = _term_share(step, flow, term, weight)
        if share is not None:
            corrections.append(c * (share - term))
    return value + tf.add_n(corrections) if corrections else value


def _term_share(step, flow, term, weight):
    """This replica's share of one term of a metric's delta, or None where the term is its share as it is."""
    what = flow.kind(term).what
    if what == REP:
        return weight * term
    if what != AGG or getattr(_given, "shares", False):
        return None
    try:
        share = share_of(step, term, what="a metric's update")
    except LossPatternError:  # not read as linear in the examples (a bucketed or segment sum): summed, as it is
        return None
    return None if share is term else share


_given = threading.local()  # .shares: a metric is given this replica's share already (writing_shares)


def writing_shares():
    """Within: the values a metric writes are this replica's shares already (the scalar ``Mean``'s own weighing,
    ``losses.patch_mean_metric``): its aggregates are not read again."""
    return set_locally(_given, shares=True)


def _behind_barrier(value, dtype):
    """``value`` cast to ``dtype``, computed only once every replica's gradients exist (the failure barrier).

    Writes that need no other replica (the ONLY_FIRST_REPLICA iteration counter, a constraint written from replica
    0) would otherwise run as soon as their replica is done, even when another replica's part of the step fails.
    """
    value = tf.cast(value, dtype)
    step = replica_state.current_replica_step()
    if step is not None and step.barrier:
        with tf.control_dependencies(step.barrier):
            value = tf.identity(value)
    return value


def _assign_first_replica(strategy, variable, value):
    """Cross-replica: writes replica 0's value to the central variable."""
    first = strategy.experimental_local_results(value)[0]
    return strategy.extended.update(variable, lambda var, v: var.assign(v), args=(first,), group=True)


def patch_seed_generator() -> None:
    # With ONLY_FIRST_REPLICA seed state every replica would draw the same dropout / noise seed within a step, so
    # the masks of different slices would be identical (correlated). Folding the replica id into the drawn seed
    # gives each replica its own stream; the state itself still advances once per call. Under the multi-worker
    # strategy every worker's copy of the seed state advances alike, so the replicas would draw the same seeds
    # there too; the same fold applies.
    from keras.src.random.seed_generator import SeedGenerator

    @patch(SeedGenerator, "next")
    def next_seed(original, self, ordered=True):
        seed = original(self, ordered=ordered)
        step = replica_state.current_replica_step()
        if step is not None and step.replica_id and current_weighting_strategy() is not None:
            return seed + tf.constant([step.replica_id * 1_000_003, 0], dtype=seed.dtype)
        return seed
