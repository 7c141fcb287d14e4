"""Mixed precision under HeteroCentralStorageStrategy, against the oracle: one device, whole batch, Keras' own
LossScaleOptimizer.

Dynamic loss scaling must take the same skip decisions and follow the same scale trajectory as on one device; an
overflow (an example whose input is beyond float16's range, so its forward pass gives inf) in any one replica's
slice skips the step. Weights are compared within float16 tolerance: a slice sums its examples' float16 products
in another order than the whole batch does.
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import hetero_cs
from hetero_cs import HeteroCentralStorageStrategy
from hetero_cs.errors import ConfigError

B = 10
STEPS = 7
GROWTH_STEPS = 2
INITIAL_SCALE = 2.0**10
FP16_ATOL = 2e-4  # measured: at most 3e-5 apart after 7 Adam steps of lr 0.01 (float16 sums in another order)
OVERFLOW = 1e6  # beyond float16's largest finite value (65504): the example's float16 input is inf

_STRATEGIES: dict[int, HeteroCentralStorageStrategy] = {}


def strategy_for(shares) -> HeteroCentralStorageStrategy:
    """One strategy per replica count for the module, re-split with set_batch_split."""
    if len(shares) not in _STRATEGIES:
        devices = [f"/cpu:{i}" for i in range(1, len(shares) + 1)]
        _STRATEGIES[len(shares)] = HeteroCentralStorageStrategy(
            devices, auto_balance=False, rebalance=False, batch_split=shares, profile_cache=False)
    strategy = _STRATEGIES[len(shares)]
    strategy.set_batch_split(shares)
    return strategy


@contextlib.contextmanager
def global_policy(name: str):
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(previous)


def make_model(seed: int = 0):
    return keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(8, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(seed)),
        keras.layers.Dense(3, kernel_initializer=keras.initializers.GlorotUniform(seed + 1)),
    ])


def scaled_adam(inner: str = "adam"):
    # AdamW: decoupled weight decay must be skipped with the rest of a non-finite step, as on one device.
    optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.2) if inner == "adamw" else keras.optimizers.Adam(0.01)
    return keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=INITIAL_SCALE,
                                               dynamic_growth_steps=GROWTH_STEPS)


def data_with_overflows(overflow_at: dict[int, int], seed: int = 0):
    """STEPS global batches of B examples; ``overflow_at`` maps a step to the example (in its batch) that overflows."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(STEPS * B, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=(STEPS * B,)).astype(np.int32)
    for step, example in overflow_at.items():
        x[step * B + example, 0] = OVERFLOW
    return x, y


def slice_starts(shares):
    return np.concatenate([[0], np.cumsum(shares)[:-1]]).astype(int)


def overflows_in_each_replica(shares, first_step=1, every=2):
    """Step -> example: an overflow in replica 0's slice, then replica 1's, ... (replicas with examples only)."""
    starts = slice_starts(shares)
    targets = [starts[i] + shares[i] - 1 for i in range(len(shares)) if shares[i] > 0]
    return {first_step + every * k: example for k, example in enumerate(targets)}


