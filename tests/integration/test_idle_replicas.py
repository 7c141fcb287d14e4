"""A replica with a 0-example slice does no work: no op on its device, no forward pass, an exact zero.

The oracle is single-device Keras on the whole global batch; the op counter is a layer that reports, from a stateful
``tf.numpy_function``, which replica ran its forward pass; the device check reads the traced step's branch for the
active replicas and asserts that none of its ops is placed on the idle replica's device.
"""

import collections
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

from hetero_cs import HeteroCentralStorageStrategy

_STRATEGIES: dict[int, HeteroCentralStorageStrategy] = {}


def strategy_for(num_replicas: int, shares) -> HeteroCentralStorageStrategy:
    """One strategy per replica count for the module (re-split with set_batch_split)."""
    if num_replicas not in _STRATEGIES:
        devices = [f"/cpu:{i}" for i in range(1, num_replicas + 1)]
        _STRATEGIES[num_replicas] = HeteroCentralStorageStrategy(
            devices, auto_balance=False, rebalance=False, batch_split=shares, profile_cache=False)
    strategy = _STRATEGIES[num_replicas]
    strategy.set_batch_split(shares)
    return strategy


class _Tally:
    """Forward passes per replica id (a plain object: Keras would track a dict attribute of a layer)."""

    def __init__(self):
        self.counts = collections.Counter()
        self.lock = threading.Lock()

    def add(self, replica_id):
        with self.lock:
            self.counts[int(replica_id)] += 1
        return np.int64(0)


class ForwardCounter(keras.layers.Layer):
    """Counts forward passes per replica (``counts[replica_id]``) at run time; passes its input through."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tally = _Tally()

    @property
    def counts(self):
        return self.tally.counts

    def call(self, x):
        context = tf.distribute.get_replica_context()
        replica_id = context.replica_id_in_sync_group if context is not None else tf.constant(-1)
        done = tf.numpy_function(self.tally.add, [tf.cast(replica_id, tf.int64)], tf.int64, stateful=True)
        with tf.control_dependencies([done]):
            return tf.identity(x)


def bn_model(seed: int, *, counter: bool = False, l2: float = 0.0):
    init = keras.initializers.GlorotUniform
    layers = [keras.Input((3,))]
    if counter:
        layers.append(ForwardCounter())
    layers += [
        keras.layers.Dense(6, activation="tanh", kernel_initializer=init(seed=seed),
                           kernel_regularizer=keras.regularizers.L2(l2) if l2 else None),
        keras.layers.BatchNormalization(),
        keras.layers.Dense(2, kernel_initializer=init(seed=seed + 1)),
    ]
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.Adam(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def data(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    return x, (x.sum(axis=1) > 0).astype(np.int32)


def assert_same_state(reference, model, atol=1e-5):
    for ref_w, w in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(w, ref_w, atol=atol)
    for ref_v, v in zip(reference.optimizer.variables, model.optimizer.variables):
        np.testing.assert_allclose(np.asarray(v), np.asarray(ref_v), atol=atol, err_msg=v.path)


def counter_of(model) -> ForwardCounter:
    return next(layer for layer in model.layers if isinstance(layer, ForwardCounter))


@pytest.mark.parametrize("shares", [[3, 0, 5], [0, 4, 4], [0, 1, 0]], ids=["middle-idle", "first-idle", "one-active"])
def test_an_idle_replica_runs_no_forward_pass_and_the_step_stays_exact(shares):
    x, y = data(32)
    reference = bn_model(3)
    ref_hist = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    strategy = strategy_for(3, shares)
    with strategy.scope():
        model = bn_model(3, counter=True)
    hist = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)

    assert_same_state(reference, model)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(hist.history[key], ref_hist.history[key], atol=1e-5, err_msg=key)
    counts = counter_of(model).counts
    idle = [i for i, share in enumerate(shares) if share == 0]
    assert all(counts[i] == 0 for i in idle), counts
    assert all(counts[i] == 8 for i in range(3) if i not in idle), counts  # 4 steps x 2 epochs

    # Inference cuts by the same split: the idle replica predicts nothing, and the outputs come back in order.
    counts.clear()
    np.testing.assert_allclose(model.predict(x, batch_size=8, verbose=0), reference.predict(x, batch_size=8,
                                                                                              verbose=0), atol=1e-5)
    got = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    want = reference.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=1e-5, err_msg=key)
    assert all(counts[i] == 0 for i in idle), counts


def test_a_last_batch_smaller_than_the_replica_count_idles_the_rest_exactly():
    x, y = data(22, seed=4)  # batches of 10, 10 and a last batch of 2 < R = 3
    reference = bn_model(5)
    reference.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    strategy = strategy_for(3, [1, 1, 1])
    with strategy.scope():
        model = bn_model(5, counter=True)
    model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    assert_same_state(reference, model)
    counts = counter_of(model).counts
    # The last batch's plan gives one replica nothing; from the second epoch its branch idles that replica.
    assert sum(counts.values()) < 3 * 3 * 2, counts
    assert np.all(np.isfinite(model.get_weights()[2]))  # BatchNormalization's gamma: never NaN


def _branch_functions(concrete) -> tuple[list, dict]:
    """The Case op's branch function names of a traced step, and every function of its library by name."""
    graph_def = concrete.graph.as_graph_def()
    library = {f.signature.name: f for f in graph_def.library.function}
    nodes = list(graph_def.node) + [n for f in library.values() for n in f.node_def]
    cases = [n for n in nodes if n.op in ("Case", "StatelessCase") and "hetero_cs_active_replicas" in n.name]
    assert len(cases) == 1, [n.name for n in cases]
    return [b.name for b in cases[0].attr["branches"].list.func], library


