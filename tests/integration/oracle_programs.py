"""Random valid Keras training programs, rendered as standalone scripts, for the generative oracle (test_oracle.py).

A :class:`Program` is a small record of choices (data, model, loss form, training loop, split); :func:`render` turns it
into the source of a script whose ``train(strategy)`` trains the program under a strategy (or on one device with
``strategy=None``) and returns what the oracle compares: weights, optimizer variables, the History, evaluate's logs
and predict's outputs. The same source runs both ways, so a difference can only come from the strategy. Hypothesis
draws programs (:func:`programs`) and shrinks a failing one to its smallest form; the failure message prints it as a
script that runs on its own (``python program.py``).

Every form the library accepts as exact has a generator case here: a program either matches one device, or is refused
with a hetero_cs error before its first update (the forms that may be refused are listed in ``MAY_REFUSE``).
"""

from __future__ import annotations

import dataclasses
import textwrap

from hypothesis import strategies as st

DATA = ("vectors", "two_inputs", "images", "sequences", "tokens")
LOSSES = (
    "keras", "keras_sum", "mean_with_sample_weight", "sample_weight", "class_weight", "two_outputs", "categorical",
    "compute_loss_mean", "compute_loss_sum", "add_loss_keras", "add_loss_tensor", "regularizers", "loss_class_scalar",
    "loss_class_dunder",
    "masked_ratio", "stop_gradient", "nonlinear", "in_batch", "concat_batch", "gradient_penalty",
)
LOOPS = ("fit", "train_step", "custom_loop", "grad_accum", "mixed_precision", "on_batch")
CUSTOM_LOSSES = ("compute_average_loss", "reduce_mean", "reduce_mean_over_replicas", "reduce_sum_over_b",
                 "masked_ratio", "boolean_mask_mean", "stop_gradient", "nonlinear", "in_batch", "regularized",
                 "l2_loss", "learned_weight", "scale_regularization", "scale_activity")
# Forms a split cannot reproduce: refused with a hetero_cs error (BatchCouplingError / LossPatternError).
MAY_REFUSE = frozenset({"nonlinear", "in_batch", "gradient_penalty"})  # the last: second-order gradients of some
# layers (pooling, recurrent loops) are read as mixing examples
# Data kinds whose models hold BatchNormalization in some programs: micro-batches refuse them (their statistics).
BODIES = {
    "vectors": ("dense", "dense_relu", "layer_norm", "batch_norm", "sync_batch_norm", "regularized_dense",
                "python_rows"),
    "two_inputs": ("dense", "dense_relu", "layer_norm"),
    "images": ("conv2d", "batch_norm", "pool", "conv2d_relu", "conv_transpose", "upsample", "zero_pad"),
    "sequences": ("conv1d", "lstm", "gru", "attention", "layer_norm", "dense", "bidirectional", "causal_tile",
                  "causal_stack"),
    "tokens": ("lstm", "gru", "dense", "attention", "bidirectional"),
}


@dataclasses.dataclass(frozen=True)
class Program:
    data: str
    form: str  # "sequential", "functional" or "subclassed"
    body: tuple
    loss: str
    loop: str
    optimizer: str
    shares: tuple
    batch_size: int
    examples: int
    epochs: int
    seed: int
    # The StepStatistics metric may be drawn (see _counts_steps); False for the two-worker runs, whose metric
    # state (Keras' own, ON_READ and summed) counts a step once per replica, as under stock strategies.
    step_statistics: bool = True

    @property
    def classification(self) -> bool:
        return self.loss in ("class_weight", "in_batch", "categorical") or self.data == "tokens"

    @property
    def kind(self) -> str:
        """The form this program tests, for the refusal table: its loop, and its loss form."""
        return f"{self.loop}:{self.loss}"


def _valid(program: Program) -> bool:
    loop, loss = program.loop, program.loss
    if loop == "custom_loop":
        return loss in CUSTOM_LOSSES
    if loss in CUSTOM_LOSSES and loss not in LOSSES:
        return False
    if loss == "gradient_penalty":  # a gradient with respect to float inputs, in a train_step
        return loop == "train_step" and program.data in ("vectors", "images", "sequences")
    if loop == "train_step":
        return loss in ("keras", "sample_weight", "stop_gradient", "nonlinear", "masked_ratio", "compute_loss_mean",
                        "add_loss_tensor", "regularizers", "concat_batch")
    if loss == "two_outputs" and (program.form == "sequential" or program.data == "two_inputs"):
        return False
    if loss == "concat_batch":
        return False  # a train_step's form only
    if loss in ("class_weight", "categorical") and program.data == "tokens":
        return False
    if loop == "mixed_precision" and loss in ("mean_with_sample_weight", "add_loss_tensor", "add_loss_keras"):
        return False  # Keras itself fails on one device (a float16 sum added to float32 ones)
    if program.data == "two_inputs" and program.form == "sequential":
        return False
    return True


