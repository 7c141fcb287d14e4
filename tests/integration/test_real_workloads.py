"""Realistic Keras workloads against the single-device oracle ("No silent wrong answer").

Each test builds a model of a kind people train (a masked RNN, a Transformer block, a ResNet-style CNN, dict inputs
and outputs, a custom loop, train_step overrides, mixed precision, checkpoint-and-resume) twice from the same seed:
once on one device, once inside ``strategy.scope()``, with the one-device model's initial weights copied over. Both
train on the same NumPy data with ``shuffle=False``. Every split has a replica with a 0 share, and the number of
examples is not a multiple of the global batch, so every epoch ends with a partial batch (``evaluate`` and
``predict`` too). The oracle then compares every weight (trainable or not), every optimizer variable, every key and
value of the one-device History, ``evaluate(return_dict=True)`` and ``predict``.

No model here has active dropout: its masks would differ from one device's on any split.

Each workload costs tens of seconds here (the strategy traces every replica's step, and a branch per set of active
replicas), so the default run keeps one model that joins the patterns most likely to catch a regression: a
Transformer block with a masked GRU on top (positions looked up with arange, attention and a per-token loss under
the padding mask, dict outputs with per-output sample weights, AdamW with a schedule and clipping), plus a refusal
check that costs nothing. Everything else runs under ``-m slow``. Workloads with convolutions run in a child process
(see ``run_in_child_process_without_onednn``).
"""

import contextlib
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import hetero_cs
from fixed_splits import strategy_for

ATOL = 1e-5  # float32: the slices' sums run in another order than the whole batch's
SEED = 7


# ------------------------------------------------------------------------------------------------------------------
# The oracle
# ------------------------------------------------------------------------------------------------------------------
def max_difference(expected, got) -> float:
    expected, got = np.asarray(expected, np.float64), np.asarray(got, np.float64)
    assert expected.shape == got.shape, (expected.shape, got.shape)
    return float(np.max(np.abs(expected - got))) if expected.size else 0.0


class Differences:
    """Compares values and keeps the largest absolute difference of each kind (printed at the end of a test)."""

    def __init__(self, atol, rtol=0.0):
        self.atol, self.rtol = atol, rtol
        self.largest: dict[str, float] = {}

    def check(self, kind, expected, got, what):
        expected, got = np.asarray(expected), np.asarray(got)
        np.testing.assert_allclose(got, expected, atol=self.atol, rtol=self.rtol, err_msg=f"{kind}: {what}")
        self.largest[kind] = max(self.largest.get(kind, 0.0), max_difference(expected, got))

    def weights(self, reference, model):
        assert len(model.weights) == len(reference.weights)
        for ref_w, w in zip(reference.weights, model.weights):
            self.check("weights", ref_w.numpy(), w.numpy(), ref_w.path)

    def optimizer(self, reference, optimizer):
        assert len(optimizer.variables) == len(reference.variables), (
            [v.path for v in reference.variables], [v.path for v in optimizer.variables])
        for ref_v, v in zip(reference.variables, optimizer.variables):
            self.check("optimizer", ref_v.numpy(), v.numpy(), ref_v.path)

    def logs(self, kind, expected: dict, got: dict):
        missing = sorted(set(expected) - set(got))
        assert not missing, f"{kind}: keys of the one-device logs missing: {missing} (got {sorted(got)})"
        for key in expected:
            self.check(kind, expected[key], got[key], key)

    def outputs(self, expected, got):
        expected_flat, got_flat = tf.nest.flatten(expected), tf.nest.flatten(got)
        assert tf.nest.map_structure(np.shape, expected) == tf.nest.map_structure(np.shape, got)
        for index, (e, g) in enumerate(zip(expected_flat, got_flat)):
            self.check("predict", e, g, f"output {index}")

    def report(self, name):
        figures = ", ".join(f"{kind} {value:.2e}" for kind, value in self.largest.items())
        print(f"{name}: largest |difference| {figures}")


def twin_models(build, strategy):
    """The same model twice from one seed: on one device, and inside ``strategy.scope()`` with the first's weights."""
    keras.utils.set_random_seed(SEED)
    reference = build()
    keras.utils.set_random_seed(SEED)
    with strategy.scope():
        model = build()
    model.set_weights(reference.get_weights())
    return reference, model


def check_against_one_device(build, x, y=None, *, shares, batch_size, epochs=2, atol=ATOL, rtol=0.0, fit_kwargs=None,
                             eval_batch_size=None, predict_batch_size=None, name="workload"):
    """fit, evaluate and predict on one device and under the strategy; every figure must agree within ``atol``.

    Returns the two models and the comparer (for checks a test adds).
    """
    fit_kwargs = dict(fit_kwargs or {})
    sample_weight = fit_kwargs.get("sample_weight")
    eval_batch_size = eval_batch_size or batch_size
    predict_batch_size = predict_batch_size or batch_size
    num_examples = len(tf.nest.flatten(x)[0])
    assert num_examples % batch_size and num_examples % eval_batch_size and num_examples % predict_batch_size, (
        "every pass must end with a partial batch")
    assert 0 in shares, "the split must idle a replica"

    strategy = strategy_for(shares)
    reference, model = twin_models(build, strategy)
    ref_history = reference.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs)
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs)
    differences = Differences(atol, rtol)
    differences.weights(reference, model)
    differences.optimizer(reference.optimizer, model.optimizer)
    differences.logs("history", ref_history.history, history.history)

    expected = reference.evaluate(x, y, sample_weight=sample_weight, batch_size=eval_batch_size, verbose=0,
                                  return_dict=True)
    got = model.evaluate(x, y, sample_weight=sample_weight, batch_size=eval_batch_size, verbose=0, return_dict=True)
    differences.logs("evaluate", expected, got)
    differences.outputs(reference.predict(x, batch_size=predict_batch_size, verbose=0),
                        model.predict(x, batch_size=predict_batch_size, verbose=0))
    differences.report(name)
    return reference, model, differences


