"""Shared helpers of the hetero_cs benchmark scripts: devices, models, data, the training step, timing, output.

Not library code and not tests: the scripts in this folder print ratios. Everything here is used the same way by
every configuration a script compares, so the configurations differ only in the strategy:

* one custom training loop (``strategy.run`` inside ``tf.function``, Keras optimizer, loss weighted by the global
  batch with ``tf.nn.compute_average_loss``) for every configuration;
* synthetic data (step time does not depend on the values), one cached global batch repeated;
* for a stock ``CentralStorageStrategy`` with emulated devices, the same per-replica wait that hetero_cs injects
  (``hetero_cs.devices.step_clock.finish_replica_step`` once a replica's gradients are ready, see ``make_train_step``);
* interleaved rounds over the configurations (the order rotates every round), medians.

TensorFlow is imported lazily (inside functions) so a script can create its logical devices first.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as `python benchmarks/x.py` from anywhere
    sys.path.insert(0, str(REPO_ROOT))

IN_CHECKOUT = (REPO_ROOT / "setup.cfg").is_file()
"""True when run from a source checkout; False when installed from the wheel (``hetero-cs bench``)."""

OUT_DIR = Path(__file__).resolve().parent / "out" if IN_CHECKOUT else Path.cwd() / "hetero_cs_bench_out"
"""Default folder for JSON and PNG outputs: ``benchmarks/out`` in a checkout (git-ignored), else
``./hetero_cs_bench_out`` (an installed package's folder may not be writable)."""

MODELS = ("mlp", "cnn")
MODEL_DESCRIPTIONS = {
    "mlp": "MLP 784-256-256-10 (ReLU), no Dropout/BatchNorm",
    "cnn": "CNN 8x8x1: Conv16-Conv32-MaxPool-Dense64-Dense10 (ReLU), no Dropout/BatchNorm",
}
INPUT_SHAPES = {"mlp": (784,), "cnn": (8, 8, 1)}
NUM_CLASSES = 10
EMULATED_NOTE = "timings are EMULATED: real compute on logical CPU devices plus waits for the named devices' times"
METHOD_NOTE = ("custom training loop: strategy.run in tf.function, Keras Adam, "
               "tf.nn.compute_average_loss(global_batch_size=B), synthetic data")


_START_S = time.perf_counter()


def log(message: str = "") -> None:
    """Progress output on stdout, flushed at once, prefixed by the seconds since the script started."""
    text = message.lstrip("\n")
    stamp = f"[{time.perf_counter() - _START_S:6.1f}s] " if text.strip() else ""
    print(message[:len(message) - len(text)] + stamp + text, flush=True)


def exit_now(code: int) -> None:
    """Ends a benchmark process at once, skipping interpreter teardown. Only for ``__main__`` of a script.

    Freeing TensorFlow objects is slow and erratic here: deleting one distributed iterator took 0.2-2.4 s, and the
    teardown of a run's strategies, iterators and tf.functions stalled a process for 4 to 70 s (a script passes
    them to ``keep_alive`` lists so that they live until this call). The results are written by then.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def quiet_libraries() -> None:
    """Keeps TensorFlow, Keras and absl quiet; hetero_cs warnings still show."""
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("tensorflow", "absl", "keras"):
        logging.getLogger(name).setLevel(logging.ERROR)


def parse_mix(text: str) -> list[str]:
    """'A10,T4,P100', 'A10+4xT4' or 'a100 p100 cpu' -> catalog names, one per replica (counts expanded).

    Raises:
        UnknownEmulatedDeviceError: A name is not in hetero_cs.emulation.CATALOG.
        ValueError: The mix is empty or a count is not a positive integer.
    """
    from hetero_cs.emulation import get_device_spec

    names: list[str] = []
    for token in text.replace("+", ",").replace(" ", ",").split(","):
        token = token.strip()
        if not token:
            continue
        count, name = 1, token
        head, sep, tail = token.partition("x")
        if sep and head.isdigit() and tail:
            count, name = int(head), tail
        if count < 1:
            raise ValueError(f"Device count must be >= 1 in mix={text!r}; received token={token!r}.")
        names.extend([get_device_spec(name).name] * count)
    if not names:
        raise ValueError(f"mix={text!r} names no device; give e.g. 'A10,T4,P100' or 'A10+4xT4'.")
    return names


def mix_label(names: Sequence[str]) -> str:
    """['A10', 'T4', 'T4', 'T4', 'T4'] -> 'A10+4xT4'."""
    parts: list[str] = []
    for name in names:
        if parts and parts[-1].split("x")[-1] == name:
            head = parts[-1].split("x")[0] if "x" in parts[-1] else "1"
            parts[-1] = f"{int(head) + 1}x{name}"
        else:
            parts.append(name)
    return "+".join(parts)


def setup_devices(names: Sequence[str]) -> list[str]:
    """Creates CPU:0 (parameter device) and CPU:1..R before TensorFlow initialises; returns the compute devices.

    Uses hetero_cs.emulation.setup_logical_devices, which also raises the inter-op thread pool to R + 2 so that
    replicas (and their emulated waits) run concurrently. For real-compute runs pass ['CPU'] * R: the names are
    only validated there.
    """
    from hetero_cs.emulation import setup_logical_devices

    return setup_logical_devices(list(names))


def build_model(kind: str, *, seed: int = 0) -> Any:
    """A built Keras model without Dropout/BatchNorm (stock CentralStorageStrategy crashes on those with R > 1)."""
    import keras

    init = keras.initializers.GlorotUniform
    if kind == "mlp":
        layers = [
            keras.Input(INPUT_SHAPES["mlp"]),
            keras.layers.Dense(256, activation="relu", kernel_initializer=init(seed)),
            keras.layers.Dense(256, activation="relu", kernel_initializer=init(seed + 1)),
            keras.layers.Dense(NUM_CLASSES, kernel_initializer=init(seed + 2)),
        ]
    elif kind == "cnn":
        layers = [
            keras.Input(INPUT_SHAPES["cnn"]),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu", kernel_initializer=init(seed)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu", kernel_initializer=init(seed + 1)),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu", kernel_initializer=init(seed + 2)),
            keras.layers.Dense(NUM_CLASSES, kernel_initializer=init(seed + 3)),
        ]
    else:
        raise ValueError(f"Unknown model={kind!r}; choose one of {MODELS}.")
    return keras.Sequential(layers, name=f"bench_{kind}")


def synthetic_batch(kind: str, global_batch_size: int, *, seed: int = 0) -> tuple[Any, Any]:
    """One global batch (x float32 [B, *input_shape], y int32 [B] in [0, 10)), fixed seed."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(global_batch_size, *INPUT_SHAPES[kind])).astype(np.float32)
    y = rng.integers(0, NUM_CLASSES, size=(global_batch_size,)).astype(np.int32)
    return x, y


def batch_dataset(batch: tuple[Any, Any]) -> Any:
    """A dataset that yields the same global batch forever (batched, so every element is one global batch)."""
    import tensorflow as tf

    x, y = batch
    return tf.data.Dataset.from_tensors((x, y)).repeat()


def loss_function(**kwargs: Any) -> Any:
    """The benchmarks' loss: sparse categorical cross-entropy on logits (kwargs go to the Keras class)."""
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, **kwargs)


