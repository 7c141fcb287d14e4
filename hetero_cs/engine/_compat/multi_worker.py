"""Private touches for :class:`~hetero_cs.HeteroMultiWorkerMirroredStrategy`: Keras 3 fit/evaluate/predict on
``tf.distribute.MultiWorkerMirroredStrategy``, and the strategy's view of its place in the cluster.

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches. Every patch here checks
``is_multi_worker_strategy`` first and otherwise calls Keras' original, so plain Keras, stock
MultiWorkerMirroredStrategy and the central-storage strategy behave exactly as before.

Why (keras-team/keras#20585, tensorflow/tensorflow#72388; read in Keras 3.15's ``backend/tensorflow/trainer.py``):

1. ``TensorFlowTrainer._maybe_symbolic_build`` reads a first batch from the distributed iterator and, when it is a
   per-replica value, averages it across the cluster with ``strategy.reduce("MEAN", batch, axis=None)``. Under
   multi-worker mode that read is an extra collective over data the model does not need (the build needs only
   shapes and dtypes), and the read moves an iterator that reshuffles. Under our strategy the build takes the
   shapes from the user dataset's element spec and reads nothing (``trainer.patch_symbolic_build``, shared with
   the central-storage strategy).
2. ``reduce_per_replica`` reduces the step's logs (scalars) with ``strategy.reduce("MEAN", v, axis=0)`` in
   multi-worker mode, which fails on a scalar ("Invalid reduction dimension 0 for input with 0 dimensions"). And a
   plain mean of the replicas' logs would be wrong anyway with uneven slices: each replica's metric is a ratio of
   its own totals. Under our strategy the logs are the model's metric results computed from every replica's
   totals and counts summed over the cluster (Keras' metric variables are ON_READ / SUM; one all-reduce for all
   of them, see ``summed_logs``): the single-device value. A log that is not a metric (a floating scalar
   a ``train_step`` override returns) is each replica's share of one device's value, summed (the same under the
   central-storage strategy). ``predict``'s
   ``"concat"`` is left to Keras with one replica per worker (it gathers slices of unequal length in replica order,
   which is batch order here); with several, Keras re-orders them for TensorFlow's own input layout, so the
   gathered slices are taken as they come instead.
"""

import contextlib
import functools
import logging
import re
import threading

import numpy as np
import tensorflow as tf

from hetero_cs.devices.device_errors import device_fault, first_line, op_message
from hetero_cs.engine._compat.context import (
    current_keras_model, entered, id_in_cluster, is_hetero_strategy, is_multi_worker_strategy, per_replica, set_locally,
)
from hetero_cs.engine._compat.loss_reader import is_log_share
from hetero_cs.engine._compat.replica_pass import keras_train_step
from hetero_cs.engine._compat.symbols import patch, require
from hetero_cs.errors import ConfigError, DeviceFaultError, ReplicaStepError, WorkerLostError

logger = logging.getLogger("hetero_cs.engine.multi_worker.strategy")

def skip_partial_batch_agreement(strategy) -> None:
    """Stops the distributed iterators from agreeing on "is there a next batch" over the cluster every step."""
    # Undocumented attribute of CollectiveAllReduceExtended (input_lib._enable_get_next_as_optional reads it): with
    # it on, every get_next of a multi-worker iterator runs an all-reduce of how many replicas still have data, so
    # that workers with unequal shards agree on the last partial batch. Here every worker reads the same global
    # batches, so they run out at the same step by construction; the extra collective per step is dropped.
    strategy.extended.experimental_enable_get_next_as_optional = False


