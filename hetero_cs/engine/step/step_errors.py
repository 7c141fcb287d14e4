"""What a failed training step is reported as: the replica and device it failed on, and what to do.

Also the advice for 0-example slices, which some TensorFlow kernels cannot run, and the error for a function that XLA
could not compile (:func:`xla_compile_error`).
"""

import logging
import re

from hetero_cs.devices.device_errors import REPLICA_ID_ATTRIBUTE, op_message
from hetero_cs.errors import ConfigError, ReplicaStepError

logger = logging.getLogger("hetero_cs.engine.central_storage")  # the messages users filter on

EMPTY_SLICE_ADVICE = (
    "Some TensorFlow kernels fail on 0-example inputs, e.g. Conv2D and SeparableConv2D on CPU with oneDNN ('input "
    "depth must be evenly divisible by filter depth'). To give every replica at least one example, make every "
    "global batch hold at least R examples: drop a last partial batch smaller than R (dataset.batch(B, "
    "drop_remainder=True), or fit on the first N - N % B examples), choose a global batch size B whose remainder "
    "N % B is 0 or at least R, and give no replica a 0 share in batch_split; or set TF_ENABLE_ONEDNN_OPTS=0 before "
    "TensorFlow is imported.")


CROSS_REPLICA_SCOPE = "hetero_cross_replica"
"""The name scope of the reductions over the replicas (the merge calls' sums on the parameter device)."""

def replica_step_error(exc: Exception, *, compute_devices, plan, empty_slice_plan, replica_id=None,
                       kind: str = "training", failed_sizes=None):
    """A ReplicaStepError naming the replica and device an op error came from, or None if it names none.

    ``replica_id``: the replica already blamed (an out-of-memory error, by :mod:`hetero_cs.devices.device_errors`).
    Otherwise: in a graph, TensorFlow names replica i's ops "replica_<i>/..." (i >= 1); replica 0's ops carry no
    prefix, and an op error without one is taken as replica 0's (errors other than out of memory only). Eagerly
    there is no op name: the replica function tagged the error (:func:`tag_replica`). A sum over the replicas
    (under :data:`CROSS_REPLICA_SCOPE`) is blamed on a replica that got 0 examples, else on none.
    ``failed_sizes``: the slices of the step that failed (None: not known); a 0-example slice of another step's cut
    (``empty_slice_plan``) is not this step's and gets no advice.
    """
    message = str(exc)
    cross_replica = False
    # The error's replica attribute is set when the replica ran eagerly.
    replica_id = getattr(exc, REPLICA_ID_ATTRIBUTE, None) if replica_id is None else replica_id
    if replica_id is None:
        # "[[{{node NAME}}]]" names the op that failed; "Detected at node NAME" may name an op it fed.
        match = re.search(r"\[\[\{\{node ([^}\s]+)\}\}\]\]", message) or re.search(r"node (\S+)", message)
        if match is None or "Iterator" in match.group(1) or "IteratorGetNext" in message:
            return None  # the input pipeline failed (e.g. a generator), not a replica's step
        cross_replica = f"{CROSS_REPLICA_SCOPE}/" in match.group(1)
        # The replica's scope may follow other scopes, e.g. "gradient_tape/replica_1/...".
        # A step over some replicas (idle ones left out) numbers its threads, not its replicas: there each
        # replica's ops also sit under "hetero_replica_<id>/" (hetero_cs.engine.replica_wrapping), read first.
        scope = (re.search(r"(?:^|/)hetero_replica_(\d+)/", match.group(1))
                 or re.search(r"(?:^|/)replica_(\d+)/", match.group(1)))
        replica_id = int(scope.group(1)) if scope else 0
    # Every slice of the step that failed held examples: a 0-example slice of another cut is not this step's.
    empty = None if failed_sizes is not None and 0 not in failed_sizes else empty_slice_plan
    zeros = [] if empty is None else [i for i, b in enumerate(empty.per_replica_batch_sizes) if b == 0]
    cause, plan = op_message(message, exc), list(plan.per_replica_batch_sizes) if plan else None
    applied = ("No update of this step was applied: variables and optimizer state are as they were before it. "
               if kind == "training" else "")
    if cross_replica:
        # A sum over the replicas failed on the parameter device (BatchNormalization's statistics, the gradients):
        # one replica's value did not fit the others'. A 0-example slice is the likely cause: some kernels give an
        # empty input's output a wrong shape (oneDNN's Conv2D). Without one, the replica is not known.
        where = (f"The {kind} step failed in a sum over the replicas on the parameter device ({type(exc).__name__}: "
                 f"{cause}): the replicas' values did not agree.")
        if not zeros:
            return ReplicaStepError(
                f"{where} Which replica's value was wrong cannot be told from the error. {applied}Check the replicas' "
                f"slices of the batch (plan: {plan}): a layer whose output shape depends on the examples, or a value "
                f"returned by one replica only, fails this way. The original error is chained below.")
        replica_id = zeros[0]
        return ReplicaStepError(
            f"{where} Replica {replica_id} on {compute_devices[replica_id]} fed it from a slice of 0 examples of a "
            f"{_empty_cut(empty, plan)} {applied}{EMPTY_SLICE_ADVICE} The original error is chained below.",
            replica_id=replica_id, device=compute_devices[replica_id])
    if replica_id >= len(compute_devices):
        return None
    device = compute_devices[replica_id]
    advice = (f"That replica gets 0 examples of a {_empty_cut(empty, plan)} {EMPTY_SLICE_ADVICE}" if replica_id in zeros
              else f"Check that replica's slice of the batch (plan: {plan}) and the device.")
    return ReplicaStepError(
        f"The {kind} step failed in replica {replica_id} on {device} ({type(exc).__name__}: {cause.strip()}). "
        f"{applied}{advice} The original error is chained below.", replica_id=replica_id, device=device)