def _devices_in(name: str, library: dict, seen=None) -> set:
    """Devices of every op in function ``name`` and the functions it calls."""
    seen = set() if seen is None else seen
    if name in seen or name not in library:
        return set()
    seen.add(name)
    devices = set()
    for node in library[name].node_def:
        devices.add(node.device)
        for value in node.attr.values():
            called = [value.func.name] if value.func.name else [f.name for f in value.list.func]
            for callee in called:
                devices |= _devices_in(callee, library, seen)
    return devices


def test_the_idle_branch_places_no_op_on_the_idle_replicas_device():
    strategy = strategy_for(3, [2, 0, 3])
    with strategy.scope():
        model = bn_model(1)
    x, y = data(10)
    strategy.calibrate(model, (x, y))  # records the plan's set of active replicas (0 and 2) before the trace
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(5))

    def step_fn(batch):
        features, labels = batch
        with tf.GradientTape() as tape:
            logits = model(features, training=True)
            loss = tf.nn.compute_average_loss(
                keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step(batch):
        return strategy.run(step_fn, args=(batch,))

    batch = next(iter(dataset))
    concrete = step.get_concrete_function(batch)
    branches, library = _branch_functions(concrete)
    sets = strategy._active_sets.for_trace(training=True)  # the sets of active replicas plans used so far
    assert len(branches) == 1 + len(sets) and (0, 2) in sets  # every replica, then one branch per set
    every, idle_one = _devices_in(branches[0], library), _devices_in(branches[1 + sets.index((0, 2))], library)
    assert any(d.endswith("CPU:2") for d in every)
    assert not any(d.endswith("CPU:2") for d in idle_one), sorted(idle_one)
    assert any(d.endswith("CPU:1") for d in idle_one) and any(d.endswith("CPU:3") for d in idle_one)

    # And it runs: the custom loop's loss is the full batch's mean, and the idle replica's share is a zero.
    losses = strategy.experimental_local_results(step(batch))
    assert float(losses[1]) == 0.0
    assert np.isfinite(float(strategy.reduce("SUM", step(batch), axis=None)))


@pytest.mark.parametrize("l2", [0.0, 0.5], ids=["plain", "regularized"])
def test_a_custom_loop_with_an_idle_replica_equals_single_device(l2):
    # TensorFlow's custom-loop tutorial: compute_average_loss without global_batch_size, and a regularization term
    # added by every replica through scale_regularization_loss (which must count once although replica 0 adds none).
    x, y = data(20, seed=9)
    reference = bn_model(2, l2=l2)
    strategy = strategy_for(3, [0, 6, 4])
    with strategy.scope():
        model = bn_model(2, l2=l2)
    strategy.calibrate(model, (x[:10], y[:10]))
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(10))

    def step_fn(batch, training_model):
        features, labels = batch
        with tf.GradientTape() as tape:
            logits = training_model(features, training=True)
            per_example = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
            loss = tf.nn.compute_average_loss(per_example)
            if training_model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(training_model.losses))
        grads = tape.gradient(loss, training_model.trainable_variables)
        training_model.optimizer.apply_gradients(zip(grads, training_model.trainable_variables))
        return loss, logits

    @tf.function
    def step(batch):
        return strategy.run(step_fn, args=(batch, model))

    losses, logits_parts = [], []
    for batch in dataset:
        loss, logits = step(batch)
        losses.append(float(strategy.reduce("SUM", loss, axis=None)))
        parts = strategy.experimental_local_results(logits)
        assert parts[0].shape[0] == 0  # the idle replica's per-example output: no rows
        logits_parts.append(np.concatenate([p.numpy() for p in parts]))

    ref_losses = []
    for start in (0, 10):
        xb, yb = x[start:start + 10], y[start:start + 10]
        with tf.GradientTape() as tape:
            logits = reference(xb, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(yb, logits, from_logits=True))
            if reference.losses:
                loss += tf.add_n(reference.losses)
        grads = tape.gradient(loss, reference.trainable_variables)
        reference.optimizer.apply_gradients(zip(grads, reference.trainable_variables))
        ref_losses.append(float(loss))
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5)
    assert all(part.shape == (10, 2) for part in logits_parts)
    for ref_w, w in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(w, ref_w, atol=1e-5)