def patch_reduce_per_replica() -> None:
    # one_step_on_data looks the function up as a module global at trace time, so this reaches every caller.
    @patch(require("keras.src.backend.tensorflow.trainer"), "reduce_per_replica")
    def reduce_per_replica(original, values, strategy, reduction):
        if reduction == "concat" and is_multi_worker_strategy(strategy) and len(strategy.extended.worker_devices) > 1:
            # predict's outputs with several replicas per worker. Keras' _multi_worker_concat re-orders the gathered
            # slices as local replica 0 of every worker, then local replica 1, ..., which is not where our replicas'
            # slices come from: each cuts its contiguous part of the global batch in cluster replica order (task,
            # then local), the order strategy.gather returns them in. So the gathered rows are the batch's order.
            return tf.nest.map_structure(
                lambda v: strategy.gather(v, axis=0) if isinstance(v, tf.distribute.DistributedValues) else v, values)
        multi_worker = is_multi_worker_strategy(strategy)
        if not (multi_worker or is_hetero_strategy(strategy)) or reduction not in ("auto", "mean"):
            return original(values, strategy, reduction)

        def logged_share(value) -> bool:  # each replica gave its share of one device's value (loss_reader)
            distributed = isinstance(value, tf.distribute.DistributedValues)
            first = strategy.experimental_local_results(value)[0] if distributed else value
            return (isinstance(first, tf.Tensor) and first.shape.rank == 0 and first.dtype.is_floating
                    and (is_log_share(first) if multi_worker else distributed))

        def structure(visit, value=values, key=None):
            if isinstance(value, dict):  # nested logs: a train_step override returning {"compile_metrics": {...}}
                return {inner: structure(visit, item, inner) for inner, item in value.items()}
            if value is values:  # logs that are not a dict: each leaf, without a key
                return tf.nest.map_structure(lambda v: visit(None, v), values)
            return visit(key, value)

        shares = []
        structure(lambda key, value: shares.append(value) if logged_share(value) else None)
        # Under the multi-worker strategy: metric results and logged shares summed over the cluster in one all-reduce.
        results, sums = (summed_logs(current_keras_model() if isinstance(values, dict) else None, strategy, shares)
                         if multi_worker else ({}, [strategy.reduce("SUM", value, axis=None) for value in shares]))
        sums = iter(sums)

        def reduce(key, value):
            if logged_share(value):
                return next(sums)
            if key in results:  # a metric's result (read from each replica's own metric state): the cluster's
                return results[key]
            return original(value, strategy, reduction) if isinstance(value, tf.distribute.DistributedValues) else value

        return structure(reduce)


def summed_logs(model, strategy, shares) -> tuple[dict, list]:
    """The model's metric results over the whole cluster, and ``shares`` (logged values, each replica's share)
    summed over it, from ONE SUM all-reduce (cross-replica context).

    Keras' metric variables are ON_READ with SUM aggregation, so reading each in cross-replica context sums it over
    every replica - one collective per variable (4 for a loss and an accuracy), every step. Here every replica's
    local values of all metric variables and logged shares travel in one vector (float64; exact for integer counts
    below 2**53), and each metric's result is computed from the summed values with Keras' ``stateless_result``.
    """
    metrics = list(model.metrics) if model is not None else []
    variables = [v for metric in metrics for v in metric.variables]
    if not variables and not shares:
        return {}, []
    # Private: a Keras variable's backing tf.Variable (_value); reading its public value in cross-replica context
    # would run the per-variable all-reduce this function avoids. Its local components are the replicas' copies.
    components = [[c.read_value() for c in strategy.experimental_local_results(v._value)]  # noqa: SLF001
                  for v in variables]
    components += [strategy.experimental_local_results(share) if isinstance(share, tf.distribute.DistributedValues)
                   else (share,) for share in shares]
    shapes = [tuple(v.shape) for v in variables] + [()] * len(shares)
    vectors = [tf.concat([tf.reshape(tf.cast(c[local], tf.float64), [-1]) for c in components], axis=0)
               for local in range(len(components[0]))]
    summed = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica(vectors), axis=None)
    pieces = [tf.cast(tf.reshape(piece, shape), c[0].dtype)  # each in its own dtype again
              for piece, shape, c in zip(tf.split(summed, [int(np.prod(s)) for s in shapes]), shapes, components)]
    logged, pieces = pieces[len(variables):], iter(pieces[:len(variables)])
    results = {}
    for metric in metrics:
        result = metric.stateless_result([next(pieces) for _ in metric.variables])
        results.update(result if isinstance(result, dict) else {metric.name: result})
    # Private: Keras' own flattening of nested result dicts, as get_metrics_result ends (tensors stay tensors here).
    from keras.src.utils.python_utils import pythonify_logs

    return pythonify_logs(results), logged