def make_train_step(strategy: Any, model: Any, optimizer: Any, *, global_batch_size: int,
                    stock_emulator: Any = None,
                    stock_record: Callable[[int, int, float], None] | None = None,
                    from_iterator: bool = True) -> Callable[[Any], Any]:
    """The one training step every configuration runs: ``train_step(iterator) -> full-batch mean loss``.

    Args:
        strategy: Any tf.distribute strategy (stock CentralStorageStrategy or HeteroCentralStorageStrategy).
        model: Built under ``strategy.scope()``.
        optimizer: A Keras optimizer created under ``strategy.scope()``.
        global_batch_size: B; each replica's loss is sum(per-example loss) / B (exact for any split).
        stock_emulator: Only for a stock strategy with emulated devices: an Emulator whose waits are injected
            exactly as hetero_cs injects them (hetero_cs strategies inject their own; leave None there).
        stock_record: ``record(replica_id, batch_size, step_time_s)`` for the stock strategy's per-replica times.
        from_iterator: True: ``train_step(iterator)`` takes the next element of a distributed iterator. False:
            ``train_step((x, y))`` takes per-replica values (``fixed_distributed_batch``), no input pipeline.
    """
    import tensorflow as tf

    from hetero_cs.devices.step_clock import finish_replica_step, wall_clock_stamp

    import hetero_cs
    from hetero_cs.errors import NotInReplicaStepError

    loss_fn = loss_function(reduction=None)

    def step_batch_size():
        # Under hetero_cs the step's B as the library gives it: a loss divided by it is a share it can read, also
        # where the slices' shapes are static (the step-only configurations' fixed values). Stock strategies, and a
        # one-device strategy whose inputs are not cut (the fastest card alone), take the constant.
        try:
            return hetero_cs.current_global_batch_size()
        except NotInReplicaStepError:
            return global_batch_size

    def replica_fn(x, y, start):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            batch = step_batch_size()
            loss = tf.nn.compute_average_loss(loss_fn(y, logits), global_batch_size=batch)
            scaled = optimizer.scale_loss(loss)  # a LossScaleOptimizer's dynamic scale (mixed_float16); else loss
        grads = tape.gradient(scaled, model.trainable_variables)
        if stock_emulator is not None:
            replica_id = int(tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group))
            grads = finish_replica_step(grads, start, replica_id=replica_id, batch_size=tf.shape(x)[0],
                                        emulator=stock_emulator, record=stock_record)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_step(source):
        x, y = next(source) if from_iterator else source
        start = None
        if stock_emulator is not None:
            # One clock start per step when the input is there, as the library does (strategy._wrap_replica_fn).
            start = wall_clock_stamp(strategy.experimental_local_results(x)[0])
        per_replica_loss = strategy.run(lambda a, b: replica_fn(a, b, start), args=(x, y))
        return strategy.reduce("SUM", per_replica_loss, axis=None)

    return train_step