# ------------------------------------------------------------------------------------------------------------------
# Data: NumPy, fixed seeds
# ------------------------------------------------------------------------------------------------------------------
def padded_tokens(rng, n, steps, vocabulary, min_length=1):
    """Token ids in 1..vocabulary-1, each row padded with 0 after a random length (masked by mask_zero=True)."""
    tokens = rng.integers(1, vocabulary, size=(n, steps)).astype(np.int32)
    for row, length in enumerate(rng.integers(min_length, steps + 1, size=n)):
        tokens[row, length:] = 0
    return tokens


# ------------------------------------------------------------------------------------------------------------------
# 1. A masked RNN: Embedding(mask_zero=True), a GRU, dict outputs, sample weights (slow; the default run's workload
#    in section 3 has the same heads on a Transformer block)
# ------------------------------------------------------------------------------------------------------------------
VOCABULARY, STEPS, TAGS = 30, 7, 4


def masked_rnn_data(n=47, seed=1):
    rng = np.random.default_rng(seed)
    tokens = padded_tokens(rng, n, STEPS, VOCABULARY)
    tags = rng.integers(0, TAGS, size=(n, STEPS)).astype(np.int32)
    score = rng.normal(size=(n, 1)).astype(np.float32)
    example_weights = rng.uniform(0.2, 2.0, size=n).astype(np.float32)
    token_weights = rng.uniform(0.5, 1.5, size=(n, STEPS)).astype(np.float32)  # per token, for the tagger
    return tokens, {"tags": tags, "score": score}, {"tags": token_weights, "score": example_weights}


def masked_rnn():
    """A tagger and a sequence scorer over one masked recurrent encoder: per-token tags (the mask reaches the loss and
    the accuracy: only real tokens count) and one score per sequence, averaged over the real tokens' states."""
    tokens = keras.Input((STEPS,), dtype="int32", name="tokens")
    embedded = keras.layers.Embedding(VOCABULARY, 8, mask_zero=True)(tokens)
    states = keras.layers.GRU(8, return_sequences=True, kernel_regularizer=keras.regularizers.L2(1e-3))(embedded)
    tags = keras.layers.Dense(TAGS, name="tags")(states)
    score = keras.layers.Dense(1, name="score")(keras.layers.GlobalAveragePooling1D()(states))
    return keras.Model(tokens, {"tags": tags, "score": score})


def compile_masked_rnn(model):
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss={"tags": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "score": "mse"},
        loss_weights={"tags": 1.0, "score": 0.5},
        metrics={"tags": ["sparse_categorical_accuracy"], "score": ["mae"]},
        weighted_metrics={"score": [keras.metrics.MeanSquaredError(name="weighted_mse")]},
    )
    return model


@pytest.mark.slow
def test_a_masked_rnn_with_dict_outputs_and_sample_weights_matches_one_device():
    """Embedding(mask_zero=True) -> GRU -> a per-token head (masked loss and accuracy) and a masked-average score
    head; dict outputs with loss weights, sample weights per output (per token for the tagger), an L2 regularizer,
    Adam; split [3, 0, 2], batches of 10 over 47 examples (a last batch of 7), evaluate in 12s (last 11), predict in
    9s (last 2)."""
    x, y, weights = masked_rnn_data()
    check_against_one_device(lambda: compile_masked_rnn(masked_rnn()), x, y, shares=[3, 0, 2], batch_size=10,
                             fit_kwargs={"sample_weight": weights}, eval_batch_size=12, predict_batch_size=9,
                             name="masked RNN")


# ------------------------------------------------------------------------------------------------------------------
# 2. A Transformer block with AdamW, a warmup-cosine schedule and global_clipnorm (slow; section 3 runs the block in
#    the default run)
# ------------------------------------------------------------------------------------------------------------------
LENGTH, WORDS, WIDTH = 8, 40, 16


class TokenAndPositionEmbedding(keras.layers.Layer):
    """Token embeddings plus position embeddings looked up with arange(T); the padding mask comes from the tokens."""

    def __init__(self, length, vocabulary, dim, **kwargs):
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(vocabulary, dim, mask_zero=True)
        self.positions = keras.layers.Embedding(length, dim)

    def call(self, x):
        positions = keras.ops.arange(keras.ops.shape(x)[-1])
        return self.tokens(x) + self.positions(positions)

    def compute_mask(self, x, mask=None):
        return keras.ops.not_equal(x, 0)


