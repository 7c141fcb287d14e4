"""A step that fails inside one replica changes nothing, and the error names the replica and its device."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import hetero_cs

from hetero_cs import HeteroCentralStorageStrategy, ReplicaStepError


class RejectNaN(keras.layers.Layer):
    def call(self, x):
        return tf.debugging.check_numerics(x, "non-finite input")


class FailsInBackward(keras.layers.Layer):
    """Identity forward; the backward pass fails on a slice holding a value above 50.

    The layers after it already have their gradients, in every replica, when the failure comes: their updates must
    still not be applied.
    """

    def call(self, x):
        @tf.custom_gradient
        def identity(t):
            def grad(upstream):
                bad = tf.reduce_any(tf.abs(t) > 50.0)
                return tf.debugging.check_numerics(tf.where(bad, np.inf, 1.0) * upstream, "bad backward")

            return tf.identity(t), grad

        return identity(x)


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])  # AdamW: its weight decay must wait for the barrier too
@pytest.mark.parametrize("bad_index,replica,device", [(5, 1, "/device:CPU:2"), (1, 0, "/device:CPU:1")])
def test_failed_replica_step_leaves_state_and_names_the_replica(bad_index, replica, device, optimizer):
    strategy = HeteroCentralStorageStrategy(
        ["/cpu:1", "/cpu:2", "/cpu:3"], batch_split=[4, 4, 2], rebalance=False, profile_cache=False
    )
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), RejectNaN(), keras.layers.Dense(1)])
        opt = keras.optimizers.AdamW(0.01, weight_decay=0.5) if optimizer == "adamw" else "adam"
        model.compile(optimizer=opt, loss="mse")
    x = np.ones((10, 3), np.float32)
    y = np.ones((10, 1), np.float32)
    model.fit(x, y, batch_size=10, epochs=2, verbose=0)
    before = [v.numpy() for v in [*model.variables, *model.optimizer.variables]]

    x_bad = x.copy()
    x_bad[bad_index] = np.nan  # slices [0, 4), [4, 8), [8, 10)
    with pytest.raises(ReplicaStepError, match=f"replica {replica} on {device}.*non-finite input") as info:
        model.fit(x_bad, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
    assert info.value.replica_id == replica and info.value.device == device
    assert isinstance(info.value.__cause__, tf.errors.InvalidArgumentError)

    after = [v.numpy() for v in [*model.variables, *model.optimizer.variables]]
    for path, a, b in zip([v.path for v in [*model.variables, *model.optimizer.variables]], before, after):
        np.testing.assert_array_equal(a, b, err_msg=path)  # iteration counter included


@pytest.mark.parametrize("bad_index,replica", [(5, 1), (9, 2)])
def test_an_eager_step_names_the_replica_that_failed(bad_index, replica):
    # Eagerly no op carries a "replica_<i>/" scope; the replica function itself says which replica raised.
    strategy = HeteroCentralStorageStrategy(
        ["/cpu:1", "/cpu:2", "/cpu:3"], batch_split=[4, 4, 2], rebalance=False, profile_cache=False
    )
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), RejectNaN(), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    x = np.ones((10, 3), np.float32)
    x[bad_index] = np.nan  # slices [0, 4), [4, 8), [8, 10)
    before = [v.numpy() for v in model.variables]
    with pytest.raises(ReplicaStepError, match=f"replica {replica} on /device:CPU:{replica + 1}.*non-finite input"):
        model.fit(x, np.ones((10, 1), np.float32), batch_size=10, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(before, [v.numpy() for v in model.variables]):
        np.testing.assert_array_equal(a, b)


def test_the_failing_op_names_the_replica_even_behind_other_scopes():
    strategy = HeteroCentralStorageStrategy(
        ["/cpu:1", "/cpu:2", "/cpu:3"], batch_split=[4, 4, 2], rebalance=False, profile_cache=False
    )
    strategy.plan_for(10)  # the plan [4, 4, 2]
    message = (
        "Graph execution error:\n\nDetected at node sequential/conv2d/BiasAdd defined at ...\n"
        "input depth must be evenly divisible by filter depth: 1 vs 32\n"
        "\t [[{{node gradient_tape/replica_2/sequential/conv2d/Conv2DBackpropFilter}}]]"
    )
    error = strategy._replica_step_error(tf.errors.InvalidArgumentError(None, None, message))  # noqa: SLF001
    assert isinstance(error, ReplicaStepError)
    assert (error.replica_id, error.device) == (2, "/device:CPU:3")
    assert "filter depth: 1 vs 32" in str(error) and "plan: [4, 4, 2]" in str(error)


def test_a_partial_batch_smaller_than_r_warns_and_a_failure_it_causes_is_explained(caplog):
    # 257 examples in batches of 256: the last batch holds 1 example, so two of the three replicas get none. Some
    # TF kernels (Conv2D with oneDNN on CPU) fail on 0-example inputs; the step then fails with advice, not a bare
    # TF error. If the kernel copes, training goes on and only the warning remains.
    strategy = HeteroCentralStorageStrategy(
        ["/cpu:1", "/cpu:2", "/cpu:3"], auto_balance=False, rebalance=False, profile_cache=False
    )
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((6, 6, 1)), keras.layers.Conv2D(4, 3), keras.layers.Flatten(), keras.layers.Dense(2)
        ])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(257, 6, 6, 1)).astype(np.float32)
    y = rng.integers(0, 2, size=(257,)).astype(np.int64)
    with caplog.at_level("INFO", logger="hetero_cs.engine.central_storage"):
        try:
            model.fit(x, y, batch_size=256, epochs=1, shuffle=False, verbose=0)
        except ReplicaStepError as error:
            assert error.replica_id in (1, 2)  # the replicas with 0 examples
            assert "gets 0 examples of a global batch of 1 (cut [1, 0, 0]" in str(error)
            assert "drop_remainder=True" in str(error)
    warnings = [r.getMessage() for r in caplog.records if "get 0 examples" in r.getMessage()]
    assert len(warnings) == 1 and "cut [1, 0, 0]: replica(s) [1, 2] get 0 examples and do no work" in warnings[0]


def test_a_failed_sum_over_the_replicas_names_the_replica_with_an_empty_slice_not_replica_0():
    # A sum over the replicas runs on the parameter device under the first replica's name scope, where replica 0's
    # ops sit too: its error used to blame replica 0 ("plan: [2, 2, 2]"), whatever fed it. Here oneDNN gives the
    # empty slice's Conv2D output a wrong shape, and BatchNormalization's statistics sum fails on the host.
    strategy = HeteroCentralStorageStrategy(
        ["/cpu:1", "/cpu:2", "/cpu:3"], auto_balance=False, rebalance=False, profile_cache=False
    )
    with strategy.scope():
        model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3), keras.layers.BatchNormalization(),
                                  keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(14, 8, 8, 3)).astype(np.float32)
    y = rng.integers(0, 2, size=(14,)).astype(np.int64)
    try:
        model.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)  # 6, 6, 2: the last batch cut [1, 1, 0]
    except ReplicaStepError as error:
        assert (error.replica_id, error.device) == (2, "/device:CPU:3")
        assert "failed in a sum over the replicas" in str(error)
        assert "0 examples of a global batch of 2 (cut [1, 1, 0]" in str(error) and "drop_remainder" in str(error)
    else:
        pytest.skip("this TensorFlow build runs Conv2D on an empty slice; nothing failed")


def test_a_failed_sum_over_the_replicas_without_an_empty_slice_names_no_replica():
    strategy = HeteroCentralStorageStrategy(
        ["/cpu:1", "/cpu:2", "/cpu:3"], batch_split=[4, 4, 2], rebalance=False, profile_cache=False
    )
    strategy.plan_for(10)
    message = ("Graph execution error:\n\nInputs to operation AddN of type AddN must have the same size and shape.  "
               "Input 0: [4] != input 1: [3]\n\t [[{{node sequential/dense/hetero_cross_replica/AddN}}]]")
    error = strategy._replica_step_error(tf.errors.InvalidArgumentError(None, None, message))  # noqa: SLF001
    assert isinstance(error, ReplicaStepError) and error.replica_id is None
    assert "sum over the replicas" in str(error) and "plan: [4, 4, 2]" in str(error)


@pytest.mark.parametrize("trial", range(2))
def test_a_replica_failing_in_its_backward_pass_applies_no_update(trial):
    strategy = HeteroCentralStorageStrategy(
        ["/cpu:1", "/cpu:2", "/cpu:3"], batch_split=[4, 4, 2], rebalance=False, profile_cache=False
    )
    x = np.ones((10, 3), np.float32)
    y = np.ones((10, 1), np.float32)
    for bad_index in (1, 5, 9):  # one in each slice [0, 4), [4, 8), [8, 10)
        with strategy.scope():
            model = keras.Sequential([
                keras.Input((3,)),
                keras.layers.Dense(3, kernel_initializer="ones"),
                FailsInBackward(),
                keras.layers.Dense(1),
            ])
            model.compile(optimizer="adam", loss="mse")
        model.fit(x, y, batch_size=10, epochs=1, verbose=0)
        before = [v.numpy() for v in [*model.trainable_variables, *model.optimizer.variables]]
        x_bad = x.copy()
        x_bad[bad_index] = 1000.0
        with pytest.raises(ReplicaStepError, match="bad backward"):
            model.fit(x_bad, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
        after = [v.numpy() for v in [*model.trainable_variables, *model.optimizer.variables]]
        for a, b in zip(before, after):
            np.testing.assert_array_equal(a, b)


def test_a_nan_batch_does_not_poison_the_logged_loss_of_later_runs():
    # Keras resets its metrics (assign 0) outside any strategy scope; that must be a plain assign, not a delta
    # (NaN + (0 - NaN) stays NaN, and every later fit and evaluate logged loss NaN).
    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2"], batch_split=[1, 1], profile_cache=False)
    rng = np.random.default_rng(0)
    x = rng.random((64, 8)).astype(np.float32)
    y = (x.sum(1) > 4).astype(np.int32)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = model.evaluate(x, y, batch_size=32, verbose=0)
    x_bad = x.copy()
    x_bad[3] = np.inf
    assert np.isnan(model.evaluate(x_bad, y, batch_size=32, verbose=0))
    assert model.evaluate(x, y, batch_size=32, verbose=0) == pytest.approx(before, rel=1e-6)
    assert np.isfinite(model.fit(x, y, batch_size=32, verbose=0).history["loss"][-1])


class FailsAfterTheOthersReported(keras.layers.Layer):
    """Identity, except in a slice holding a NaN: there it waits until every other replica has reported its step
    time, then fails. So the failed step leaves reports of some replicas only, every time (no race)."""

    def __init__(self, others_reported, **kwargs):
        super().__init__(**kwargs)
        self.others_reported = others_reported

    def call(self, x):
        def gate(values):
            if np.isnan(values).any():
                if not self.others_reported.wait(120):  # generous: only a hang would reach it
                    raise RuntimeError("the other replicas never reported")
                raise ValueError("a failing replica, after the others reported")
            return values

        y = tf.numpy_function(gate, [x], tf.float32, stateful=False)
        y.set_shape(x.shape)
        return hetero_cs.per_example(y)  # the gate returns each row as it is (hetero_cs cannot read Python code)


@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_a_caught_failed_step_leaves_the_monitor_aligned(loop, monkeypatch):
    # Issue 30, bug 3: replicas 0 and 2 report the failed step, replica 1 never does. Without step keys the next
    # step's report of replica 1 paired with the failed step's reports of replicas 0 and 2: a step (4, 8, 2).
    import threading


    monkeypatch.setenv("HETERO_CS_TIMING", "1")  # time every step (no sampling, no emulator)
    strategy = HeteroCentralStorageStrategy(
        ["/cpu:1", "/cpu:2", "/cpu:3"], batch_split=[2, 2, 1], rebalance=False, profile_cache=False
    )
    others_reported = threading.Event()
    reporters = set()
    record = strategy._record_step_time  # noqa: SLF001

    def record_and_note(replica_id, *args, **kwargs):
        record(replica_id, *args, **kwargs)
        if replica_id != 1:
            reporters.add(replica_id)
            if reporters == {0, 2}:
                others_reported.set()

    monkeypatch.setattr(strategy, "_record_step_time", record_and_note)  # read when the step is traced
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), FailsAfterTheOthersReported(others_reported),
                                  keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.01)
        model.compile(optimizer=optimizer, loss="mse")
    loss_fn = keras.losses.MeanSquaredError(reduction=None)

    @tf.function
    def train_step(iterator):
        def step_fn(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(
                    loss_fn(yb, model(xb, training=True)), global_batch_size=hetero_cs.current_global_batch_size())
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        strategy.run(step_fn, args=next(iterator))

    def train(x, batch_size):
        y = np.ones((len(x), 1), np.float32)
        if loop == "fit":
            model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
        else:
            dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
            train_step(iter(strategy.experimental_distribute_dataset(dataset)))

    x = np.ones((10, 3), np.float32)
    train(x, 10)  # one step cut [4, 4, 2]
    reporters.clear()
    others_reported.clear()
    x_bad = x.copy()
    x_bad[5] = np.nan  # in replica 1's slice [4, 8)
    with pytest.raises((ReplicaStepError, tf.errors.OpError), match="after the others reported"):
        train(x_bad, 10)
    assert reporters == {0, 2}  # the failed step left a partial step behind
    x20 = np.ones((20, 3), np.float32)
    train(x20, 20)  # cut [8, 8, 4]
    assert strategy.monitor.last_step().per_replica_batch_sizes == (8, 8, 4)
    train(x20, 20)
    window = strategy.monitor.window()
    assert [s.per_replica_batch_sizes for s in window] == [(4, 4, 2), (8, 8, 4), (8, 8, 4)]
    assert strategy.monitor.completed_steps == 3


def test_regression_a_label_out_of_range_is_not_blamed_on_an_empty_slice_of_another_step():
    # The error of a step whose slices all held examples came with the advice for a 0-example slice, because an
    # earlier cut (here the last partial batch of the epoch before) left that replica none.
    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2", "/cpu:3"], batch_split=[2, 1, 1],
                                            rebalance=False, profile_cache=False)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(85, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=(85,)).astype(np.int64)
    model.fit(x, y, batch_size=84, epochs=1, shuffle=False, verbose=0)  # the last batch of 1 is cut [1, 0, 0]
    y[42:63] = 7  # out of range in replica 1's slice of 21 (replica 0 holds the first 42 examples)
    with pytest.raises(ReplicaStepError) as caught:
        model.fit(x[:84], y[:84], batch_size=84, epochs=1, shuffle=False, verbose=0)
    assert "0 examples" not in str(caught.value) and "oneDNN" not in str(caught.value), str(caught.value)
    assert caught.value.replica_id == 1 and "plan: [42, 21, 21]" in str(caught.value)