def fixed_distributed_batch(strategy: Any, batch: tuple[Any, Any], split: Sequence[int]) -> tuple[Any, Any]:
    """Per-replica values (x, y) holding fixed slices of one global batch (replica i gets split[i] examples).

    Made once with ``experimental_distribute_values_from_function``: feeding them to a step measures the step
    without any input pipeline.
    """
    import numpy as np
    import tensorflow as tf

    offsets = np.concatenate([[0], np.cumsum(split)]).astype(int)

    def part(index: int) -> Callable[[Any], Any]:
        def value_fn(context: Any) -> Any:
            i = context.replica_id_in_sync_group
            return tf.constant(batch[index][offsets[i]:offsets[i + 1]])

        return value_fn

    return (strategy.experimental_distribute_values_from_function(part(0)),
            strategy.experimental_distribute_values_from_function(part(1)))


@dataclasses.dataclass
class Config:
    """One configuration under test: its step, its input and where its per-replica times come from.

    ``source`` is what ``train_step`` takes: a distributed iterator, or fixed per-replica values.
    """

    name: str
    label: str
    train_step: Callable[[Any], Any]
    source: Any
    monitor: Any = None  # a hetero_cs StepTimeMonitor, or None when per-replica timing is off
    strategy: Any = None
    step_times_s: list[float] = dataclasses.field(default_factory=list)
    samples: list[Any] = dataclasses.field(default_factory=list)  # StepSample per timed step (or None)
    round_medians_s: list[float] = dataclasses.field(default_factory=list)

    def run_step(self) -> float:
        """Runs one step; returns its wall time in seconds (the loss fetched: every update has run)."""
        start_s = time.perf_counter()
        float(self.train_step(self.source))
        return time.perf_counter() - start_s

    def timed_steps(self, count: int) -> None:
        """Runs ``count`` steps, recording wall times, the monitor's sample of each and the round's median."""
        times_s = []
        for _ in range(count):
            times_s.append(self.run_step())
            self.samples.append(None if self.monitor is None else self.monitor.last_step())
        self.step_times_s.extend(times_s)
        self.round_medians_s.append(statistics.median(times_s))

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_times_s)

    def median_index(self) -> int:
        """Index of the timed step whose wall time is the (lower) median."""
        order = sorted(range(len(self.step_times_s)), key=self.step_times_s.__getitem__)
        return order[(len(order) - 1) // 2]


MAX_SETTLING_STEPS = 120
"""Untimed steps after the warm-up at most, while a configuration's guard is still trying a plan."""


def run_interleaved(configs: Sequence[Config], *, rounds: int, steps_per_round: int, warmup_steps: int,
                    progress_every: int = 1) -> None:
    """Warm-up steps per configuration (tracing, prefetch), then rounds of timed steps, order rotating each round.

    A configuration whose guard is still trying a plan after its warm-up steps (the first move off the even split,
    then the check against the fastest card alone) runs on, untimed, until the guard decides (at most
    ``MAX_SETTLING_STEPS`` more): the rounds measure the plan it settles on. Prints the warm-up times and, every
    ``progress_every`` rounds (and after the last), each configuration's median step time over the rounds since the
    previous print.
    """
    for config in configs:
        start_s = time.perf_counter()
        for _ in range(warmup_steps):
            config.run_step()
        settling = 0
        balancer = getattr(config.strategy, "balancer", None)
        while balancer is not None and balancer.guard.in_trial and settling < MAX_SETTLING_STEPS:
            config.run_step()
            settling += 1
        more = f" + {settling} while the guard decided" if settling else ""
        log(f"    warm-up {config.name:<17} {warmup_steps} steps{more}, {time.perf_counter() - start_s:6.1f} s")
    printed = 0
    for r in range(rounds):
        order = [configs[(r + k) % len(configs)] for k in range(len(configs))]
        for config in order:
            config.timed_steps(steps_per_round)
        if (r + 1) % progress_every == 0 or r + 1 == rounds:
            medians = "  ".join(f"{c.name} {statistics.median(c.round_medians_s[printed:]) * 1e3:7.2f} ms"
                                for c in configs)
            span = f"{r + 1}" if r + 1 - printed == 1 else f"{printed + 1}-{r + 1}"
            log(f"    round {span}/{rounds}: {medians}")
            printed = r + 1


class TrueProfile:
    """The true emulated step-time curve of one replica at one step (drift included), as a cost model.

    ``predict_step_time_s(b) = emulator.step_time_s(replica_id, b, step=step)``: linear in b for b >= 1, so the
    solver's continuous bound over it is exact. Read only by the benchmarks (the library never sees it).
    """

    def __init__(self, emulator: Any, replica_id: int, *, step: int = 0):
        self.emulator = emulator
        self.replica_id = replica_id
        self.step = step

    def predict_step_time_s(self, batch_size: int) -> float:
        return float(self.emulator.step_time_s(self.replica_id, int(batch_size), step=self.step))


def true_profiles(emulator: Any, *, step: int = 0) -> list[TrueProfile]:
    return [TrueProfile(emulator, i, step=step) for i in range(emulator.num_replicas)]


def true_figures(emulator: Any, global_batch_size: int, *, step: int = 0) -> dict[str, Any]:
    """Ideal (continuous), optimal integer and even-split makespans of the true emulated profiles, seconds.

    The central-storage engine runs nothing for a replica with 0 examples, and an emulated device takes 0 s for 0
    examples: the optimum and the ideal range over every subset of cards (min_batch_size=0), as the library's
    solver does."""
    from hetero_cs.planning.plan import even_batch_split
    from hetero_cs.planning.solver import ideal_makespan_s, solve_batch_split

    models = true_profiles(emulator, step=step)
    optimal = solve_batch_split(models, global_batch_size, min_batch_size=0)
    even = even_batch_split(global_batch_size, len(models))
    return {
        "ideal_makespan_s": ideal_makespan_s(models, global_batch_size, min_batch_size=0),
        "optimal_makespan_s": optimal.predicted_makespan_s,
        "optimal_split": list(optimal.per_replica_batch_sizes),
        "even_split": list(even),
        "even_split_makespan_s": max(m.predict_step_time_s(b) for m, b in zip(models, even)),
    }


def plans_by_policy(names: list[str], workload: Any, global_batch_size: int, policy: str) -> dict[str, Any]:
    """The true optimal plans (emulated profiles, time_scale 1) under float32 and under ``policy``, logged side by
    side: the devices' order and ratios change with the precision (in fp16 the T4 overtakes the P100)."""
    from hetero_cs.emulation import Emulator

    plans = {}
    for name in dict.fromkeys(("float32", policy)):
        emulator = Emulator(names, workload=dataclasses.replace(workload, compute_dtype=name), time_scale=1.0)
        plans[name] = true_figures(emulator, global_batch_size)
        plans[name]["theoretical_speedup"] = (plans[name]["even_split_makespan_s"]
                                              / plans[name]["ideal_makespan_s"])
    log(f"   true optimal plans (emulated, unscaled) {'policy':<15} {'/'.join(names):<22} {'makespan':>10} "
        f"{'even split':>11} {'theoretical speedup':>20}")
    for name, figures in plans.items():
        log(f"   {'':<40}{name:<15} {'/'.join(map(str, figures['optimal_split'])):<22} "
            f"{ms(figures['optimal_makespan_s']):>10} {ms(figures['even_split_makespan_s']):>11} "
            f"{figures['theoretical_speedup']:>20.3f}")
    return plans


def emulation_overrun(emulator: Any, samples: Sequence[Any]) -> float:
    """Median over steps of the largest relative excess of a replica's measured time over its emulated time.

    ~0 when the emulated waits dominate (real compute hidden inside them); clearly > 0 when the real compute on
    the shared CPU cores takes longer than the emulated device would (raise the time scale then).
    """
    excess = []
    for sample in samples:
        if sample is None:
            continue
        worst = 0.0
        for i, (b, t) in enumerate(zip(sample.per_replica_batch_sizes, sample.per_replica_step_times_s)):
            target_s = emulator.step_time_s(i, int(b), step=sample.step)
            if b > 0 and target_s > 0:
                worst = max(worst, t / target_s - 1.0)
        excess.append(worst)
    return statistics.median(excess) if excess else math.nan


def write_json(path: Path, data: Any) -> Path:
    """Writes JSON atomically (temporary file, then rename), creating the folder; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


def ms(seconds: float | None) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1e3:.2f} ms"