#: The names TensorFlow's errors quote for the functions hetero_cs compiles with XLA (the fused host update of
#: :mod:`hetero_cs.engine.step.fused_update`, a replica's pass of :mod:`hetero_cs.engine._compat.replica_xla`), each
#: with what it compiles and the fix. A replica's pass that reads a variable the model does not track is named by
#: TensorFlow's "tfvariable_on_a_different_device" instead (XLA cannot read it on the parameter device).
_XLA_FUNCTIONS = {
    "hetero_cs_fused_update": (
        "the optimizer's update on the parameter device (fused_update)",
        "Pass fused_update=False to HeteroCentralStorageStrategy to run the update without XLA, or None (the default) "
        "to compile only Keras' own optimizers."),
    "hetero_cs_replica_forward_backward": (
        "a replica's forward and backward pass (compile(jit_compile=True))",
        "Compile the model with jit_compile=False to train without XLA; nothing of this step was applied."),
}


def xla_compile_error(exc: Exception) -> ConfigError | None:
    """A ConfigError with the fix when TensorFlow's ``exc`` says XLA could not compile one of our compiled functions
    (:data:`_XLA_FUNCTIONS`), else None.

    That happens with an op XLA has no kernel for (``tf.py_function``, string ops): in a layer or loss
    (``compile(jit_compile=True)``), or in a custom optimizer's update (``fused_update=True``; Keras' own optimizers
    compile).
    """
    import tensorflow as tf

    if not isinstance(exc, (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError)):
        return None
    message = str(exc)
    name = next((name for name in _XLA_FUNCTIONS if name in message),
                "hetero_cs_replica_forward_backward" if "tfvariable_on_a_different_device" in message else None)
    if name is None or not re.search(r"XLA|compile|jit|located in device", message, re.IGNORECASE):
        return None
    # TensorFlow's message starts with "Graph execution error:" and stack notes; the line that names the op is it.
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    reason = next((line for line in lines if "unsupported operations" in line or "located in device" in line),
                  next((line for line in lines if re.search(r"XLA|compile", line, re.IGNORECASE)), type(exc).__name__))
    what, fix = _XLA_FUNCTIONS[name]
    return ConfigError(f"XLA could not compile {what}: {reason[:500].rstrip('.')}. {fix}")


def _empty_cut(empty, plan) -> str:
    return (f"global batch of {empty.global_batch_size} (cut {list(empty.per_replica_batch_sizes)}; full batches: "
            f"{plan}), which is likely this step.")


def raised_by_input_pipeline(exc: Exception, input_error: Exception) -> bool:
    """Whether TensorFlow's op error ``exc`` is ``input_error``, raised in the input pipeline's numpy_function (or,
    under the multi-worker strategy, in a step's plan function).

    TensorFlow reports a Python exception raised inside ``tf.numpy_function`` as an op error whose message holds
    ``"<class name>: <message>"``. The pipeline runs ahead of the steps (it prefetches), so the error it kept may
    belong to a later batch than the step that failed; only the error TensorFlow actually raised is that step's.
    """
    lines = str(input_error).strip().splitlines()
    return bool(lines) and f"{type(input_error).__name__}: {lines[0]}" in str(exc)


class EmptySliceNotes:
    """Remembers the last cut that left a replica 0 examples, and logs (INFO) once per global batch size that its
    replicas with 0 examples idle."""

    def __init__(self) -> None:
        self.last_plan = None  # the last BatchPlan with a 0-example slice, for the advice in a failed step's error
        self._logged_sizes: set[int] = set()

    def note(self, plan, served) -> None:
        """``plan`` leaves a replica 0 examples; ``served``: the sizes the running step cuts instead (a superset)."""
        self.last_plan = plan
        if plan.global_batch_size not in self._logged_sizes:
            self._logged_sizes.add(plan.global_batch_size)
            # The advice for kernels that fail on 0-example inputs goes with the error of a step that fails (above),
            # not here: an idle replica runs nothing, and only a step traced before its set was first used runs
            # empty slices.
            sizes = list(plan.per_replica_batch_sizes)
            idle = [i for i, b in enumerate(sizes) if b == 0]
            if tuple(served) == tuple(sizes):
                logger.info("hetero_cs: a global batch of %d examples is cut %s: replica(s) %s get 0 examples and do "
                            "no work in that step.", plan.global_batch_size, sizes, idle)
                return
            logger.info("hetero_cs: a global batch of %d examples is cut %s by the plan, but the running step was "
                        "traced without a branch that leaves replica(s) %s idle: it runs as %s (each added replica "
                        "given one example of the largest slices; exact). model.fit traces its step again; a custom "
                        "loop keeps its trace (set batch_split before tracing it).", plan.global_batch_size, sizes,
                        idle, [int(b) for b in served])
