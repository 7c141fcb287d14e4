"""Custom loops (strategy.run), metrics, reductions and checkpoints under HeteroCentralStorageStrategy."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import hetero_cs
from hetero_cs import HeteroCentralStorageStrategy


@pytest.fixture(scope="module")
def strategy3():
    return HeteroCentralStorageStrategy(
        ["/cpu:1", "/cpu:2", "/cpu:3"], auto_balance=False, rebalance=False, batch_split=[5, 3, 2], profile_cache=False
    )


def make_model(seed=0):
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu", kernel_initializer=keras.initializers.GlorotUniform(seed)),
            keras.layers.Dense(3, kernel_initializer=keras.initializers.GlorotUniform(seed + 1)),
        ]
    )


def data(n=47, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=(n,)).astype(np.int32)
    return x, y


@pytest.mark.parametrize("global_batch_size", ["given", "left_out"])
def test_custom_loop_with_compute_average_loss_is_exact(strategy3, global_batch_size):
    """Also without global_batch_size: TensorFlow would take the slice size times R (each replica weighing 1/R
    instead of b_i/B: regression); under the strategy it is the step's global batch, as on one device."""
    x, y = data()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(10)  # 4 full batches and a last batch of 7

    reference = make_model()
    ref_opt = keras.optimizers.Adam(0.01)
    for xb, yb in dataset:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_fn(yb, reference(xb, training=True)))
        grads = tape.gradient(loss, reference.trainable_variables)
        ref_opt.apply_gradients(zip(grads, reference.trainable_variables))

    with strategy3.scope():
        model = make_model()
        optimizer = keras.optimizers.Adam(0.01)

    @tf.function
    def train_step(iterator):
        def step_fn(xb, yb):
            with tf.GradientTape() as tape:
                per_example = loss_fn(yb, model(xb, training=True))
                if global_batch_size == "given":
                    loss = tf.nn.compute_average_loss(
                        per_example, global_batch_size=hetero_cs.current_global_batch_size()
                    )
                else:
                    loss = tf.nn.compute_average_loss(per_example)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        per_replica = strategy3.run(step_fn, args=next(iterator))
        return strategy3.reduce("SUM", per_replica, axis=None)

    iterator = iter(strategy3.experimental_distribute_dataset(dataset))
    losses = [float(train_step(iterator)) for _ in range(5)]
    assert all(np.isfinite(losses))
    for ref_w, w in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(w, ref_w, atol=1e-5)
    for ref_v, v in zip(ref_opt.variables, optimizer.variables):
        np.testing.assert_allclose(np.asarray(v), np.asarray(ref_v), atol=1e-5)


class SumsItsInput(keras.layers.Layer):
    def call(self, inputs):  # keras-io's custom-loop guide: an activity loss, a sum over the batch
        self.add_loss(1e-2 * tf.reduce_sum(inputs))
        return inputs


def test_scale_regularization_loss_of_the_models_losses_is_one_devices(strategy3):
    """TensorFlow's tutorial adds tf.nn.scale_regularization_loss(tf.add_n(model.losses)). One device divides the
    term by 1: the whole batch's activity sum plus the weight penalty. So does every split (regression: a term
    computed from the batch was refused as multiplying two values computed from it)."""
    x, y = data()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(10)

    def build():
        init = keras.initializers.GlorotUniform(3)
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu", kernel_initializer=init,
                                                                     kernel_regularizer=keras.regularizers.L2(0.01)),
                                 SumsItsInput(), keras.layers.Dense(3, kernel_initializer=init)])

    def loss_of(model, xb, yb):
        per_example = loss_fn(yb, model(xb, training=True))
        return tf.nn.compute_average_loss(per_example) + tf.nn.scale_regularization_loss(tf.add_n(model.losses))

    reference, ref_opt = build(), keras.optimizers.SGD(0.05)
    for xb, yb in dataset:
        with tf.GradientTape() as tape:
            loss = loss_of(reference, xb, yb)
        ref_opt.apply_gradients(zip(tape.gradient(loss, reference.trainable_variables), reference.trainable_variables))
    with strategy3.scope():
        model, optimizer = build(), keras.optimizers.SGD(0.05)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_of(model, xb, yb)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    for batch in strategy3.experimental_distribute_dataset(dataset):
        strategy3.run(train_step, args=batch)
    for ref_w, w in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(w, ref_w, atol=1e-5)


