"""Micro-batched steps through model.fit on emulated cards with little memory, against single-device Keras.

The cards hold 16, 64 and 64 examples (144 in all). A global batch larger than that trains as sub-steps whose
gradients are summed on the host and applied once: weights, optimizer state, logged loss and metrics must equal one
device's training on the same batches, partial last batch included. What cannot stay exact is refused.
"""

import logging

import keras
import numpy as np
import pytest

from hetero_cs import (
    CalibrationOOMError,
    ConfigError,
    HeteroCentralStorageStrategy,
    InfeasiblePlanError,
    MemoryRecoveryPolicy,
    MicroBatchError,
    StepOOMError,
)
from hetero_cs.emulation import Drift, Emulator, Workload
from hetero_cs.planning.cost_model import idle_free

DEVICES = ["/cpu:1", "/cpu:2", "/cpu:3"]
ACTIVATION_BYTES = 10_000
# The caps and slow-downs below were sized for the A10's fp32 rate (TF32 off: 31.2 TFLOP/s beside the T4's 8.1 and
# the P100's 9.3) and for 2e7 FLOPs at 35 % of peak; 3e7 at the model's 50 % take about as long.
WORKLOAD = Workload(flops_per_example=3e7, parameter_bytes=10_000, activation_bytes_per_example=ACTIVATION_BYTES,
                    tensor_float_32=False)
CAPS = (16, 64, 64)
CAPACITY = sum(CAPS)


def memory_for(examples):
    return WORKLOAD.fixed_memory_bytes + examples * ACTIVATION_BYTES


def emulator(drift=(), caps=CAPS):
    names = [f"{name}@{memory_for(cap)}B" for name, cap in zip(["A10", "T4", "P100"], caps)]
    return Emulator(names, workload=WORKLOAD, time_scale=20.0, drift=list(drift))


@pytest.fixture(autouse=True)
def fast_emulation(monkeypatch, tmp_path):
    monkeypatch.setenv("HETERO_CS_EMULATION_TARGET_MAKESPAN_MS", "10")
    monkeypatch.setenv("HETERO_CS_CACHE_DIR", str(tmp_path))


def classifier():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", kernel_regularizer="l2"),
                              keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(0.01, clipnorm=0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], weighted_metrics=["accuracy"])
    return model


def labelled(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5)).astype(np.int32)
    return x, y, rng.uniform(0.5, 2.0, size=n).astype(np.float32)


def assert_same_training(model, history, reference, reference_history, atol=1e-5):
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=atol)
    for key, want in reference_history.history.items():
        np.testing.assert_allclose(history.history[key], want, atol=atol, err_msg=key)


def trained_like_one_device(global_batch_size, examples, *, epochs=1, drift=(), caps=CAPS, **strategy_options):
    """The classifier fit on ``examples`` (sample-weighted) under the strategy and on one device, on emulated cards
    holding ``caps`` examples; asserts they train alike and returns the strategy."""
    x, y, w = labelled(examples)
    reference = classifier()
    reference_history = reference.fit(x, y, sample_weight=w, batch_size=global_batch_size, epochs=epochs,
                                      shuffle=False, verbose=0)
    strategy_options.setdefault("rebalance", False)
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator(drift, caps), profile_cache=False,
                                            **strategy_options)
    with strategy.scope():
        model = classifier()
    history = model.fit(x, y, sample_weight=w, batch_size=global_batch_size, epochs=epochs, shuffle=False, verbose=0)
    assert_same_training(model, history, reference, reference_history)
    return strategy


def built_like_one_device(build, x, y, global_batch_size):
    """``build()``'s model fit on ``(x, y)`` under the strategy (on the capped cards, fixed time scale) and on one
    device; asserts they train alike and returns the strategy."""
    reference = build()
    reference_history = reference.fit(x, y, batch_size=global_batch_size, epochs=1, shuffle=False, verbose=0)
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator(), profile_cache=False, rebalance=False)
    with strategy.scope():
        model = build()
    history = model.fit(x, y, batch_size=global_batch_size, epochs=1, shuffle=False, verbose=0)
    assert_same_training(model, history, reference, reference_history)
    return strategy