QUICK_LOOPS = ("fit", "train_step", "custom_loop", "grad_accum")  # the default run's: mixed precision traces slowly
_RECURRENT = ("lstm", "gru", "attention", "bidirectional")


@st.composite
def programs(draw, *, loops=LOOPS, replicas=(2, 4), data_kinds=DATA, max_layers: int = 3,
             max_recurrent: int = 3, one_card: bool = False) -> Program:
    """A random valid program (hypothesis strategy); shrinks toward small plain ones (vectors, Dense, fit).

    ``max_layers`` bounds the hidden layers, ``max_recurrent`` how many of them are LSTM, GRU or attention layers
    (the slowest to trace under a strategy: the default run keeps one). ``one_card``: the split gives every example
    to one replica (a card alone)."""
    data = draw(st.sampled_from(data_kinds), label="data")
    loop = draw(st.sampled_from(loops), label="loop")
    loss = draw(st.sampled_from(CUSTOM_LOSSES if loop == "custom_loop" else LOSSES), label="loss")
    form = draw(st.sampled_from(("sequential", "functional", "subclassed")), label="form")
    body = tuple(draw(st.lists(st.sampled_from(BODIES[data]), min_size=1, max_size=max_layers)
                      .filter(lambda b: sum(t in _RECURRENT for t in b) <= max_recurrent), label="body"))
    num_replicas = draw(st.integers(*replicas), label="replicas")
    if one_card:
        alone = draw(st.integers(0, num_replicas - 1), label="card alone")
        shares = tuple(int(i == alone) * draw(st.integers(1, 4), label="share") for i in range(num_replicas))
    else:
        shares = tuple(draw(st.lists(st.integers(0, 4), min_size=num_replicas, max_size=num_replicas)
                            .filter(lambda s: sum(s) > 0), label="shares"))
    batch_size = draw(st.integers(4, 12), label="batch_size")
    short = draw(st.integers(0, batch_size - 1), label="short")  # a partial last batch of batch_size - short
    program = Program(
        data=data, form=form, body=body, loss=loss, loop=loop,
        optimizer=draw(st.sampled_from(("sgd", "adam", "adam_clipnorm")), label="optimizer"),
        shares=shares, batch_size=batch_size, examples=2 * batch_size - short,
        epochs=draw(st.integers(1, 2), label="epochs"), seed=draw(st.integers(0, 2**16), label="seed"),
    )
    if not _valid(program):
        program = dataclasses.replace(program, loss="keras", form="functional")
    return program


# ---------------------------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------------------------
def render(program: Program) -> str:
    """The program as the source of a standalone script (see the module docstring)."""
    parts = [_HEADER.format(program=program), _data(program), _layers(program), _model(program), _loss_parts(program),
             _train(program), _MAIN.format(shares=list(program.shares))]
    return "\n\n".join(textwrap.dedent(p).strip("\n") for p in parts) + "\n"


_HEADER = '''
"""A program drawn by hetero_cs's generative oracle: {program}."""
import numpy as np
import tensorflow as tf
import keras

import hetero_cs

SEED = {program.seed}
BATCH_SIZE = {program.batch_size}
EXAMPLES = {program.examples}
EPOCHS = {program.epochs}
'''

_MAIN = '''
def save(record, path):
    """The results of a run, as the oracle compares them (arrays in an .npz, logs in a .json beside it)."""
    import json
    import pathlib

    arrays = {{}}
    for key in ("weights", "optimizer", "predict"):
        value = record.get(key, [])
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            arrays[f"{{key}}_{{i}}"] = np.asarray(item)
    np.savez(path, **arrays)
    logs = {{key: record[key] for key in ("history", "evaluate", "phase", "refused") if key in record}}
    pathlib.Path(path).with_suffix(".json").write_text(json.dumps(logs, default=float))


if __name__ == "__main__":
    import sys

    shares = {shares}
    if len(sys.argv) > 1:  # a worker of `hetero-cs launch --workers 2 -- python program.py OUT`
        strategy = hetero_cs.HeteroMultiWorkerMirroredStrategy(batch_split=shares)
        record = {{}}
        try:
            train(strategy, record)
        except hetero_cs.HeteroCSError as exc:
            record["refused"] = f"{{type(exc).__name__}}: {{exc}}"
        if strategy.cluster_resolver.task_id == 0:
            save(record, sys.argv[1])
        sys.exit(0)
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 5)
    strategy = hetero_cs.HeteroCentralStorageStrategy(
        [f"/cpu:{{i}}" for i in range(1, len(shares) + 1)], batch_split=shares, profile_cache=False)
    expected, got = train(None), train(strategy)
    for key in expected:
        print(key, "one device:", expected[key])
        print(key, "hetero_cs: ", got[key])
'''