class TransformerBlock(keras.layers.Layer):
    """Post-norm encoder block: self-attention over the unpadded tokens, then a feed-forward net (no dropout)."""

    def __init__(self, dim, heads, hidden, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True
        self.attention = keras.layers.MultiHeadAttention(heads, dim // heads)
        self.norm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.norm2 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.hidden = keras.layers.Dense(hidden, activation="gelu")
        self.out = keras.layers.Dense(dim)

    def call(self, x, mask=None):
        attention_mask = None if mask is None else keras.ops.logical_and(mask[:, :, None], mask[:, None, :])
        h = self.norm1(x + self.attention(x, x, attention_mask=attention_mask))
        return self.norm2(h + self.out(self.hidden(h)))


def transformer_classifier():
    tokens = keras.Input((LENGTH,), dtype="int32")
    h = TokenAndPositionEmbedding(LENGTH, WORDS, WIDTH)(tokens)
    h = TransformerBlock(WIDTH, heads=2, hidden=32)(h)
    h = keras.layers.GlobalAveragePooling1D()(h)  # over the real tokens only
    logits = keras.layers.Dense(1)(h)
    return keras.Model(tokens, logits)


def adamw_with_schedule():
    schedule = keras.optimizers.schedules.CosineDecay(
        1e-3, decay_steps=20, warmup_target=5e-3, warmup_steps=3, alpha=0.1)
    return keras.optimizers.AdamW(schedule, weight_decay=0.05, global_clipnorm=0.5)


def transformer_data(n=53, seed=2):
    rng = np.random.default_rng(seed)
    tokens = padded_tokens(rng, n, LENGTH, WORDS, min_length=2)
    labels = (np.sum(tokens % 3 == 0, axis=1) > 2).astype(np.float32)[:, None]
    return tokens, labels


def compile_transformer(model, auc=True):
    metrics = [keras.metrics.BinaryAccuracy(threshold=0.0)]
    if auc:  # left out under float16, whose rounding can move an output across one of AUC's thresholds
        metrics.append(keras.metrics.AUC(from_logits=True, name="auc"))
    model.compile(optimizer=adamw_with_schedule(), loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=metrics)
    return model


@pytest.mark.slow
def test_a_transformer_block_with_adamw_a_schedule_and_clipping_matches_one_device():
    """Token + positional Embedding (positions looked up with arange), MultiHeadAttention under a padding mask,
    LayerNormalization, a GELU feed-forward net, masked average pooling; AdamW with weight decay, a warmup-cosine
    schedule and global_clipnorm (it clips in most steps); AUC and accuracy metrics; split [5, 2, 0], batches of 8
    over 53 examples (a last batch of 5); evaluate in 10s (last 3), predict in 13s (last 1)."""
    x, y = transformer_data()
    check_against_one_device(lambda: compile_transformer(transformer_classifier()), x, y, shares=[5, 2, 0],
                             batch_size=8, epochs=2, eval_batch_size=10, predict_batch_size=13, name="transformer")


# ------------------------------------------------------------------------------------------------------------------
# 3. A Transformer encoder with a masked GRU on top, tagging tokens and scoring sequences (default run)
# ------------------------------------------------------------------------------------------------------------------
def transformer_tagger():
    """Token + positional Embedding, the Transformer block, then a GRU over the block's states (an encoder-plus-RNN
    tagger): per-token tags and a score per sequence, both under the padding mask."""
    tokens = keras.Input((LENGTH,), dtype="int32", name="tokens")
    h = TokenAndPositionEmbedding(LENGTH, WORDS, WIDTH)(tokens)
    h = TransformerBlock(WIDTH, heads=2, hidden=32)(h)
    states = keras.layers.GRU(8, return_sequences=True, kernel_regularizer=keras.regularizers.L2(1e-3))(h)
    tags = keras.layers.Dense(TAGS, name="tags")(states)
    score = keras.layers.Dense(1, name="score")(keras.layers.GlobalAveragePooling1D()(states))
    model = keras.Model(tokens, {"tags": tags, "score": score})
    model.compile(
        optimizer=adamw_with_schedule(),
        loss={"tags": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "score": "mse"},
        loss_weights={"tags": 1.0, "score": 0.5},
        metrics={"tags": ["sparse_categorical_accuracy"], "score": ["mae"]},
        weighted_metrics={"score": [keras.metrics.MeanSquaredError(name="weighted_mse")]},
    )
    return model


def tagging_data(n=47, seed=10):
    rng = np.random.default_rng(seed)
    tokens = padded_tokens(rng, n, LENGTH, WORDS, min_length=2)
    y = {"tags": rng.integers(0, TAGS, size=(n, LENGTH)).astype(np.int32),
         "score": rng.normal(size=(n, 1)).astype(np.float32)}
    weights = {"tags": rng.uniform(0.5, 1.5, size=(n, LENGTH)).astype(np.float32),
               "score": rng.uniform(0.2, 2.0, size=n).astype(np.float32)}
    return tokens, y, weights


def test_a_transformer_encoder_with_a_masked_gru_tagger_matches_one_device():
    """The default run's workload, the patterns of sections 1 and 2 in one model: positions looked up with arange,
    MultiHeadAttention under the padding mask, LayerNormalization, a masked GRU, a per-token loss and accuracy that
    count real tokens only, dict outputs with loss weights and per-output sample weights (per token for the tags),
    an L2 regularizer, AdamW with weight decay, a warmup-cosine schedule and global_clipnorm. Split [3, 0, 2],
    batches of 10 over 47 examples (a last batch of 7), evaluate in 12s (last 11), predict in 9s (last 2)."""
    x, y, weights = tagging_data()
    check_against_one_device(transformer_tagger, x, y, shares=[3, 0, 2], batch_size=10,
                             fit_kwargs={"sample_weight": weights}, eval_batch_size=12, predict_batch_size=9,
                             name="Transformer encoder + GRU tagger")


# ------------------------------------------------------------------------------------------------------------------
# Workloads with convolutions run in a fresh process with oneDNN off
# ------------------------------------------------------------------------------------------------------------------
# On logical CPU devices, oneDNN's Conv2DBackpropFilter can crash under hetero_cs (a segmentation fault, "corrupted
# size vs. prev_size", or AbortedError "could not create a primitive descriptor for the reorder primitive"; seen with
# replicas holding slices of unlike sizes; see "Known limits" in the README). A crash would end the whole test session,
# so these tests run their workload in a child process with TF_ENABLE_ONEDNN_OPTS=0, set before TensorFlow is
# imported there. The child configures the same logical CPU devices as this directory's conftest.
CHILD_PROCESS = """
import sys
sys.path.insert(0, {directory!r})
import conftest  # the logical CPU devices, before TensorFlow initialises
import test_real_workloads
test_real_workloads.{function}(*{args!r})
"""


def run_in_child_process_without_onednn(function, *args, timeout_s=900):
    code = CHILD_PROCESS.format(directory=os.path.dirname(os.path.abspath(__file__)), function=function, args=args)
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout_s)
    print(done.stdout)
    assert done.returncode == 0, f"{function} ended with status {done.returncode}:\n{done.stdout[-3000:]}" \
                                 f"\n{done.stderr[-6000:]}"


# ------------------------------------------------------------------------------------------------------------------
# 4. A ResNet-style CNN with BatchNormalization and class weights (slow)
# ------------------------------------------------------------------------------------------------------------------
def residual_cnn():
    """Two residual stages: 3x3 convolutions with BatchNormalization and an identity shortcut, then a strided 3x3
    convolution whose shortcut is a strided 1x1 projection; global average pooling and a 4-way classifier."""
    def conv_bn(h, filters, kernel, strides=1, activation=True):
        h = keras.layers.Conv2D(filters, kernel, strides=strides, padding="same", use_bias=False)(h)
        h = keras.layers.BatchNormalization()(h)
        return keras.layers.Activation("relu")(h) if activation else h

    images = keras.Input((12, 12, 3))
    h = conv_bn(images, 8, 3)
    shortcut = h
    h = conv_bn(h, 8, 3)
    h = conv_bn(h, 8, 3, activation=False)
    h = keras.layers.Activation("relu")(keras.layers.Add()([h, shortcut]))
    shortcut = conv_bn(h, 16, 1, strides=2, activation=False)
    h = conv_bn(h, 16, 3, strides=2)
    h = conv_bn(h, 16, 3, activation=False)
    h = keras.layers.Activation("relu")(keras.layers.Add()([h, shortcut]))
    logits = keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(images, logits)
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["sparse_categorical_accuracy", keras.metrics.SparseTopKCategoricalAccuracy(2, name="top2")],
                  weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="weighted_accuracy")])
    return model


