"""Out of memory in every shape a real GPU raises it, blamed on the device that raised it (hetero_cs.devices.device_errors).

Each form is injected as the TensorFlow error a GPU run raises, with realistic messages, node names and device
names; one fit run recovers from a failed host-to-device copy raised inside a replica's step.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from hetero_cs import HeteroCentralStorageStrategy, ReplicaStepError, StepOOMError
from hetero_cs.engine import _compat
from hetero_cs.devices.device_errors import blamed_replica, classify, is_out_of_memory
from hetero_cs.devices.device_errors import tag_replica

GPUS = ["/device:GPU:0", "/device:GPU:1", "/device:GPU:2"]
JOB = "/job:localhost/replica:0/task:0"
HINT = ("\nHint: If you want to see a list of allocated tensors when OOM happens, add "
        "report_tensor_allocations_upon_oom to RunOptions for current allocation info. This isn't available when "
        "running in Eager mode.\n")


def graph_error(cls, text, node, op="__inference_one_step_on_data_2210"):
    """What TensorFlow raises from a tf.function step: the op's message, its node, the function."""
    detected = f"Detected at node {node} defined at (most recent call last):\n  File \"train.py\", line 9\n\n"
    return cls(None, None, f"Graph execution error:\n\n{detected}{text}\n\t [[{{{{node {node}}}}}]]{HINT} [Op:{op}]")


def bfc(device_index, node, allocator=None):
    allocator = allocator or f"GPU_{device_index}_bfc"
    return graph_error(
        tf.errors.ResourceExhaustedError,
        f"OOM when allocating tensor with shape[256,1024] and type float on {JOB}/device:GPU:{device_index} by "
        f"allocator {allocator}", node)


# (error, replica blamed on GPUS, how, form) for each form of out of memory a GPU run raises.
FORMS = {
    "bfc allocator names its device": (bfc(1, "replica_1/sequential/dense/MatMul"), 1, "device", "allocator"),
    # The device decides, not the op name: replica 0's ops carry no prefix, and this op ran on GPU:2.
    "bfc device beats an op without prefix": (bfc(2, "sequential/dense/MatMul"), 2, "device", "allocator"),
    "allocator's name alone": (
        tf.errors.ResourceExhaustedError(None, None, "Allocator (GPU_2_bfc) ran out of memory trying to allocate "
                                         "4.00GiB with freed_by_count=0."), 2, "device", "allocator"),
    "cuda_malloc_async allocator": (
        tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[64,512,512] and type "
                                         "float by allocator gpu_async_1"), 1, "device", "allocator"),
    "xla": (graph_error(tf.errors.ResourceExhaustedError,
                        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes.",
                        "replica_2/sequential/dense/XlaLaunch"), 2, "op name", "xla"),
    # Eagerly the copy names its destination (GPU:1), after its source (the host, CPU:0).
    "host-to-device copy, eager": (
        tf.errors.InternalError(None, None, f"Failed copying input tensor from {JOB}/device:CPU:0 to {JOB}/device:"
                                f"GPU:1 in order to run _EagerConst: Dst tensor is not initialized."),
        1, "device", "host-to-device copy"),
    "host-to-device copy, graph": (
        graph_error(tf.errors.InternalError, "Dst tensor is not initialized.", "replica_2/sequential/Cast/_14"),
        2, "op name", "host-to-device copy"),
    # TensorFlow reports a Python exception of a tf.numpy_function as UnknownError around its text.
    "host-to-device copy inside a numpy_function": (
        graph_error(tf.errors.UnknownError, "InternalError: Failed copying input tensor from /job:localhost/replica:0"
                    f"/task:0/device:CPU:0 to {JOB}/device:GPU:2 in order to run _EagerConst: Dst tensor is not "
                    "initialized.", "replica_2/sequential/fail/PyFunc"), 2, "device", "host-to-device copy"),
    "cublas alloc failed": (
        graph_error(tf.errors.InternalError, "Blas xGEMM launch failed : a.shape=[1,256,1024], b.shape=[1,1024,10], "
                    "m=256, n=10, k=1024: CUBLAS_STATUS_ALLOC_FAILED",
                    "gradient_tape/replica_1/sequential/dense/MatMul/MatMul_1"), 1, "op name", "cublas"),
    # A replica's gradient op without prefix: replica 0's (gradients are formed in the replicas only).
    "cublas launch failed in replica 0's gradients": (
        graph_error(tf.errors.InternalError, "Blas GEMM launch failed : a.shape=(256, 1024), b.shape=(1024, 10), "
                    "m=256, n=10, k=1024: CUBLAS_STATUS_ALLOC_FAILED",
                    "gradient_tape/sequential/dense/MatMul/MatMul_1"),
        0, "op name", "cublas"),
    "cudnn alloc failed": (
        graph_error(tf.errors.InternalError, "cuDNN launch failure : input shape ([32,3,224,224]): "
                    "CUDNN_STATUS_ALLOC_FAILED", "replica_2/sequential/conv2d/Conv2D"), 2, "op name", "cudnn"),
    "scratch": (
        graph_error(tf.errors.InternalError, "Failed to allocate scratch buffer of 1073741824 bytes",
                    "replica_1/sequential/conv2d/Conv2D"), 1, "op name", "scratch"),
    "cuda runtime": (
        tf.errors.InternalError(None, None, "CUDA error: out of memory (cudaErrorMemoryAllocation) on /gpu:1"),
        1, "device", "cuda"),
    "cuda driver": (
        tf.errors.UnknownError(None, None, "failed to allocate 2.00G (2147483648 bytes) from device: "
                               "CUDA_ERROR_OUT_OF_MEMORY: out of memory [Op:MatMul] on /device:GPU:0"),
        0, "device", "cuda"),
    "emulated": (
        tf.errors.ResourceExhaustedError(None, None, "EmulatedOutOfMemoryError: Emulated out of memory: replica=2 (T4)"
                                         " needs 5 bytes"), 2, "emulated", "emulated"),
    # Two replicas ran out at once: TensorFlow lists the errors, (0) first; that one is blamed (the other next).
    "two at once": (
        tf.errors.ResourceExhaustedError(None, None, "2 root error(s) found.\n  (0) RESOURCE_EXHAUSTED: OOM when "
                                         f"allocating tensor with shape[8] and type float on {JOB}/device:GPU:2 by "
                                         f"allocator GPU_2_bfc\n  (1) RESOURCE_EXHAUSTED: OOM when allocating tensor "
                                         f"with shape[8] and type float on {JOB}/device:GPU:1 by allocator GPU_1_bfc"),
        2, "device", "allocator"),
}


