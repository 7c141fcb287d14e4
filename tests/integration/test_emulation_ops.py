"""TF side of hetero_cs.emulation (logical CPU devices, stamps, emulated waits) and the real no-driver discovery."""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import tensorflow as tf

from hetero_cs.devices import discovery as devices
from hetero_cs.emulation import (
    TIME_SCALE_ENV_VAR,
    Emulator,
    Workload,
    estimate_workload,
    setup_logical_devices,
)
from hetero_cs.errors import ConfigError, EmulationError, UnknownEmulatedDeviceError
from hetero_cs.devices.step_clock import end_replica_step, sampled_wall_clock_stamp, tie_to_stamp, wall_clock_stamp

# Before any TF op runs in this process (idempotent: a conftest or an earlier module may have configured more).
COMPUTE_DEVICES = setup_logical_devices(["A10", "T4", "T4"])
WAIT_S = 0.25  # long, so that a busy host starting one replica late still leaves the waits overlapping
MLP = Workload(flops_per_example=406_528.0, parameter_bytes=814_120)


@pytest.fixture(scope="session")
def emulated_devices():
    return COMPUTE_DEVICES


@pytest.fixture(autouse=True)
def _no_time_scale_env(monkeypatch):
    monkeypatch.delenv(TIME_SCALE_ENV_VAR, raising=False)


class Recorder:
    def __init__(self):
        self.calls: list[tuple[int, int, float]] = []
        self._lock = threading.Lock()

    def __call__(self, replica_id: int, batch_size: int, elapsed_s: float) -> None:
        now_s = time.perf_counter()  # at or just after the step's end stamp
        with self._lock:
            self.calls.append((replica_id, batch_size, elapsed_s, now_s))


def make_replicated_step(devices_, slices, *, emulator=None, record=None):
    """One step of len(slices) replicas, replica r on devices_[r] with examples [offset_r, offset_r + slices[r])."""
    offsets = [sum(slices[:r]) for r in range(len(slices))]

    @tf.function
    def step(x):
        ends = []
        for r, device in enumerate(devices_):
            with tf.device(device):
                local = x[offsets[r]:offsets[r] + slices[r]]
                start = wall_clock_stamp(local)
                local = tie_to_stamp(local, start)  # the work starts after the start stamp
                work = tf.reduce_sum(tf.square(local), axis=0)  # shape [features]; zeros for an empty slice
                end = end_replica_step(start, work, replica_id=r, batch_size=tf.shape(local)[0],
                                       emulator=emulator, record=record)
                ends.append(tie_to_stamp(work, end))  # not tf.control_dependencies: see end_replica_step
        return tf.stack(ends)

    return step


def test_setup_logical_devices_returns_compute_devices_and_is_idempotent(emulated_devices):
    assert emulated_devices == ["/device:CPU:1", "/device:CPU:2", "/device:CPU:3"]
    tf.constant(1.0) + 1.0  # TF is certainly initialised now
    assert len(tf.config.list_logical_devices("CPU")) >= 4
    assert setup_logical_devices(["t4", "P100", "cpu"]) == emulated_devices
    assert tf.config.threading.get_inter_op_parallelism_threads() >= 5
    with pytest.raises(EmulationError, match=r"already initialised.*before any TensorFlow op runs"):
        setup_logical_devices(["T4"] * 64)
    with pytest.raises(UnknownEmulatedDeviceError, match="Known devices"):
        setup_logical_devices(["T4", "GTX480"])
    with pytest.raises(ConfigError, match="non-empty"):
        setup_logical_devices([])


def test_replicas_wait_concurrently(emulated_devices):
    emulator = Emulator(["T4"] * 3, workload=MLP)
    emulator.calibrate_time_scale(30, target_makespan_s=WAIT_S)  # each replica's 10 examples -> WAIT_S
    record = Recorder()
    step = make_replicated_step(emulated_devices, [10, 10, 10], emulator=emulator, record=record)
    x = tf.random.uniform([30, 8])
    for _ in range(4):  # the first traces and warms up
        step(x).numpy()
    assert emulator.steps_done == (4, 4, 4)
    assert all(elapsed_s >= WAIT_S * 0.99 for _, _, elapsed_s, _ in record.calls)  # the waits happened at all
    # Concurrent waits overlap: some instant lies within every replica's wait of the step. One after another,
    # each replica would start after the previous one's end (its report), leaving no such instant. No bound on
    # the step's wall time: a busy host stretches it. The best of the three timed steps absorbs a replica that
    # a busy host started more than WAIT_S late.
    waits = {r: [(end_s - elapsed_s, end_s) for rr, _, elapsed_s, end_s in record.calls if rr == r] for r in range(3)}
    overlaps = [max(waits[r][k][0] for r in range(3)) < min(waits[r][k][1] for r in range(3)) for k in (1, 2, 3)]
    assert any(overlaps), waits