def resnet_cnn_workload():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(45, 12, 12, 3)).astype(np.float32)
    y = rng.integers(0, 4, size=45).astype(np.int32)
    check_against_one_device(residual_cnn, x, y, shares=[3, 0, 2], batch_size=10, epochs=2,
                             fit_kwargs={"class_weight": {0: 1.0, 1: 2.0, 2: 0.5, 3: 1.5}},
                             eval_batch_size=12, predict_batch_size=11, name="ResNet-style CNN")


@pytest.mark.slow
def test_a_resnet_style_cnn_with_batch_normalization_and_class_weights_matches_one_device():
    """Residual stages of 3x3 and strided convolutions with BatchNormalization (training statistics over the whole
    global batch, moving statistics compared too), a 1x1 projection shortcut, Adam, class weights and a weighted
    metric; split [3, 0, 2], batches of 10 over 45 images (last 5), evaluate in 12s (last 9), predict in 11s (last 1).
    Runs in a child process with TF_ENABLE_ONEDNN_OPTS=0 (the oneDNN crash above)."""
    run_in_child_process_without_onednn("resnet_cnn_workload")


# ------------------------------------------------------------------------------------------------------------------
# 5. TensorFlow's custom-training tutorial: compute_average_loss in strategy.run, metrics, tf.train.Checkpoint (slow)
# ------------------------------------------------------------------------------------------------------------------
def tutorial_cnn():
    return keras.Sequential([
        keras.Input((12, 12, 1)),
        keras.layers.Conv2D(8, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(16, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3)),
        keras.layers.Dense(4),
    ])