class ScaleRecorder(keras.callbacks.Callback):
    """The loss scale, its counter and the iteration counter after every batch."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self.model.optimizer
        self.rows.append((float(optimizer.dynamic_scale.numpy()), int(optimizer.step_counter.numpy()),
                          int(optimizer.iterations.numpy())))


def fit_run(model, x, y):
    recorder = ScaleRecorder()
    history = model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    return recorder.rows, history.history["loss"][0]


def assert_same_state(model, reference):
    for w, ref in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(w, ref, atol=FP16_ATOL)
    inner, ref_inner = model.optimizer.inner_optimizer, reference.optimizer.inner_optimizer
    for v, ref in zip(inner.variables, ref_inner.variables):
        np.testing.assert_allclose(np.asarray(v), np.asarray(ref), atol=FP16_ATOL)


@pytest.mark.parametrize("shares, inner", [([5, 3, 2], "adam"), ([6, 0, 4], "adam"),
                                           pytest.param([2, 5, 3], "adamw", marks=pytest.mark.slow)])
def test_fit_loss_scaling_matches_one_device_with_an_overflow_in_each_replica(shares, inner):
    overflow_at = overflows_in_each_replica(shares)
    x, y = data_with_overflows(overflow_at)
    with global_policy("mixed_float16"):
        reference = make_model()
        reference.compile(optimizer=scaled_adam(inner),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        expected_rows, _ = fit_run(reference, x, y)
        strategy = strategy_for(shares)
        with strategy.scope():
            model = make_model()
            model.compile(optimizer=scaled_adam(inner),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        rows, _ = fit_run(model, x, y)
    assert strategy.plan.per_replica_batch_sizes == tuple(shares)
    # The overflow steps were skipped on one device: the iteration counter stands still there, and the scale halves.
    skipped = [i for i in range(STEPS) if i in overflow_at]
    assert [expected_rows[i][2] - (expected_rows[i - 1][2] if i else 0) for i in skipped] == [0] * len(skipped)
    assert rows == expected_rows  # same skip decisions, same scale trajectory, same counters
    assert_same_state(model, reference)


@pytest.mark.parametrize("run_eagerly", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_compile_wraps_the_optimizer_automatically_and_trains_like_one_device(run_eagerly):
    # global_clipnorm: clipping must see the unscaled summed gradient (the scaled one is ~2**15 times larger).
    x, y = data_with_overflows({2: 1})
    with global_policy("mixed_float16"):
        reference = make_model()
        reference.compile(optimizer=keras.optimizers.Adam(0.01, global_clipnorm=0.05),
                          loss="sparse_categorical_crossentropy")
        expected_rows, expected_loss = fit_run(reference, x, y)
        strategy = strategy_for([6, 3, 1])
        with strategy.scope():
            model = make_model()
            model.compile(optimizer=keras.optimizers.Adam(0.01, global_clipnorm=0.05),
                          loss="sparse_categorical_crossentropy", run_eagerly=run_eagerly)
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        rows, loss = fit_run(model, x, y)
    assert rows == expected_rows
    assert rows[2][0] == rows[1][0] / 2  # the overflow halved Keras' default scale 2**15
    for variable in (model.optimizer.dynamic_scale, model.optimizer.step_counter):  # once, on the parameter device
        local = strategy.experimental_local_results(variable.value)
        assert len(local) == 1 and "CPU:0" in local[0].device
    assert_same_state(model, reference)
    np.testing.assert_equal(np.isfinite(loss), np.isfinite(expected_loss))


def custom_loop_run(strategy, x, y, shares):
    """A custom loop with the documented loss-scaling idiom; returns (scale, counter, iterations) per step."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    context = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with context:
        model = make_model()
        optimizer = scaled_adam()
        optimizer.build(model.trainable_variables)

    def step_fn(xb, yb):
        with tf.GradientTape() as tape:
            per_example = loss_fn(yb, model(xb, training=True))
            if strategy is None:
                loss = tf.reduce_mean(per_example)
            else:
                loss = tf.nn.compute_average_loss(per_example,
                                                  global_batch_size=hetero_cs.current_global_batch_size())
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
    if strategy is None:
        step, iterator = tf.function(step_fn), iter(dataset)
        run = lambda: step(*next(iterator))  # noqa: E731
    else:
        iterator = iter(strategy.experimental_distribute_dataset(dataset))

        @tf.function
        def run_distributed():
            return strategy.reduce("SUM", strategy.run(step_fn, args=next(iterator)), axis=None)

        run = run_distributed
    rows = []
    for _ in range(STEPS):
        run()
        rows.append((float(optimizer.dynamic_scale.numpy()), int(optimizer.step_counter.numpy()),
                     int(optimizer.iterations.numpy())))
    return model, optimizer, rows


def test_custom_loop_loss_scaling_matches_one_device_with_an_overflow_in_each_replica():
    shares = [2, 5, 3]
    overflow_at = overflows_in_each_replica(shares)
    x, y = data_with_overflows(overflow_at, seed=1)
    with global_policy("mixed_float16"):
        reference, ref_optimizer, expected_rows = custom_loop_run(None, x, y, shares)
        model, optimizer, rows = custom_loop_run(strategy_for(shares), x, y, shares)
    assert rows == expected_rows
    assert [row[2] for row in rows] == [1, 1, 2, 2, 3, 3, 4]  # steps 1, 3, 5 skipped
    for w, ref in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(w, ref, atol=FP16_ATOL)
    for v, ref in zip(optimizer.inner_optimizer.variables, ref_optimizer.inner_optimizer.variables):
        np.testing.assert_allclose(np.asarray(v), np.asarray(ref), atol=FP16_ATOL)


def test_mixed_bfloat16_fit_matches_one_device():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(4 * B, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=(4 * B,)).astype(np.int32)
    with global_policy("mixed_bfloat16"):
        reference = make_model()
        reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
        reference.fit(x, y, batch_size=B, shuffle=False, verbose=0)
        strategy = strategy_for([7, 0, 3])
        with strategy.scope():
            model = make_model()
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
        assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    for w, ref in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(w, ref, atol=1e-2)  # bfloat16 keeps 8 bits of mantissa


def test_mixed_bfloat16_on_an_emulated_t4_is_refused_at_fit():
    x, y = data_with_overflows({})
    with global_policy("mixed_bfloat16"):
        strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2"], emulate=["A10", "T4"], auto_balance=False,
                                                rebalance=False, profile_cache=False)
        with strategy.scope():
            model = make_model()
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        with pytest.raises(hetero_cs.UnsupportedPrecisionError, match="T4 has no bfloat16"):
            model.fit(x[:B], y[:B], batch_size=B, verbose=0)