def test_a_batch_sixteen_times_what_the_cards_hold_trains_exactly():
    # B = 16 x 144: at least 16 sub-steps per batch; a full batch and a partial one (sample weights, clipping, an
    # L2 regulariser, plain and weighted metrics).
    B = 16 * CAPACITY
    strategy = trained_like_one_device(B, B + B // 3)
    micro = strategy.micro_batching
    assert micro.micro_batched_steps == 2
    full = micro.plan_for(B)
    assert full.num_sub_steps >= 16 and full.global_batch_size == B
    # More sub-steps than one traced call holds: several overlapped calls, each card back to back within each.
    assert micro.overlapped_steps == 2 and micro.fallbacks == 0 and full.overlapped and full.num_calls >= 2
    assert all(m <= cap for m, cap in zip(full.micro_batch_sizes, CAPS))
    assert sum(full.per_replica_batch_sizes) == B
    assert "micro-batch" in str(full)


def test_regression_a_stop_iteration_inside_a_step_in_hand_is_an_error_not_the_end_of_the_data(monkeypatch):
    # The "model.fit got no batches: the dataset is empty" (once in seven runs): a StopIteration escaping
    # the micro-batch planner after the batch was read, which Keras' loop took for the end of the data.
    from hetero_cs.engine.memory import micro_batches

    planned = micro_batches.MicroBatching.plan_to_run
    calls = []

    def plan_to_run(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise StopIteration
        return planned(self, *args, **kwargs)

    monkeypatch.setattr(micro_batches.MicroBatching, "plan_to_run", plan_to_run)
    x, y, _ = labelled(4 * CAPACITY)
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator(), profile_cache=False, rebalance=False)
    with strategy.scope():
        model = classifier()
    with pytest.raises(RuntimeError, match="StopIteration was raised inside a training step"):
        model.fit(x, y, batch_size=2 * CAPACITY, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == 1  # the first step applied; the second raised before its update


def test_a_card_that_cannot_hold_one_example_sits_idle_and_the_others_train_exactly(caplog):
    # The P100's memory holds the model but not one example's activations: calibration leaves it idle (cap 0)
    # instead of failing, and the others train within their caps (B = 64).
    with caplog.at_level(logging.WARNING, logger="calibration.calibrate"):
        strategy = trained_like_one_device(64, 150, caps=(16, 64, 0))
    assert "cannot hold one example of this model" in caplog.text
    profile = strategy.calibration.profiles[2]
    assert profile.max_batch_size == 0 and profile.holds_no_example and profile.probe_batch_sizes == ()
    assert "idle: out of memory at 1 example" in strategy.calibration.format_table()
    assert strategy.plan.per_replica_batch_sizes[2] == 0
    # Micro-batched beside such a card: test_a_card_that_loses_memory_until_the_caps_cannot_hold_the_batch_...


@pytest.mark.slow  # the default run keeps the slow-down-and-recover test below, which re-plans both ways
def test_a_card_that_slows_down_under_micro_batches_is_measured_and_planned_again():
    # The A10 (6 micro-batches a step at B = 128) runs 4x slower from its 30th micro-batch on. Its overlapped steps
    # report each card's time to the monitor as one step, and the re-balance policy moves examples off it.
    B = 128
    strategy = trained_like_one_device(B, 40 * B, drift=[Drift(replica_id=0, factor=4.0, from_step=30)],
                                       rebalance=True, guard=False)
    micro, balancer, calibration = strategy.micro_batching, strategy.balancer, strategy.calibration
    assert micro.overlapped_steps >= 10 and micro.fallbacks == 0 and balancer.micro_batched_replans >= 1
    # Measured from the micro-batched steps: the A10 about 4x slower than calibrated, the others as calibrated.
    factors = [now.predict_step_time_s(8) / then.predict_step_time_s(8)
               for now, then in zip(balancer.cost_models, calibration.cost_models)]
    assert factors[0] > 3.0 and all(0.8 < f < 1.25 for f in factors[1:])
    calibrated = micro.plan_for(B, cost_models=idle_free(list(calibration.cost_models)),
                                max_batch_sizes=list(calibration.max_batch_sizes))
    assert calibrated.per_replica_batch_sizes[0] > CAPS[0]  # micro-batched on the A10, as planned at first
    assert micro.plan_for(B).per_replica_batch_sizes[0] <= CAPS[0]  # now: at most one micro-batch's worth


def test_a_card_that_slows_down_and_recovers_gets_its_micro_batches_back(monkeypatch):
    # The A10 runs 2.5x slower for a while (its micro-batches 30 to 69): planned back to one step within its cap,
    # where the one-step re-planner cannot see it recover; the measured models bring its micro-batches back.
    # Modelled steps of 40 ms: at 10 ms a loaded host's real compute, as large, once hid the recovery.
    monkeypatch.setenv("HETERO_CS_EMULATION_TARGET_MAKESPAN_MS", "40")
    B = 128
    strategy = trained_like_one_device(B, 40 * B, epochs=2, rebalance=True,
                                       drift=[Drift(replica_id=0, factor=2.5, from_step=30, until_step=70)])
    balancer = strategy.balancer
    assert balancer.micro_batched_replans >= 2  # out of its micro-batches, then back (the models measured again)
    # (Whether the plan at the end, or the guard's side-by-side trial, keeps them is a comparison of a 13 % gain
    # measured on the wall clock: not asserted here, where a busy host decided it once; the clear case is below.)


def test_on_devices_that_are_not_emulated_each_cards_micro_batches_are_timed_as_one_chain():
    # Plain logical CPUs (no emulated waits), with models and caps set by hand: replica 0 is said to be 4x faster
    # and to hold 16 examples, so B = 128 runs it micro-batched in overlapped calls. Its micro-batches are timed
    # from the first one's start to the last one's end, without a clock between them, and reach the monitor as one
    # step with their count.
    from hetero_cs.planning.cost_model import LinearCostModel

    x, y, w = labelled(128 * 6)
    reference = classifier()
    reference_history = reference.fit(x, y, sample_weight=w, batch_size=128, epochs=1, shuffle=False, verbose=0)
    strategy = HeteroCentralStorageStrategy(DEVICES, profile_cache=False, rebalance=True, guard=False)
    # The models and caps of an A10 beside two slower cards, set by hand: fit keeps them (no calibration).
    strategy.set_cost_models([LinearCostModel(2e-4, 1e-5), LinearCostModel(2e-4, 4e-5),
                              LinearCostModel(2e-4, 4e-5)], max_batch_sizes=[16, 64, 64])
    with strategy.scope():
        model = classifier()
    history = model.fit(x, y, sample_weight=w, batch_size=128, epochs=1, shuffle=False, verbose=0)
    assert_same_training(model, history, reference, reference_history)
    assert strategy.calibration is None  # the models set by hand stood in for it
    assert strategy.micro_batching.overlapped_steps >= 4
    chained = [s for s in strategy.monitor.window() if s.per_replica_micro_batches is not None]
    assert chained and all(s.per_replica_micro_batches[0] >= 2 and min(s.per_replica_step_times_s) > 0
                           for s in chained)
    assert all(sum(s.per_replica_batch_sizes) == 128 for s in chained)


def test_the_guard_keeps_a_micro_batched_plan_only_if_it_measured_faster_than_the_one_step_it_replaces():
    # (A kept trial: the slow-down-and-recover test above.) Models set by hand that misjudge the A10 (no fixed cost per step, 100x faster than it is): the planner puts
    # 126 examples on it in 8 micro-batches, predicted 155x faster than one step. The emulated A10 pays its fixed
    # cost per micro-batch: the trial measures that plan slower and reverts to the one step within the caps.
    from hetero_cs.planning.cost_model import LinearCostModel

    x, y, w = labelled(128 * 30)
    reference = classifier()
    reference_history = reference.fit(x, y, sample_weight=w, batch_size=128, epochs=1, shuffle=False, verbose=0)
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator(), profile_cache=False, rebalance=False)
    strategy.set_cost_models([LinearCostModel(0.0, 1e-6), LinearCostModel(0.0, 1e-4), LinearCostModel(0.0, 1e-4)],
                             max_batch_sizes=list(CAPS))
    with strategy.scope():
        model = classifier()
    history = model.fit(x, y, sample_weight=w, batch_size=128, epochs=1, shuffle=False, verbose=0)
    assert_same_training(model, history, reference, reference_history)  # every step of either plan is exact
    micro = strategy.micro_batching
    (decision,) = micro.trial_decisions
    assert not decision.kept and decision.median_ratio > 1.5
    assert decision.candidate_per_replica_batch_sizes[0] > CAPS[0]
    assert micro.overlapped_steps <= (decision.step * 2) // 3 + 1  # none after the revert


def test_a_card_that_loses_memory_until_the_caps_cannot_hold_the_batch_goes_on_in_sub_steps():
    # B = 64 fits the A10 and the T4 (16 + 64; the P100 holds nothing) in one step, until the T4 holds 20: its cap
    # falls to about 32 and the caps hold 48. The failed step changed nothing; it and the rest run as sub-steps.
    drift = [Drift(replica_id=1, from_step=2, memory_bytes=memory_for(20))]
    strategy = trained_like_one_device(64, 6 * 64, caps=(16, 64, 0), drift=drift)
    assert sum(cap or 0 for cap in strategy.balancer.max_batch_sizes) < 64
    assert strategy.micro_batching.micro_batched_steps >= 1


@pytest.mark.parametrize("options", [{"batch_split": [6, 1, 1]}, {"auto_balance": False}])
def test_a_batch_three_times_what_the_cards_hold_trains_with_fixed_shares_or_an_even_split(options):
    # No calibration sets caps: out-of-memory steps find them by halving (upper bounds, e.g. the A10 at 192 where it
    # holds 16). When the caps learned cannot hold the batch, or the retries run out, the batch runs as sub-steps,
    # which are cut finer on each further failure. Both stopped with a StepOOMError before ("at most 372", wrong).
    B = 3 * CAPACITY
    strategy = trained_like_one_device(B, 2 * B, **options)
    assert strategy.micro_batching.micro_batched_steps >= 1
    known = strategy.balancer.memory_caps.known_to_fit()
    assert all(fit <= cap for fit, cap in zip(known, CAPS))  # only sizes that fitted are "known to fit"


@pytest.mark.slow  # about a minute: eight calibrated two-epoch fits
@pytest.mark.parametrize("seed", range(8))
def test_stress_a_micro_batched_two_epoch_fit_never_ends_with_an_empty_dataset(seed, monkeypatch):
    # Once in seven runs this fit (auto_balance, B = 512 on cards holding 16, 64 and 64) ended with "InputError:
    # model.fit got no batches: the dataset is empty": a StopIteration escaped the micro-batch planner (an
    # overlapped plan on cost lines with a tiny slope), and Keras' loop took it for the end of the data. Each run
    # here calibrates on its own emulated timings (the seed moves the target makespan) and must train like one device.
    monkeypatch.setenv("HETERO_CS_EMULATION_TARGET_MAKESPAN_MS", str(6 + 2 * seed))
    trained_like_one_device(512, 2 * 512 + 64 * seed, epochs=2, rebalance=True)


@pytest.mark.slow
def test_every_cards_memory_dropping_at_once_goes_on_in_sub_steps_exactly():
    # From the 3rd step each card holds half what it held: the retries of that step lower every cap at once, and the
    # step runs as sub-steps, exactly (before: "still ran out of memory after 4 retries", advice "at most 42").
    drift = [Drift(replica_id=i, from_step=2, memory_bytes=memory_for(cap // 2)) for i, cap in enumerate(CAPS)]
    strategy = trained_like_one_device(CAPACITY, 4 * CAPACITY, drift=drift, auto_balance=False)
    assert strategy.micro_batching.micro_batched_steps >= 1
    # Every cap came down. Not necessarily to half: on a busy host the first card to run out of memory can end the
    # step before another card checks its memory, so that card fails on a later retry, at a larger slice, whose
    # halving can leave its cap a little above what it holds now (33 for 32: the next slice that large fails and
    # halves it again).
    assert all(cap is not None and cap < held for cap, held in zip(strategy.balancer.max_batch_sizes, CAPS))


def test_no_card_that_can_hold_one_example_is_a_clear_error():
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator(caps=(0, 0, 0)), profile_cache=False)
    with strategy.scope():
        model = classifier()
    x, y, _ = labelled(64)
    with pytest.raises(CalibrationOOMError, match=r"No device can hold one example of this model: "
                       r"device='/device:CPU:1' ran out of memory at batch_sizes=\[1\], the smallest tried.*"
                       r"Use a smaller model"):
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)


def _ancestors(op):
    """Every op ``op`` waits for: its inputs' ops and control inputs, transitively."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent.name not in seen:
                seen.add(parent.name)
                stack.append(parent)
    return seen


def test_a_fast_card_with_little_memory_runs_its_micro_batches_back_to_back_exactly():
    # B = 128 fits in one step, but there the A10 (cap 16) idles most of it. Overlapped: the A10 runs several
    # micro-batches in one call while the T4 and the P100 run one step each; no card waits for another between its
    # micro-batches. Two epochs with a partial last batch, sample weights, clipping, an L2 term, two metrics.
    strategy = trained_like_one_device(128, 3 * 128 + 37, epochs=2)
    micro = strategy.micro_batching
    assert micro.overlapped_steps > 0 and micro.fallbacks == 0
    plan = micro.last_plan
    assert plan.overlapped and plan.micro_batch_counts[0] >= 2 and plan.micro_batch_counts[1:] == (1, 1)
    assert all(m <= cap for m, cap in zip(plan.micro_batch_sizes, CAPS))
    # No barrier: in the traced call, the A10's second micro-batch waits for its first one only, not for the
    # other cards' work (each replica's step ends in its end_replica_step op, after its gradients exist).
    function = next(iter(micro._overlapped_functions.values()))[1]  # noqa: SLF001
    graph = function._list_all_concrete_functions()[0].graph  # noqa: SLF001
    ends = [op for op in graph.get_operations() if op.type == "PyFuncStateless" and "end_replica_step_" in op.name]
    first = {int(op.name[-1]): op for op in ends[:3]}  # sub-step 0: every replica
    second_a10 = ends[3]
    assert second_a10.name.endswith("end_replica_step_0")
    waits_for = _ancestors(second_a10)
    assert first[0].name in waits_for
    assert first[1].name not in waits_for and first[2].name not in waits_for


@pytest.mark.slow  # the default run keeps the suite near 10 minutes; tox -e slow runs it
def test_validation_evaluate_and_predict_on_batches_larger_than_the_caps_run_as_sub_steps():
    # An inference batch the training caps cannot hold used to be split without them (and ran out of memory on the
    # 16-example card); it now runs as sub-steps within them: the same figures as one device's.
    B = 2 * CAPACITY + 12
    x, y, w = labelled(3 * B + 7)
    reference = classifier()
    reference_history = reference.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0, validation_split=0.3)
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator(), profile_cache=False, rebalance=False)
    with strategy.scope():
        model = classifier()
    history = model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0, validation_split=0.3)
    assert_same_training(model, history, reference, reference_history)
    np.testing.assert_allclose(model.evaluate(x, y, sample_weight=w, batch_size=B, verbose=0),
                               reference.evaluate(x, y, sample_weight=w, batch_size=B, verbose=0), atol=1e-5)
    np.testing.assert_allclose(model.predict(x, batch_size=B, verbose=0), reference.predict(x, batch_size=B, verbose=0),
                               atol=1e-5)


@pytest.mark.slow  # the default run keeps the suite near 10 minutes; tox -e slow runs it
def test_micro_batched_mixed_precision_equals_one_device():
    from test_mixed_precision import FP16_ATOL  # the tolerance of the other float16 oracle tests

    B = 3 * CAPACITY + 20
    x, y, _ = labelled(2 * B)

    def regressor():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1, dtype="float32")])
        model.compile(optimizer="adam", loss="mse")
        return model

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        reference = regressor()
        reference_history = reference.fit(x, x[:, :1], batch_size=B, epochs=1, shuffle=False, verbose=0)
        strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator(), profile_cache=False, rebalance=False)
        with strategy.scope():
            model = regressor()
        history = model.fit(x, x[:, :1], batch_size=B, epochs=1, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert strategy.micro_batching.micro_batched_steps == 2
    assert_same_training(model, history, reference, reference_history, atol=FP16_ATOL)


@pytest.mark.parametrize("positions", [pytest.param(False, marks=pytest.mark.slow), True])
def test_an_embeddings_sparse_gradient_stays_sparse_over_sub_steps(positions):
    # Adam squares each row of an IndexedSlices gradient: the sub-steps' rows must reach it as one device's
    # IndexedSlices (duplicates included), not as a dense sum. With positions, a second Embedding is looked up
    # without the batch (arange(6), as a Transformer's positions): one device has one row per position, summed over
    # the batch, so the sub-steps' rows are added row by row.
    B = 2 * CAPACITY + 5
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 20, size=(2 * B, 6)).astype(np.int32)
    labels = rng.integers(0, 2, size=2 * B)

    class WithPositions(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.positions = keras.layers.Embedding(6, 16)

        def call(self, x):
            return x + self.positions(keras.ops.arange(6))

    def embedder():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((6,))
        embedded = keras.layers.Embedding(20, 16)(inputs)
        pooled = keras.layers.GlobalAveragePooling1D()(WithPositions()(embedded) if positions else embedded)
        model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(pooled))
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy")
        return model

    strategy = built_like_one_device(embedder, tokens, labels, B)
    assert strategy.micro_batching.micro_batched_steps == 2


@pytest.mark.slow  # 9 s
def test_sparse_rows_of_sub_steps_with_other_indices_are_kept_each_even_with_a_static_batch():
    # Shown not to happen (a reviewer's doubt): with a static batch shape (drop_remainder=True) the per-example rows'
    # count could look known while tracing, and a sum row by row would keep only the last sub-step's indices. The
    # sub-steps' slices are cut to dynamic shapes, so each keeps its own indices: exact against one device.
    import tensorflow as tf

    B = 2 * CAPACITY + 5
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 20, size=(2 * B, 6)).astype(np.int32)
    labels = rng.integers(0, 2, size=2 * B).astype(np.float32)

    def embedder():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((6,))
        pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 16)(inputs))
        model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(pooled))
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy")
        return model

    def dataset():
        return tf.data.Dataset.from_tensor_slices((tokens, labels)).batch(B, drop_remainder=True)

    reference = embedder()
    reference_history = reference.fit(dataset(), epochs=1, verbose=0)
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator(), profile_cache=False, rebalance=False)
    with strategy.scope():
        model = embedder()
    history = model.fit(dataset(), epochs=1, verbose=0)
    assert strategy.micro_batching.micro_batched_steps == 2
    assert_same_training(model, history, reference, reference_history)


def batch_norm_model():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.BatchNormalization(),
                              keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    return model


class RunningMean(keras.layers.Layer):
    """A layer keeping a moving average of its inputs' mean in training, as BatchNormalization does its statistics."""

    def build(self, input_shape):
        self.moving = self.add_weight(shape=(input_shape[-1],), initializer="zeros", trainable=False, name="moving")

    def call(self, inputs, training=False):
        if training:
            self.moving.assign(0.9 * self.moving + 0.1 * keras.ops.mean(inputs, axis=0))
        return inputs - self.moving


def running_mean_model():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), RunningMean(),
                              keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    return model


@pytest.mark.parametrize("build, match", [
    (batch_norm_model, r"BatchNormalization.*at most 144.*micro_batches=True"),
    pytest.param(running_mean_model,
                 r"sets its own non-trainable state in training \(.*moving\).*at most 144.*micro_batches=True",
                 marks=pytest.mark.slow),  # 16 s; the same refusal path as BatchNormalization's
])
def test_batch_norm_is_not_micro_batched_silently_and_a_refused_step_changes_nothing(build, match):
    # Nor is any layer that sets its own state in training (a moving average of its inputs).
    B = 3 * CAPACITY
    x, _, _ = labelled(2 * B)
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator(), profile_cache=False, rebalance=False)
    with strategy.scope():
        model = build()
    before = [np.array(v) for v in model.get_weights()]
    with pytest.raises(MicroBatchError, match=match):
        model.fit(x, x[:, :1], batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == 0
    for got, want in zip(model.get_weights(), before):  # moving statistics included
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow  # the default run keeps the suite near 10 minutes; tox -e slow runs it
def test_a_second_model_on_the_same_strategy_is_checked_again():
    # A first model without BatchNormalization micro-batches; a second one with it, under the same strategy, must
    # still be refused (what a step cannot keep exact is found again when its step is traced).
    B = 2 * CAPACITY
    x, y, _ = labelled(B)
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator(), profile_cache=False, rebalance=False)
    with strategy.scope():
        first = classifier()
    first.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert strategy.micro_batching.micro_batched_steps == 1
    with strategy.scope():
        second = batch_norm_model()
    with pytest.raises(MicroBatchError, match="BatchNormalization"):
        second.fit(x, x[:, :1], batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert int(second.optimizer.iterations) == 0


@pytest.mark.slow  # the default run keeps the suite near 10 minutes; tox -e slow runs it
def test_batch_norm_trains_with_the_opt_in_and_says_so(caplog):
    B = 3 * CAPACITY
    x, _, _ = labelled(2 * B)
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator(), profile_cache=False, rebalance=False,
                                            micro_batches=True)
    with strategy.scope():
        model = batch_norm_model()
    with caplog.at_level(logging.WARNING, logger="hetero_cs"):
        history = model.fit(x, x[:, :1], batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == 2 and np.isfinite(history.history["loss"]).all()
    assert strategy.micro_batching.micro_batched_steps == 2
    assert any("micro_batches=True" in r.getMessage() and "BatchNormalization" in r.getMessage()
               for r in caplog.records)


@pytest.mark.slow  # the default run keeps the suite near 10 minutes; tox -e slow runs it
def test_a_masked_loss_is_refused_even_with_the_opt_in():
    B = 2 * CAPACITY
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 10, size=(B, 5)).astype(np.int32)
    targets = rng.normal(size=(B, 5, 1)).astype(np.float32)
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator(), profile_cache=False, rebalance=False,
                                            micro_batches=True)
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Embedding(10, 4, mask_zero=True),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
    before = model.get_weights()
    with pytest.raises(MicroBatchError, match="normalised by the batch") as raised:
        model.fit(tokens, targets, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert "micro_batches=True" not in str(raised.value)  # no opt-in offered: it would be wrong
    assert int(model.optimizer.iterations) == 0
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)