def tutorial_loop(strategy, train, test, epochs, initial_weights):
    """The tutorial's loop as written there: the same code runs on one device (strategy None: TensorFlow's default
    strategy, one replica) and under a distribution strategy."""
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

        def compute_loss(labels, predictions, model_losses):
            per_example_loss = loss_object(labels, predictions)
            loss = tf.nn.compute_average_loss(per_example_loss)  # no global_batch_size, as in the tutorial
            if model_losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
            return loss

        test_loss = keras.metrics.Mean(name="test_loss")
        train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_accuracy = keras.metrics.SparseCategoricalAccuracy(name="test_accuracy")
        model = tutorial_cnn()
        model.set_weights(initial_weights)
        optimizer = keras.optimizers.Adam(1e-2)
        checkpoint = tf.train.Checkpoint(optimizer=optimizer, model=model)

    def train_step(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = compute_loss(labels, predictions, model.losses)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        train_accuracy.update_state(labels, predictions)
        return loss

    def test_step(inputs):
        images, labels = inputs
        predictions = model(images, training=False)
        test_loss.update_state(loss_object(labels, predictions))
        test_accuracy.update_state(labels, predictions)

    if strategy is not None:
        @tf.function
        def distributed_train_step(dataset_inputs):
            per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

        @tf.function
        def distributed_test_step(dataset_inputs):
            return strategy.run(test_step, args=(dataset_inputs,))

        train, test = strategy.experimental_distribute_dataset(train), strategy.experimental_distribute_dataset(test)
    else:
        distributed_train_step, distributed_test_step = tf.function(train_step), tf.function(test_step)

    rows = []
    for _ in range(epochs):
        total_loss, num_batches = 0.0, 0
        for element in train:
            total_loss += distributed_train_step(element)
            num_batches += 1
        train_loss = total_loss / num_batches
        for element in test:
            distributed_test_step(element)
        rows.append({"train_loss": float(train_loss), "train_accuracy": float(train_accuracy.result()),
                     "test_loss": float(test_loss.result()), "test_accuracy": float(test_accuracy.result())})
        for metric in (test_loss, train_accuracy, test_accuracy):
            metric.reset_state()
    return model, optimizer, checkpoint, rows


def custom_loop_tutorial_workload(directory):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(53, 12, 12, 1)).astype(np.float32)
    y = rng.integers(0, 4, size=53).astype(np.int32)
    train = tf.data.Dataset.from_tensor_slices((x[:41], y[:41])).batch(8)  # 5 batches of 8, then 1
    test = tf.data.Dataset.from_tensor_slices((x[41:], y[41:])).batch(5)  # 5, 5, 2
    keras.utils.set_random_seed(SEED)
    initial_weights = tutorial_cnn().get_weights()
    reference, ref_optimizer, _, expected_rows = tutorial_loop(None, train, test, 2, initial_weights)
    strategy = strategy_for([2, 3, 0])
    model, optimizer, checkpoint, rows = tutorial_loop(strategy, train, test, 2, initial_weights)

    differences = Differences(ATOL)
    differences.weights(reference, model)
    differences.optimizer(ref_optimizer, optimizer)
    for epoch, (expected, got) in enumerate(zip(expected_rows, rows)):
        differences.logs(f"epoch {epoch}", expected, got)
    differences.outputs(reference.predict(x, batch_size=7, verbose=0), model.predict(x, batch_size=7, verbose=0))

    # The tutorial's last part: a checkpoint written under the strategy, restored into a model without one.
    path = checkpoint.save(os.path.join(directory, "ckpt"))
    restored, restored_optimizer = tutorial_cnn(), keras.optimizers.Adam(1e-2)
    restored_optimizer.build(restored.trainable_variables)
    tf.train.Checkpoint(optimizer=restored_optimizer, model=restored).restore(path).assert_consumed()
    differences.weights(reference, restored)
    differences.optimizer(ref_optimizer, restored_optimizer)
    differences.report("custom-loop tutorial")


@pytest.mark.slow
def test_tensorflows_custom_training_tutorial_matches_one_device(tmp_path):
    """TensorFlow's "Custom training with tf.distribute.Strategy" loop as written there: per-example losses through
    tf.nn.compute_average_loss without global_batch_size, the L2 term through tf.nn.scale_regularization_loss, an
    accuracy metric updated in the replica function, strategy.reduce(SUM), a test step feeding Mean and accuracy
    metrics, then tf.train.Checkpoint saved under the strategy and restored into a plain model. Split [2, 3, 0],
    batches of 8 over 41 images (last 1), test batches of 5 over 12 (last 2). Its model has convolutions: it runs in a
    child process with TF_ENABLE_ONEDNN_OPTS=0."""
    run_in_child_process_without_onednn("custom_loop_tutorial_workload", str(tmp_path))


# ------------------------------------------------------------------------------------------------------------------
# 6. Dict inputs and outputs: tabular features, a category, words; per-output sample weights; 4 replicas (slow)
# ------------------------------------------------------------------------------------------------------------------
def customer_data(n=50, seed=5):
    rng = np.random.default_rng(seed)
    x = {"numeric": rng.normal(loc=3.0, scale=2.0, size=(n, 6)).astype(np.float32),
         "category": rng.integers(0, 10, size=(n, 1)).astype(np.int32),
         "words": padded_tokens(rng, n, 5, 50)}
    y = {"price": (x["numeric"][:, :1] * 0.5 + rng.normal(size=(n, 1))).astype(np.float32),
         "churn": (rng.uniform(size=(n, 1)) < 0.4).astype(np.float32)}
    weights = {"price": rng.uniform(0.5, 1.5, size=n).astype(np.float32),
               "churn": rng.uniform(0.2, 3.0, size=n).astype(np.float32)}
    return x, y, weights