def test_sum_metric_accumulates_once_per_step(strategy3):
    # Stock CentralStorageStrategy reads 60, 240, 780 here: each replica's assign(old + d_i) is summed.
    with strategy3.scope():
        metric = keras.metrics.Sum()
    values = tf.data.Dataset.from_tensor_slices(np.arange(1, 16, dtype=np.float32)).batch(15).repeat(3)
    iterator = iter(strategy3.experimental_distribute_dataset(values))

    @tf.function
    def update(iterator):
        strategy3.run(lambda v: metric.update_state(v), args=(next(iterator),))

    readings = []
    for _ in range(3):
        update(iterator)
        readings.append(float(metric.result()))
    assert readings == [120.0, 240.0, 360.0]


def test_reduce_nested_values_leaf_by_leaf(strategy3):
    dataset = tf.data.Dataset.from_tensor_slices(np.arange(10, dtype=np.float32)).batch(10)
    element = next(iter(strategy3.experimental_distribute_dataset(dataset)))

    def replica_fn(v):
        return {"sum": tf.reduce_sum(v), "count": tf.cast(tf.shape(v)[0], tf.float32)}, tf.reduce_sum(v) * 0 + 1.0

    outputs = strategy3.run(replica_fn, args=(element,))
    summed = strategy3.reduce("SUM", outputs, axis=None)
    assert float(summed[0]["sum"]) == 45.0
    assert float(summed[0]["count"]) == 10.0
    assert float(summed[1]) == 3.0
    mean = strategy3.reduce("MEAN", outputs, axis=None)
    assert float(mean[1]) == 1.0
    # Per replica sums of slices [5, 3, 2]: 10, 18, 17 -> mean 15 (not replica 0's 10).
    assert float(mean[0]["sum"]) == pytest.approx(15.0)