def run_entry_point(original, self, strategy, bound):
    """``fit``, ``evaluate`` or ``predict`` (``original``, with its arguments ``bound``) under the multi-worker
    strategy (patched in :func:`hetero_cs.engine._compat.trainer.patch_entry_points`): the reduce above needs the
    model (set for the call, thread-local), and each gets the strategy's callback (emulated device sizes before the
    first step, plan and timing in the logs)."""
    verb = original.__name__
    if verb == "fit":
        _refuse_loss_scaling(self)
        strategy._prepare_idle_replicas(self, keras_train_step())  # noqa: SLF001
    # Keras runs steps_per_execution > 1 as a tf.while_loop over the iterator inside the train function; under
    # MultiWorkerMirroredStrategy (our strategy, even a fixed split without the agreement) that loop fails with "You
    # must feed a value for placeholder tensor 'while/body/.../while/cond/Placeholder_1'" (TF 2.21, 2 workers; not
    # tracked down). Refuse it with the fix instead of that message.
    steps = getattr(self, "steps_per_execution", 1)
    if steps is not None and int(steps) > 1:
        raise ConfigError(
            f"steps_per_execution={int(steps)} is not supported under HeteroMultiWorkerMirroredStrategy (Keras' "
            f"multi-step loop fails there). Compile with steps_per_execution=1 (the default)."
        )
    bound.arguments["callbacks"] = strategy._keras_callbacks(bound.arguments.get("callbacks"))  # noqa: SLF001
    with entered(self, verb):
        strategy._kept_plan_error(None)  # noqa: SLF001 - an error kept from an earlier call is not this one's
        try:
            return original(*bound.args, **bound.kwargs)
        except tf.errors.InvalidArgumentError as exc:
            # The library's own error, raised where a step decides its split (a numpy_function, which TensorFlow
            # reports as InvalidArgumentError): raised as itself, TensorFlow's chained. Some out-of-memory forms
            # come as InvalidArgumentError too.
            kept = strategy._kept_plan_error(exc) or _out_of_memory_here(strategy, verb, exc, self)  # noqa: SLF001
            raise (kept or _step_error_here(strategy, verb, exc)) from exc
        except _PEER_FAILURES as exc:
            raise _worker_lost(strategy, verb, exc) from exc
        except tf.errors.OpError as exc:
            error = (_out_of_memory_here(strategy, verb, exc, self)
                     or _device_fault_here(strategy, verb, exc, (self.name,)) or _step_error_here(strategy, verb, exc))
            raise error from exc


def _refuse_loss_scaling(model) -> None:
    # Keras' LossScaleOptimizer judges finiteness on each replica's own gradients and runs the update - the
    # gradient all-reduce included - inside a tf.cond on it: one worker whose slice overflows skips the collective
    # the others enter, and every worker waits forever (measured with 2 workers). Loss scaling is done right on the
    # central-storage strategy only (hetero_cs.engine._compat.loss_scale), so refuse it here instead of hanging.
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

    if isinstance(getattr(model, "optimizer", None), LossScaleOptimizer):
        raise ConfigError(
            "Loss scaling (mixed_float16's LossScaleOptimizer) is not supported under "
            "HeteroMultiWorkerMirroredStrategy: an overflow in one worker's slice would make that worker skip the "
            "gradient all-reduce the others wait in. Use mixed_bfloat16 (no loss scaling) or float32 on several "
            "machines, or HeteroCentralStorageStrategy on one machine."
        )


# How TensorFlow's collectives report a peer that is gone: the coordination service's missed heartbeats or a
# refused connection (Unavailable), a collective that waited past CommunicationOptions.timeout_seconds
# (DeadlineExceeded), or a collective aborted because another one failed (Cancelled/Aborted).
_PEER_FAILURES = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.CancelledError,
                  tf.errors.AbortedError)