CUSTOMER_OPTIMIZERS = {
    "rmsprop": lambda: keras.optimizers.RMSprop(5e-3, momentum=0.5, centered=True),
    "nadam": lambda: keras.optimizers.Nadam(5e-3),
}


def customer_model(numeric_sample, optimizer="rmsprop"):
    numeric = keras.Input((6,), name="numeric")
    category = keras.Input((1,), dtype="int32", name="category")
    words = keras.Input((5,), dtype="int32", name="words")
    normalization = keras.layers.Normalization()
    normalization.adapt(numeric_sample)
    h = keras.layers.Concatenate()([
        normalization(numeric),
        keras.layers.Flatten()(keras.layers.Embedding(10, 4)(category)),
        keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 6, mask_zero=True)(words)),
    ])
    # No bias before BatchNormalization: its gradient is 0 up to rounding, which adaptive optimizers turn into steps
    # of the learning rate's size in a direction rounding picks (on one device too).
    h = keras.layers.Dense(16, use_bias=False)(h)
    h = keras.layers.Activation("relu")(keras.layers.BatchNormalization()(h))
    outputs = {"price": keras.layers.Dense(1, name="price")(h),
               "churn": keras.layers.Dense(1, activation="sigmoid", name="churn")(h)}
    model = keras.Model({"numeric": numeric, "category": category, "words": words}, outputs)
    model.compile(
        optimizer=CUSTOMER_OPTIMIZERS[optimizer](),
        loss={"price": keras.losses.Huber(delta=0.5), "churn": keras.losses.BinaryCrossentropy()},
        loss_weights={"price": 0.7, "churn": 1.0},
        metrics={"price": [keras.metrics.MeanAbsoluteError(name="mae")],
                 "churn": [keras.metrics.AUC(name="auc"), keras.metrics.Precision(name="precision"),
                           keras.metrics.Recall(name="recall")]},
        weighted_metrics={"price": [keras.metrics.RootMeanSquaredError(name="rmse")],
                          "churn": [keras.metrics.BinaryAccuracy(name="accuracy")]},
    )
    return model


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", [
    "rmsprop",
    "nadam",  # Nadam writes its _u_product through Keras' TFOptimizer.assign in the replica step
])
def test_dict_inputs_and_outputs_with_per_output_sample_weights_match_one_device(optimizer):
    """A model of three named inputs (numbers through an adapted Normalization, a category through an Embedding,
    padded words through a masked Embedding and average) and two named outputs (a Huber-loss regression and a
    sigmoid classifier), per-output sample weights and loss weights, AUC/precision/recall and weighted metrics,
    BatchNormalization; RMSprop (centered, with momentum), Nadam, or Adam with an exponential moving average of the
    weights (the last two fail: see their reasons); four replicas, split [2, 0, 3, 1], batches of 12 over 50 examples
    (last 2, fewer than the replicas), evaluate in 16s (last 2), predict in 7s (last 1)."""
    x, y, weights = customer_data()
    check_against_one_device(lambda: customer_model(x["numeric"], optimizer), x, y, shares=[2, 0, 3, 1], batch_size=12,
                             fit_kwargs={"sample_weight": weights}, eval_batch_size=16, predict_batch_size=7,
                             name=f"dict inputs and outputs ({optimizer})")


# ------------------------------------------------------------------------------------------------------------------
# 7. Sparse embedding gradients and class weights: a bag-of-words classifier over a large vocabulary (slow); a sparse
#    input matrix, refused (default run)
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adam", "sgd_nesterov", "adagrad"])
def test_a_large_vocabulary_embedding_with_sparse_gradients_and_class_weights_matches_one_device(optimizer):
    """An Embedding of 3000 rows of which each batch touches a few dozen: its gradient is a tf.IndexedSlices, which
    the optimizers apply as sparse updates (rows no batch touched must stay as they were, Adam's and Adagrad's slots
    too). Masked average, a 3-way softmax, class weights, top-2 accuracy; split [0, 2, 1], batches of 9 over 40
    examples (last 4)."""
    rng = np.random.default_rng(6)
    x = padded_tokens(rng, 40, 12, 3000, min_length=3)
    y = (x[:, 0] % 3).astype(np.int32)

    def build():
        model = keras.Sequential([
            keras.Input((12,), dtype="int32"),
            keras.layers.Embedding(3000, 8, mask_zero=True),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3, activation="softmax"),
        ])
        chosen = {"adam": lambda: keras.optimizers.Adam(0.02),
                  "sgd_nesterov": lambda: keras.optimizers.SGD(0.5, momentum=0.9, nesterov=True),
                  "adagrad": lambda: keras.optimizers.Adagrad(0.2)}[optimizer]()
        model.compile(optimizer=chosen, loss="sparse_categorical_crossentropy",
                      metrics=["sparse_categorical_accuracy",
                               keras.metrics.SparseTopKCategoricalAccuracy(2, name="top2")])
        return model

    check_against_one_device(build, x, y, shares=[0, 2, 1], batch_size=9,
                             fit_kwargs={"class_weight": {0: 1.0, 1: 3.0, 2: 0.5}}, eval_batch_size=11,
                             predict_batch_size=13, name=f"sparse embedding ({optimizer})")


