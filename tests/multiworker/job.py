"""One training job for the multi-worker tests: run as a worker (under ``hetero-cs launch``) or as the reference.

    python tests/multiworker/job.py OUT_DIR --split 3,1|even|auto [--reference] [--steps-kill N] [--epochs E]

Trains a small MLP (fixed initial weights, Adam, an L2 regulariser) on a fixed dataset of global batches of 16
with a partial last batch of 6 (38 examples). Writes ``OUT_DIR/worker<i>.npz`` (or ``reference.npz``): the
weights, the optimizer's variables, the logged loss per epoch, the evaluate loss and the predict output. The
chief also writes ``OUT_DIR/plans.json``: the split in force at each epoch's end (its History).

``--replan-at-epoch E --replan-split 9,4,3`` changes the plan on the chief alone at the start of epoch E (the
others must adopt it through the per-step agreement). ``--wide`` trains a 784-256-256-10 MLP on one global batch
of 1024 per epoch instead (emulated compute then outweighs the fixed per-step costs), and ``--drift R:F:S``
passes an Emulator whose replica R runs F times slower from its step S. ``--modelled-times`` makes each replica
report its emulated device's modelled step time instead of the host clock's (see ``modelled_step_times`` in
tests/integration/conftest.py): what the chief's Balancer decides then follows from the emulated devices alone,
however busy the host is.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

GLOBAL_BATCH = 16
EXAMPLES = 38  # 2 full global batches and a partial one of 6


WIDE_BATCH = 1024


def data(wide=False):
    rng = np.random.RandomState(7)
    if wide:
        return rng.normal(size=(WIDE_BATCH, 784)).astype("float32"), rng.randint(0, 10, size=(WIDE_BATCH,))
    x = rng.normal(size=(EXAMPLES, 5)).astype("float32")
    y = rng.randint(0, 3, size=(EXAMPLES,)).astype("int64")
    return x, y


BUG_AT_STEP = None  # --bug-at-step
_FORWARD_ROWS: list = []  # --count-forward: the rows of every forward pass this process ran in training


def _counted(x):
    """Identity; records the rows of each training forward pass that runs (a Python call per pass)."""
    import tensorflow as tf

    def record(rows):
        _FORWARD_ROWS.append(int(rows))
        if BUG_AT_STEP is not None and len(_FORWARD_ROWS) > BUG_AT_STEP and "\"index\": 1" in os.environ["TF_CONFIG"]:
            raise ValueError(f"a bug in worker 1's forward pass {len(_FORWARD_ROWS)}")
        return rows

    done = tf.py_function(record, [tf.shape(x)[0]], tf.int32)
    with tf.control_dependencies([done]):
        return tf.identity(x)


def _embedded(x):
    """Each feature as an index in [0, 20) for an Embedding (whose gradient is sparse: tf.IndexedSlices)."""
    import tensorflow as tf

    return tf.cast(tf.clip_by_value(tf.abs(x) * 6.0, 0.0, 19.0), tf.int32)


def _positions(keras):
    """Adds a learned position embedding, Embedding(5, 2)(arange(5)): a lookup that does not depend on the batch."""
    class AddPositions(keras.layers.Layer):
        def build(self, input_shape):
            self.positions = keras.layers.Embedding(5, 2)
            self.positions.build((5,))

        def call(self, h):
            return h + self.positions(keras.ops.arange(5))[None]

    return AddPositions()


def _overridden(keras):
    """A Sequential whose train_step follows Keras' guide: its logs nest the compiled metrics in a dict."""
    import tensorflow as tf

    class Overridden(keras.Sequential):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    return Overridden