def test_record_sees_each_replica_and_its_batch_size(emulated_devices):
    record = Recorder()
    step = make_replicated_step(emulated_devices, [5, 7, 0], record=record)
    x = tf.random.uniform([12, 3])
    out = step(x)
    assert out.shape == (3, 3)
    assert sorted((r, b) for r, b, *_ in record.calls) == [(0, 5), (1, 7), (2, 0)]
    assert all(elapsed_s >= 0.0 for _, _, elapsed_s, _ in record.calls)


def test_an_empty_slice_works_and_idles(emulated_devices, monkeypatch):
    from hetero_cs.devices import step_clock as step_timing

    emulator = Emulator(["T4", "T4", "T4"], workload=MLP, time_scale=1000.0)  # a non-empty slice would wait >= 0.5 s
    sleeps = []
    monkeypatch.setattr(step_timing.time, "sleep", sleeps.append)  # idling is not sleeping (no wall-clock bound)
    record = Recorder()
    empty = tf.zeros([0, 4])
    start = wall_clock_stamp(empty)  # eager
    end = end_replica_step(start, empty, replica_id=2, batch_size=tf.constant(0), emulator=emulator, record=record)
    assert start.dtype == end.dtype == tf.float64 and end.shape == ()
    assert float(end) >= float(start) and sleeps == []
    assert [(r, b) for r, b, *_ in record.calls] == [(2, 0)]
    assert emulator.steps_done == (0, 0, 1)

    step = make_replicated_step(emulated_devices, [0, 0, 0], emulator=emulator)
    assert step(tf.zeros([0, 4])).shape == (3, 4)


def test_an_emulated_step_that_is_not_timed_still_waits_and_reports_nothing(monkeypatch):
    """Sampled timing on emulated devices: every step waits out its device's time and advances its counter; only a
    timed step reports."""
    from hetero_cs.devices import step_clock as step_timing

    emulator = Emulator(["T4", "T4", "T4"], workload=MLP, time_scale=1000.0)
    wanted_s = emulator.step_time_s(1, 4)
    sleeps = []
    monkeypatch.setattr(step_timing.time, "sleep", sleeps.append)  # the wait asked for, without a wall-clock bound
    record = Recorder()
    anchor = tf.ones([4, 2])
    for timed in (False, True):
        start = sampled_wall_clock_stamp(anchor, tf.constant(timed), emulated=True)
        assert (float(start) >= 0.0) == timed  # untimed: the clock's negative
        end = end_replica_step(start, anchor, replica_id=1, batch_size=4, emulator=emulator, record=record)
        assert (float(end) >= 0.0) == timed and abs(float(end)) >= abs(float(start))
    assert len(sleeps) == 2 and all(0 < s <= wanted_s for s in sleeps)  # both steps waited, from their starts
    assert emulator.steps_done == (0, 2, 0)
    assert [(r, b) for r, b, *_ in record.calls] == [(1, 4)]  # the timed step only
    # Real devices: an untimed step's stamp is -1.0, and the clock is not read.
    assert float(sampled_wall_clock_stamp(anchor, tf.constant(False))) == -1.0


def test_probes_do_not_advance_the_emulator(emulated_devices):
    emulator = Emulator(["T4", "T4", "T4"], workload=MLP, time_scale=1.0)
    record = Recorder()
    anchor = tf.ones([4, 2])
    end_replica_step(wall_clock_stamp(anchor), anchor, replica_id=1, batch_size=4, emulator=emulator,
                     record=record, advance=False)
    assert emulator.steps_done == (0, 0, 0)
    assert record.calls[0][:2] == (1, 4) and record.calls[0][2] >= emulator.step_time_s(1, 4) * 0.99


def test_tie_to_stamp_keeps_values_bit_for_bit():
    stamp = wall_clock_stamp(tf.ones([1]))
    # No subnormals: TF's CPU kernels flush them to zero in any arithmetic, this one included.
    floats = tf.constant([-0.0, 0.0, float("inf"), float("-inf"), float("nan"), 1.2e-38, -3.4e38], tf.float32)
    sparse = tf.IndexedSlices(tf.constant([[1.0, -0.0]]), tf.constant([2]), tf.constant([3, 2]))
    tied = tie_to_stamp({"f": floats, "i": tf.constant([7, -3]), "b": tf.constant([True]), "none": None,
                         "sparse": sparse, "h": tf.constant([2.5], tf.bfloat16)}, stamp)
    assert tied["f"].numpy().tobytes() == floats.numpy().tobytes()
    assert tied["i"].dtype == tf.int32 and tied["i"].numpy().tolist() == [7, -3]
    assert tied["b"] is not None and tied["none"] is None and tied["h"].dtype == tf.bfloat16
    assert isinstance(tied["sparse"], tf.IndexedSlices)
    assert tied["sparse"].values.numpy().tobytes() == sparse.values.numpy().tobytes()


def test_stamps_are_not_constant_folded():
    @tf.function
    def stamps(x):
        first = wall_clock_stamp(x)
        with tf.control_dependencies([first]):
            second = wall_clock_stamp(tf.identity(x) * 2.0)
        return first, second

    x = tf.constant([[1.0, 2.0]])
    first_a, second_a = stamps(x)
    time.sleep(0.01)
    first_b, second_b = stamps(x)  # the same constant input: a folded stamp would repeat exactly
    assert float(first_b) > float(first_a)
    assert float(second_a) >= float(first_a) and float(second_b) >= float(first_b)