def _data(program: Program) -> str:
    d = program.data
    lines = ["def make_data():", "    rng = np.random.default_rng(SEED)", "    n = EXAMPLES"]
    if d in ("vectors", "two_inputs"):
        lines.append("    x = rng.normal(size=(n, 6)).astype('float32')")
        if d == "two_inputs":
            lines.append("    x = [x, rng.normal(size=(n, 4)).astype('float32')]")
        base = "x[0] if isinstance(x, list) else x"
        lines.append(f"    base = {base}")
        lines.append("    signal = base[:, :1] * 0.7 - base[:, 1:2]")
    elif d == "images":
        lines.append("    x = rng.normal(size=(n, 6, 6, 1)).astype('float32')")
        lines.append("    signal = x[:, :3, :3, 0].mean(axis=(1, 2))[:, None]")
    elif d == "sequences":
        lines.append("    x = rng.normal(size=(n, 5, 3)).astype('float32')")
        lines.append("    signal = x[:, :, :1].mean(axis=1)")
    else:  # tokens: padded with 0 (masked)
        lines.append("    x = rng.integers(1, 12, size=(n, 6)).astype('int32')")
        lines.append("    for row, length in enumerate(rng.integers(1, 7, size=n)):")
        lines.append("        x[row, length:] = 0")
        lines.append("    signal = (x[:, :1] % 3).astype('float32') - 1.0")
    if program.classification:
        lines.append("    y = (np.digitize(signal[:, 0], [-0.3, 0.3])).astype('int32')")
    else:
        lines.append("    y = (signal + 0.1 * rng.normal(size=signal.shape)).astype('float32')")
    if program.loss == "two_outputs":
        lines.append("    y = [y, (-2.0 * y).astype('float32')]")
    if program.loss == "categorical":
        lines.append("    y = np.eye(3, dtype='float32')[y]")
    lines.append("    weights = rng.uniform(0.2, 2.0, size=n).astype('float32')")
    lines.append("    return x, y, weights")
    return "\n".join(lines)


def _layers(program: Program) -> str:
    """``body(h)``: the program's hidden layers on ``h`` (functional calls), and ``head(h)``."""
    d = program.data
    lines = ["def body(h):", "    init = keras.initializers.GlorotUniform(SEED)"]
    if d == "tokens":
        lines.append("    h = keras.layers.Embedding(12, 4, mask_zero=True, embeddings_initializer=init)(h)")
    sequence = d in ("sequences", "tokens")
    for token, after in zip(program.body, (*program.body[1:], None)):
        # A bias (or a normalization's offset) right before a BatchNormalization has a gradient of 0 up to rounding,
        # which Adam magnifies into steps of its learning rate whose sign is noise: such a layer has none, as Keras
        # advises.
        lines.extend("    " + _without_offset(line) if after in ("batch_norm", "sync_batch_norm") else "    " + line
                     for line in _layer(token, sequence))
    if sequence:
        lines.append("    h = keras.layers.GlobalAveragePooling1D()(h)")
    elif d == "images":
        lines.append("    h = keras.layers.Flatten()(h)")
    lines.append("    return h")
    return "\n".join(lines)


def _layer(token: str, sequence: bool) -> list:
    if token == "dense":
        return ["h = keras.layers.Dense(5, kernel_initializer=init)(h)"]
    if token == "dense_relu":
        return ["h = keras.layers.Dense(5, activation='relu', kernel_initializer=init)(h)"]
    if token == "regularized_dense":
        return ["h = keras.layers.Dense(5, activation='tanh', kernel_initializer=init, kernel_regularizer='l2',"
                " activity_regularizer=keras.regularizers.L2(0.01))(h)"]
    if token == "layer_norm":
        return ["h = keras.layers.LayerNormalization()(h)"]
    if token == "python_rows":  # Python code that works row by row, marked as such
        return ["h = keras.layers.Lambda(lambda t: hetero_cs.per_example(tf.ensure_shape(tf.numpy_function(",
                "    lambda a: np.tanh(a), [t], tf.float32, stateful=False), t.shape)), output_shape=lambda s: s)(h)"]
    if token == "batch_norm":
        return ["h = keras.layers.BatchNormalization()(h)"]
    if token == "sync_batch_norm":
        return ["h = keras.layers.BatchNormalization(synchronized=True)(h)"]
    if token in ("conv2d", "conv2d_relu"):
        activation = "'relu'" if token == "conv2d_relu" else "None"
        return [f"h = keras.layers.Conv2D(3, 3, padding='same', activation={activation}, kernel_initializer=init)(h)"]
    if token == "pool":
        return ["h = keras.layers.MaxPooling2D(2, padding='same')(h)"]
    if token == "conv1d":
        return ["h = keras.layers.Conv1D(4, 2, padding='same', kernel_initializer=init)(h)"]
    if token == "lstm":
        return ["h = keras.layers.LSTM(4, return_sequences=True, kernel_initializer=init)(h)"]
    if token == "gru":
        return ["h = keras.layers.GRU(4, return_sequences=True, kernel_initializer=init)(h)"]
    if token == "attention":
        return ["h = keras.layers.MultiHeadAttention(2, 2, kernel_initializer=init)(h, h)"]
    if token == "bidirectional":  # a backward LSTM reverses the time axis
        return ["h = keras.layers.Bidirectional(keras.layers.LSTM(3, return_sequences=True, kernel_initializer=init))(h)"]
    if token in ("causal_tile", "causal_stack"):
        # A causal mask (constants) tiled to the slice's rows by multiples holding its row count, built as keras-io's
        # Transformer examples build them (concat of expand_dims) or with tf.stack: a causal sum over time per example.
        count = ("tf.concat([tf.expand_dims(tf.shape(t)[0], -1), [1, 1]], 0)" if token == "causal_tile"
                 else "tf.stack([tf.shape(t)[0], 1, 1])")
        return ["h = keras.layers.Lambda(lambda t: tf.einsum('bts,bsd->btd', tf.tile(",
                f"    tf.linalg.band_part(tf.ones((1, 5, 5), t.dtype), -1, 0), {count}), t), output_shape=lambda s: s)(h)"]
    if token == "conv_transpose":
        return ["h = keras.layers.Conv2DTranspose(2, 3, padding='same', kernel_initializer=init)(h)"]
    if token == "zero_pad":
        return ["h = keras.layers.ZeroPadding2D(1)(h)"]
    if token == "upsample":
        return ["h = keras.layers.UpSampling2D(2)(h)"]
    raise ValueError(token)