def test_checkpoints_round_trip_between_strategies(tmp_path, strategy3):
    x, y = data(30)
    with strategy3.scope():
        model = make_model(3)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.SparseCategoricalCrossentropy(True))
    model.fit(x, y, batch_size=10, epochs=1, verbose=0)

    ckpt_dir = tmp_path / "ckpt"
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(str(ckpt_dir / "c"))
    model.save_weights(str(tmp_path / "w.weights.h5"))
    model.save(str(tmp_path / "m.keras"))

    plain = make_model(9)
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.SparseCategoricalCrossentropy(True))
    plain.optimizer.build(plain.trainable_variables)
    tf.train.Checkpoint(model=plain, optimizer=plain.optimizer).read(str(ckpt_dir / "c")).assert_existing_objects_matched()
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(model.optimizer.variables, plain.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    two = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2"], auto_balance=False, profile_cache=False)
    with two.scope():
        other = make_model(11)
    other.load_weights(str(tmp_path / "w.weights.h5"))
    for a, b in zip(model.get_weights(), other.get_weights()):
        np.testing.assert_array_equal(a, b)

    loaded = keras.models.load_model(str(tmp_path / "m.keras"))
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_other_strategies_and_plain_keras_are_unaffected():
    # The patches dispatch on our strategy only: stock CentralStorageStrategy still scales by 1/N.
    from keras.src.losses import loss as loss_module

    stock = tf.distribute.experimental.CentralStorageStrategy(["/cpu:1", "/cpu:2"])
    with stock.scope():
        scaled = loss_module.scale_loss_for_distribution(tf.constant(1.0))
    assert float(scaled) == 0.5
    assert float(loss_module.scale_loss_for_distribution(tf.constant(1.0))) == 1.0


def test_distribute_datasets_from_function_cuts_global_batches_by_the_plan(strategy3):
    seen = []

    def dataset_fn(context):
        seen.append((context.num_replicas_in_sync, context.get_per_replica_batch_size(20)))
        return tf.data.Dataset.range(40).batch(context.get_per_replica_batch_size(20))

    element = next(iter(strategy3.distribute_datasets_from_function(dataset_fn)))
    slices = [t.numpy().tolist() for t in strategy3.experimental_local_results(element)]
    assert seen == [(1, 20)]
    assert [len(s) for s in slices] == [10, 6, 4]  # shares 5:3:2 of 20
    assert sum(slices, []) == list(range(20))  # every example once, in order


def test_per_replica_scalars_do_not_count_as_slices(strategy3):
    # A PerReplica of scalars has no batch dimension: the step keeps the stock 1/R weighting and does not fail.
    values = strategy3.experimental_distribute_values_from_function(lambda ctx: tf.constant(1.0))

    def replica_fn(v):
        return v * 2.0

    outputs = strategy3.run(replica_fn, args=(values,))
    assert float(strategy3.reduce("SUM", outputs, axis=None)) == 6.0


def test_each_replica_draws_its_own_dropout_mask():
    # Seed state is shared (ONLY_FIRST_REPLICA); without folding in the replica id every replica would draw the
    # same mask within a step, so equal slices would be dropped identically.
    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2"], batch_split=[1, 1], profile_cache=False)
    with strategy.scope():
        dropout = keras.layers.Dropout(0.5, seed=7)
        dropout.build((None, 64))
    ones = tf.data.Dataset.from_tensors(np.ones((8, 64), np.float32))
    element = next(iter(strategy.experimental_distribute_dataset(ones)))
    masks = strategy.experimental_local_results(strategy.run(lambda x: dropout(x, training=True), args=(element,)))
    assert masks[0].shape == masks[1].shape == (4, 64)
    assert not np.array_equal(masks[0].numpy() > 0, masks[1].numpy() > 0)


def test_an_eager_custom_loop_is_exact(strategy3):
    # No tf.function: every replica's ops run eagerly, and the update must still equal one device's.
    x, y = data(n=23, seed=4)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(10)
    reference = make_model(3)
    ref_opt = keras.optimizers.SGD(0.1)
    for xb, yb in dataset:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_fn(yb, reference(xb, training=True)))
        ref_opt.apply_gradients(zip(tape.gradient(loss, reference.trainable_variables), reference.trainable_variables))
    with strategy3.scope():
        model = make_model(3)
        optimizer = keras.optimizers.SGD(0.1)

    def step_fn(xb, yb):
        with tf.GradientTape() as tape:
            per_example = loss_fn(yb, model(xb, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=hetero_cs.current_global_batch_size())
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    for element in strategy3.experimental_distribute_dataset(dataset):
        strategy3.run(step_fn, args=element)
    for ref_w, w in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(w, ref_w, atol=1e-5)
    assert int(optimizer.iterations) == 3


def test_the_batch_leaf_sets_the_weights_wherever_it_is(strategy3):
    # b_i and B come from the dataset element's slices, not from a non-batch argument placed before them.
    x = tf.constant(np.arange(10, dtype=np.float32).reshape(10, 1))
    element = next(iter(strategy3.experimental_distribute_dataset(tf.data.Dataset.from_tensors((x, x)))))
    per_class = tf.constant([1.0, 1.0])
    constant_first = strategy3.run(lambda c, xb, yb: hetero_cs.replica_weight(), args=(per_class, *element))
    assert [float(w) for w in strategy3.experimental_local_results(constant_first)] == pytest.approx([0.5, 0.3, 0.2])
    other = strategy3.experimental_distribute_values_from_function(lambda ctx: tf.constant([1.0]))
    sizes = strategy3.run(lambda o, xb, yb: hetero_cs.current_global_batch_size(), args=(other, *element))
    assert {int(b) for b in strategy3.experimental_local_results(sizes)} == {10}  # equal values may come back as one


class InterleavingAdamW(keras.optimizers.AdamW):
    """AdamW whose host update, in its merge, first runs ``interleave`` once (another model's whole step)."""

    interleave = None

    def _distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
        interleave, self.interleave = self.interleave, None
        if interleave is not None:
            interleave()
        return super()._distributed_tf_update_step(distribution, grads_and_vars, learning_rate)


def test_a_step_traced_in_another_thread_meanwhile_keeps_the_weight_decay(strategy3):
    # Issue 30, bug 4: the barrier token and the deferred weight decay went from the replicas to the update merge
    # through module globals. Another model tracing its step in another thread in between consumed them: this step's
    # update ran without its weight decay (and without the failure barrier). Now each strategy.run call has its own.
    import threading

    x, y = data(n=10)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(10)

    def make_step(model, optimizer):
        # autograph=False: AutoGraph's own conversion cache is not safe for two threads converting at once (seen
        # once: "tf__source_element_spec() got an unexpected keyword argument 'source'" in the other thread), and
        # this test is about hetero_cs's per-call state, which two traces at once exercise without it.
        @tf.function(autograph=False)
        def train_step(iterator):
            def step_fn(xb, yb):
                with tf.GradientTape() as tape:
                    loss = tf.nn.compute_average_loss(
                        loss_fn(yb, model(xb, training=True)), global_batch_size=hetero_cs.current_global_batch_size())
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))

            strategy3.run(step_fn, args=next(iterator))

        return train_step

    def one_step(interleave=None):
        with strategy3.scope():
            model = make_model()
            optimizer = InterleavingAdamW(0.1, weight_decay=0.5)
            optimizer.build(model.trainable_variables)  # else tf.function traces twice: variables made in the first
        optimizer.interleave = interleave
        make_step(model, optimizer)(iter(strategy3.experimental_distribute_dataset(dataset)))
        return model.get_weights()

    expected = one_step()
    with strategy3.scope():
        other_model = make_model(seed=5)
        other_optimizer = keras.optimizers.AdamW(0.1, weight_decay=0.5)
        other_optimizer.build(other_model.trainable_variables)
    other_step = make_step(other_model, other_optimizer)
    errors = []

    def other_model_step_in_another_thread():
        def run():
            try:
                other_step(iter(strategy3.experimental_distribute_dataset(dataset)))
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join(timeout=300)  # generous: only a deadlock would reach it
        assert not thread.is_alive()

    interleaved = one_step(interleave=other_model_step_in_another_thread)
    assert not errors
    assert int(other_optimizer.iterations.numpy()) == 1
    for a, b in zip(expected, interleaved):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


