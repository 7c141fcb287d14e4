"""The digits CNN trained with a custom loop: `strategy.run` and exact loss scaling, printing per-step loss.

Run:
    pip install ".[examples]" && python examples/custom_loop.py

Each replica computes its per-example losses and scales them by the global batch size of the step,
`tf.nn.compute_average_loss(per_example_loss, global_batch_size=hetero_cs.current_global_batch_size())`, so the SUM
over replicas is the full-batch mean loss even when the slices differ in size (and on the last, partial batch).
With auto_balance a custom loop calls `strategy.calibrate(model, dataset)` once; `model.fit` does it by itself.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10, help="training epochs (default 10)")
    parser.add_argument("--global-batch-size", type=int, default=256, help="examples per optimizer step (default 256)")
    parser.add_argument("--emulate", default="A10,T4,P100", help="catalog devices to emulate, or 'none'")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--traceback", action="store_true", help="on a hetero_cs error, show the full traceback")
    parser.add_argument("-v", "--verbose", action="store_true", help="also show TensorFlow's start-up lines")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.global_batch_size < 1:
        parser.error("--epochs and --global-batch-size must be >= 1")

    from hetero_cs.cli import start_tensorflow_quietly

    start_tensorflow_quietly(args.verbose)  # TensorFlow's C++ start-up lines only with --verbose
    import tensorflow as tf

    from hetero_cs import emulation

    emulate = None if args.emulate.lower() == "none" else [n.strip() for n in args.emulate.split(",")]
    if emulate:
        emulation.setup_logical_devices(emulate)  # before TensorFlow initialises

    import keras
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import hetero_cs

    keras.utils.set_random_seed(args.seed)
    digits = load_digits()
    x = (digits.images.astype("float32") / 16.0)[..., None]
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target.astype("int32"), test_size=0.2, random_state=args.seed, stratify=digits.target
    )

    strategy = hetero_cs.HeteroCentralStorageStrategy(emulate=emulate)
    if emulate:
        print(f"EMULATED devices {emulate} on {list(strategy.compute_devices)} (logical CPU devices)")
    B = args.global_batch_size
    dataset = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(len(x_train), seed=args.seed).batch(B)
    )

    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8, 8, 1)),
                keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
                keras.layers.MaxPooling2D(2),
                keras.layers.Flatten(),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        optimizer = keras.optimizers.Adam(3e-3)
        accuracy = keras.metrics.SparseCategoricalAccuracy()
    # Reduction "none": one loss per example; the weighting below makes the sum over replicas exact.
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    model.compile(optimizer=optimizer, loss=loss_fn)  # gives calibration the loss to time
    strategy.calibrate(model, dataset)
    print(strategy.plan)

    @tf.function
    def train_step(iterator):
        def step_fn(x, y):
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = tf.nn.compute_average_loss(
                    loss_fn(y, logits), global_batch_size=hetero_cs.current_global_batch_size()
                )
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            accuracy.update_state(y, logits)
            return loss

        per_replica_loss = strategy.run(step_fn, args=next(iterator))
        return strategy.reduce("SUM", per_replica_loss, axis=None)  # the full-batch mean loss

    iterator = iter(strategy.experimental_distribute_dataset(dataset.repeat()))
    step = 0
    started = time.perf_counter()
    for epoch in range(args.epochs):
        accuracy.reset_state()
        for _ in range(len(dataset)):  # the last step of each epoch is the partial batch, exactly weighted
            loss = float(train_step(iterator))
            step += 1
            # The plan in force; while the guard tries another split, some steps run that one instead.
            print(f"epoch {epoch + 1} step {step}: loss={loss:.4f} "
                  f"plan_in_force={list(strategy.plan.per_replica_batch_sizes)}")
        print(f"epoch {epoch + 1}: train accuracy={float(accuracy.result()):.4f}")

    test_logits = model.predict(x_test, batch_size=B, verbose=0)
    test_accuracy = float((test_logits.argmax(axis=1) == y_test).mean())
    print(f"test_accuracy={test_accuracy:.4f} steps={step} train_s={time.perf_counter() - started:.1f}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # a clear one-line message for hetero_cs' own errors, the traceback otherwise
        from hetero_cs.errors import HeteroCSError

        if not isinstance(exc, HeteroCSError) or "--traceback" in sys.argv[1:]:
            raise
        print(f"custom_loop.py: error: {exc}", file=sys.stderr)
        if exc.__cause__ is not None:  # e.g. the TensorFlow error behind a ReplicaStepError
            print("(add --traceback to see the error it was raised from)", file=sys.stderr)
        sys.exit(2)