def _without_offset(line: str) -> str:
    for layer in ("LayerNormalization(", "BatchNormalization("):
        if layer in line:
            return line.replace(layer + ")", layer + "center=False)").replace(layer + "synchronized",
                                                                               layer + "center=False, synchronized")
    return line.replace("kernel_initializer=init)", "kernel_initializer=init, use_bias=False)")


_INPUT_SHAPES = {"vectors": "(6,)", "images": "(6, 6, 1)", "sequences": "(5, 3)", "tokens": "(6,)"}


def _model(program: Program) -> str:
    d, loss = program.data, program.loss
    units = 3 if program.classification else 1
    dtype = ", dtype='int32'" if d == "tokens" else ""
    if d == "two_inputs":
        inputs = "[keras.Input((6,)), keras.Input((4,))]"
        merged = "keras.layers.Concatenate()(inputs)"
    else:
        inputs = f"keras.Input({_INPUT_SHAPES[d]}{dtype})"
        merged = "inputs"
    regularizer = ", kernel_regularizer=keras.regularizers.L2(0.01)" if loss == "regularizers" else ""
    heads = [f"keras.layers.Dense({units}, name='out', kernel_initializer=keras.initializers.GlorotUniform(SEED + 1)"
             f"{regularizer})"]
    if loss == "two_outputs":
        heads.append("keras.layers.Dense(1, name='second', kernel_initializer=keras.initializers.GlorotUniform(SEED + "
                     "2))")
    base = {"compute_loss_mean": "ComputeLossMean", "compute_loss_sum": "ComputeLossSum"}.get(loss, "keras.Model")
    if program.loop == "train_step":
        base = "TrainStepModel"
    lines = ["def build_model():", "    keras.utils.set_random_seed(SEED)", f"    inputs = {inputs}",
             f"    h = body({merged})"]
    if loss == "add_loss_keras":
        lines.append("    h = AddsKerasLoss()(h)")
    elif loss == "add_loss_tensor":
        lines.append("    h = AddsTensorLoss()(h)")
    outputs = [f"{head}(h)" for head in heads]
    output = outputs[0] if len(outputs) == 1 else "[" + ", ".join(outputs) + "]"
    if program.form == "subclassed" and base == "keras.Model":
        base = "Subclassed"
    lines.append(f"    model = {base}(inputs, {output})")
    lines.append(f"    model.compile(optimizer={_optimizer(program)}, loss={_compiled_loss(program)}, "
                 f"{_compile_extras(program)})")
    lines.append("    return model")
    classes = [_CLASSES[name] for name in _class_names(program, base)]
    return "\n\n\n".join([*classes, "\n".join(lines)])


def _class_names(program, base) -> list:
    names = []
    if base in _CLASSES:
        names.append(base)
    if program.loss in ("add_loss_keras", "add_loss_tensor"):
        names.append({"add_loss_keras": "AddsKerasLoss", "add_loss_tensor": "AddsTensorLoss"}[program.loss])
    if _counts_steps(program):
        names.append("StepStatistics")
    return names


def _counts_steps(program: Program) -> bool:
    """Whether the program compiles the StepStatistics metric too (every other seed, in loops that compile
    metrics): terms every replica computes alike in a metric's accumulation."""
    return program.step_statistics and program.loop not in ("train_step", "custom_loop") and program.seed % 2 == 0