def test_two_outputs_with_loss_weights_are_micro_batched_exactly():
    # Each output's loss tracker gets the loss unscaled (its share divided by b_ij / B): no batch aggregate, so the
    # model is micro-batched (regression: the loss reader took the tracker's value for a loss normalised by the
    # batch and refused the micro-batches).
    def build():
        keras.utils.set_random_seed(5)
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="relu")(inputs)
        outputs = [keras.layers.Dense(3, name="cls")(hidden), keras.layers.Dense(1, name="reg")(hidden)]
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=[keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"],
                      loss_weights=[1.0, 0.5])
        return model

    B = 2 * CAPACITY
    x, y, _ = labelled(B + B // 3)
    strategy = built_like_one_device(build, x, [y, x[:, :1]], B)
    # The full batch (twice what the cards hold) runs micro-batched; the last (96 examples) fits in one step and runs
    # micro-batched only where calibration times the A10 fast enough for that to pay, which the host's load decides.
    assert strategy.micro_batching.micro_batched_steps >= 1


@pytest.mark.filterwarnings("ignore:Calibration finished, but no plan fits")
def test_micro_batches_false_keeps_the_caps_error():
    B = 2 * CAPACITY
    x, y, _ = labelled(B)
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator(), profile_cache=False, micro_batches=False)
    with strategy.scope():
        model = classifier()
    with pytest.raises((InfeasiblePlanError, StepOOMError), match="144"):
        model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert strategy.micro_batching.micro_batched_steps == 0


