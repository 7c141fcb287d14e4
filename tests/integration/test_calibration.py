"""Calibration on emulated A10 / T4 / P100 devices (logical CPU devices with emulated waits).

The emulated step times are short (time_scale chosen for a ~40 ms even-split step) so the module runs in seconds,
yet well above the real per-replica compute of these small models even on a busy 2-core machine, so the emulated
curves dominate what is measured.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from hetero_cs.emulation import Emulator, estimate_workload, setup_logical_devices  # noqa: E402

# Before TensorFlow initialises (idempotent when the integration conftest already made enough CPU devices).
EMULATED = ("A10", "T4", "P100")
DEVICES = setup_logical_devices(list(EMULATED))

import json  # noqa: E402
import logging  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from calibration import probe as probe_module  # noqa: E402
from calibration.__main__ import main  # noqa: E402
from calibration.calibrate import calibrate  # noqa: E402
from calibration.models import build_model  # noqa: E402
from calibration.probe import (  # noqa: E402
    DeviceProbe,
    extrapolate_memory_cap,
    input_signature,
    model_fingerprint,
    preserved_model_state,
    search_memory_cap,
)
from calibration.store import ProfileStore, load_result_file  # noqa: E402
from calibration.result import CalibrationResult  # noqa: E402
from hetero_cs.cli import main as cli_main  # noqa: E402
from hetero_cs.planning.cost_model import idle_free  # noqa: E402
from hetero_cs.planning.solver import solve_batch_split  # noqa: E402
from hetero_cs.errors import CalibrationError, CalibrationOOMError, ConfigError, DeviceError  # noqa: E402

GLOBAL_BATCH_SIZE = 128
TARGET_STEP_S = 0.04
PROBED_SIZES = (1, 3, 11, 38, 128)
UNPROBED_SIZES = (8, 24, 64, 100)


def _emulator(model, names=EMULATED, target_s=TARGET_STEP_S, global_batch_size=GLOBAL_BATCH_SIZE):
    """An Emulator whose even-split step takes ~target_s (explicit time_scale: immune to the environment)."""
    workload = estimate_workload(model)
    unit = Emulator(list(names), workload=workload, time_scale=1.0)
    share = -(-global_batch_size // len(names))
    makespan_s = max(unit.step_time_s(i, share) for i in range(len(names)))
    return Emulator(list(names), workload=workload, time_scale=target_s / makespan_s)


def _compiled(model):
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _digits_batch(n, shape=(8, 8, 1), seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, *shape)).astype(np.float32), rng.integers(0, 10, size=n).astype(np.int64)


@pytest.fixture(scope="module")
def strategy():
    return tf.distribute.experimental.CentralStorageStrategy(DEVICES, parameter_device="/device:CPU:0")


@pytest.fixture(scope="module")
def digits_cnn(strategy):
    with strategy.scope():
        return _compiled(build_model("digits_cnn", input_shape=(8, 8, 1), num_classes=10))


@pytest.fixture(scope="module")
def calibrated(digits_cnn):
    emulator = _emulator(digits_cnn)
    started = time.perf_counter()
    result = calibrate(digits_cnn, _digits_batch(GLOBAL_BATCH_SIZE), devices=DEVICES, emulator=emulator,
                       store=False, progress=False)
    return result, emulator, time.perf_counter() - started


@pytest.mark.slow  # asserts on wall-clock measurements: run by `tox -e slow` on a quiet machine, never in CI
def test_calibration_ranks_devices_and_predicts_unprobed_sizes(calibrated, digits_cnn, capsys):
    result, emulator, wall_time_s = calibrated
    assert result.emulated
    assert [p.emulated_as for p in result.profiles] == list(EMULATED)
    assert all(p.probe_batch_sizes == PROBED_SIZES for p in result.profiles)
    at_full_batch = [p.cost_model.predict_step_time_s(GLOBAL_BATCH_SIZE) for p in result.profiles]
    assert int(np.argmin(at_full_batch)) == 0, at_full_batch  # A10 is the fastest
    assert max(result.plan.per_replica_batch_sizes) == result.plan.per_replica_batch_sizes[0]
    assert sum(result.plan.per_replica_batch_sizes) == GLOBAL_BATCH_SIZE

    errors = {}
    batch = _digits_batch(GLOBAL_BATCH_SIZE)
    with preserved_model_state(digits_cnn):
        for replica_id, (device, profile) in enumerate(zip(DEVICES, result.profiles)):
            probe = DeviceProbe(digits_cnn, batch, device=device, replica_id=replica_id, emulator=emulator)
            for b in UNPROBED_SIZES:
                measured_s = float(np.median(probe.time_step(b, warmup_steps=1, trials=3)))
                errors[(profile.emulated_as, b)] = profile.cost_model.predict_step_time_s(b) / measured_s - 1
    worst = max(abs(e) for e in errors.values())
    with capsys.disabled():
        print(f"\n{result.format_table()}\ncalibration wall time (3 emulated devices, digits CNN, "
              f"{TARGET_STEP_S * 1e3:.0f} ms steps): {wall_time_s:.2f} s; worst prediction error at unprobed sizes "
              f"{UNPROBED_SIZES}: {worst * 100:.1f} %")
    assert worst < 0.10, errors


def test_calibration_does_not_advance_emulated_drift_counters(calibrated):
    _, emulator, _ = calibrated
    assert emulator.steps_done == (0, 0, 0)


def test_probe_leaves_the_model_unchanged(strategy):
    with strategy.scope():
        model = _compiled(keras.Sequential([
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3),
            keras.layers.BatchNormalization(),
            keras.layers.Flatten(),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(10),
        ]))
    batch = _digits_batch(32)
    tracked = list(model.variables) + list(model.metrics_variables) + list(model.optimizer.variables)

    def snapshot():
        return [np.array(v.numpy(), copy=True) for v in tracked]

    before = snapshot()
    probe = DeviceProbe(model, batch, device=DEVICES[0])
    probe.run_step(16)  # Unprotected: BatchNormalization statistics and the dropout seed do move ...
    moved = [v.path for v, a, b in zip(tracked, before, snapshot()) if not np.array_equal(a, b)]
    assert any("moving_mean" in path for path in moved) and any("seed" in path for path in moved), moved
    for variable, value in zip(tracked, before):  # ... so put them back before the real tests.
        variable.assign(value)

    probe.time_step(8, warmup_steps=1, trials=2)
    assert [v.path for v, a, b in zip(tracked, before, snapshot()) if not np.array_equal(a, b)] == []
    # A stateless probe (an idle card's, beside training) changes nothing by itself, traced here and run elsewhere.
    stateless = DeviceProbe(model, batch, device=DEVICES[1], stateless=True)
    stateless.trace(16)
    worker = threading.Thread(target=stateless.run_step, args=(16,))
    worker.start()
    worker.join()
    assert stateless.run_step(16) > 0
    assert [v.path for v, a, b in zip(tracked, before, snapshot()) if not np.array_equal(a, b)] == []

    calibrate(model, batch, devices=DEVICES[:2], probe_batch_sizes=[2, 8, 32], warmup_steps=1, trials=1,
              store=False, progress=False)
    after = snapshot()
    changed = [v.path for v, a, b in zip(tracked, before, after) if not np.array_equal(a, b)]
    assert changed == []


def test_cache_hit_skips_probing_and_model_change_misses(tmp_path, monkeypatch, strategy):
    def mlp(hidden):
        with strategy.scope():
            return _compiled(keras.Sequential([keras.Input((16,)), keras.layers.Dense(hidden, activation="relu"),
                                               keras.layers.Dense(10)]))

    batch = (np.ones((32, 16), np.float32), np.zeros((32,), np.int64))
    store = ProfileStore(tmp_path)
    kwargs = dict(devices=DEVICES, probe_batch_sizes=[1, 8, 32], warmup_steps=1, trials=2, store=store,
                  progress=False)
    first = calibrate(mlp(32), batch, **kwargs)
    assert len(list(tmp_path.glob("*.json"))) == 1

    def no_probing(*args, **kwargs):
        raise AssertionError("a cache hit must not probe")

    with monkeypatch.context() as patch:
        patch.setattr(probe_module, "DeviceProbe", no_probing)
        calls = []
        # check_cached=False: the check's own timed steps are tested with injected times below.
        second = calibrate(mlp(32), batch, **kwargs, run_plan=lambda plan: calls.append(plan) or 0.0123,
                           check_cached=False)
    assert second.profiles == first.profiles and second.plan == first.plan
    assert second.from_cache and not first.from_cache
    assert "loaded from the profile cache" in second.format_table()
    assert calls == [first.plan]
    assert second.measured_makespan_s == 0.0123

    calibrate(mlp(48), batch, **kwargs)  # another model: a miss, calibrated and stored beside the first
    assert len(list(tmp_path.glob("*.json"))) == 2


def _oom():
    return tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor (simulated)")


def test_out_of_memory_gives_a_cap_and_a_plan_within_it(monkeypatch, strategy):
    with strategy.scope():
        model = _compiled(keras.Sequential([keras.Input((16,)), keras.layers.Dense(10)]))
    real_run_step = DeviceProbe.run_step

    def run_step(self, batch_size):
        if self.device == DEVICES[0] and batch_size > 100:
            raise _oom()
        return real_run_step(self, batch_size)

    monkeypatch.setattr(DeviceProbe, "run_step", run_step)
    batch = (np.ones((256, 16), np.float32), np.zeros((256,), np.int64))
    result = calibrate(model, batch, devices=DEVICES[:2], warmup_steps=0, trials=1, store=False, progress=False)
    cap = result.profiles[0].max_batch_size
    assert cap is not None and 98 <= cap <= 100
    assert result.profiles[0].probe_batch_sizes[-1] == cap  # the cap itself was timed and fitted
    assert result.profiles[1].max_batch_size is None
    assert result.plan.per_replica_batch_sizes[0] <= cap


def test_out_of_memory_at_every_size_names_device_and_fix(monkeypatch, strategy):
    with strategy.scope():
        model = _compiled(keras.Sequential([keras.Input((16,)), keras.layers.Dense(10)]))

    def run_step(self, batch_size):
        raise _oom()

    monkeypatch.setattr(DeviceProbe, "run_step", run_step)
    batch = (np.ones((64, 16), np.float32), np.zeros((64,), np.int64))
    with pytest.raises(CalibrationOOMError, match=r"device='/device:CPU:1'.*batch_sizes=\[1\].*smaller model"):
        calibrate(model, batch, devices=DEVICES[:1], store=False, progress=False)


def test_search_memory_cap_and_extrapolation():
    tried = []

    def fits(b):
        tried.append(b)
        return b <= 300

    assert search_memory_cap(fits, largest_fitting=256, smallest_failing=512, relative_precision=0) == 300
    assert len(tried) <= 8 and all(256 < b < 512 for b in tried)
    tried.clear()
    assert search_memory_cap(fits, largest_fitting=256, smallest_failing=512, first_guess=300,
                             relative_precision=0) == 300
    assert tried[0] == 300
    with pytest.raises(ConfigError, match="largest_fitting < smallest_failing"):
        search_memory_cap(fits, largest_fitting=8, smallest_failing=8)
    # peak(b) = 1000 + 10 b bytes; 90 % of 11,000 bytes -> (9,900 - 1,000) / 10 = 890 examples.
    assert extrapolate_memory_cap([(16, 1160), (64, 1640)], memory_limit_bytes=11_000) == 890
    assert extrapolate_memory_cap([(16, 1160), (64, 1640)], memory_limit_bytes=None) is None
    assert extrapolate_memory_cap([(16, 1160)], memory_limit_bytes=11_000) is None


def test_fingerprint_and_signature(strategy):
    first = build_model("mlp", input_shape=(64,), num_classes=10)
    same = build_model("mlp", input_shape=(64,), num_classes=10)
    other = build_model("mlp", input_shape=(32,), num_classes=10)
    assert model_fingerprint(first) == model_fingerprint(same)  # layer names differ; they do not count
    assert model_fingerprint(first) != model_fingerprint(other)
    x, y = _digits_batch(5)
    assert input_signature((x, y)) == "0=float32[*,8,8,1];1=int64[*]"
    assert input_signature((x, y), include_batch_dim=True) == "0=float32[5,8,8,1];1=int64[5]"


def test_invalid_arguments(digits_cnn):
    batch = _digits_batch(16)
    with pytest.raises(DeviceError, match="Unknown device"):
        calibrate(digits_cnn, batch, devices=["/device:CPU:9"], store=False, progress=False)
    with pytest.raises(DeviceError, match="once"):
        calibrate(digits_cnn, batch, devices=[DEVICES[0], DEVICES[0]], store=False, progress=False)
    with pytest.raises(ConfigError, match="num_replicas=3 but len\\(devices\\)=2"):
        calibrate(digits_cnn, batch, devices=DEVICES[:2], emulator=_emulator(digits_cnn), store=False)
    with pytest.raises(ConfigError, match="sample_batch"):
        calibrate(digits_cnn, batch[0], devices=DEVICES[:1], store=False)
    uncompiled = build_model("mlp", input_shape=(8, 8, 1), num_classes=10)
    with pytest.raises(CalibrationError, match="not compiled and no loss"):
        calibrate(uncompiled, batch, devices=DEVICES[:1], store=False, progress=False)


def test_explicit_loss_on_an_uncompiled_model(capsys, caplog):
    # Headings are printed where INFO logging is off (the CLI's main, run by other tests, turns it on for good).
    caplog.set_level(logging.WARNING, logger="calibration")
    model = build_model("mlp", input_shape=(8, 8, 1), num_classes=10)
    result = calibrate(model, _digits_batch(16), devices=DEVICES[:1], probe_batch_sizes=[4, 16], warmup_steps=1,
                       trials=1, store=False, progress=True,
                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert result.profiles[0].probe_batch_sizes == (4, 16)
    assert not result.emulated
    out = capsys.readouterr().out
    assert "2/2" in out  # Keras' Progbar reached the end
    # Each bar under its heading, without INFO logging.
    warm = out.index("hetero_cs calibration: warming up 1 device(s)")
    timing = out.index("hetero_cs calibration: timing 1 device(s) interleaved, 1 trial(s)")
    assert warm < out.index("2/2") < timing < out.rindex("2/2"), out


def test_cli_calibrates_writes_a_profile_and_plans(tmp_path, capsys):
    output = tmp_path / "profile.json"
    status = main(["--model", "mlp", "--emulate", ",".join(EMULATED), "--global-batch-size", "64",
                   "--cache-dir", str(tmp_path / "cache"), "--output", str(output), "--trials", "2",
                   "--warmup-steps", "1", "--target-step-ms", "10", "--no-progress"])
    printed = capsys.readouterr().out
    assert status == 0
    assert "EMULATED" in printed and "BatchPlan" in printed
    # The profile of emulated cards is used with the same emulate= (without it: a ConfigError, other devices).
    assert f"HeteroCentralStorageStrategy(emulate={list(EMULATED)}, profile={str(output)!r})" in printed
    result = load_result_file(output)
    assert [p.emulated_as for p in result.profiles] == list(EMULATED)
    assert result.plan.global_batch_size == 64

    assert cli_main(["plan", "--profile", str(output), "--global-batch-size", "96", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["global_batch_size"] == 96 and sum(plan["per_replica_batch_sizes"]) == 96

    output.write_text("{}")
    assert cli_main(["plan", "--profile", str(output)]) == 2
    assert "Recalibrate" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.slow  # asserts on wall-clock measurements (benchmarks report this figure)
def test_wall_time_with_default_settings(strategy, capsys):
    """The figure DESIGN.md asks for: 3 devices, default warm-up/trials, the CLI's 50 ms emulated steps."""
    with strategy.scope():
        model = _compiled(build_model("digits_cnn", input_shape=(8, 8, 1), num_classes=10))
    emulator = _emulator(model, target_s=0.05, global_batch_size=256)
    batch = _digits_batch(256)
    result = calibrate(model, batch, devices=DEVICES, emulator=emulator, store=False, progress=False)
    errors = []
    with preserved_model_state(model):
        for replica_id, (device, profile) in enumerate(zip(DEVICES, result.profiles)):
            probe = DeviceProbe(model, batch, device=device, replica_id=replica_id, emulator=emulator)
            for b in (8, 40, 100, 180):
                measured_s = float(np.median(probe.time_step(b, warmup_steps=1, trials=5)))
                errors.append(abs(profile.cost_model.predict_step_time_s(b) / measured_s - 1))
    with capsys.disabled():
        print(f"\n{result.format_table()}\ndefault settings: wall time {result.wall_time_s:.2f} s, worst "
              f"prediction error at unprobed sizes {max(errors) * 100:.1f} %")
    assert max(errors) < 0.10