def _optimizer(program: Program) -> str:
    accumulate = ", gradient_accumulation_steps=2" if program.loop == "grad_accum" else ""
    # Adam with epsilon 1e-4: a gradient that is 0 in exact arithmetic (the offset of a BatchNormalization that
    # another one follows) is rounding noise of ~1e-9, which the default epsilon (1e-7) turns into steps of ~1e-4 in
    # directions that change with the order of a sum: on one device too (found at seed 2, program 22). 1e-4 keeps
    # such noise under 1e-6 and still steps a real gradient as Adam does.
    optimizer = {"sgd": f"keras.optimizers.SGD(0.05{accumulate})",
                 "adam": f"keras.optimizers.Adam(0.01, epsilon=1e-4{accumulate})",
                 "adam_clipnorm": f"keras.optimizers.Adam(0.01, epsilon=1e-4, clipnorm=0.5{accumulate})",
                 }[program.optimizer]
    if program.loop == "mixed_precision":
        # Loss scaling with a scale at which neither run's float16 gradients overflow: one device's whole-batch
        # gradient and a replica's share of it overflow at different scales, so their skipped steps would differ.
        return f"keras.optimizers.LossScaleOptimizer({optimizer}, initial_scale=2.0 ** 6)"
    return optimizer


def _compiled_loss(program: Program) -> str:
    loss, classification = program.loss, program.classification
    base = "keras.losses.SparseCategoricalCrossentropy(from_logits=True{})" if classification \
        else "keras.losses.MeanSquaredError({})"
    if program.loop == "train_step" and loss != "compute_loss_mean":
        return "None"  # its train_step computes its own loss (compute_loss_mean: Keras' compiled one)
    if loss == "keras_sum":
        return base.format(", reduction='sum'" if classification else "reduction='sum'")
    if loss == "categorical":  # one-hot labels (make_data)
        return "keras.losses.CategoricalCrossentropy(from_logits=True)"
    if loss == "mean_with_sample_weight":
        return base.format(", reduction='mean_with_sample_weight'" if classification
                           else "reduction='mean_with_sample_weight'")
    if loss == "two_outputs":
        return "['mse', 'mae']"
    if loss == "loss_class_scalar":
        return "ScalarMeanLoss()"
    if loss == "loss_class_dunder":
        return "OverridesCallLoss()"
    if loss == "masked_ratio":
        return "MaskedRatioLoss()"
    if loss == "stop_gradient":
        return "straight_through_loss"
    if loss == "nonlinear":
        return "root_mean_squared_error"
    if loss == "in_batch":
        return "in_batch_contrastive_loss"
    return base.format("")


def _compile_extras(program: Program) -> str:
    extras = []
    if program.loop == "train_step":
        return ""  # its own train_step and test_step return its logs
    if program.loss == "two_outputs":
        extras.append("loss_weights=[1.0, 0.5]")
        extras.append("metrics=[['mae'], ['mse']]")
    elif program.loop != "train_step":
        step_statistics = ", StepStatistics()" if _counts_steps(program) else ""
        extras.append(f"metrics=['accuracy'{step_statistics}]" if program.classification
                      else f"metrics=['mae'{step_statistics}]")
    if program.loss in ("sample_weight", "mean_with_sample_weight"):
        extras.append("weighted_metrics=['mae']" if not program.classification else "weighted_metrics=['accuracy']")
    return ", ".join(extras)


def _loss_parts(program: Program) -> str:
    parts = []
    if program.loss == "loss_class_scalar":
        parts.append(_CLASSES["ScalarMeanLoss"])
    if program.loss == "loss_class_dunder":
        parts.append(_CLASSES["OverridesCallLoss"])
    if program.loss == "masked_ratio":
        parts.append(_CLASSES["MaskedRatioLoss"])
    if program.loss == "stop_gradient":
        parts.append(_FUNCTIONS["straight_through_loss"])
    if program.loss == "nonlinear":
        parts.append(_FUNCTIONS["root_mean_squared_error"])
    if program.loss == "in_batch":
        parts.append(_FUNCTIONS["in_batch_contrastive_loss"])
    if program.loop == "train_step":
        parts.append(_train_step_model(program))
    return "\n\n\n".join(parts) if parts else "# (the loss is a Keras loss)"