@pytest.mark.parametrize("name", list(FORMS))
def test_each_form_of_out_of_memory_is_recognised_and_blamed_on_its_device(name):
    error, replica_id, blame, form = FORMS[name]
    assert is_out_of_memory(error)
    oom = classify(error, GPUS)
    assert (oom.replica_id, oom.blame, oom.form) == (replica_id, blame, form)
    assert blamed_replica(error, GPUS)[0] == replica_id


def test_device_names_are_compared_canonically_with_the_compute_devices():
    error = bfc(1, "replica_1/x")
    assert classify(error, ["/gpu:0", "GPU:1"]).replica_id == 1  # as given to the strategy, not yet canonical
    assert classify(error, ["/gpu:0", "/gpu:1"]).device == "/device:GPU:1"


@pytest.mark.parametrize("error, device", [
    # The parameter device (CPU:0 here) holds the variables and applies the update: no replica's slice is to blame.
    (graph_error(tf.errors.ResourceExhaustedError, f"OOM when allocating tensor with shape[1024,1024] and type float "
                 f"on {JOB}/device:CPU:0 by allocator cpu", "adam/Mul_3"), "/device:CPU:0"),
    (bfc(3, "replica_1/sequential/dense/MatMul"), "/device:GPU:3"),  # a GPU that runs no replica
    (tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[10]"), None),  # names nothing
    (graph_error(tf.errors.InternalError, "Dst tensor is not initialized.", "adam/AssignVariableOp"), None),
    (graph_error(tf.errors.ResourceExhaustedError, "OOM", "StatefulPartitionedCall"), None),
    (graph_error(tf.errors.ResourceExhaustedError, "OOM", "IteratorGetNext"), None),  # the input pipeline
    (graph_error(tf.errors.ResourceExhaustedError, "OOM", "replica_7/x"), None),  # not one of ours
])
def test_an_error_that_names_no_replica_blames_none_never_replica_0(error, device):
    oom = classify(error, GPUS)
    assert oom is not None and (oom.replica_id, oom.device, oom.blame) == (None, device, None)


def test_ops_without_prefix_are_replica_0s_only_when_known_to_be_a_replica_op():
    forward = graph_error(tf.errors.InternalError, "CUDNN_STATUS_ALLOC_FAILED", "sequential_1/conv2d/Conv2D")
    assert classify(forward, GPUS).replica_id is None  # could be any op outside the replicas
    assert classify(forward, GPUS, replica_scopes=("sequential",)).replica_id == 0  # the model's forward pass
    loss = graph_error(tf.errors.ResourceExhaustedError, "OOM", "compile_loss/mse/sub")
    assert classify(loss, GPUS).replica_id == 0


def test_a_replica_that_ran_eagerly_is_named_by_its_tag():
    error = tf.errors.InternalError(None, None, "Dst tensor is not initialized. [Op:MatMul]")
    assert classify(error, GPUS).replica_id is None
    tag_replica(error, 2)
    assert (classify(error, GPUS).replica_id, classify(error, GPUS).blame) == (2, "eager replica")


@pytest.mark.parametrize("error", [
    graph_error(tf.errors.InvalidArgumentError, "Incompatible shapes: [32,10] vs. [16,10]",
                "replica_1/compile_loss/mse/sub"),
    graph_error(tf.errors.InvalidArgumentError, "Matrix size-incompatible: In[0]: [32,8], In[1]: [16,1]",
                "sequential/dense/MatMul"),
    tf.errors.InternalError(None, None, f"Failed copying input tensor from {JOB}/device:CPU:0 to {JOB}/device:GPU:1 in "
                            "order to run _EagerConst: CUDA error: Error recording CUDA event: CUDA_ERROR_ASSERT: "
                            "device-side assert triggered"),
    tf.errors.CancelledError(None, None, "Dst tensor is not initialized (a derived error)"),  # not an OOM class
    tf.errors.UnknownError(None, None, "ValueError: could not broadcast input array from shape (3,) into (4,)"),
    # A library's name is no proof of an allocation that failed (a persistent one halved a healthy card's cap to 0):
    graph_error(tf.errors.InternalError, "Blas GEMM launch failed : a.shape=(256, 1024), b.shape=(1024, 10), m=256, "
                "n=10, k=1024", "gradient_tape/sequential/dense/MatMul/MatMul_1"),
    graph_error(tf.errors.UnknownError, "Failed to get convolution algorithm. This is probably because cuDNN failed to "
                "initialize, so try looking to see if a warning log message was printed above.",
                "replica_1/sequential/conv2d/Conv2D"),
    tf.errors.InternalError(None, None, f"cudnn library could not create a handle: CUDNN_STATUS_NOT_INITIALIZED on "
                            f"{JOB}/device:GPU:2"),
    tf.errors.InternalError(None, None, "failed to create cublas handle: CUBLAS_STATUS_NOT_INITIALIZED"),
])
def test_other_errors_are_never_taken_for_out_of_memory(error):
    assert not is_out_of_memory(error)
    assert classify(error, GPUS) is None
    assert not is_out_of_memory(MemoryError("a Python error is not TensorFlow's"))


# --------------------------------------------------------------------------------------------------------------
# StepRecovery and fit's error mapping
# --------------------------------------------------------------------------------------------------------------
DEVICES = ["/cpu:1", "/cpu:2", "/cpu:3"]
CPU_JOB = JOB


def batch(size=96):
    return _compat.per_replica((tf.zeros([size, 8]),))  # a packed global batch, as fit keeps it in hand


def raising(error):
    def step(data):
        raise error

    return step


def test_step_recovery_lets_other_errors_through_unchanged_and_names_unblamed_oom():
    strategy = HeteroCentralStorageStrategy(DEVICES, batch_split=[1, 2, 1], profile_cache=False, oom_recovery=True)
    recovery = strategy._step_recovery  # noqa: SLF001
    shape_error = graph_error(tf.errors.InvalidArgumentError, "Incompatible shapes: [48,1] vs. [24,1]",
                              "replica_1/compile_loss/mse/sub")
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        recovery.run(raising(shape_error), batch())
    assert info.value is shape_error and recovery.recoveries == 0

    unnamed = tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[96,8]")
    with pytest.raises(StepOOMError, match=r"names no device and no replica's op.*does not guess replica 0.*"
                       r"TF_CPP_MIN_LOG_LEVEL=0") as info:
        recovery.run(raising(unnamed), batch())
    assert (info.value.replica_id, info.value.device, info.value.last_error) == (None, None, unnamed)
    assert info.value.__cause__ is unnamed and recovery.recoveries == 0

    on_parameter_device = graph_error(tf.errors.ResourceExhaustedError, "OOM when allocating tensor with shape[8,16] "
                                      f"and type float on {CPU_JOB}/device:CPU:0 by allocator cpu", "adam/Mul")
    with pytest.raises(StepOOMError, match=r"on /device:CPU:0, the parameter device") as info:
        recovery.run(raising(on_parameter_device), batch())
    assert (info.value.replica_id, info.value.device) == (None, "/device:CPU:0")
    assert not strategy.balancer.memory_caps.history  # no cap was lowered


def test_fit_error_mapping_blames_the_device_and_names_an_unblamed_oom():
    strategy = HeteroCentralStorageStrategy(DEVICES, batch_split=[1, 2, 1], profile_cache=False)
    copy = tf.errors.InternalError(None, None, f"Failed copying input tensor from {CPU_JOB}/device:CPU:0 to "
                                   f"{CPU_JOB}/device:CPU:3 in order to run _EagerConst: Dst tensor is not "
                                   "initialized.")
    error = strategy._replica_step_error(copy)  # noqa: SLF001
    assert isinstance(error, ReplicaStepError) and (error.replica_id, error.device) == (2, "/device:CPU:3")
    unnamed = graph_error(tf.errors.ResourceExhaustedError, "OOM when allocating tensor", "adam/Mul")
    error = strategy._replica_step_error(unnamed)  # noqa: SLF001
    assert isinstance(error, StepOOMError) and error.replica_id is None
    # Errors other than out of memory keep their rule: an op without prefix is replica 0's.
    shape = graph_error(tf.errors.InvalidArgumentError, "Incompatible shapes", "sequential/dense/add")
    assert strategy._replica_step_error(shape).replica_id == 0  # noqa: SLF001


# --------------------------------------------------------------------------------------------------------------
# End to end: fit recovers from a failed host-to-device copy on one replica's device
# --------------------------------------------------------------------------------------------------------------
B = 96
NUM_BATCHES = 8


class FailingCopy(keras.layers.Layer):
    """Passes its input through; on the ``fail_at``-th slice larger than ``over`` examples it raises what a GPU
    raises when the host-to-device copy of that slice finds no memory on ``target``."""

    def __init__(self, target=None, over=30, fail_at=3, **kwargs):
        super().__init__(**kwargs)
        self.target, self.over, self.fail_at, self.large_slices, self.failures = target, over, fail_at, 0, 0

    def _copy(self, x):
        if self.target is not None and x.shape[0] > self.over:
            self.large_slices += 1
            if self.large_slices == self.fail_at:
                self.failures += 1
                raise tf.errors.InternalError(
                    None, None, f"Failed copying input tensor from {CPU_JOB}/device:CPU:0 to {CPU_JOB}{self.target} "
                    f"in order to run _EagerConst: Dst tensor is not initialized.")
        return x

    def call(self, x):
        copied = tf.numpy_function(self._copy, [x], tf.float32, stateful=True)
        with tf.control_dependencies([copied]):  # outside the data path, which the loss reader reads
            return tf.identity(x)


def model_with(layer):
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((8,)), layer, keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(1)])