def test_reference_models():
    assert build_model("mlp", input_shape=(64,), num_classes=10).count_params() == 85_002
    cnn = build_model("digits_cnn", input_shape=(8, 8, 1), num_classes=10)
    assert cnn.count_params() == 151_306  # the model of examples/train_digits.py ("same" padding)
    assert [layer.padding for layer in cnn.layers if isinstance(layer, keras.layers.Conv2D)] == ["same", "same"]
    assert any(isinstance(layer, keras.layers.Dropout) for layer in cnn.layers)
    with pytest.raises(ConfigError, match="H, W >= 2"):
        build_model("digits_cnn", input_shape=(1, 8, 1), num_classes=10)
    with pytest.raises(ConfigError, match="Unknown model name='resnet'"):
        build_model("resnet", input_shape=(8, 8, 1), num_classes=10)


def test_user_caps_bound_the_probes_and_the_plan(strategy):
    with strategy.scope():
        model = _compiled(keras.Sequential([keras.Input((16,)), keras.layers.Dense(10)]))
    batch = (np.ones((64, 16), np.float32), np.zeros((64,), np.int64))
    result = calibrate(model, batch, devices=DEVICES[:2], max_batch_sizes=[20, None], warmup_steps=0, trials=1,
                       store=False, progress=False)
    assert result.profiles[0].max_batch_size == 20
    assert result.profiles[0].probe_batch_sizes[-1] == 20
    assert result.profiles[1].max_batch_size is None
    assert result.profiles[1].probe_batch_sizes[-1] == 64
    assert result.plan.per_replica_batch_sizes[0] <= 20