def test_a_sparse_input_matrix_is_refused_with_an_input_error():
    """A SciPy CSR matrix (a TF-IDF bag of words as scikit-learn gives it) reaches the step as a tf.SparseTensor,
    which the strategy does not cut: a clear InputError, not a silent wrong answer."""
    scipy_sparse = pytest.importorskip("scipy.sparse")
    rng = np.random.default_rng(7)
    dense = np.where(rng.uniform(size=(23, 30)) < 0.1, rng.uniform(size=(23, 30)), 0.0).astype(np.float32)
    y = rng.integers(0, 2, size=(23, 1)).astype(np.float32)
    with strategy_for([3, 0, 2]).scope():
        model = keras.Sequential([keras.Input((30,), sparse=True), keras.layers.Dense(1, activation="sigmoid")])
        model.compile(optimizer="adam", loss="binary_crossentropy")
    with pytest.raises(hetero_cs.errors.InputError, match="SparseTensor"):
        model.fit(scipy_sparse.csr_matrix(dense), y, batch_size=10, epochs=1, verbose=0)


# ------------------------------------------------------------------------------------------------------------------
# 8. Callbacks, ModelCheckpoint to .keras, load_model inside strategy.scope() and fit on (slow)
# ------------------------------------------------------------------------------------------------------------------
class BatchLogs(keras.callbacks.Callback):
    """Every batch's logs (the running loss and metrics Keras shows in the progress bar) and the learning rate."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def on_train_batch_end(self, batch, logs=None):
        row = {f"batch_{key}": value for key, value in (logs or {}).items()}
        row["learning_rate"] = float(self.model.optimizer.learning_rate.numpy())
        self.rows.append(row)


def tabular_regressor():
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, use_bias=False)(inputs)  # no bias before BatchNormalization (see customer_model)
    h = keras.layers.Activation("relu")(keras.layers.BatchNormalization()(h))
    h = keras.layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3))(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer=keras.optimizers.Adam(2e-2), loss="mse",
                  metrics=[keras.metrics.MeanAbsoluteError(name="mae")])
    return model


@pytest.mark.slow
def test_checkpoint_and_resume_with_callbacks_matches_one_device(tmp_path):
    """fit with validation data and callbacks: ModelCheckpoint(save_best_only) to a .keras file, ReduceLROnPlateau
    (its min_delta makes it halve the learning rate after every epoch, so it acts on the validation loss), a callback
    recording every batch's logs; then keras.models.load_model of the checkpoint inside strategy.scope() (the
    one-device model loads its own outside) and fit on from initial_epoch. Split [3, 0, 2], batches of 10 over 43
    examples (last 3), validation batches of 6 over 17 (last 5)."""
    rng = np.random.default_rng(8)
    x = rng.normal(size=(60, 8)).astype(np.float32)
    y = (np.sin(x[:, :1]) + 0.5 * x[:, 1:2] + 0.1 * rng.normal(size=(60, 1))).astype(np.float32)
    (x_train, y_train), (x_val, y_val) = (x[:43], y[:43]), (x[43:], y[43:])
    strategy = strategy_for([3, 0, 2])
    reference, model = twin_models(tabular_regressor, strategy)

    def fit(model, path, **kwargs):
        batch_logs = BatchLogs()
        callbacks = [keras.callbacks.ModelCheckpoint(path, monitor="val_loss", save_best_only=True),
                     keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0, min_delta=100.0),
                     batch_logs]
        history = model.fit(x_train, y_train, batch_size=10, shuffle=False, verbose=0, callbacks=callbacks,
                            validation_data=(x_val, y_val), validation_batch_size=6, **kwargs)
        return history.history, batch_logs.rows

    differences = Differences(ATOL)
    ref_path, path = str(tmp_path / "reference.keras"), str(tmp_path / "strategy.keras")
    expected, got = fit(reference, ref_path, epochs=3), fit(model, path, epochs=3)
    differences.logs("history", expected[0], got[0])
    assert len(got[1]) == len(expected[1])
    for expected_row, row in zip(expected[1], got[1]):
        differences.logs("batch logs", expected_row, row)

    reference = keras.models.load_model(ref_path)
    with strategy.scope():
        model = keras.models.load_model(path)
    differences.weights(reference, model)
    differences.optimizer(reference.optimizer, model.optimizer)

    expected, got = fit(reference, ref_path, initial_epoch=3, epochs=5), fit(model, path, initial_epoch=3, epochs=5)
    differences.logs("resumed history", expected[0], got[0])
    for expected_row, row in zip(expected[1], got[1]):
        differences.logs("resumed batch logs", expected_row, row)
    differences.weights(reference, model)
    differences.optimizer(reference.optimizer, model.optimizer)
    differences.logs("evaluate", reference.evaluate(x, y, batch_size=7, verbose=0, return_dict=True),
                     model.evaluate(x, y, batch_size=7, verbose=0, return_dict=True))
    differences.outputs(reference.predict(x, batch_size=7, verbose=0), model.predict(x, batch_size=7, verbose=0))
    differences.report("checkpoint and resume")


# ------------------------------------------------------------------------------------------------------------------
# 9. Mixed precision: the Transformer block under mixed_float16 and its LossScaleOptimizer (slow)
# ------------------------------------------------------------------------------------------------------------------
# float16 activations: a slice sums its products in another order than the whole batch. The float32 weights and the
# logged figures stay within FP16_ATOL; outputs of a few units in float16 differ by a unit in the last place
# (0.004 at 5), hence a relative tolerance of two such units as well.
FP16_ATOL, FP16_RTOL = 1e-3, 2e-3


@pytest.mark.slow
def test_the_transformer_block_under_mixed_float16_matches_one_device_within_float16_tolerance():
    """The Transformer block of the default run under the mixed_float16 policy: compile wraps AdamW (schedule,
    clipping) in a LossScaleOptimizer with dynamic scaling; the scale, its counter and the float32 weights are
    compared within float16 tolerance. Split [5, 2, 0], batches of 8 over 53 examples (last 5)."""
    x, y = transformer_data()
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        reference, model, _ = check_against_one_device(
            lambda: compile_transformer(transformer_classifier(), auc=False), x, y, shares=[5, 2, 0], batch_size=8,
            eval_batch_size=10, predict_batch_size=13, atol=FP16_ATOL, rtol=FP16_RTOL,
            name="transformer, mixed_float16")
    finally:
        keras.mixed_precision.set_global_policy(previous)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    differences = Differences(FP16_ATOL, FP16_RTOL)
    differences.optimizer(reference.optimizer.inner_optimizer, model.optimizer.inner_optimizer)
    assert float(model.optimizer.dynamic_scale) == float(reference.optimizer.dynamic_scale)


# ------------------------------------------------------------------------------------------------------------------
# 10. train_step overrides: Keras' guide with compute_loss, and a loss the step reduces itself (slow)
# ------------------------------------------------------------------------------------------------------------------
class GuideTrainStep(keras.Model):
    """Keras' "Customizing what happens in fit()" guide, with sample weights: compute_loss, apply_gradients, then
    every metric (the loss tracker given the loss, the compiled metrics given y and y_pred)."""

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred, sample_weight=sample_weight)
        return {m.name: m.result() for m in self.metrics}


def masked_lstm_tagger():
    """The guide's loop updates every metric with (y, y_pred): one output, as there."""
    tokens = keras.Input((STEPS,), dtype="int32")
    embedded = keras.layers.Embedding(VOCABULARY, 8, mask_zero=True)(tokens)
    states = keras.layers.Bidirectional(
        keras.layers.LSTM(6, return_sequences=True, kernel_regularizer=keras.regularizers.L2(1e-3)))(embedded)
    model = GuideTrainStep(tokens, keras.layers.Dense(TAGS)(states))
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["sparse_categorical_accuracy"],
                  weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="weighted_accuracy")])
    return model