def build(keras, wide=False, accumulate=None, jit_compile=False, count_forward=False, batch_norm=False,
          embedding=False, override=False, weighted_mean=False):
    rng = np.random.RandomState(0)
    if wide:
        layers = [keras.Input((784,)), keras.layers.Dense(256, activation="relu"),
                  keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)]
    else:
        layers = [keras.Input((5,)), *([keras.layers.Lambda(_counted)] if count_forward else []),
                  *([keras.layers.Lambda(_embedded), keras.layers.Embedding(20, 2), _positions(keras),
                     keras.layers.Flatten()] if embedding else []),
                  keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(1e-2)),
                  *([keras.layers.BatchNormalization()] if batch_norm else []),
                  keras.layers.Dense(3)]
    model = (_overridden(keras) if override else keras.Sequential)(layers)
    model.set_weights([rng.normal(scale=0.5, size=w.shape).astype("float32") for w in model.get_weights()])
    model.compile(
        # global_clipnorm: clipping must apply to the summed gradient of all replicas, as on one device.
        optimizer=keras.optimizers.Adam(learning_rate=0.05, global_clipnorm=0.5,
                                        gradient_accumulation_steps=accumulate),
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight" if weighted_mean else "sum_over_batch_size"),
        metrics=["accuracy"],
        jit_compile=jit_compile,
    )
    return model