# ------------------------------------------------------------------------------------------------- injected times
class _ScriptedProbe:
    """Stands in for DeviceProbe: step times come from a true linear model times the host's load at that call.

    ``load(call)`` is a shared clock of calls across all devices, so a busy phase of the host hits whatever device
    happens to be measured then - the situation interleaving is for. No wall clock is read.
    """

    calls = 0
    log: list = []

    def __init__(self, model, sample_batch, *, device, parameter_device, loss, replica_id, emulator):
        self.device = device
        self.replica_id = replica_id
        self.tracks_memory = False

    def memory_limit_bytes(self):
        return None

    def reset_peak_memory(self):
        pass

    def peak_memory_bytes(self):
        return None

    def time_step(self, batch_size, *, warmup_steps=2, trials=5):
        return [self.run_step(batch_size) for _ in range(warmup_steps + trials)][-trials:]

    def run_step(self, batch_size):
        cls = type(self)
        call = cls.calls
        cls.calls += 1
        cls.log.append((self.replica_id, batch_size))
        a_s, c_s = cls.true[self.replica_id]
        # Stepped beside the other cards (the concurrent probe runs each card in a thread of its own): `together`.
        beside = threading.current_thread() is not threading.main_thread()
        return (a_s + c_s * batch_size) * cls.load(call) * (cls.together[self.replica_id] if beside else 1.0)

    def fits(self, batch_size):
        return True