def test_a_batch_that_runs_as_one_step_says_why_it_was_not_micro_batched():
    B = 2 * CAPACITY
    x, y, _ = labelled(2 * B)
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator(), profile_cache=False, rebalance=False)
    with strategy.scope():
        model = classifier()
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=2)
    with pytest.raises(MicroBatchError, match=r"exceeds the total capacity.*steps_per_execution=1"):
        model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == 0


@pytest.mark.parametrize("global_batch_size, replica_id, holds, batches, overlapped",
                         [pytest.param(2 * CAPACITY, 1, 20, 3, False, marks=pytest.mark.slow), (128, 0, 6, 4, True)])
def test_a_card_losing_memory_mid_step_is_recovered_inside_the_micro_batched_step(global_batch_size, replica_id,
                                                                                   holds, batches, overlapped):
    # From its 5th micro-batch a card holds fewer examples: the step runs out of memory. An overlapped call is undone
    # (metrics, iteration count, gradient sums) and the batch runs as sub-steps with a barrier each, where a sub-step
    # that runs out of memory is retried within a lower cap and later sub-steps are cut finer; later batches are
    # planned within it. The whole training still equals one device's.
    drift = [Drift(replica_id=replica_id, from_step=4, memory_bytes=memory_for(holds))]
    # guard=False: every step runs the micro-batched plan (no side-by-side trial of it against the capped one).
    strategy = trained_like_one_device(global_batch_size, batches * global_batch_size, drift=drift,
                                       oom_recovery=MemoryRecoveryPolicy(grow_after_steps=1000), guard=False)
    assert strategy._step_recovery.recoveries >= 1  # noqa: SLF001
    assert strategy.balancer.max_batch_sizes[replica_id] <= holds
    if overlapped:  # the A10's micro-batches ran back to back until one of them ran out of memory
        assert strategy.micro_batching.fallbacks >= 1