@pytest.mark.parametrize("when", ["batch_end", "batch_begin"])
def test_fit_traces_its_step_again_before_the_first_step_that_idles_a_replica(when):
    # A Conv2D model: oneDNN's Conv2D on a CPU fails on a 0-example slice, so a step that ran the idle replica in the
    # old trace would fail; the train function is traced again right before that step instead.
    def cnn(seed):
        init = keras.initializers.GlorotUniform
        model = keras.Sequential([keras.Input((4, 4, 1)), ForwardCounter(),
                                  keras.layers.Conv2D(2, 3, padding="same", kernel_initializer=init(seed=seed)),
                                  keras.layers.Flatten(), keras.layers.Dense(2, kernel_initializer=init(seed=seed + 1))])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2", "/cpu:3"], auto_balance=False, rebalance=False,
                                            profile_cache=False)
    with strategy.scope():
        model = cnn(3)
    reference = cnn(3)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(24, 4, 4, 1)).astype(np.float32)
    y = rng.integers(0, 2, size=24).astype(np.int32)

    class IdleFromTheSecondStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if when == "batch_end" and batch == 0:
                strategy.set_batch_split([2, 0, 1])

        def on_train_batch_begin(self, batch, logs=None):
            if when == "batch_begin" and batch == 1:
                strategy.set_batch_split([2, 0, 1])

    reference.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0, callbacks=[IdleFromTheSecondStep()])
    for ref_w, w in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(w, ref_w, atol=1e-5)
    counts = counter_of(model).counts
    assert counts[0] == counts[2] == 4 and counts[1] == 1, counts  # replica 1 worked in the first step only


def recorded_traces(model, read=lambda data: data) -> list:
    """Wraps ``model.train_step`` to append ``read(data)`` once per replica pass in a trace; returns that list."""
    records, keras_train_step = [], model.train_step

    def train_step(data):
        records.append(read(data))
        return keras_train_step(data)

    model.train_step = train_step
    return records


def test_fit_traces_its_step_once_per_set_of_active_replicas_it_runs_and_a_set_met_again_traces_nothing():
    # fit runs a step traced for its plan's set of active replicas alone (idle_replicas.StepPerSet): a new set traces
    # one function, its own, with only its replicas' passes, and a set met before traces nothing (with branches, each
    # new set traced the whole step again, every set's passes in it).
    splits = {0: [2, 2, 2], 1: [3, 0, 3], 2: [2, 2, 2], 3: [3, 0, 3], 4: [0, 6, 0], 5: [3, 0, 3]}
    strategy = strategy_for(3, [1, 1, 1])
    with strategy.scope():
        model = bn_model(4)
    reference = bn_model(4)
    traced = recorded_traces(model)

    class Resplit(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            strategy.set_batch_split(splits[batch])

    x, y = data(36)
    reference.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0, callbacks=[Resplit()])
    assert_same_state(reference, model)
    assert len(traced) == 3 + 2 + 1, len(traced)  # the sets (0, 1, 2), (0, 2) and (1,), each traced once


def two_output_model(seed: int):
    init = keras.initializers.GlorotUniform
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(6, activation="tanh", kernel_initializer=init(seed=seed))(inputs)
    outputs = {"cls": keras.layers.Dense(2, kernel_initializer=init(seed=seed + 1), name="cls")(hidden),
               "reg": keras.layers.Dense(1, kernel_initializer=init(seed=seed + 2), name="reg")(hidden)}
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss={
        "cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "reg": "mse"})
    return model


@pytest.mark.parametrize("drop_remainder", [False, True], ids=["batch-size-unknown", "batch-size-known"])
def test_a_card_alone_runs_one_devices_step_after_the_first_and_logs_what_one_device_logs(drop_remainder):
    # After a first step traced with the loss reader, fit's steps of a card alone run as one device's step on the whole
    # batch (StepPerSet): nothing weighed, num_replicas_in_sync 1 inside the replica, the batch's static size known.
    # Keras weighs a per-output loss tracker by a static batch size: one device reads its dataset's (unknown without
    # drop_remainder, 1 per step; else the same every step), so a card alone's step counts one per step, as the
    # weighted steps around it do. 46 examples in batches of 10: a last batch of 6 without drop_remainder.
    strategy = strategy_for(3, [0, 1, 0])
    with strategy.scope():
        model = two_output_model(5)
    reference = two_output_model(5)
    traced = recorded_traces(model, lambda data: (int(model.distribute_strategy.num_replicas_in_sync),
                                                  tf.nest.flatten(data)[0].shape[0]))
    x, y = data(46)
    targets = {"cls": y, "reg": x[:, :1] * 2.0}
    dataset = tf.data.Dataset.from_tensor_slices((x, targets)).batch(10, drop_remainder=drop_remainder)
    expected = reference.fit(dataset, epochs=2, verbose=0).history
    got = model.fit(dataset, epochs=2, verbose=0).history
    # The weighted step's trace (the reader reads it; three replicas, a slice of no static size), then one device's
    # on the whole batch, and without drop_remainder that once more for the last batch of 6 (Keras'
    # reduce_retracing: a new input shape traces with the batch dimension open).
    assert traced == [(3, None), (1, 10)] + ([] if drop_remainder else [(1, None)]), traced
    assert_same_state(reference, model)
    assert set(got) == set(expected)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, err_msg=key)