@pytest.mark.slow
def test_a_guide_style_train_step_on_a_masked_bidirectional_lstm_matches_one_device():
    """The guide's train_step (compute_loss with sample weights, then the metrics) on a masked bidirectional LSTM
    tagger with an L2 regularizer: the mask and the per-token sample weights reach compute_loss and the compiled
    metrics. Split [3, 0, 2], batches of 10 over 47 examples (last 7)."""
    x, y, weights = masked_rnn_data()
    check_against_one_device(masked_lstm_tagger, x, y["tags"], shares=[3, 0, 2], batch_size=10,
                             fit_kwargs={"sample_weight": weights["tags"]}, eval_batch_size=12, predict_batch_size=9,
                             name="guide train_step, masked bidirectional LSTM")


class OwnLossForecaster(keras.Model):
    """A time-series forecaster whose train_step and test_step reduce their own loss: tf.reduce_mean of the squared
    error plus the layers' L2 terms, then tape.gradient; the loss and MAE are tracked by metrics of its own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.encoder = keras.layers.GRU(8, kernel_regularizer=keras.regularizers.L2(1e-3))
        self.head = keras.layers.Dense(1)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae = keras.metrics.MeanAbsoluteError(name="mae")

    def call(self, x):
        return self.head(self.encoder(x))

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae]

    def own_loss(self, y, y_pred):
        return tf.reduce_mean(tf.square(y - y_pred)) + tf.add_n(self.losses)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.own_loss(y, y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        self.loss_tracker.update_state(loss)
        self.mae.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        self.loss_tracker.update_state(self.own_loss(y, y_pred))
        self.mae.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


@pytest.mark.slow
def test_a_train_step_that_reduces_its_own_loss_on_a_gru_forecaster_matches_one_device():
    """A train_step (and test_step) override that reduces its loss with tf.reduce_mean, adds the L2 terms and calls
    tape.gradient itself, on a GRU over windows of a noisy series; RMSprop with global_clipnorm. Split [5, 2, 0],
    batches of 12 over 58 windows (last 10), evaluate in 9s (last 4), predict in 8s (last 2)."""
    rng = np.random.default_rng(9)
    series = np.sin(np.arange(80) / 4.0) + 0.1 * rng.normal(size=80)
    windows = np.stack([series[i:i + 10] for i in range(58)])
    x = np.stack([windows, np.cos(np.arange(58)[:, None] + np.arange(10))], axis=-1).astype(np.float32)
    y = series[10:68, None].astype(np.float32)

    def build():
        model = OwnLossForecaster()
        model(x[:1])  # builds the layers
        model.compile(optimizer=keras.optimizers.RMSprop(1e-2, global_clipnorm=1.0))
        return model

    check_against_one_device(build, x, y, shares=[5, 2, 0], batch_size=12, eval_batch_size=9, predict_batch_size=8,
                             name="own-mean train_step, GRU forecaster")