def _train_step_model(program: Program) -> str:
    classification = program.classification
    per_example = ("keras.losses.sparse_categorical_crossentropy(y, pred, from_logits=True)" if classification
                   else "tf.reduce_mean(tf.square(pred - y), axis=-1)")
    loss = {
        "keras": "tf.reduce_mean(per_example)",
        "sample_weight": "tf.reduce_sum(per_example * w) / tf.reduce_sum(w)",
        "stop_gradient": "tf.reduce_mean(per_example) + tf.stop_gradient(tf.reduce_mean(tf.sqrt(per_example + 1.0)))",
        "nonlinear": "tf.sqrt(tf.reduce_mean(per_example) + 1.0)",
        "masked_ratio": "tf.reduce_sum(per_example * mask) / (tf.reduce_sum(mask) + 1.0)",
        "compute_loss_mean": "self.compute_loss(x=x, y=y, y_pred=pred)",
        "add_loss_tensor": "tf.reduce_mean(per_example) + tf.add_n(self.losses) if self.losses else "
                           "tf.reduce_mean(per_example)",
        "regularizers": "tf.reduce_mean(per_example) + 0.01 * tf.add_n([tf.reduce_sum(tf.square(v)) for v in "
                        "self.trainable_variables])",
        # a GAN's discriminator step: two batches of rows concatenated along the batch axis, one mean over them
        "concat_batch": "tf.reduce_mean(tf.concat([per_example, 0.5 * per_example + 0.1], 0))",
        # WGAN-GP's penalty: a second-order gradient, through the model's padding too
        "gradient_penalty": "tf.reduce_mean(per_example) + 0.1 * self.input_gradient_penalty(x)",
    }[program.loss]
    return f'''
class TrainStepModel(keras.Model):
    """A train_step and a test_step of its own, returning scalars it computes itself, and a Mean tracker weighed by
    the batch's static size (Keras' per-output loss trackers' idiom: None where unknown)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tracked = keras.metrics.Mean(name="tracked")

    def train_step(self, data):
        x, y, w = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            pred = self(x, training=True)
            per_example = {per_example}
            w = tf.ones_like(per_example) if w is None else tf.cast(w, per_example.dtype)
            mask = tf.cast(tf.cast(y, per_example.dtype)[:, 0] > 0 if len(y.shape) > 1 else y > 0, per_example.dtype)
            loss = {loss}
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        self.tracked.update_state(tf.reduce_mean(per_example), sample_weight=x.shape[0])
        return {{"loss": loss, "mean_prediction": tf.reduce_mean(pred), "batch_sum": tf.reduce_sum(per_example),
                "tracked": self.tracked.result()}}

    def input_gradient_penalty(self, x):
        with tf.GradientTape() as inner:
            inner.watch(x)
            out = self(x, training=False)
        g = inner.gradient(out, x)
        return tf.reduce_mean(tf.reduce_sum(tf.square(tf.reshape(g, [tf.shape(g)[0], -1])), axis=-1))

    def test_step(self, data):
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        pred = self(x, training=False)
        per_example = {per_example}
        return {{"loss": tf.reduce_mean(per_example), "mean_prediction": tf.reduce_mean(pred)}}
'''


_CLASSES = {
    "StepStatistics": '''
class StepStatistics(keras.metrics.Metric):
    """Steps counted with assign_add of a constant, and a total that adds each step a constant, a sum and a mean."""

    def __init__(self, name="step_statistics", **kwargs):
        super().__init__(name=name, **kwargs)
        self.steps = self.add_variable((), "zeros", name="steps")
        self.total = self.add_variable((), "zeros", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.steps.assign_add(1.0)
        y_pred = tf.cast(y_pred, "float32")
        self.total.assign(self.total + 0.5 + 0.01 * tf.reduce_sum(y_pred) + 0.1 * tf.reduce_mean(y_pred))

    def result(self):
        return self.total.value / self.steps.value + self.steps.value
''',
    "Subclassed": '''
class Subclassed(keras.Model):
    """A subclassed model: its call runs a functional model it holds as an attribute."""

    def __init__(self, inputs, outputs):
        super().__init__()
        self.inner = keras.Model(inputs, outputs)

    def call(self, x, training=False):
        return self.inner(x, training=training)
''',
    "ComputeLossMean": '''
class ComputeLossMean(keras.Model):
    """compute_loss adds its own mean over the batch to Keras' loss."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)
        first = y_pred[0] if isinstance(y_pred, (list, tuple)) else y_pred
        return loss + 0.1 * tf.reduce_mean(tf.square(tf.cast(first, tf.float32)))
''',
    "ComputeLossSum": '''
class ComputeLossSum(keras.Model):
    """compute_loss adds its own sum over the batch to Keras' loss."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)
        first = y_pred[0] if isinstance(y_pred, (list, tuple)) else y_pred
        return loss + 0.01 * tf.reduce_sum(tf.abs(tf.cast(first, tf.float32)))
''',
    "AddsKerasLoss": '''
class AddsKerasLoss(keras.layers.Layer):
    """add_loss of a Keras loss object's value (itself a mean over the batch)."""

    def call(self, h):
        self.add_loss(0.1 * keras.losses.MeanSquaredError()(tf.zeros_like(h), h))
        return h
''',
    "AddsTensorLoss": '''
class AddsTensorLoss(keras.layers.Layer):
    """add_loss of plain tensors: a mean and a sum over the batch."""

    def call(self, h):
        self.add_loss(0.05 * tf.reduce_mean(tf.square(h)) + 0.001 * tf.reduce_sum(tf.abs(h)))
        return h
''',
    "ScalarMeanLoss": '''
class ScalarMeanLoss(keras.losses.Loss):
    """A loss that reduces itself to a scalar mean."""

    def call(self, y_true, y_pred):
        y_true = tf.cast(tf.reshape(y_true, [-1, 1]), y_pred.dtype)  # class labels come as (n,): not (n, n) pairs
        return tf.reduce_mean(tf.square(y_true - y_pred[..., :1]))
''',
    "OverridesCallLoss": '''
class OverridesCallLoss(keras.losses.Loss):
    """A loss that overrides __call__ itself (keras.io's supervised contrastive loss does): no Keras reduction."""

    def __call__(self, y_true, y_pred, sample_weight=None):
        y_true = tf.cast(tf.reshape(y_true, [-1, 1]), y_pred.dtype)
        return tf.reduce_mean(tf.abs(y_true - y_pred[..., :1]))
''',
    "MaskedRatioLoss": '''
class MaskedRatioLoss(keras.losses.Loss):
    """A masked ratio: the squared error of the examples whose target is above 0, over their count (NER-style)."""

    def call(self, y_true, y_pred):
        y_true = tf.cast(tf.reshape(y_true, [-1, 1]), y_pred.dtype)
        mask = tf.cast(y_true > 0, y_pred.dtype)
        return tf.reduce_sum(tf.square(y_true - y_pred[..., :1]) * mask) / (tf.reduce_sum(mask) + 1.0)
''',
}