def _scripted(monkeypatch, true, load, together=(1.0, 1.0, 1.0)):
    probe_class = type("Probe", (_ScriptedProbe,), {"calls": 0, "log": [], "true": true, "load": staticmethod(load),
                                                   "together": together})
    monkeypatch.setattr(probe_module, "DeviceProbe", probe_class)
    return probe_class


TRUE_A10_T4_P100 = [(0.005, 1e-4), (0.005, 4e-4), (0.005, 3e-4)]


def test_calibration_times_devices_interleaved_round_robin(monkeypatch, digits_cnn):
    probe_class = _scripted(monkeypatch, TRUE_A10_T4_P100, lambda call: 1.0)
    calibrate(digits_cnn, _digits_batch(16), devices=DEVICES, global_batch_size=GLOBAL_BATCH_SIZE,
              probe_batch_sizes=[4, 64], warmup_steps=1, trials=2, store=False, progress=False)
    warmup = probe_class.log[:6]  # phase 1: one device after another, each size once (warmup_steps=1)
    assert warmup == [(0, 4), (0, 64), (1, 4), (1, 64), (2, 4), (2, 64)]
    first_pass, second_pass = probe_class.log[6:12], probe_class.log[12:18]
    assert first_pass == [(0, 4), (1, 4), (2, 4), (0, 64), (1, 64), (2, 64)]
    assert second_pass == [(1, 4), (2, 4), (0, 4), (1, 64), (2, 64), (0, 64)]  # the device order rotates
    assert len(probe_class.log) == 18 + 24  # 6 warm-up steps, 2 trials x 2 sizes x 3 devices, the concurrent probe
    # Then the concurrent probe: 4 rounds (the first untimed), each card alone at its slice of the plan, then all
    # three at once; every card at one size throughout.
    sizes = {i: {b for j, b in probe_class.log[18:] if j == i} for i in range(3)}
    assert all(len(sizes[i]) == 1 for i in range(3)), sizes