def _tell_cluster(strategy, reason: str) -> None:
    """Tells every other worker that this one stopped, and why (``_worker_lost`` reads it there).

    The other workers wait for this worker's gradients in the collective. They learn of the failure at once through
    TensorFlow's coordination service: private ``context.report_error_to_cluster`` (TFE_ReportErrorToCluster)
    hands them this error, naming this worker's task, so their ``fit`` ends with a WorkerLostError within seconds,
    even while this process lingers (a script that catches the error, a slow exit); otherwise they would wait until
    this process exits or the collective times out.
    """
    from tensorflow.python.eager import context

    worker = id_in_cluster(strategy)
    message = (f"hetero_cs: worker {worker} (/job:worker/replica:0/task:{worker}) stopped: {reason}; the other "
               f"workers cannot go on without it.")
    try:
        context.context().report_error_to_cluster(tf.errors.UNAVAILABLE, message)
    except Exception as report_error:  # noqa: BLE001 - no coordination service (a cluster of one): nothing to tell
        logger.debug("hetero_cs: could not tell the cluster why this worker stopped: %s", report_error)


def _out_of_memory_here(strategy, verb: str, exc: Exception, model):
    """A StepOOMError for an out-of-memory error on this worker (the strategy reads it:
    :mod:`hetero_cs.engine.multi_worker.oom`), after telling every other worker, or None for any other error."""
    found = strategy._out_of_memory_here(verb, exc, (model.name,), model=model)  # noqa: SLF001 - ours
    if found is None:
        return None
    _tell_cluster(strategy, found.reason)
    return found.error


def _step_error_here(strategy, verb: str, exc: Exception):
    """A ReplicaStepError for any other error of this worker's step (a Python error inside it, a shape error), after
    telling every other worker (:func:`_tell_cluster`): they stop within seconds with a WorkerLostError that names it,
    instead of waiting in the collective."""
    cause = f"{type(exc).__name__}: {op_message(str(exc), exc)[:300]}"
    _tell_cluster(strategy, f"an error in its step ({cause})")
    return ReplicaStepError(
        f"model.{verb} failed on worker {id_in_cluster(strategy)} ({cause}). The other workers were told and stop too, "
        f"with a WorkerLostError. No update of this step was applied. Fix the error, then restart all workers. The "
        f"original error is chained below.")


def _device_fault_here(strategy, verb: str, exc: Exception, replica_scopes):
    """A DeviceFaultError for a device error on one of this worker's replicas (the rule of
    :mod:`hetero_cs.engine.faults.failover`), after telling every other worker (:func:`_tell_cluster`), or None for any
    other error."""
    local = list(strategy.extended.worker_devices)
    fault = device_fault(exc, local, replica_scopes)
    if fault is None:
        return None
    local_id, first = fault.replica_id, strategy._first_replica  # noqa: SLF001 - ours
    emulated = re.search(r"emulated device fault on replica=(\d+)", str(exc))
    if emulated is not None:  # the emulator numbers the replicas of the whole cluster
        offset = int(emulated.group(1)) - first
        local_id = offset if 0 <= offset < len(local) else None
    device = local[local_id] if local_id is not None else "one of its devices"
    _tell_cluster(strategy, f"a device error on {device} ({first_line(exc)})")
    return DeviceFaultError(
        f"model.{verb} failed on worker {id_in_cluster(strategy)} with a device error on {device} ({type(exc).__name__}: "
        f"{first_line(exc)}). On several machines a failing card is not set aside: every worker runs the same steps "
        f"in lockstep, so the job stops (the other workers were told and stop too, with a WorkerLostError). No update "
        f"of this step was applied. Check the card (nvidia-smi -q: ECC errors, Xid events), then restart the job "
        f"without it (leave it out of CUDA_VISIBLE_DEVICES on this worker); with keras.callbacks.BackupAndRestore the "
        f"rerun resumes from the last backup. The original error is chained below.",
        replica_id=None if local_id is None else first + local_id,
        device=None if local_id is None else device, last_error=exc)


