"""TensorFlow integration tests: one process, logical CPU devices configured once before TF initialises.

CPU:0 is the parameter device; CPU:1..4 are compute devices (up to 4 replicas).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

NUM_COMPUTE_DEVICES = 4


def _configure() -> None:
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(NUM_COMPUTE_DEVICES + 1)]
        )
        # Emulated waits overlap across replicas only with enough inter-op threads.
        tf.config.threading.set_inter_op_parallelism_threads(NUM_COMPUTE_DEVICES + 4)
    except RuntimeError:
        pass  # Already initialised by an earlier module in this process; the configuration then stands.


_configure()


@pytest.fixture(scope="session")
def compute_devices():
    """The 4 logical CPU compute devices."""
    return [f"/device:CPU:{i}" for i in range(1, NUM_COMPUTE_DEVICES + 1)]


@pytest.fixture
def modelled_step_times(monkeypatch):
    """Emulated devices report the step times their model gives instead of what the host's clock measured.

    The emulated devices still run every step (real compute, then a sleep up to the modelled time), but on a busy
    host the clock adds the scheduler's delays to each step - enough to reorder devices in calibration or to hide
    a guard's gain. Tests about what the balancer, the guard or the re-planner decide from step times use this, so
    their outcome follows from the emulated devices alone and no host load can change it. Both ends are replaced:
    calibration's probe steps (``calibration.probe.DeviceProbe.run_step``) and the training steps' reports
    (``HeteroCentralStorageStrategy._record_step_time``, read when the step is traced); the host's measured tail
    (``_record_step_end``) is left out. Steps on devices that are not emulated keep their measured times.
    """
    from calibration import probe as probe_module
    from hetero_cs import HeteroCentralStorageStrategy

    measured_run_step = probe_module.DeviceProbe.run_step
    measured_record = HeteroCentralStorageStrategy._record_step_time

    def run_step(self, batch_size):
        elapsed_s = measured_run_step(self, batch_size)
        if self.emulator is None:
            return elapsed_s
        return self.emulator.step_time_s(self.replica_id, int(batch_size))  # probes do not advance the emulator

    def record(self, replica_id, batch_size, step_time_s, **kwargs):
        emulator = self._emulator
        if emulator is not None and emulator.workload is not None:
            # The report follows the replica's step, which advanced its counter: its time is the previous step's.
            step = max(emulator.steps_done[int(replica_id)] - 1, 0)
            step_time_s = emulator.step_time_s(int(replica_id), int(batch_size), step=step)
        measured_record(self, replica_id, batch_size, step_time_s, **kwargs)

    measured_step_end = HeteroCentralStorageStrategy._record_step_end

    def record_step_end(self, start_s, step_time_s):
        if self._emulator is None:  # only emulated steps are modelled; a modelled step has no host tail
            measured_step_end(self, start_s, step_time_s)

    monkeypatch.setattr(probe_module.DeviceProbe, "run_step", run_step)
    monkeypatch.setattr(HeteroCentralStorageStrategy, "_record_step_time", record)
    monkeypatch.setattr(HeteroCentralStorageStrategy, "_record_step_end", record_step_end)