def test_calibration_ends_with_all_cards_at_once_and_solves_the_plan_again_for_their_contention(monkeypatch,
                                                                                               digits_cnn, caplog):
    # Beside the other cards the A10 steps 1.5x slower than alone (it shares the host with them), the others alike.
    _scripted(monkeypatch, TRUE_A10_T4_P100, lambda call: 1.0, together=(1.5, 1.0, 1.0))
    with caplog.at_level("INFO", logger="calibration"):
        result = calibrate(digits_cnn, _digits_batch(16), devices=DEVICES, global_batch_size=GLOBAL_BATCH_SIZE,
                           probe_batch_sizes=[4, 64], warmup_steps=1, trials=2, store=False, progress=False)
    assert result.contention_factors == pytest.approx((1.5, 1.0, 1.0))
    assert result.cost_models[0].predict_step_time_s(64) == pytest.approx(
        1.5 * result.profiles[0].cost_model.predict_step_time_s(64))
    assert result.cost_models[1] is result.profiles[1].cost_model
    alone_plan = solve_batch_split(idle_free([p.cost_model for p in result.profiles]), GLOBAL_BATCH_SIZE,
                                   min_batch_size=0)
    assert result.plan.per_replica_batch_sizes[0] < alone_plan.per_replica_batch_sizes[0]  # solved again
    assert result.plan.predicted_makespan_s > alone_plan.predicted_makespan_s
    assert "x1.500, x1.000, x1.000" in result.format_table()
    assert any("all cards at once" in r.getMessage() for r in caplog.records)
    assert CalibrationResult.from_dict(result.to_dict()) == result