def test_mixed_bfloat16_on_a_real_gpu_without_bf16_is_refused(monkeypatch):
    from hetero_cs.devices import discovery
    from hetero_cs.engine import calibrating

    t4 = discovery.DeviceInfo(name="/device:GPU:1", device_type="GPU", description="Tesla T4",
                              compute_capability=(7, 5))
    monkeypatch.setattr(discovery, "discover_devices", lambda: [t4])
    fake_strategy = type("FakeStrategy", (), {"_compute_devices": ("/device:GPU:0", "/device:GPU:1")})()
    with global_policy("mixed_bfloat16"):
        model = make_model()
    with pytest.raises(hetero_cs.UnsupportedPrecisionError, match=r"GPU:1 \(compute capability 7.5\)"):
        calibrating.check_policy_support(fake_strategy, model)
    with global_policy("mixed_float16"):
        calibrating.check_policy_support(fake_strategy, make_model())  # float16 runs on a T4


def test_a_profile_measured_under_one_policy_never_serves_another(tmp_path, monkeypatch):
    import importlib

    from calibration import calibrate

    calibrate_module = importlib.import_module("calibration.calibrate")  # the package exports a function of that name
    from calibration.store import ProfileStore

    policies = []
    real_key = calibrate_module.profile_key

    def recording_key(**kwargs):
        policies.append(kwargs["dtype_policy"])
        return real_key(**kwargs)

    monkeypatch.setattr(calibrate_module, "profile_key", recording_key)
    x, y = data_with_overflows({})
    kwargs = dict(devices=["/device:CPU:1", "/device:CPU:2"], probe_batch_sizes=[1, 4, 8], warmup_steps=1, trials=1,
                  store=ProfileStore(tmp_path), progress=False,
                  check_cached=False)  # a hit is not re-timed: a busy host could make the check recalibrate
    for policy in ("float32", "mixed_float16", "float32"):
        with global_policy(policy):
            model = make_model()
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
            result = calibrate(model, (x[:8], y[:8]), **kwargs)
        assert result.from_cache == (len(policies) == 3)  # the third run (float32 again) hits the first's entry
    assert policies == ["float32", "mixed_float16", "float32"]
    assert len(list(tmp_path.glob("*.json"))) == 2


@pytest.mark.slow
def test_several_steps_per_execution_skip_like_one_device():
    # Keras runs the steps of one execution inside one tf.function (a loop): each step is judged on its own.
    shares = [5, 3, 2]
    x, y = data_with_overflows(overflows_in_each_replica(shares))

    def final_state(model):
        optimizer = model.optimizer
        return float(optimizer.dynamic_scale.numpy()), int(optimizer.step_counter.numpy()), int(
            optimizer.iterations.numpy())

    with global_policy("mixed_float16"):
        reference = make_model()
        reference.compile(optimizer=scaled_adam(), loss="sparse_categorical_crossentropy")
        reference.fit(x, y, batch_size=B, shuffle=False, verbose=0)
        strategy = strategy_for(shares)
        with strategy.scope():
            model = make_model()
            model.compile(optimizer=scaled_adam(), loss="sparse_categorical_crossentropy", steps_per_execution=3)
        model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert final_state(model) == final_state(reference)
    assert final_state(model)[2] == STEPS - 3
    assert_same_state(model, reference)


def test_a_failed_replica_step_under_loss_scaling_changes_nothing():
    # The loss-scaled update and the scale's own update wait for every replica's gradients (the failure barrier).
    class RejectNaN(keras.layers.Layer):
        def call(self, x):
            return tf.debugging.check_numerics(x, "non-finite input")

    with global_policy("mixed_float16"):
        strategy = strategy_for([4, 4, 2])
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), RejectNaN(), keras.layers.Dense(1)])
            model.compile(optimizer=scaled_adam(), loss="mse")
        x, y = np.ones((10, 3), np.float32), np.ones((10, 1), np.float32)
        model.fit(x, y, batch_size=10, epochs=2, verbose=0)
        state = [*model.variables, *model.optimizer.variables]
        before = [v.numpy() for v in state]
        x[5] = np.nan  # replica 1's slice
        with pytest.raises(hetero_cs.ReplicaStepError, match="replica 1 on /device:CPU:2"):
            model.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
    for variable, value in zip(state, before):
        np.testing.assert_array_equal(variable.numpy(), value, err_msg=variable.path)  # scale and counters included


def test_loss_scaling_is_refused_under_the_multi_worker_strategy_instead_of_hanging():
    # An overflow in one worker's slice made that worker skip the gradient all-reduce the others waited in.
    from hetero_cs.engine._compat.multi_worker import _refuse_loss_scaling

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD()), loss="mse")
    with pytest.raises(ConfigError, match="Loss scaling .* is not supported under HeteroMultiWorkerMirroredStrategy"):
        _refuse_loss_scaling(model)
    model.compile(optimizer="sgd", loss="mse")
    _refuse_loss_scaling(model)  # no loss scaling: nothing to refuse