def accumulating_classifier(run_eagerly=False):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.AdamW(0.01, global_clipnorm=0.3, gradient_accumulation_steps=3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                  run_eagerly=run_eagerly)
    return model


@pytest.mark.parametrize("global_batch_size, run_eagerly", [
    (96, False), pytest.param(2 * CAPACITY + 12, False, marks=pytest.mark.slow), (40, True)])
def test_keras_gradient_accumulation_equals_one_device_with_the_same_setting(global_batch_size, run_eagerly):
    # Keras applies every 3rd optimizer step, on the average of the 3 steps' gradients (clipped, decayed once);
    # 7 batches and a partial one: two updates and a pending sum. Micro-batched (B > 144) or not, and eagerly.
    B = global_batch_size
    x, y, _ = labelled(7 * B + B // 3)
    reference = accumulating_classifier(run_eagerly)
    reference_history = reference.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator(), profile_cache=False, rebalance=False)
    with strategy.scope():
        model = accumulating_classifier(run_eagerly)
    history = model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_same_training(model, history, reference, reference_history)
    assert int(model.optimizer._iterations) == int(reference.optimizer._iterations) == 8  # noqa: SLF001
    micro = strategy.micro_batching
    if B > CAPACITY:
        assert micro.micro_batched_steps > 0
    elif run_eagerly:  # no traced call to overlap micro-batches in: one step within the caps
        assert micro.micro_batched_steps == 0
    else:  # fits in one step within the caps; where the A10's micro-batches are planned (whether they beat one step
        # depends on the calibrated costs, which a loaded host inflates), they run back to back beside the others' step
        assert micro.fallbacks == 0 and (micro.overlapped_steps > 0) == (micro.last_plan is not None)


def test_a_bad_micro_batches_setting_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"micro_batches must be None .* Received: micro_batches='yes'"):
        HeteroCentralStorageStrategy(DEVICES, micro_batches="yes")