def test_a_busy_phase_of_the_host_does_not_reorder_the_devices(monkeypatch, digits_cnn):
    """Regression (noisy host): a neighbour made the host 3x slower for the first third of the calibration.

    Timed one device after another, the A10 (first) took the whole slowdown and came out slowest; interleaved,
    the slowdown hits every device alike and the ranking and the plan stay right.
    """
    _scripted(monkeypatch, TRUE_A10_T4_P100, lambda call: 3.0 if call < 25 else 1.0)
    result = calibrate(digits_cnn, _digits_batch(16), devices=DEVICES, global_batch_size=GLOBAL_BATCH_SIZE,
                       probe_batch_sizes=[4, 32, 128], warmup_steps=1, trials=5, store=False, progress=False)
    per_example = [p.cost_model.predict_step_time_s(GLOBAL_BATCH_SIZE) for p in result.profiles]
    assert per_example[0] < per_example[2] < per_example[1]  # A10 < P100 < T4
    for profile, (a_s, c_s) in zip(result.profiles, TRUE_A10_T4_P100):
        for b in (8, 64, 100):  # sizes that were never probed
            assert profile.cost_model.predict_step_time_s(b) == pytest.approx(a_s + c_s * b, rel=0.10)
    sizes = result.plan.per_replica_batch_sizes
    assert sizes[0] == max(sizes) and sizes[1] == min(sizes)


def test_noise_is_recorded_and_a_noisy_calibration_repeats_its_trials(monkeypatch, digits_cnn, caplog):
    rng = np.random.default_rng(0)
    jitter = rng.uniform(0.6, 1.4, 10_000)  # +-40 %: far above NOISE_LIMIT
    probe_class = _scripted(monkeypatch, TRUE_A10_T4_P100, lambda call: float(jitter[call]))
    with caplog.at_level("WARNING", logger="calibration"):
        result = calibrate(digits_cnn, _digits_batch(16), devices=DEVICES, global_batch_size=GLOBAL_BATCH_SIZE,
                           probe_batch_sizes=[4, 64], warmup_steps=1, trials=3, store=False, progress=False)
    timed = len(probe_class.log) - 6 - 24  # not the warm-up, nor the concurrent probe
    assert timed == 3 * (3 * 2 * 3)  # MAX_TIMING_ROUNDS rounds of 3 trials x 2 sizes x 3 devices
    assert all(p.relative_noise > 0.10 for p in result.profiles)
    messages = [r.getMessage() for r in caplog.records]
    assert any("repeating the trials (round 2 of at most 3)" in m for m in messages)
    assert any("may be ranked wrongly" in m for m in messages)
    assert result.to_dict()["profiles"][0]["relative_noise"] == result.profiles[0].relative_noise


def test_a_quiet_calibration_records_low_noise_and_does_not_repeat(monkeypatch, digits_cnn):
    rng = np.random.default_rng(1)
    jitter = rng.uniform(0.99, 1.01, 10_000)
    probe_class = _scripted(monkeypatch, TRUE_A10_T4_P100, lambda call: float(jitter[call]))
    result = calibrate(digits_cnn, _digits_batch(16), devices=DEVICES, global_batch_size=GLOBAL_BATCH_SIZE,
                       probe_batch_sizes=[4, 64], warmup_steps=1, trials=3, store=False, progress=False)
    assert len(probe_class.log) - 6 - 24 == 3 * 2 * 3
    assert all(0 < p.relative_noise < 0.02 for p in result.profiles)


def _calibrate_scripted(model, store, **kwargs):
    return calibrate(model, _digits_batch(16), devices=DEVICES, global_batch_size=GLOBAL_BATCH_SIZE,
                     probe_batch_sizes=[4, 32, 128], warmup_steps=1, trials=3, store=store, progress=False, **kwargs)