_FUNCTIONS = {
    "straight_through_loss": '''
def straight_through_loss(y_true, y_pred):
    """A value of one loss with the gradient of another (stop_gradient)."""
    y_true, y_pred = tf.cast(tf.reshape(y_true, [-1, 1]), y_pred.dtype), y_pred[..., :1]
    squared = tf.reduce_mean(tf.square(y_true - y_pred))
    absolute = tf.reduce_mean(tf.abs(y_true - y_pred))
    return squared + tf.stop_gradient(absolute - squared)
''',
    "root_mean_squared_error": '''
def root_mean_squared_error(y_true, y_pred):
    """Not linear in the examples: a split cannot reproduce it (hetero_cs refuses)."""
    y_true = tf.cast(tf.reshape(y_true, [-1, 1]), y_pred.dtype)
    return tf.sqrt(keras.losses.MeanSquaredError()(y_true, y_pred[..., :1]) + 1e-3)
''',
    "in_batch_contrastive_loss": '''
def in_batch_contrastive_loss(y_true, y_pred):
    """Every example against every other of the batch: a split cannot reproduce it (hetero_cs refuses)."""
    similarity = tf.matmul(y_pred, y_pred, transpose_b=True)
    labels = tf.range(tf.shape(y_pred)[0])
    return keras.losses.sparse_categorical_crossentropy(labels, similarity, from_logits=True)
''',
}


def _train(program: Program) -> str:
    if program.loop == "custom_loop":
        return _custom_loop(program)
    fit_args = ["x", "y", "batch_size=BATCH_SIZE", "epochs=EPOCHS", "shuffle=False", "verbose=0"]
    evaluate_args = ["x", "y", "batch_size=BATCH_SIZE", "verbose=0", "return_dict=True"]
    if program.loss in ("sample_weight", "mean_with_sample_weight") or (
            program.loop == "train_step" and program.loss == "sample_weight"):
        fit_args.append("sample_weight=weights")
        evaluate_args.append("sample_weight=weights")
    if program.loss == "class_weight":
        fit_args.append("class_weight={0: 0.5, 1: 1.0, 2: 2.0}")
    policy = "mixed_float16" if program.loop == "mixed_precision" else None
    helpers, fit = "", f"history = model.fit({', '.join(fit_args)}).history"
    evaluate = f"model.evaluate({', '.join(evaluate_args)})"
    predict = "model.predict(x, batch_size=BATCH_SIZE, verbose=0)"
    if program.loop == "on_batch":
        helpers, fit, evaluate, predict = _on_batch(fit_args, evaluate_args)
    return helpers + f'''
def train(strategy, record=None):
    """Trains the program under ``strategy`` (None: one device); fills and returns ``record``: what the oracle
    compares, and how far it got (``phase``) should the strategy refuse the program."""
    record = {{}} if record is None else record
    x, y, weights = make_data()
    keras.mixed_precision.set_global_policy({policy!r} or "float32")
    try:
        if strategy is None:
            model = build_model()
        else:
            with strategy.scope():
                model = build_model()
        record.update(model=model, initial=[w.copy() for w in model.get_weights()], phase="fit")
{textwrap.indent(fit, " " * 8)}
        record.update(weights=model.get_weights(), history=history,
                      optimizer=[np.asarray(v) for v in model.optimizer.variables], phase="evaluate")
        record["evaluate"] = {evaluate}
        record["phase"] = "predict"
        record["predict"] = {predict}
        return record
    finally:
        keras.mixed_precision.set_global_policy("float32")
'''