def use_modelled_step_times(strategy_class) -> None:
    """Each replica's step reports its emulator's modelled time for that step (the step still runs and waits)."""
    measured_record = strategy_class._record_step_time

    def record(self, replica_id, batch_size, step_time_s):
        emulator = self._emulator
        if emulator is not None and emulator.workload is not None:
            # The report follows the replica's step, which advanced its counter: its time is the previous step's.
            step = max(emulator.steps_done[int(replica_id)] - 1, 0)
            step_time_s = emulator.step_time_s(int(replica_id), int(batch_size), step=step)
        measured_record(self, replica_id, batch_size, step_time_s)

    strategy_class._record_step_time = record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--split", default="even")
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--die-at-step", type=int, default=None, help="worker 1 exits abruptly at this step")
    parser.add_argument("--die-at-epoch", type=int, default=0, help="... of this epoch")
    parser.add_argument("--backup", default=None, help="keras.callbacks.BackupAndRestore in BACKUP/<worker>")
    parser.add_argument("--custom-loop", action="store_true", help="a tf.function loop over strategy.run instead")
    parser.add_argument("--timeout-s", type=float, default=None)
    parser.add_argument("--replan-at-epoch", type=int, default=None, help="the chief alone changes the plan ...")
    parser.add_argument("--replan-split", default=None, help="... to these shares")
    parser.add_argument("--wide", action="store_true", help="784-256-256-10 on global batches of 1024")
    parser.add_argument("--drift", default=None, help="R:F:S, replica R F times slower from its step S")
    parser.add_argument("--fail", default=None, help="R:S, replica R's card fails (a device error) from its step S")
    parser.add_argument("--eval-batch", type=int, default=None, help="evaluate and predict on global batches of this")
    parser.add_argument("--weighted-mean", action="store_true",
                        help="sample weights and reduction='mean_with_sample_weight' (normalised by the global batch)")
    parser.add_argument("--memory-drift", default=None,
                        help="R:BYTES:S, replica R's card has BYTES of memory left from its step S (also relaunched)")
    parser.add_argument("--bug-at-step", type=int, default=None, help="worker 1's step raises a Python error")
    parser.add_argument("--linger-s", type=float, default=0.0,
                        help="worker 1, when its fit fails, prints the error and waits this long before it exits")
    parser.add_argument("--modelled-times", action="store_true",
                        help="report the emulated devices' modelled step times, not the host clock's")
    parser.add_argument("--record-received", action="store_true",
                        help="write received_worker<i>.json: [replica id, leading dimension] of every batch argument "
                             "tf.distribute hands each replica function (before anything of hetero_cs runs in it)")
    parser.add_argument("--accumulate", type=int, default=None,
                        help="Keras' gradient_accumulation_steps of the optimizer (the reference's too)")
    parser.add_argument("--mismatched-evaluate", action="store_true",
                        help="after fit, worker 1 evaluates batches of 15, 17, 6 where the others read 16, 16, 6")
    parser.add_argument("--jit", action="store_true", help="compile(jit_compile=True): XLA per replica")
    parser.add_argument("--max-batch-sizes", default=None,
                        help="the strategy's max_batch_sizes, e.g. 4,n (n: uncapped); OUT/micro_<worker>.json says "
                             "how the last step's slices ran")
    parser.add_argument("--micro-batches", default="none", choices=["none", "true", "false"])
    parser.add_argument("--batch", type=int, default=GLOBAL_BATCH, help="the global batch size")
    parser.add_argument("--batch-norm", action="store_true", help="a BatchNormalization after the first layer")
    parser.add_argument("--embedding", action="store_true",
                        help="an Embedding first and a position embedding (sparse gradients)")
    parser.add_argument("--override-train-step", action="store_true",
                        help="a train_step of Keras' guide (its logs nest the compiled metrics)")
    parser.add_argument("--count-forward", action="store_true",
                        help="write OUT/forward_rows_<worker>.json: the rows of each forward pass fit ran here")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    global BUG_AT_STEP
    BUG_AT_STEP = args.bug_at_step
    args.count_forward = args.count_forward or args.bug_at_step is not None

    import keras
    import tensorflow as tf

    if args.reference:
        strategy, name = None, "reference"
    else:
        import logging

        import hetero_cs

        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
        logging.getLogger("hetero_cs").setLevel(logging.INFO)
        if args.jit:  # each replica says that its step is compiled
            logging.getLogger("hetero_cs.engine._compat.replica_pass").setLevel(logging.DEBUG)
        kwargs = {}
        if args.split == "auto":
            kwargs["auto_balance"] = True
        elif args.split == "even":
            kwargs["auto_balance"] = False
        else:
            kwargs["batch_split"] = [float(s) for s in args.split.split(",")]
        if args.drift is not None or args.fail is not None or args.memory_drift is not None:
            from hetero_cs.emulation import Drift, Emulator

            drift = []
            if args.drift is not None:
                replica, factor, from_step = args.drift.split(":")
                drift.append(Drift(replica_id=int(replica), factor=float(factor), from_step=int(from_step)))
            relaunched = os.environ.get("HETERO_CS_RESTART", "0") != "0"  # relaunched: the failed card is gone
            if args.fail is not None and not relaunched:
                replica, from_step = args.fail.split(":")
                drift.append(Drift(replica_id=int(replica), from_step=int(from_step), fails=True))
            if args.memory_drift is not None:
                replica, memory_bytes, from_step = args.memory_drift.split(":")
                drift.append(Drift(replica_id=int(replica), from_step=int(from_step), memory_bytes=int(memory_bytes)))
            names = [name for entry in os.environ["HETERO_CS_EMULATE"].split(",") for name in entry.split("+")]
            kwargs["emulate"] = Emulator(names, drift=drift)
        if args.max_batch_sizes is not None:
            kwargs["max_batch_sizes"] = [None if c == "n" else int(c) for c in args.max_batch_sizes.split(",")]
        kwargs["micro_batches"] = {"none": None, "true": True, "false": False}[args.micro_batches]
        if args.timeout_s is not None:
            kwargs["communication_options"] = tf.distribute.experimental.CommunicationOptions(
                timeout_seconds=args.timeout_s)
        if args.modelled_times:
            use_modelled_step_times(hetero_cs.HeteroMultiWorkerMirroredStrategy)
        strategy = hetero_cs.HeteroMultiWorkerMirroredStrategy(**kwargs)
        name = f"worker{json.loads(os.environ['TF_CONFIG'])['task']['index']}"
        if args.record_received:
            received = _record_received(tf)
    x, y = data(args.wide)  # after the strategy: MultiWorkerMirroredStrategy must come before TensorFlow initialises
    if args.weighted_mean:  # sample weights, and a loss normalised by the global batch's sum of them
        weights = np.random.RandomState(3).uniform(0.5, 2.0, size=len(x)).astype("float32")
        dataset = tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(args.batch)
    else:
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(WIDE_BATCH if args.wide else args.batch)
    callbacks = []
    if args.replan_at_epoch is not None and name == "worker0":
        class Replan(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                if epoch == args.replan_at_epoch:
                    print("replanning now", flush=True)
                    strategy.balancer.set_batch_split([float(s) for s in args.replan_split.split(",")])

        callbacks.append(Replan())
    if args.die_at_step is not None and name == "worker1":
        class Die(keras.callbacks.Callback):
            epoch = 0

            def on_epoch_begin(self, epoch, logs=None):
                self.epoch = epoch

            def on_train_batch_begin(self, batch, logs=None):
                if batch == args.die_at_step and self.epoch == args.die_at_epoch:
                    print("dying now", flush=True)
                    os._exit(17)

        callbacks.append(Die())
    if args.backup is not None:
        # Keras 3's BackupAndRestore writes plain files and knows nothing of workers: each worker gets its own
        # folder (the mirrored weights are the same on every worker, so each backup is whole).
        callbacks.append(keras.callbacks.BackupAndRestore(os.path.join(args.backup, name)))
    if strategy is None:
        model = build(keras, args.wide, args.accumulate, args.jit, args.count_forward, args.batch_norm, args.embedding,
                          args.override_train_step, args.weighted_mean)
    else:
        with strategy.scope():
            model = build(keras, args.wide, args.accumulate, args.jit, args.count_forward, args.batch_norm, args.embedding,
                          args.override_train_step, args.weighted_mean)
    if args.custom_loop:
        return custom_loop(args, strategy, model, dataset, name)
    try:
        history = model.fit(dataset, epochs=args.epochs, verbose=0, callbacks=callbacks)
    except Exception as exc:
        if strategy is not None:  # what reached the script, by its type (the tests assert on it)
            print(f"fit raised {type(exc).__module__}.{type(exc).__name__}", flush=True)
        if not args.linger_s or name != "worker1":
            raise
        print(f"fit failed: {type(exc).__name__}: {exc}", flush=True)
        time.sleep(args.linger_s)  # a process that lingers after its error (the others must not wait for it)
        return 3
    if args.mismatched_evaluate:  # bad input: worker 1 reads other batch sizes than the others
        sizes = [15, 17, 6] if name == "worker1" else [16, 16, 6]
        bounds = np.cumsum([0] + sizes)
        batches = [(x[a:b], y[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        mismatched = tf.data.Dataset.from_generator(
            lambda: iter(batches), output_signature=(tf.TensorSpec([None, 5], tf.float32),
                                                     tf.TensorSpec([None], y.dtype)))
        for _ in range(3):
            model.evaluate(mismatched, verbose=0)
        print("mismatched evaluate ended", name, strategy.agreement_counts, flush=True)
        _barrier(strategy)
        return 0
    if args.max_batch_sizes is not None and strategy is not None:
        micro = strategy.micro_batching
        plan = micro.last_plan
        with open(os.path.join(args.out, f"micro_{name}.json"), "w") as f:
            json.dump({"active": micro.active, "caps": micro.max_batch_sizes, "traces": micro.micro_batched_traces,
                       "sizes": None if plan is None else list(plan.micro_batch_sizes),
                       "counts": None if plan is None else list(plan.micro_batch_counts)}, f)
    if args.count_forward:
        with open(os.path.join(args.out, f"forward_rows_{name}.json"), "w") as f:
            json.dump(_FORWARD_ROWS, f)
    trained_rows = len(_FORWARD_ROWS)
    if args.eval_batch is not None:  # evaluate and predict on global batches of another size
        dataset = dataset.unbatch().batch(args.eval_batch)
    evaluated = model.evaluate(dataset, verbose=0, return_dict=True)
    predicted = model.predict(dataset, verbose=0)
    if args.count_forward:  # the forward passes of evaluate, then predict
        with open(os.path.join(args.out, f"forward_rows_inference_{name}.json"), "w") as f:
            json.dump(_FORWARD_ROWS[trained_rows:], f)
    result = {f"weight_{i}": w for i, w in enumerate(model.get_weights())}
    for i, v in enumerate(model.optimizer.variables):
        result[f"optimizer_{i}"] = np.asarray(v)
    result["loss"] = np.asarray(history.history["loss"])
    result["epochs_run"] = np.asarray(len(history.history["loss"]))
    result["accuracy"] = np.asarray(history.history["accuracy"])
    result["eval_loss"] = np.asarray(evaluated["loss"])
    result["predict"] = np.asarray(predicted)
    np.savez(os.path.join(args.out, f"{name}.npz"), **result)
    if args.record_received:
        with open(os.path.join(args.out, f"received_{name}.json"), "w") as f:
            json.dump(received, f)
    if strategy is not None:  # how many steps ran the plan agreement, and how many kept the split held
        with open(os.path.join(args.out, f"agreements_{name}.json"), "w") as f:
            json.dump(list(strategy.agreement_counts), f)
    if name == "worker0":
        stats = getattr(strategy, "stats", None)  # the figures beyond the logs' (chief only)
        figures = {**history.history, **(stats.history if stats is not None else {})}
        plans = [[figures[f"replica_{i}_batch_size"][epoch] for i in range(strategy.num_replicas_in_sync)]
                 for epoch in range(len(history.history["loss"]))] if "replica_0_batch_size" in figures else []
        with open(os.path.join(args.out, "plans.json"), "w") as f:
            json.dump(plans, f)
        with open(os.path.join(args.out, "history.json"), "w") as f:  # NaN is written as NaN (json's default)
            json.dump({k: [float(v) for v in vs] for k, vs in figures.items()}, f)
    _barrier(strategy)
    print("done", name, history.history["loss"], flush=True)
    return 0


def _record_received(tf) -> list:
    """Records what tf.distribute hands each replica function: MultiWorkerMirroredStrategy.run (which the strategy's
    own run calls with its replica wrapper) is wrapped so that every replica first records [its replica id, the
    leading dimension] of each rank >= 1 tensor argument it receives, when the step runs. Returns the (live) list."""
    from tensorflow.python.eager import def_function  # the class mirrored_run checks to lift a tf.function

    received = []
    original = tf.distribute.MultiWorkerMirroredStrategy.run

    def record(replica_id, size):
        received.append([int(replica_id), int(size)])
        return np.int64(0)

    def recording(fn):
        @functools.wraps(fn)
        def replica_fn(*args, **kwargs):
            replica_id = tf.distribute.get_replica_context().replica_id_in_sync_group
            for t in tf.nest.flatten((args, kwargs)):
                if isinstance(t, tf.Tensor) and t.shape.rank != 0:
                    tf.numpy_function(record, [replica_id, tf.shape(t)[0]], tf.int64, stateful=True)
            return fn(*args, **kwargs)

        return replica_fn

    def run(self, fn, args=(), kwargs=None, options=None):
        if isinstance(fn, def_function.Function):
            fn = fn._clone(python_function=recording(fn.python_function))  # noqa: SLF001
        else:
            fn = recording(fn)
        return original(self, fn, args=args, kwargs=kwargs, options=options)

    tf.distribute.MultiWorkerMirroredStrategy.run = run
    return received


def _barrier(strategy) -> None:
    """Every worker waits here until all have written their results (the chief's exit ends the cluster)."""
    if strategy is not None:
        import tensorflow as tf

        strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)


def custom_loop(args, strategy, model, dataset, name) -> int:
    """The custom loop of hetero_cs.engine.step.replica_state's docstring: weights, optimizer state and per-step losses."""
    import keras
    import tensorflow as tf

    optimizer = model.optimizer
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            per_example = loss_fn(y, model(x, training=True))
            if strategy is None:
                loss = tf.nn.compute_average_loss(per_example) + tf.add_n(model.losses)
            else:
                import hetero_cs

                B = hetero_cs.current_global_batch_size()
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=B)
                loss += hetero_cs.replica_weight() * tf.add_n(model.losses)  # shares of the regulariser sum to it
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_step(batch):
        if strategy is None:
            return step_fn(*batch)
        return strategy.reduce("SUM", strategy.run(step_fn, args=batch), axis=None)

    losses = []
    source = dataset if strategy is None else strategy.experimental_distribute_dataset(dataset)
    for _ in range(args.epochs):
        for batch in source:
            losses.append(float(train_step(batch)))
    result = {f"weight_{i}": w for i, w in enumerate(model.get_weights())}
    for i, v in enumerate(optimizer.variables):
        result[f"optimizer_{i}"] = np.asarray(v)
    result["loss"] = np.asarray(losses)
    np.savez(os.path.join(args.out, f"{name}.npz"), **result)
    _barrier(strategy)
    print("done", name, losses, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