def test_a_cached_profile_is_checked_and_reused_when_it_fits(monkeypatch, digits_cnn, tmp_path, caplog):
    store = ProfileStore(tmp_path)
    _scripted(monkeypatch, TRUE_A10_T4_P100, lambda call: 1.0)
    first = _calibrate_scripted(digits_cnn, store)
    probe_class = _scripted(monkeypatch, TRUE_A10_T4_P100, lambda call: 2.0)  # the whole host runs 2x slower now
    with caplog.at_level("INFO", logger="calibration"):
        second = _calibrate_scripted(digits_cnn, store)
    assert second.from_cache and second.profiles == first.profiles
    assert len(probe_class.log) == 3 + 3 * 3  # one warm-up and CHECK_TRIALS timed steps per device, nothing more
    assert any("checked against a few timed steps" in r.getMessage() for r in caplog.records)


def test_a_cached_profile_that_no_longer_fits_is_recalibrated_and_replaced(monkeypatch, digits_cnn, tmp_path, caplog):
    """Regression (profile cached from a busy host): the cache says replica 0 is slow; in truth it is the fastest."""
    store = ProfileStore(tmp_path)
    busy_truth = [(0.005, 5e-4), (0.005, 4e-4), (0.005, 3e-4)]
    _scripted(monkeypatch, busy_truth, lambda call: 1.0)
    stale = _calibrate_scripted(digits_cnn, store)
    _scripted(monkeypatch, TRUE_A10_T4_P100, lambda call: 1.0)
    with caplog.at_level("WARNING", logger="calibration"):
        fresh = _calibrate_scripted(digits_cnn, store)
    assert not fresh.from_cache and fresh.profiles != stale.profiles
    assert fresh.plan.per_replica_batch_sizes[0] == max(fresh.plan.per_replica_batch_sizes)
    warning = next(r.getMessage() for r in caplog.records if "no longer fits" in r.getMessage())
    assert "replica 0 (/device:CPU:1)" in warning and "Recalibrating" in warning
    _scripted(monkeypatch, TRUE_A10_T4_P100, lambda call: 1.0)
    assert _calibrate_scripted(digits_cnn, store).from_cache  # the entry was replaced by the fresh profile


def test_check_cached_false_trusts_the_cache_without_timing(monkeypatch, digits_cnn, tmp_path):
    store = ProfileStore(tmp_path)
    _scripted(monkeypatch, TRUE_A10_T4_P100, lambda call: 1.0)
    _calibrate_scripted(digits_cnn, store)
    probe_class = _scripted(monkeypatch, [(0.005, 5e-4)] * 3, lambda call: 1.0)
    assert _calibrate_scripted(digits_cnn, store, check_cached=False).from_cache
    assert probe_class.log == []


# ----------------------------------------------------------------------------------------------------------------
# A probe step that fails: the data, or the device
# ----------------------------------------------------------------------------------------------------------------
def _classifier(strategy, classes=3):
    with strategy.scope():
        return _compiled(keras.Sequential([keras.Input((4,)), keras.layers.Dense(classes)]))


def test_regression_a_bad_label_in_the_calibration_batch_blames_the_data_not_the_device(strategy):
    # It said "The probe step failed on device='/device:CPU:1' ... Check that the model runs on this device".
    x = np.ones((8, 4), np.float32)
    y = np.zeros(8, np.int64)
    y[5] = 7
    with pytest.raises(CalibrationError, match=r"data is at fault, not device=.*labels y hold \[7\] at examples "
                                               r"\[5\]; valid labels are 0\.\.2 \(the model has 3 outputs\)") as info:
        calibrate(_classifier(strategy), (x, y), devices=DEVICES, probe_batch_sizes=[2, 8], warmup_steps=0,
                  trials=1, store=False, progress=False)
    assert "Received a label value of 7" in str(info.value) and "\n" not in str(info.value)
    assert isinstance(info.value.__cause__, tf.errors.InvalidArgumentError)


def test_a_negative_label_blames_the_data(strategy):
    x = np.ones((4, 4), np.float32)
    y = np.array([0, -1, 2, 1], np.int64)
    with pytest.raises(CalibrationError, match=r"labels y hold \[-1\] at examples \[1\]"):
        calibrate(_classifier(strategy), (x, y), devices=DEVICES[:1], probe_batch_sizes=[4], warmup_steps=0,
                  trials=1, store=False, progress=False)