def _on_batch(fit_args: list, evaluate_args: list) -> tuple[str, str, str, str]:
    """The on_batch loop's parts of ``train``: train_on_batch over the batches fit would make (the same weights and
    class weights), then test_on_batch and predict_on_batch on all the data."""
    per_batch = {"x": "*rows((x, y), start)", "sample_weight=weights": "sample_weight=rows(weights, start)"}
    train_args = [per_batch.get(a, a) for a in fit_args
                  if a in per_batch or a.startswith("class_weight=")] + ["return_dict=True"]
    test_args = [a for a in evaluate_args if not a.startswith(("batch_size=", "verbose="))]
    helpers = '''
def rows(value, start):
    """The rows [start, start + BATCH_SIZE) of an array, or of each array of a list or tuple."""
    if isinstance(value, (list, tuple)):
        return type(value)(rows(v, start) for v in value)
    return value[start:start + BATCH_SIZE]

'''
    fit = f"""history = {{}}
for _ in range(EPOCHS):
    for start in range(0, len(weights), BATCH_SIZE):
        for name, value in model.train_on_batch({', '.join(train_args)}).items():
            history.setdefault(name, []).append(value)"""
    return helpers, fit, f"model.test_on_batch({', '.join(test_args)})", "model.predict_on_batch(x)"


def _custom_loop(program: Program) -> str:
    classification = program.classification
    per_example = ("keras.losses.sparse_categorical_crossentropy(yb, pred, from_logits=True)" if classification
                   else "tf.reduce_mean(tf.square(pred - yb), axis=-1)")
    loss = {
        "compute_average_loss": "tf.nn.compute_average_loss(per_example)",
        "reduce_mean": "tf.reduce_mean(per_example)",
        "reduce_mean_over_replicas": "tf.reduce_mean(per_example) / replicas",
        "reduce_sum_over_b": "tf.reduce_sum(per_example) / tf.cast(tf.shape(per_example)[0], per_example.dtype)",
        "masked_ratio": "tf.reduce_sum(per_example * mask) / (tf.reduce_sum(mask) + 1.0)",
        "boolean_mask_mean": "tf.reduce_mean(tf.boolean_mask(per_example, per_example > 0.0))",
        "stop_gradient": "tf.reduce_mean(per_example) + tf.stop_gradient(tf.reduce_mean(tf.abs(pred)))",
        "nonlinear": "tf.sqrt(tf.reduce_mean(per_example) + 1.0)",
        "in_batch": "tf.reduce_mean(tf.matmul(pred, pred, transpose_b=True))",
        "regularized": "tf.reduce_mean(per_example) + 0.01 * tf.add_n([tf.reduce_sum(tf.square(v)) for v in "
                       "model.trainable_variables])",
        "l2_loss": "tf.nn.l2_loss(pred - tf.cast(tf.reshape(yb, [-1, 1]), pred.dtype)) / 10.0",
        "learned_weight": "tf.exp(-log_scale) * tf.reduce_mean(per_example) + log_scale",
        # TensorFlow's custom-loop tutorial: a weight penalty every replica adds alike, or (keras-io's custom-loop
        # guide) the model's losses with an activity term summed over the batch, through scale_regularization_loss.
        "scale_regularization": "tf.nn.compute_average_loss(per_example) + tf.nn.scale_regularization_loss("
                                "0.01 * tf.add_n([tf.reduce_sum(tf.square(v)) for v in model.trainable_variables]))",
        "scale_activity": "tf.nn.compute_average_loss(per_example) + tf.nn.scale_regularization_loss("
                          "tf.add_n(model.losses + [0.01 * tf.reduce_sum(tf.square(pred))]))",
    }[program.loss]
    return f'''
def train(strategy, record=None):
    """A custom loop in tf.function; the same code on one device (tf.distribute's default strategy)."""
    record = {{}} if record is None else record
    x, y, weights = make_data()
    runner = strategy or tf.distribute.get_strategy()
    replicas = runner.num_replicas_in_sync
    with runner.scope():
        model = build_model()
        log_scale = tf.Variable(0.1, name="log_scale")  # a learned loss weight (uncertainty weighting)
        optimizer = {_optimizer(program)}
        optimizer.build(model.trainable_variables + [log_scale])
    record.update(model=model, initial=[w.copy() for w in model.get_weights()], phase="fit")
    dataset = tf.data.Dataset.from_tensor_slices((tuple(x) if isinstance(x, list) else x, y)).batch(BATCH_SIZE)
    losses = []

    def step(xb, yb):
        with tf.GradientTape() as tape:
            pred = model(xb, training=True)
            per_example = {per_example}
            mask = tf.cast(tf.cast(yb, per_example.dtype)[:, 0] > 0 if len(yb.shape) > 1 else yb > 0,
                           per_example.dtype)
            loss = {loss}
        trained = model.trainable_variables + ([log_scale] if {program.loss == "learned_weight"} else [])
        optimizer.apply_gradients(zip(tape.gradient(loss, trained), trained))
        return loss

    @tf.function
    def train_step(element):
        return runner.reduce("SUM", runner.run(step, args=element), axis=None)

    for _ in range(EPOCHS):
        for element in runner.experimental_distribute_dataset(dataset):
            losses.append(float(train_step(element)))
    record.update(weights=model.get_weights(), optimizer=[np.asarray(v) for v in optimizer.variables],
                  phase="predict")
    record["predict"] = model.predict(x, batch_size=BATCH_SIZE, verbose=0)
    return record
'''