class NumberWeighedTrackers(keras.Model):
    """A train_step override whose Mean trackers are weighed by numbers: the batch's static size (Keras' own
    per-output loss trackers' idiom; None, so 1, where unknown), a constant and a constant tensor; trackers of a
    batch's mean that one device adds once a step: a Mean of a mean kept as a 1-vector, a Sum of the mean; and
    compute_loss's value weighed by the batch's rows and by a constant tensor (Sum and rows also in a test_step)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.by_static_size = keras.metrics.Mean(name="by_static_size")
        self.by_constant = keras.metrics.Mean(name="by_constant")
        self.by_tensor = keras.metrics.Mean(name="by_tensor")
        self.of_kept_dims = keras.metrics.Mean(name="of_kept_dims")
        self.summed = keras.metrics.Sum(name="summed")
        self.loss_by_rows = keras.metrics.Mean(name="loss_by_rows")
        self.loss_by_tensor = keras.metrics.Mean(name="loss_by_tensor")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        error = tf.reduce_mean(tf.square(y_pred - y))
        self.by_static_size.update_state(error, sample_weight=x.shape[0])
        self.by_constant.update_state(error, sample_weight=2)
        self.by_tensor.update_state(error, sample_weight=tf.constant(2.0))
        self.of_kept_dims.update_state(tf.reduce_mean(tf.square(y_pred - y), axis=0))
        self.summed.update_state(error)
        self.loss_by_rows.update_state(loss, sample_weight=tf.cast(tf.shape(x)[0], "float32"))
        self.loss_by_tensor.update_state(loss, sample_weight=tf.constant(2.0))
        trackers = (self.by_static_size, self.by_constant, self.by_tensor, self.of_kept_dims, self.summed,
                    self.loss_by_rows, self.loss_by_tensor)
        return {m.name: m.result() for m in trackers}

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        self.summed.update_state(tf.reduce_mean(tf.square(y_pred - y)))
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        self.loss_by_rows.update_state(loss, sample_weight=tf.cast(tf.shape(x)[0], "float32"))
        return {m.name: m.result() for m in (self.summed, self.loss_by_rows)}


@pytest.mark.parametrize("shares", [[0, 1, 0], [3, 2, 1]])
@pytest.mark.parametrize("drop_remainder", [False, True], ids=["batch-size-unknown", "batch-size-known"])
def test_a_mean_weighed_by_a_number_logs_what_one_device_logs(shares, drop_remainder):
    # One device weighs every step of an epoch alike (one static size, or none); a card alone's step knows a static
    # size where one device may not, and a weighted step's slices know none: a Mean weighed by a number counts one
    # per step in our steps (before: the card alone's logged mean was 0.05 off; a weighted step's about R times).
    def build():
        init = keras.initializers.GlorotUniform
        inputs = keras.Input((3,))
        outputs = keras.layers.Dense(1, kernel_initializer=init(seed=3))(
            keras.layers.Dense(6, activation="tanh", kernel_initializer=init(seed=2))(inputs))
        model = NumberWeighedTrackers(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model

    strategy = strategy_for(3, shares)
    with strategy.scope():
        model = build()
    reference = build()
    x, _ = data(46)
    dataset = tf.data.Dataset.from_tensor_slices((x, x[:, :1] * 2.0)).batch(10, drop_remainder=drop_remainder)
    expected = reference.fit(dataset, epochs=2, verbose=0).history
    got = model.fit(dataset, epochs=2, verbose=0).history
    assert_same_state(reference, model)
    for key in ("by_static_size", "by_constant"):
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, err_msg=key)
    # A batch's mean in a metric's delta is weighed b_i / B as in a loss (before: R slices' means, up to 3x off);
    # compute_loss's value (a share) weighed by a tensor is its slice's value under that weight (before: w_i b_i).
    for key in ("by_tensor", "of_kept_dims", "summed", "loss_by_rows", "loss_by_tensor"):
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, err_msg=key)
    evaluated = model.evaluate(dataset, verbose=0, return_dict=True)
    for key, value in reference.evaluate(dataset, verbose=0, return_dict=True).items():
        np.testing.assert_allclose(evaluated[key], value, rtol=1e-5, err_msg=key)


def test_regression_fit_gives_no_example_to_a_replica_with_a_0_share_however_many_sets_it_met():
    # Four cards, more sets of active replicas in one fit than the branches' bound (2 per replica): the ninth set ran
    # as a traced superset, one example each to cards with a 0 share (under auto-balance, a card left out for being
    # 50x slower, so the guard never measured the plan it was trying). fit now traces each set's own step.
    import itertools

    sets = [bits for bits in itertools.product([0, 1], repeat=4) if 0 < sum(bits) < 4][:10]
    strategy = strategy_for(4, [1, 1, 1, 1])
    with strategy.scope():
        model = bn_model(6)
    reference = bn_model(6)
    ran = []

    class Resplit(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            strategy.set_batch_split([2 * b for b in sets[batch]])

        def on_train_batch_end(self, batch, logs=None):
            ran.append(strategy._slicer.last_step_sizes())  # noqa: SLF001

    x, y = data(8 * len(sets))
    reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[Resplit()])
    assert_same_state(reference, model)
    assert [tuple(int(b > 0) for b in sizes) for sizes in ran] == sets


def test_predict_and_strategy_run_eagerly_give_an_idle_replica_an_empty_batch():
    strategy = strategy_for(3, [2, 0, 1])
    x, y = data(6, seed=3)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(loss="mse", run_eagerly=True)
    reference = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    reference.set_weights(model.get_weights())
    np.testing.assert_allclose(model.predict(x, batch_size=6, verbose=0), reference.predict(x, verbose=0), atol=1e-6)
    element = next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(6))))
    outputs = strategy.run(lambda batch: batch * 2.0, args=(element,))
    assert [p.shape[0] for p in strategy.experimental_local_results(outputs)] == [4, 0, 2]
    np.testing.assert_allclose(strategy.gather(outputs, axis=0), x * 2.0)


class FailsOnReplica2(keras.layers.Layer):
    def call(self, x):
        def fail_on_2(replica_id):
            if int(replica_id) == 2:
                raise ValueError("replica 2 fails here")
            return np.int32(0)

        context = tf.distribute.get_replica_context()
        if context is None:  # building the model (cross-replica context)
            return x
        replica_id = context.replica_id_in_sync_group
        ok = tf.numpy_function(fail_on_2, [replica_id], tf.int32, stateful=True)
        with tf.control_dependencies([ok]):
            return tf.identity(x)


@pytest.mark.parametrize("shares", [[0, 1, 1], [0, 0, 1]])
def test_an_error_in_a_step_with_idle_replicas_names_the_replica_that_raised_it(shares):
    # tf.distribute numbers the threads of a call in its op names; with replica 0 idle, thread 0 is replica 1 or 2.
    from hetero_cs import ReplicaStepError

    strategy = strategy_for(3, shares)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), FailsOnReplica2(), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data(12)
    with pytest.raises(ReplicaStepError) as raised:
        model.fit(x, y, batch_size=6, epochs=1, verbose=0, shuffle=False)
    assert raised.value.replica_id == 2 and raised.value.device.endswith("CPU:3")


def test_timing_reports_an_idle_replica_as_0_examples_and_its_emulated_clock_advances(monkeypatch, tmp_path):
    monkeypatch.setenv("HETERO_CS_EMULATION_TARGET_MAKESPAN_MS", "10")
    monkeypatch.setenv("HETERO_CS_CACHE_DIR", str(tmp_path))
    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2", "/cpu:3"], emulate=["A10", "T4", "P100"],
                                            batch_split=[2, 0, 1])
    with strategy.scope():
        model = bn_model(6, counter=True)
    x, y = data(30, seed=6)
    model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    assert counter_of(model).counts[1] == 0
    assert strategy.monitor.completed_steps == 10  # every step pairs, the idle replica's report included
    sample = strategy.monitor.last_step()
    assert sample.per_replica_batch_sizes == (4, 0, 2) and sample.per_replica_step_times_s[1] == 0.0
    assert sample.straggler_wait_s < sample.makespan_s  # an idle replica does not count as waiting
    steps_done = strategy.emulator.steps_done
    assert steps_done[1] == steps_done[0] == steps_done[2]  # drift schedules count the idle replica's steps too


def test_timing_without_emulation_reports_an_idle_replica_on_the_steps_it_times(tmp_path, monkeypatch):
    # Real devices: an untimed step (sampled timing) calls no Python for its idle replicas; a timed one (here every
    # step, as HETERO_CS_TIMING asks) reports them, or its step would never pair in the monitor.
    monkeypatch.setenv("HETERO_CS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("HETERO_CS_TIMING", "1")
    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2", "/cpu:3"], batch_split=[2, 0, 1])
    with strategy.scope():
        model = bn_model(6)
    x, y = data(30, seed=6)
    model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    assert strategy.monitor.completed_steps == 10
    sample = strategy.monitor.last_step()
    assert sample.per_replica_batch_sizes == (4, 0, 2) and sample.per_replica_step_times_s[1] == 0.0


def test_the_first_evaluate_and_predict_idle_the_replicas_of_a_last_batch_smaller_than_r():
    # Their plans for batches below R are known before the pass: the first trace has their branches, so no replica
    # runs a 0-example slice - which oneDNN's Conv2D on a CPU fails on (before, the first call raised).
    def cnn(seed):
        init = keras.initializers.GlorotUniform
        model = keras.Sequential([
            keras.Input((6, 6, 2)), ForwardCounter(),
            keras.layers.Conv2D(3, 3, use_bias=False, kernel_initializer=init(seed=seed)),
            keras.layers.BatchNormalization(), keras.layers.Flatten(),
            keras.layers.Dense(2, kernel_initializer=init(seed=seed + 1)),
        ])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model

    rng = np.random.default_rng(5)
    x = rng.normal(size=(17, 6, 6, 2)).astype(np.float32)  # batches of 8, 8 and 1 < R = 3
    y = rng.integers(0, 2, size=17).astype(np.int32)
    reference = cnn(11)
    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2", "/cpu:3"], auto_balance=False, rebalance=False,
                                            profile_cache=False)
    with strategy.scope():
        model = cnn(11)
    got = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    want = reference.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=1e-5, err_msg=key)
    np.testing.assert_allclose(model.predict(x, batch_size=8, verbose=0), reference.predict(x, batch_size=8,
                                                                                              verbose=0), atol=1e-5)
    counts = counter_of(model).counts
    assert counts[0] == 6 and counts[1] == counts[2] == 4, counts  # the last batch of 1 ran on replica 0 alone


def test_a_custom_loop_calibrated_before_its_trace_leaves_the_cards_the_fastest_alone_trial_idles_idle():
    # The guard tries the fastest card alone; a custom loop traces its step once. strategy.calibrate (called before
    # the trace) gives that trial's set of active replicas a branch, so the others do no work in its steps. Without
    # it they ran a conv model on 0-example slices, where oneDNN's Conv2D fails ("input depth must be evenly
    # divisible by filter depth"; examples/custom_loop.py failed so).
    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2", "/cpu:3"], profile_cache=False)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6, 6, 1)), keras.layers.Conv2D(4, 3, padding="same", activation="relu"),
                                  keras.layers.Conv2D(4, 3, padding="same"), keras.layers.Flatten(),
                                  keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(12, 6, 6, 1)).astype(np.float32), rng.integers(0, 3, size=(12,)).astype(np.int32)
    strategy.calibrate(model, (x, y), progress=False)
    # The card measured fastest alone has a branch (on a loaded host the solved plan may leave a card alone too:
    # calibration times three alike CPUs, so which one is fastest, and by how much, is the load's choice).
    alone = [s for s in strategy._active_sets.for_trace(training=True) if len(s) == 1]
    assert alone, strategy._active_sets.for_trace(training=True)

    def step_fn(batch):
        features, labels = batch
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                keras.losses.sparse_categorical_crossentropy(labels, model(features, training=True), from_logits=True))
        model.optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    @tf.function
    def step(batch):
        return strategy.run(step_fn, args=(batch,))

    batch = next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(12))))
    first = strategy.reduce("SUM", step(batch), axis=None)  # traced here, with the plan's split
    strategy.set_batch_split([int(i == alone[0][0]) for i in range(3)])  # the trial's split, after the trace
    alone = strategy.reduce("SUM", step(batch), axis=None)
    assert np.isfinite(float(first)) and np.isfinite(float(alone))


def test_regression_an_evaluate_batch_whose_plan_leaves_a_card_out_runs_no_0_example_conv2d():
    # The main job, calibrated with contention: the A10 paid a large fixed cost per step beside the others, so the
    # plan of evaluate's last batch (104 of 360 examples) left it out - a set no branch was traced for, whose step
    # then ran the A10 on a 0-example slice, and oneDNN's Conv2D failed ("input depth must be evenly divisible by
    # filter depth"). Such a step now runs as a traced superset, the left-out card given one example.
    from hetero_cs.planning.cost_model import LinearCostModel

    def cnn(seed):
        init = keras.initializers.GlorotUniform
        model = keras.Sequential([keras.Input((6, 6, 2)), ForwardCounter(),
                                  keras.layers.Conv2D(3, 3, kernel_initializer=init(seed=seed)),
                                  keras.layers.Conv2D(4, 3, kernel_initializer=init(seed=seed + 2)),
                                  keras.layers.Flatten(), keras.layers.Dense(2, kernel_initializer=init(seed=seed + 1))])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model

    rng = np.random.default_rng(6)
    x = rng.normal(size=(17, 6, 6, 2)).astype(np.float32)  # batches of 12 and 5 (>= R = 3)
    y = rng.integers(0, 2, size=17).astype(np.int32)
    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2", "/cpu:3"], rebalance=False, guard=False,
                                            profile_cache=False)
    # Replica 0: 10 ms fixed, fast per example; the others none, slow per example: 12 examples use all three, the
    # last 5 only replicas 1 and 2.
    strategy.set_cost_models([LinearCostModel(0.01, 1e-4), LinearCostModel(0.0, 2e-3), LinearCostModel(0.0, 2e-3)])
    assert strategy.balancer.plan_for_inference(5).per_replica_batch_sizes[0] == 0
    assert 0 not in strategy.balancer.plan_for_inference(12).per_replica_batch_sizes
    reference = cnn(4)
    with strategy.scope():
        model = cnn(4)
    got = model.evaluate(x, y, batch_size=12, verbose=0, return_dict=True)
    want = reference.evaluate(x, y, batch_size=12, verbose=0, return_dict=True)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=1e-5, err_msg=key)
    assert min(counter_of(model).counts[i] for i in range(3)) == 2, counter_of(model).counts  # every replica, both
    # The next pass traces the set, and the last batch leaves the card out, as planned.
    model.evaluate(x, y, batch_size=12, verbose=0)
    assert counter_of(model).counts[0] == 3, counter_of(model).counts


def test_a_set_without_a_branch_runs_as_the_smallest_traced_superset():
    from hetero_cs.engine.step.idle_replicas import served_sizes

    traced = frozenset({(0,), (0, 1), (1, 2)})
    assert served_sizes([8, 0, 0], traced) == (8, 0, 0)  # traced
    assert served_sizes([0, 0, 8], traced) == (0, 1, 7)  # {2} runs as {1, 2}
    assert served_sizes([0, 8, 0], traced) == (1, 7, 0)  # {1}: two supersets of two, the first in order
    assert served_sizes([5, 0, 3], traced) == (4, 1, 3)  # {0, 2}: as every replica, from the largest slice
    assert served_sizes([0, 0, 2], traced) == (0, 1, 1)
    assert served_sizes([2, 0, 0, 0], frozenset()) == (2, 0, 0, 0)  # fewer examples than replicas: as planned
    assert served_sizes([0, 3, 1], None) == (0, 3, 1)  # no branches (eager, one replica)
    # A card set aside (cap 0) never gets an example: under load a set aside T4 ran a superset's one example and
    # failed again (the emulated device error of docs/failover.md's example, a third retry).
    assert served_sizes([0, 8, 0], traced, keep_idle=[0]) == (0, 7, 1)  # {1} runs as {1, 2}, not {0, 1}
    assert served_sizes([0, 0, 8], traced, keep_idle=[1]) == (0, 0, 8)  # no superset without 1: as planned


def test_a_set_keeps_its_branch_however_many_others_come():
    from hetero_cs.engine.step.idle_replicas import MAX_SETS_PER_REPLICA, ActiveSets

    sets = ActiveSets(3)
    for sizes in ([8, 0, 0], [7, 1, 0], [7, 0, 1], [8, 0, 0], [0, 4, 4], [7, 1, 0], [3, 3, 2]):
        sets.note(sizes, training=True)  # plans, trials and their returns
    assert sets.for_trace(training=True) == ((0,), (0, 1), (0, 2), (1, 2)) and sets.version(training=True) == 4
    sets.note([0, 0, 8], training=False)
    assert (2,) in sets.for_trace(training=False) and (2,) not in sets.for_trace(training=True)
    bounded = ActiveSets(2)  # 2 sets for R = 2; any set past the bound would run as its superset
    for sizes in ([1, 0], [0, 1], [1, 0]):
        bounded.note(sizes, training=True)
    assert bounded.for_trace(training=True) == ((0,), (1,)) and MAX_SETS_PER_REPLICA * 2 >= 2


def test_regression_fit_on_arrays_whose_last_batch_has_fewer_examples_than_replicas_runs_no_0_example_slice():
    # The oracle's program: images through BatchNormalization and Conv2DTranspose, batch_split [1, 3, 4, 1], 11
    # examples in batches of 9. The last batch of 2 is cut [0, 1, 1, 0]; its set had no branch when the step was
    # traced, so replicas 0 and 3 ran 0-example slices and BatchNormalization's reshape failed there. fit on arrays
    # now knows that batch before the first trace and gives its set a branch.
    def model_of(seed):
        init = keras.initializers.GlorotUniform
        model = keras.Sequential([keras.Input((4, 4, 1)), keras.layers.BatchNormalization(),
                                  keras.layers.Conv2DTranspose(2, 2, kernel_initializer=init(seed=seed)),
                                  keras.layers.Flatten(), keras.layers.Dense(1, kernel_initializer=init(seed=seed + 1))])
        model.compile(optimizer="sgd", loss="mse")
        return model

    rng = np.random.default_rng(7)
    x = rng.normal(size=(11, 4, 4, 1)).astype(np.float32)
    y = rng.normal(size=(11, 1)).astype(np.float32)
    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2", "/cpu:3", "/cpu:4"], batch_split=[1, 3, 4, 1],
                                            profile_cache=False)
    reference = model_of(3)
    with strategy.scope():
        model = model_of(3)
    model.fit(x, y, batch_size=9, epochs=1, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=9, epochs=1, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_regression_a_set_past_the_branch_bound_runs_its_own_step_in_fit():
    # The oracle's program (seed 2): a strategy over four cards re-split many times, so that the set of
    # batch_split [0, 0, 0, 3] got no branch of its own (the bound of traced sets was reached). Its first step ran as
    # a traced superset, but the plan was published to the graph's plan cache all the same, and the steps after it
    # read the plan's own sizes from there: branch 0, idle replicas on 0-example slices, oneDNN's Conv2D failed
    # ("ReluGrad ... must have the same size and shape"). Later such a plan was cut as a superset in every step,
    # giving cards with a 0 share an example each (under auto-balance, a card left out for being 50x slower). fit now
    # runs every set in a step of its own, past the branches' bound too: the replicas with a 0 share get nothing.
    import itertools

    from hetero_cs.engine.step.idle_replicas import MAX_SETS_PER_REPLICA

    def cnn(seed):
        init = keras.initializers.GlorotUniform
        model = keras.Sequential([keras.Input((6, 6, 2)),
                                  keras.layers.Conv2D(3, 3, activation="relu", kernel_initializer=init(seed=seed)),
                                  keras.layers.Flatten(), keras.layers.Dense(1, kernel_initializer=init(seed=seed + 1))])
        model.compile(optimizer="sgd", loss="mse")
        return model

    strategy = HeteroCentralStorageStrategy([f"/cpu:{i}" for i in range(1, 5)], auto_balance=False, rebalance=False,
                                            batch_split=[1, 1, 1, 1], profile_cache=False)
    for bits in itertools.product([0, 1], repeat=4):  # every other set of active replicas, past the bound
        if 0 < sum(bits) < 4 and bits != (0, 0, 0, 1):
            strategy.set_batch_split([2 * b for b in bits])
    assert len(strategy._active_sets.for_trace(training=True)) == MAX_SETS_PER_REPLICA * 4  # noqa: SLF001
    strategy.set_batch_split([0, 0, 0, 3])
    rng = np.random.default_rng(8)
    x = rng.normal(size=(12, 6, 6, 2)).astype(np.float32)  # three steps of 4 examples
    y = rng.normal(size=(12, 1)).astype(np.float32)
    reference = cnn(5)
    with strategy.scope():
        model = cnn(5)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert strategy._slicer.last_step_sizes() == (0, 0, 0, 4)  # noqa: SLF001


def test_regression_a_trained_model_leaves_no_traced_graph_behind():
    # The log shares of every traced step were remembered by tensor in a dictionary weakly keyed by graph: a tensor
    # holds its graph, so no graph with a log share ever died (+17 MB per model trained in one process; the oracle's
    # long runs grew to 6 GB). Once the model is gone, so are its traced graphs.
    import gc

    from hetero_cs.engine._compat import loss_reader

    def train_one():
        strategy = strategy_for(3, [2, 0, 2])
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        x = np.ones((8, 3), np.float32)
        model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0)
        model.evaluate(x, x[:, :1], batch_size=4, verbose=0)

    train_one()
    gc.collect()
    before = len(loss_reader._log_shares)  # noqa: SLF001
    for _ in range(3):
        train_one()
    gc.collect()
    assert len(loss_reader._log_shares) <= before, (before, len(loss_reader._log_shares))  # noqa: SLF001


@pytest.mark.parametrize("drop_remainder", [False, True], ids=["partial_last_batch", "static_batch_size"])
def test_regression_a_custom_loop_whose_shares_round_a_replica_to_0_examples_runs_no_0_example_conv(drop_remainder):
    # The slow oracle's draw 9: a custom loop over batch_split [4, 1, 3, 1] with B = 5 (cut [2, 1, 2, 0]) and a last
    # batch of 1 (cut [1, 0, 0, 0]). The loop's step was traced before any plan was served, so neither set had a
    # branch: replica 3 ran its Conv1D on an empty slice in branch 0 at the first step, where oneDNN fails ("Must
    # provide as many biases as the last dimension of the input tensor"), as TensorFlow's own error. Under fixed
    # shares a full batch now runs as a traced superset (every replica with a share gets an example) and the sets of
    # batches smaller than that get branches when the loop is traced. (Whether the kernel fails on 0 rows depends on
    # oneDNN's path; the rows each replica's step ran on are what is checked.) A batch of one static size of at least
    # the replicas with a share (drop_remainder) gets no branches for smaller batches.
    def conv1d(seed):
        init = keras.initializers.GlorotUniform
        inputs = keras.Input((5, 3))
        h = keras.layers.GlobalAveragePooling1D()(keras.layers.Conv1D(4, 2, padding="same",
                                                                      kernel_initializer=init(seed))(inputs))
        return keras.Model(inputs, keras.layers.Dense(1, kernel_initializer=init(seed + 1))(h))

    rng = np.random.default_rng(3)
    x = rng.normal(size=(6, 5, 3)).astype(np.float32)
    y = rng.normal(size=(6, 1)).astype(np.float32)
    strategy = HeteroCentralStorageStrategy([f"/cpu:{i}" for i in range(1, 5)], batch_split=[4, 1, 3, 1],
                                            profile_cache=False)

    def train(runner):
        with runner.scope():
            model = conv1d(4)
            optimizer = keras.optimizers.SGD(0.1)
            optimizer.build(model.trainable_variables)

        def step_fn(xb, yb):
            # Runs where the replica's step runs: not at all for an idle replica, with 0 rows on an empty slice.
            tf.numpy_function(lambda n: rows.append(int(n)) or np.int64(0), [tf.shape(xb)[0]], tf.int64, stateful=True)
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(tf.reduce_mean(tf.square(model(xb, training=True) - yb), axis=-1))
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            return loss

        @tf.function
        def step(batch):
            return runner.reduce("SUM", runner.run(step_fn, args=batch), axis=None)

        losses = []
        for _ in range(2):
            for batch in runner.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(5, drop_remainder)):
                losses.append(float(step(batch)))
        return losses, model.get_weights()

    rows: list = []
    ref_losses, ref_weights = train(tf.distribute.get_strategy())
    rows.clear()
    losses, weights = train(strategy)
    assert rows and 0 not in rows, rows  # no replica ran its step on an empty slice
    assert ((0,) in strategy._active_sets.for_trace(training=True)) is not drop_remainder  # noqa: SLF001 - B' = 1's set
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5)
    for got, want in zip(weights, ref_weights):
        np.testing.assert_allclose(got, want, atol=1e-5)