def test_fit_recovers_from_a_failed_host_to_device_copy_on_the_device_that_raised_it(monkeypatch, tmp_path):
    monkeypatch.setenv("HETERO_CS_CACHE_DIR", str(tmp_path))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B * NUM_BATCHES, 8)).astype(np.float32)
    y = rng.normal(size=(B * NUM_BATCHES, 1)).astype(np.float32)
    # Shares 1:2:1 cut 96 into [24, 48, 24]: only replica 1 (/device:CPU:2) gets slices over 30 examples.
    strategy = HeteroCentralStorageStrategy(DEVICES, batch_split=[1, 2, 1], profile_cache=False, oom_recovery=True)
    failing = FailingCopy(target="/device:CPU:2")
    with strategy.scope():
        model = model_with(failing)
        model.compile(optimizer="adam", loss="mse")
    initial = model.get_weights()
    history = model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)

    reference = model_with(FailingCopy())
    reference.set_weights(initial)
    reference.compile(optimizer="adam", loss="mse")
    reference.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)

    assert failing.failures == 1
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == NUM_BATCHES
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5)
    drops = [c for c in strategy.balancer.memory_caps.history if c.reason == "out_of_memory"]
    assert [(c.replica_id, c.new_cap) for c in drops] == [(1, 24)]  # half of the 48 that failed
    assert strategy.balancer.max_batch_sizes == [None, 24, None]
    assert strategy.stats.history["oom_recoveries"][-1] == strategy._step_recovery.recoveries == 1  # noqa: SLF001