def _worker_lost(strategy, verb: str, exc: Exception):
    text, me = str(exc).strip(), id_in_cluster(strategy)
    resume = "; with keras.callbacks.BackupAndRestore the rerun resumes from the last backup."
    reported = re.search(r"hetero_cs: worker (\d+) \([^)]*\) stopped: (.*?); the other workers", text, re.S)
    if reported is not None:  # a worker told the cluster why it stopped (_tell_cluster)
        worker, why = reported.groups()
        told = f"worker {worker} stopped with {why}"
        fix = f"Check that worker's card, then restart all workers without it{resume}"  # _device_fault_here
        if why.startswith("out of memory"):  # _out_of_memory_here
            caps = re.search(r"relaunch with (\w+=[\w,]+)", why)
            told = f"worker {worker} stopped, {why}"
            fix = (f"Restart all workers with {caps.group(1)} (hetero-cs launch --max-restarts N does so by itself; "
                   f"see that worker's StepOOMError)" if caps else
                   "See that worker's StepOOMError, then restart all workers") + resume
        elif why.startswith("an error in its step"):  # _step_error_here
            fix = "See that worker's ReplicaStepError, fix it, then restart all workers."
        return WorkerLostError(f"model.{verb} stopped on worker {me}: {told}. Every worker runs the same steps in "
                               f"lockstep, so the job cannot go on without it. {fix}")
    # Private: the options MWMS was given.
    timeout_s = getattr(getattr(strategy.extended, "_communication_options", None), "timeout_seconds", None)
    # TensorFlow's first line is often only "Graph execution error:"; the task that stopped answering is named
    # further down, as "/job:worker/replica:0/task:<i>".
    lost = sorted({int(t) for t in re.findall(r"/job:worker/replica:\d+/task:(\d+)", text)} - {me})
    detail = next((line.strip() for line in text.splitlines()
                   if re.search(r"heartbeat|unavailable|deadline|timed? ?out|connect|task:\d", line, re.I)),
                  text.splitlines()[0] if text else type(exc).__name__)
    who = (f"worker {lost[0]}" if len(lost) == 1 else f"workers {lost}") if lost else "another worker of the cluster"
    return WorkerLostError(
        f"model.{verb} stopped on worker {me}: {who} is gone or not answering ({type(exc).__name__}: "
        f"{detail[:300]}). Every worker runs the same steps in lockstep, so the job cannot go on without it "
        f"(collective timeout: {'none set' if timeout_s is None else f'{timeout_s:g} s'}). Check the other workers' "
        f"logs, then restart all workers{resume}"
    )


_local_cpus = threading.local()  # .count while a HeteroMultiWorkerMirroredStrategy with CPU replicas is built here
_local_devices_lock = threading.Lock()


@contextlib.contextmanager
def local_cpu_replicas(count: int):
    """While a HeteroMultiWorkerMirroredStrategy is built in this block, its worker runs ``count`` replicas on the
    logical CPU devices ``CPU:0..count-1`` (which must exist) instead of TensorFlow's one CPU replica."""
    with _local_devices_lock:  # patched once (functools.cache), by the first such block
        patch_local_devices()
    with set_locally(_local_cpus, count=int(count)):
        yield


@functools.cache
def patch_local_devices() -> None:
    # Private: CollectiveAllReduceExtended._initialize_local_devices chooses a worker's local replicas: every GPU,
    # else exactly one CPU replica, and MultiWorkerMirroredStrategy has no argument to give them in a cluster (only
    # its single-worker path takes a device list, through the private _from_local_devices). Emulating several unlike
    # devices per worker on a CPU-only machine needs one replica per logical CPU device. The patch answers only
    # while local_cpu_replicas() is active in this thread (our strategy's own construction); otherwise, and for
    # one replica, TensorFlow's own choice stands. TensorFlow's collectives then span those devices like GPUs
    # (group size = replicas per worker x workers, the same on every worker).
    from tensorflow.python.distribute import collective_all_reduce_strategy

    @patch(collective_all_reduce_strategy.CollectiveAllReduceExtended, "_initialize_local_devices")
    def _initialize_local_devices(original, self, cluster_resolver, worker_device):
        count = getattr(_local_cpus, "count", None)
        if not count or count == 1:
            return original(self, cluster_resolver, worker_device)
        return tuple(f"{worker_device}/device:CPU:{i}" for i in range(count)), "CPU"