def test_library_errors_raised_while_tracing_keep_their_type():
    """Regression: a hetero_cs error raised while tf.function traced a custom loop's step reached the user as
    TensorFlow's StagingError, so `except hetero_cs.ConfigError` did not catch it."""
    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2"], emulate=["A10", "T4"], batch_split=[1, 1],
                                            profile_cache=False)
    with strategy.scope():
        model = make_model()
    x, y = data(8)
    element = next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(8))))

    @tf.function
    def step(element):
        return strategy.run(lambda xb, yb: model(xb), args=element)

    with pytest.raises(hetero_cs.ConfigError, match="strategy.calibrate"):  # emulated devices need the model's size
        step(element)

    @tf.function
    def weight_outside_a_replica():
        return hetero_cs.replica_weight()

    with pytest.raises(hetero_cs.NotInReplicaStepError):
        weight_outside_a_replica()


def test_regression_current_global_batch_size_on_one_replica_is_the_batch():
    # A review: examples/custom_loop.py on a CPU-only machine without emulation (one replica) failed with
    # NotInReplicaStepError: tf.distribute hands one replica its batch as plain tensors, which named no global batch.
    strategy = HeteroCentralStorageStrategy(["/cpu:1"], auto_balance=False, profile_cache=False)
    x, y = data(n=20)
    with strategy.scope():
        model = make_model()
        optimizer = keras.optimizers.SGD(0.1)
    reference = make_model()
    reference.set_weights(model.get_weights())
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    @tf.function
    def train_step(element):
        def step_fn(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(yb, model(xb, training=True)),
                                                  global_batch_size=hetero_cs.current_global_batch_size())
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            return hetero_cs.current_global_batch_size()

        return strategy.run(step_fn, args=element)

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)  # 8, 8 and a last batch of 4
    sizes = [int(train_step(element)) for element in strategy.experimental_distribute_dataset(dataset)]
    assert sizes == [8, 8, 4]
    reference_optimizer = keras.optimizers.SGD(0.1)
    for start in range(0, 20, 8):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_fn(y[start:start + 8], reference(x[start:start + 8], training=True)))
        grads = tape.gradient(loss, reference.trainable_variables)
        reference_optimizer.apply_gradients(zip(grads, reference.trainable_variables))
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