def test_stamps_accept_any_dtype():
    for anchor in (tf.constant([b"ab", b"c"]), tf.constant([[True]]), tf.constant([3], tf.int64),
                   tf.constant([1 + 2j], tf.complex64), tf.constant(0.5)):
        assert wall_clock_stamp(anchor).dtype == tf.float64


# --------------------------------------------------------------------------------------------- estimate_workload


def test_estimate_workload_mlp():
    import keras

    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
    workload = estimate_workload(model)
    assert workload.flops_per_example == 2 * 784 * 256 + 2 * 256 * 10
    assert workload.parameter_bytes == (784 * 256 + 256 + 256 * 10 + 10) * 4
    assert workload.layers == 2


def test_estimate_workload_reads_whether_tensorflow_runs_float32_as_tf32():
    import keras

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    assert tf.config.experimental.tensor_float_32_execution_enabled()  # TensorFlow's default
    assert estimate_workload(model).tensor_float_32
    tf.config.experimental.enable_tensor_float_32_execution(False)
    try:
        assert not estimate_workload(model).tensor_float_32
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(True)


def test_estimate_workload_convolutions_and_sequences():
    import keras

    image = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3), keras.layers.Flatten(),
                              keras.layers.Dense(5)])
    assert estimate_workload(image).flops_per_example == 2 * 3 * 3 * 3 * 4 * (6 * 6) + 2 * 144 * 5
    sequence = keras.Sequential([keras.Input((10, 2)), keras.layers.Conv1D(8, 3),
                                 keras.layers.Dense(6, dtype="float16")])
    workload = estimate_workload(sequence)
    assert workload.flops_per_example == 2 * 3 * 2 * 8 * 8 + 2 * 8 * 6 * 8  # Dense per output row (8 rows)
    assert workload.parameter_bytes == (3 * 2 * 8 + 8) * 4 + (8 * 6 + 6) * 2


def test_estimate_workload_nested_subclassed_model():
    import keras

    class Nested(keras.Model):
        def __init__(self):
            super().__init__()
            self.first = keras.layers.Dense(3)
            self.inner = keras.Sequential([keras.layers.Dense(2)])

        def call(self, x):
            return self.inner(self.first(x))

    model = Nested()
    with pytest.raises(ConfigError, match="not built"):
        estimate_workload(model)
    model(tf.ones([2, 4]))
    workload = estimate_workload(model)
    assert workload.flops_per_example == 2 * 4 * 3 + 2 * 3 * 2
    assert workload.parameter_bytes == (4 * 3 + 3 + 3 * 2 + 2) * 4


# ------------------------------------------------------------------------------------ discovery without a driver


def test_discover_devices_without_a_driver_lists_the_cpus_without_a_warning(monkeypatch, caplog):
    if tf.config.list_physical_devices("GPU"):
        pytest.skip("this machine has a GPU; the no-driver path needs a CPU-only machine")
    monkeypatch.setattr(devices, "_WARNED_ONCE", set())
    with warnings.catch_warnings(), caplog.at_level("INFO", logger="hetero_cs.devices"):
        warnings.simplefilter("error")  # no GPU: nothing NVML could add is missing
        found = devices.discover_devices()
    assert any("NVML is unavailable" in r.getMessage() for r in caplog.records)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = devices.discover_devices()
    assert [d.name for d in again] == [d.name for d in found]  # (free host memory moves between calls)
    assert [d.name for d in found] == [d.name for d in tf.config.list_logical_devices("CPU")]
    assert all(d.device_type == "CPU" and d.source == "tensorflow" for d in found)
    assert found[0].memory_total_bytes and found[0].memory_total_bytes > 0 and found[0].description
    assert devices.format_device_table(found).splitlines()[1].startswith("/device:CPU:0")


def test_finish_replica_step_stamps_the_end_after_every_gradient():
    # The end stamp waits for the gradients through control edges only; if they were lost (e.g. pruned by Grappler)
    # the stamp would run as soon as the start stamp exists, before the slow gradients below are computed.
    from hetero_cs.devices.step_clock import finish_replica_step

    done_s: list[float] = []
    recorder = Recorder()

    def slow(value):
        time.sleep(0.05)
        done_s.append(time.perf_counter())
        return value

    @tf.function
    def step(x):
        start = wall_clock_stamp(x)
        fast = x * 2.0
        late = tf.numpy_function(slow, [x * 3.0], tf.float32, stateful=False)
        grads = finish_replica_step([fast, None, late], start, replica_id=0, batch_size=tf.shape(x)[0],
                                    record=recorder)
        return tf.add_n([g for g in grads if g is not None]), start

    out, start = step(tf.ones([4]))
    assert out.numpy().tolist() == [5.0] * 4  # values unchanged
    (replica_id, batch_size, elapsed_s, _), = recorder.calls
    assert (replica_id, batch_size) == (0, 4)
    assert float(start) + elapsed_s >= done_s[0]  # the end stamp came after the last gradient