def test_a_failure_the_data_does_not_explain_names_the_device(strategy):
    probe = DeviceProbe(_classifier(strategy), (np.ones((4, 4), np.float32), np.array([0, 1, 2, 1])),
                        device=DEVICES[1])
    failure = tf.errors.InternalError(None, None, "Graph execution error:\n\nkernel launch failed\n\t [[{{node x}}]]")
    error = probe.step_error(failure, 4)
    assert isinstance(error, CalibrationError)
    assert str(error).startswith(f"The probe step failed on device={DEVICES[1]!r} at batch_size=4: InternalError: "
                                 "kernel launch failed. Check that the model runs on this device")


def test_a_bad_label_in_the_first_batch_of_fit_blames_the_data(tmp_path):
    from hetero_cs import HeteroCentralStorageStrategy

    hetero = HeteroCentralStorageStrategy(DEVICES, profile_cache=tmp_path, guard=False)
    x = np.ones((12, 4), np.float32)
    y = np.zeros(12, np.int64)
    y[2] = 3
    with pytest.raises(CalibrationError, match=r"data is at fault.*labels y hold \[3\] at examples \[2\]"):
        _classifier(hetero).fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)


@pytest.mark.parametrize("kind", ["not_utf8", "nested_thousands_deep", "int_too_large", "fifo"])
def test_regression_an_unreadable_cache_entry_is_one_warning_a_fresh_calibration_and_replaced(tmp_path, strategy,
                                                                                               kind):
    # Some of these raised UnicodeDecodeError, RecursionError or OverflowError out of calibration (and model.fit),
    # and the file was never replaced, so every later run failed too.
    import os
    import re
    import warnings

    with strategy.scope():
        model = _compiled(keras.Sequential([keras.Input((16,)), keras.layers.Dense(10)]))
    batch = (np.ones((16, 16), np.float32), np.zeros((16,), np.int64))
    kwargs = dict(devices=DEVICES[:2], probe_batch_sizes=[1, 16], warmup_steps=0, trials=1,
                  store=ProfileStore(tmp_path), progress=False)
    first = calibrate(model, batch, **kwargs)
    (entry,) = tmp_path.glob("*.json")
    text = entry.read_text()
    entry.unlink()
    if kind == "fifo":
        os.mkfifo(entry)
    else:
        too_large = re.sub(r'"wall_time_s": [^,\n]+', '"wall_time_s": 1' + "0" * 400, text)
        assert too_large != text
        entry.write_bytes({"not_utf8": b"\xff\xfe" + text.encode(), "nested_thousands_deep": b"[" * 50_000,
                           "int_too_large": too_large.encode()}[kind])
    with pytest.warns(UserWarning, match="unusable profile cache file") as record:
        second = calibrate(model, batch, **kwargs)
    assert len(record) == 1
    assert not second.from_cache and second.devices == first.devices  # calibrated afresh
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_result_file(entry) == second  # replaced by a good entry
    assert sorted(p.name for p in tmp_path.iterdir()) == [entry.name]  # and nothing else left behind


def test_caps_lowered_at_run_time_are_written_back_beside_a_card_calibrated_at_zero(tmp_path):
    # A card calibrated at 0 (it holds no example) keeps 0; another's lowered cap is written; a 0 in force that
    # calibration did not find (a card set aside after a device error) leaves that card's profile cap as it was.
    from types import SimpleNamespace

    from calibration.result import CalibrationResult, DeviceProfile
    from calibration.store import ProfileStore
    from hetero_cs.engine.calibrating import write_back_caps
    from hetero_cs.planning.cost_model import LinearCostModel, OutOfMemoryCostModel

    def timed(device, cap):
        return DeviceProfile(device=device, cost_model=LinearCostModel(0.01, 1e-4), max_batch_size=cap,
                             fit_error=0.0, probe_batch_sizes=(1, 8), median_step_times_s=(0.01, 0.0108),
                             mad_s=(0.0, 0.0))

    idle = DeviceProfile(device="/device:CPU:3", cost_model=OutOfMemoryCostModel(), max_batch_size=0,
                         fit_error=0.0, probe_batch_sizes=(), median_step_times_s=(), mad_s=())
    store = ProfileStore(tmp_path)
    result = CalibrationResult(profiles=(timed("/device:CPU:1", None), timed("/device:CPU:2", None), idle),
                               wall_time_s=1.0, emulated=False, plan=None, cache_key="a" * 64)
    store.save(result.cache_key, result)
    strategy = SimpleNamespace(_calibration=result, _balancer=SimpleNamespace(max_batch_sizes=[0, 6, 0]),
                               _profile_cache=str(tmp_path))
    write_back_caps(strategy)
    assert store.load(result.cache_key).max_batch_sizes == (None, 6, 0)
    assert strategy._calibration.max_batch_sizes == (None, 6, 0)
