"""HeteroMultiWorkerMirroredStrategy across worker processes on 127.0.0.1 (CPU; one replica per worker, or two).

Each test starts TensorFlow processes (the workers, configured once each); the test process itself never imports
TensorFlow. The oracle is single-device Keras training on the whole batch (``job.py --reference``).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

JOB = Path(__file__).with_name("job.py")
ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env.update(extra)
    return env


def _launch(out: Path, workers: int, *job_args: str, emulate: str | None = None, timeout_s: float = 240,
            max_restarts: int = 0, **env) -> str:
    command = [sys.executable, "-m", "hetero_cs.cli", "launch", "--workers", str(workers)]
    if emulate:
        command += ["--emulate", emulate]
    if max_restarts:
        command += ["--max-restarts", str(max_restarts)]
    command += ["--", sys.executable, str(JOB), str(out), *job_args]
    done = subprocess.run(command, env=_env(**env), capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    return done.stdout


def _run_reference(out: Path, *job_args: str) -> dict:
    """Single-device training of the job with ``job_args``: its results (weights, optimizer state, logs)."""
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, str(JOB), str(out), "--reference", *job_args],
                          env=_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(np.load(out / "reference.npz"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-device training: {epochs: results}, each run once per module."""
    runs = {}

    def run(epochs: int = 2) -> dict:
        if epochs not in runs:
            runs[epochs] = _run_reference(tmp_path_factory.mktemp(f"reference{epochs}"), "--epochs", str(epochs))
        return runs[epochs]

    return run


def _assert_equal_to_reference(out: Path, workers: int, reference: dict) -> None:
    for index in range(workers):
        result = np.load(out / f"worker{index}.npz")
        assert sorted(result.files) == sorted(reference), (sorted(result.files), sorted(reference))
        for key, expected in reference.items():
            # Weights, every optimizer variable (iterations, Adam's moments), logged loss and accuracy per epoch,
            # evaluate's loss, and predict's output in batch order.
            np.testing.assert_allclose(result[key], expected, rtol=0, atol=TOLERANCE, err_msg=f"worker{index} {key}")


def _assert_resumed_after_the_first_epoch_equal_to(path: Path, expected: dict) -> None:
    """A job relaunched in its second epoch resumed from the first epoch's backup: it ran epochs 2 and 3 and ends
    where uninterrupted single-device training (``expected``, 3 epochs) ends."""
    result = np.load(path)
    assert int(result["epochs_run"]) == 2
    for key, value in expected.items():
        if key in ("loss", "accuracy"):
            value = value[1:]
        if key == "epochs_run":
            continue
        np.testing.assert_allclose(result[key], value, rtol=0, atol=TOLERANCE, err_msg=key)


def _assert_agreements_skipped_alike(out: Path, workers: int) -> None:
    # Once the chief has decided, steps keep the agreed split without the agreement all-reduce (a hold): every
    # worker must hold in the same steps (a collective run on one worker only would hang), and some steps held.
    counts = [json.loads((out / f"agreements_worker{index}.json").read_text()) for index in range(workers)]
    assert all(c == counts[0] for c in counts), counts
    agreed, held = counts[0]
    assert held > 0 and agreed > 0, counts


@pytest.mark.slow  # the default suite keeps the 3-worker run below (uneven, partial batch, agreement) for time
def test_two_workers_uneven_fixed_split_equal_one_device(tmp_path, reference):
    # Slices 12 | 4 of each global batch of 16, and 5 | 1 of the last batch of 6 (weighted by 6, not 16).
    _launch(tmp_path, 2, "--split", "3,1", "--epochs", "4")  # 4 epochs: the same reference run as below
    _assert_equal_to_reference(tmp_path, 2, reference(4))


@pytest.mark.slow  # 19 s; the default run keeps the central-storage strategy's idle-replica tests
def test_an_idle_worker_runs_no_forward_pass_and_still_joins_every_all_reduce(tmp_path):
    # Shares 1, 0: worker 1's replica holds 0 examples of every batch. It skips its forward and backward pass (a
    # py_function in the model counts the passes that ran) and adds zeros to the gradient all-reduce, which worker 0
    # waits for: the job ends, and every value equals single-device training.
    expected = _run_reference(tmp_path / "reference", "--epochs", "2", "--count-forward")
    _launch(tmp_path, 2, "--split", "1,0", "--epochs", "2", "--count-forward")
    rows = [json.loads((tmp_path / f"forward_rows_worker{i}.json").read_text()) for i in (0, 1)]
    assert rows[0] == [16, 16, 6] * 2, rows  # every example on worker 0
    assert rows[1] == [], rows  # no pass at all on worker 1
    _assert_equal_to_reference(tmp_path, 2, expected)


@pytest.mark.slow  # 20 s; the central-storage strategy's XLA per replica is in the default run
def test_two_workers_uneven_with_xla_per_replica_equal_one_device_with_xla(tmp_path):
    expected = _run_reference(tmp_path / "reference", "--epochs", "2", "--jit")
    stdout = _launch(tmp_path, 2, "--split", "3,1", "--epochs", "2", "--jit")
    for worker in (0, 1):
        assert (f"[worker {worker}] hetero_cs.engine._compat.replica_pass: hetero_cs: replica {worker}'s forward "
                f"pass, loss and gradient are compiled with XLA") in stdout, stdout
    _assert_equal_to_reference(tmp_path, 2, expected)


@pytest.mark.slow  # 23 s; the default run keeps test_two_workers_of_two_emulated_replicas_each_auto_balance_...
def test_three_unlike_workers_auto_balance_equal_one_device(tmp_path, reference):
    # auto_balance over 18 steps (6 epochs of 3, the last batch of each partial): a warm-up step, 6 probe splits
    # (uneven, changing every step; only full batches of 16 probe, so they end in epoch 3), the chief's fit of the
    # probe times, then the Balancer's decision. The workers report their emulated devices' modelled times
    # (--modelled-times): on the host's clock a busy host's noise could make the solved split look 2 % faster and
    # start a guard trial, which times every step and so leaves no held step in this short fit. This tiny model's
    # modelled steps are fixed overhead, so the solved split is refused as a tie (benchmarks/multiworker.py shows
    # a trial kept). At the start of the last epoch the chief alone changes the
    # plan (as a re-plan would; test_a_drifting_worker_... below has a real one). Every split reaches all workers
    # through the per-step agreement, with emulated A10 | T4 | P100 waits: a worker that cut the batch by any
    # other split would lose or repeat examples, and every step must still equal the single-device step.
    stdout = _launch(tmp_path, 3, "--split", "auto", "--epochs", "6", "--replan-at-epoch", "5",
                     "--replan-split", "9,4,3", "--modelled-times", emulate="A10,T4,P100",
                     HETERO_CS_EMULATION_TARGET_MAKESPAN_MS="5")  # short emulated waits: this test is about values
    assert stdout.count("timings are EMULATED") == 3
    assert "[worker 0] hetero_cs.engine.multi_worker.cluster_planner: hetero_cs multi-worker calibration from 6" in stdout, stdout
    assert "keeping the even split" in stdout and "guard: trying" not in stdout, stdout
    assert "[worker 0] replanning now" in stdout, stdout
    plans = json.loads((tmp_path / "plans.json").read_text())
    # The chief's History: the plan in force for the global batch of 16, at each epoch's end.
    assert plans[-1] == [9.0, 4.0, 3.0] != plans[-2], plans
    # Every epoch of the chief's History also has the measured makespan and step times (the workers' reports) and
    # the guard's state, as under the central-storage strategy.
    history = json.loads((tmp_path / "history.json").read_text())
    for key in ("makespan_ms", "replica_0_step_ms", "replica_2_step_ms", "guard_in_trial", "guard_reverts"):
        assert len(history[key]) == 6, (key, history)
    # Epochs 2-3 calibrate (every step agrees, so the workers' times reach the chief); later epochs may hold
    # through all their steps, and then report nothing (NaN), as documented.
    assert all(ms > 0 for ms in history["makespan_ms"][1:3]), history
    assert all(ms > 0 or math.isnan(ms) for ms in history["makespan_ms"]), history
    _assert_agreements_skipped_alike(tmp_path, 3)
    _assert_equal_to_reference(tmp_path, 3, reference(6))


def test_two_workers_of_two_emulated_replicas_each_auto_balance_equal_one_device(tmp_path, reference):
    # --emulate A10+T4,P100+T4: each worker runs 2 replicas on 2 logical CPU devices (4 in the cluster, numbered in
    # task-index then local order), and TensorFlow's collectives span all 4. The chief's agreement vector now
    # carries two local replicas per worker; in the last epoch the chief alone switches to 7,4,3,2.
    # Modelled times, as above: held steps must not depend on the host's load.
    stdout = _launch(tmp_path, 2, "--split", "auto", "--epochs", "6", "--replan-at-epoch", "5",
                     "--replan-split", "7,4,3,2", "--modelled-times", emulate="A10+T4,P100+T4",
                     HETERO_CS_EMULATION_TARGET_MAKESPAN_MS="5")
    assert "[worker 0] hetero_cs.engine.multi_worker.strategy: hetero_cs: timings are EMULATED - this worker's replicas " \
           "[0, 1] emulate ['A10', 'T4']" in stdout, stdout
    assert "[worker 1] hetero_cs.engine.multi_worker.strategy: hetero_cs: timings are EMULATED - this worker's replicas " \
           "[2, 3] emulate ['P100', 'T4']" in stdout, stdout
    assert "[worker 0] replanning now" in stdout, stdout
    plans = json.loads((tmp_path / "plans.json").read_text())
    assert plans[-1] == [7.0, 4.0, 3.0, 2.0] != plans[-2], plans
    history = json.loads((tmp_path / "history.json").read_text())
    assert all(len(history[f"replica_{i}_step_ms"]) == 6 for i in range(4)), history
    _assert_agreements_skipped_alike(tmp_path, 2)
    _assert_equal_to_reference(tmp_path, 2, reference(6))


@pytest.mark.slow  # 18 s; the default run keeps two workers of two emulated replicas each, auto-balanced, exact
def test_each_local_replica_receives_only_its_own_slice(tmp_path, reference):
    # 2 workers x 2 emulated replicas, fixed shares 3,1,2,2: slices 6,2 | 4,4 of each global batch of 16 and
    # 2,1 | 2,1 of the last batch of 6. The global batch stays on each worker's host and is cut there, so what
    # tf.distribute hands each replica function (recorded before any hetero_cs code runs in it) is b_i examples,
    # not B: in fit, evaluate and predict alike. Before, every local replica received the whole global batch (one
    # copy per replica on its device) and cut its slice itself. Every value still equals single-device training.
    _launch(tmp_path, 2, "--split", "3,1,2,2", "--epochs", "1", "--record-received", emulate="A10+T4,P100+T4",
            HETERO_CS_EMULATION_TARGET_MAKESPAN_MS="5")
    expected = {0: {(0, 6), (1, 2), (0, 2), (1, 1)}, 1: {(2, 4), (3, 4), (2, 2), (3, 1)}}
    for index in range(2):
        received = {tuple(r) for r in json.loads((tmp_path / f"received_worker{index}.json").read_text())}
        assert received == expected[index], (index, sorted(received))
    _assert_equal_to_reference(tmp_path, 2, reference(1))


@pytest.mark.slow  # 17 s: the default suite keeps the multi-worker tests of this release's features
def test_a_worker_reading_other_batch_sizes_fails_or_trains_on_but_never_hangs(tmp_path):
    # Bad input: after fit, worker 1 evaluates batches of 15, 17, 6 where the others read 16, 16, 6. Whether a
    # step agrees depends on agreed values only (never on the batch a worker reads), so every worker takes the same
    # branch: a step that agrees catches the mismatch (InputError on worker 1, WorkerLostError on the others), a
    # held step cuts worker 1's batch in proportion to the held split. Before, a held step sent worker 1 alone into
    # the agreement's collective and the cluster hung.
    command = [sys.executable, "-m", "hetero_cs.cli", "launch", "--workers", "2", "--emulate", "A10,T4", "--",
               sys.executable, str(JOB), str(tmp_path), "--split", "auto", "--epochs", "8", "--mismatched-evaluate"]
    done = subprocess.run(command, env=_env(HETERO_CS_EMULATION_TARGET_MAKESPAN_MS="5"), capture_output=True,
                          text=True, timeout=300)
    output = done.stdout + done.stderr
    if done.returncode == 0:
        assert output.count("mismatched evaluate ended") == 2, output[-4000:]
    else:
        assert "InputError: The workers do not read the same data" in output, output[-4000:]


@pytest.mark.slow  # 11 s, a refusal; kept out of the default run for time
def test_keras_gradient_accumulation_equals_one_device_with_the_same_setting(tmp_path):
    # Keras applies the accumulated gradients every 2nd step inside a tf.cond whose branch would all-reduce; here the
    # gradients are all-reduced every step and the cond runs in cross-replica context. Weights, Adam's moments, the
    # accumulators, the iteration count and the logged loss equal one device with gradient_accumulation_steps=2
    # (global_clipnorm too: clipped once, on the average applied). An Embedding's sparse gradient is accumulated too,
    # and an idle-ready replica's empty sparse gradient is built (it failed to trace once); a position embedding's
    # rows add up row by row over the workers (concatenated, Adam squared each part apart: 7e-2 off).
    expected = _run_reference(tmp_path / "reference", "--epochs", "2", "--accumulate", "2", "--embedding")
    _launch(tmp_path, 2, "--split", "3,1", "--epochs", "2", "--accumulate", "2", "--embedding")
    _assert_equal_to_reference(tmp_path, 2, expected)


@pytest.mark.slow  # 14 s: the default suite keeps the multi-worker tests of this release's features
def test_a_train_step_override_with_nested_logs_logs_the_clusters_metrics(tmp_path):
    # Keras' guide returns {m.name: m.result()}: the compiled metrics nest in a dict. Every worker must log the
    # cluster's accuracy (it once logged its own replica's), and train exactly.
    # With an Embedding and a position embedding: the latter's rows add up over the workers row by row (concatenated
    # by TensorFlow's all-reduce, Adam squared each worker's part apart: 7e-2 off one device).
    expected = _run_reference(tmp_path / "reference", "--epochs", "2", "--override-train-step", "--embedding")
    _launch(tmp_path, 2, "--split", "1,3", "--epochs", "2", "--override-train-step", "--embedding")
    _assert_equal_to_reference(tmp_path, 2, expected)


def test_slices_past_a_cap_run_as_micro_batches_within_it_and_equal_one_device(tmp_path):
    # max_batch_sizes [3e9, 4]: worker 1's card holds 4 examples; its 12 of each global batch of 16 run as 3
    # micro-batches of 4 in fit, evaluate and predict (counted by a py_function in the model), its 4 of the last
    # batch of 6 as one. Worker 0's cap is past int32 (a roomy card and a tiny model): its slices run whole, once (an
    # int32 count wrapped and ran none).
    # The model embeds its inputs and adds a position embedding, whose rows add up row by row over the micro-batches
    # (end to end, Adam squared each part apart).
    expected = _run_reference(tmp_path / "reference", "--epochs", "2", "--count-forward", "--embedding")
    _launch(tmp_path, 2, "--split", "1,3", "--epochs", "2", "--count-forward", "--max-batch-sizes", "3000000000,4",
            "--embedding")
    rows = [json.loads((tmp_path / f"forward_rows_worker{i}.json").read_text()) for i in (0, 1)]
    assert rows[0] == [4, 4, 2] * 2, rows
    assert rows[1] == [4, 4, 4, 4, 4, 4, 4] * 2, rows
    # evaluate, then predict: the same micro-batches, one forward pass each (their results equal one device below).
    rows = [json.loads((tmp_path / f"forward_rows_inference_worker{i}.json").read_text()) for i in (0, 1)]
    assert rows[0] == [4, 4, 2] * 2 and rows[1] == [4, 4, 4, 4, 4, 4, 4] * 2, rows
    micro = json.loads((tmp_path / "micro_worker1.json").read_text())
    assert micro["active"] and micro["caps"] == [3000000000, 4] and micro["traces"] >= 1, micro
    _assert_equal_to_reference(tmp_path, 2, expected)


def test_a_finding_made_while_tracing_switches_every_worker_even_one_without_caps(tmp_path):
    # A loss normalised by the global batch's sum of sample weights cannot be micro-batched; it is found while each
    # replica traces its step. Worker 0's replica has no cap, worker 1's holds 3: both must switch to slices within
    # the caps alike. (Worker 0 used to keep the micro-batched even split while worker 1 cut [13, 3], and training
    # went silently wrong: a loss of 2.13 where one device has 1.62.)
    expected = _run_reference(tmp_path / "reference", "--weighted-mean")
    output = _launch(tmp_path, 2, "--split", "even", "--max-batch-sizes", "n,3", "--weighted-mean")
    for worker in (0, 1):
        assert f"[worker {worker}] hetero_cs.engine.multi_worker.strategy: hetero_cs: not micro-batching this model: a loss " \
               f"normalised by the global batch" in output, output[-4000:]
    _assert_equal_to_reference(tmp_path, 2, expected)


@pytest.mark.slow  # 25 s
def test_out_of_memory_in_evaluate_relaunches_with_a_cap_its_micro_batches_run_within(tmp_path):
    # The emulated T4 holds 4 training examples, and trains on slices of 4 (global batches of 8); evaluate's single
    # global batch of 38 gives it 19, which need more memory than it has even for inference. Worker 1's evaluate
    # raises StepOOMError, the launcher relaunches both workers with HETERO_CS_MAX_BATCH_SIZES=none,9, and the
    # relaunched job trains again (no backup) and evaluates and predicts the T4's 19 as micro-batches of 7, 6 and 6:
    # every result equal to one device.
    expected = _run_reference(tmp_path / "reference", "--batch", "8", "--eval-batch", "64")
    output = _launch(tmp_path, 2, "--split", "even", "--batch", "8", "--eval-batch", "64", "--max-batch-sizes", "n,n",
                     emulate="A10,T4@1500B", max_restarts=1)
    assert ("[worker 1] hetero_cs.errors.StepOOMError: model.evaluate ran out of memory on worker 1, replica 1 "
            "(/job:worker/replica:0/task:1/device:CPU:0), with 19 examples at once, its slice of a global batch of "
            "38") in output, output[-4000:]
    assert ("[launch] a replica of worker 1 ran out of memory: relaunching 2 worker(s) with "
            "HETERO_CS_MAX_BATCH_SIZES=none,9") in output, output[-4000:]
    _assert_equal_to_reference(tmp_path, 2, expected)


@pytest.mark.slow  # 15 s
def test_a_default_batch_norm_takes_the_global_batchs_statistics_on_every_worker(tmp_path):
    # Not synchronized: each replica still normalises by the whole global batch's moments (all-reduced over the
    # cluster), so an uneven split equals one device, moving statistics included, on both workers.
    expected = _run_reference(tmp_path / "reference", "--batch-norm")
    _launch(tmp_path, 2, "--split", "1,3", "--batch-norm")
    _assert_equal_to_reference(tmp_path, 2, expected)


@pytest.mark.slow  # 30 s
def test_a_global_batch_16x_what_the_cards_hold_trains_auto_balanced_with_accumulation(tmp_path):
    # Two emulated cards that hold 1 example each train global batches of 32 (16x) and a last one of 6, calibrated
    # and planned on micro-batches, with gradient_accumulation_steps=2: equal to one device.
    expected = _run_reference(tmp_path / "reference", "--epochs", "8", "--batch", "32", "--accumulate", "2")
    stdout = _launch(tmp_path, 2, "--split", "auto", "--epochs", "8", "--batch", "32", "--accumulate", "2",
                     "--max-batch-sizes", "1,1", emulate="A10,T4")
    assert "hetero_cs multi-worker calibration from 6 training steps" in stdout, stdout[-4000:]
    assert "memory caps [1, 1] examples per replica (from max_batch_sizes)" in stdout, stdout[-4000:]
    micro = json.loads((tmp_path / "micro_worker0.json").read_text())
    assert micro["sizes"] == [1, 1] and sum(micro["counts"]) == 6, micro  # the last batch: 6 micro-batches of 1
    _assert_equal_to_reference(tmp_path, 2, expected)


def test_a_batch_norm_model_keeps_its_slices_within_the_caps_and_a_batch_they_cannot_hold_is_refused(tmp_path):
    # A trainable BatchNormalization all-reduces its statistics inside the forward pass: no micro-batch can hold it.
    # By default its slices stay within the caps (logged), and a global batch of 16 on caps [4, 4] fails on every
    # worker at its first step, before any collective, naming why and the largest batch that fits.
    command = [sys.executable, "-m", "hetero_cs.cli", "launch", "--workers", "2", "--", sys.executable, str(JOB),
               str(tmp_path), "--split", "even", "--batch-norm", "--max-batch-sizes", "4,4"]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    for worker in (0, 1):
        assert f"[worker {worker}] fit raised hetero_cs.errors.MicroBatchError" in output, output[-4000:]
        assert (f"[worker {worker}] hetero_cs.errors.MicroBatchError: A global batch of 16 examples does not fit the "
                f"replicas' memory in one step (memory caps [4, 4] examples per replica, 8 in all)") in output, \
            output[-4000:]
    assert "a trainable BatchNormalization normalises by the statistics of the examples it sees" in output
    assert "Use a global batch of at most 8" in output


@pytest.mark.slow  # 6 s
def test_caps_where_no_card_holds_one_example_are_a_micro_batch_error_at_fit_on_every_worker(tmp_path):
    command = [sys.executable, "-m", "hetero_cs.cli", "launch", "--workers", "2", "--", sys.executable, str(JOB),
               str(tmp_path), "--split", "even", "--max-batch-sizes", "0,0"]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    for worker in (0, 1):
        assert f"[worker {worker}] fit raised hetero_cs.errors.MicroBatchError" in output, output[-4000:]
        assert (f"[worker {worker}] hetero_cs.errors.MicroBatchError: No replica can hold one example of this model: "
                f"memory caps [0, 0] examples per replica") in output, output[-4000:]


@pytest.mark.slow
def test_a_drifting_worker_is_rebalanced_by_the_chief_and_every_worker_adopts_it(tmp_path):
    # The A10 worker's emulated device turns 4x slower at its step 40 (drift in an Emulator every worker builds
    # alike). Only the chief's Balancer sees it, through the step times all workers report in the agreement; its
    # re-plan must move work off replica 0, and every worker must adopt it at the same step (the run would hang or
    # fail on mismatched collectives otherwise). Emulated steps of ~100 ms dominate this wide model's real compute.
    stdout = _launch(tmp_path, 3, "--split", "auto", "--wide", "--epochs", "80", "--drift", "0:4:40",
                     emulate="A10,T4,P100", timeout_s=600, HETERO_CS_EMULATION_TARGET_MAKESPAN_MS="100")
    assert stdout.count("given in the script wins over HETERO_CS_EMULATE") == 3, stdout[-6000:]  # and --emulate's
    plans = json.loads((tmp_path / "plans.json").read_text())
    before, after = plans[38], plans[-1]  # epoch = step here (one global batch of 1024 per epoch)
    assert "[worker 0] hetero_cs.planning.rebalance: re-planned at step" in stdout, stdout[-6000:]
    assert before[0] > max(before[1:]), plans  # the A10 took the largest slice before it slowed down
    assert after[0] < 0.6 * before[0], plans  # and much less after
    assert sum(after) == 1024, plans
    weights = [np.load(tmp_path / f"worker{i}.npz") for i in range(3)]
    for other in weights[1:]:
        for key in weights[0].files:
            np.testing.assert_array_equal(other[key], weights[0][key], err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("split", ["5,3", "auto"])  # auto: the agreement (and its holds) in a tf.function's cond
def test_custom_loop_over_strategy_run_equals_one_device(tmp_path, split):
    # The documented custom loop: strategy.run inside tf.function, compute_average_loss with
    # current_global_batch_size(), the regulariser weighted by replica_weight(), strategy.reduce("SUM").
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    done = subprocess.run([sys.executable, str(JOB), str(reference_dir), "--reference", "--custom-loop"],
                          env=_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    reference = dict(np.load(reference_dir / "reference.npz"))
    _launch(tmp_path, 2, "--split", split, "--custom-loop")
    _assert_equal_to_reference(tmp_path, 2, reference)


@pytest.mark.slow
def test_killed_worker_ends_the_others_with_worker_lost_error(tmp_path):
    # Workers started directly (not by the launcher, which would stop the survivor itself): worker 1 exits at its
    # second step; worker 0 must fail with WorkerLostError, not hang. The bound is generous (a busy machine);
    # what is asserted is that it ends, with the error, and leaves no process behind.
    from hetero_cs.launch import free_ports, tf_config

    ports = free_ports(2)
    processes = [
        subprocess.Popen(
            [sys.executable, str(JOB), str(tmp_path), "--split", "1,1", "--die-at-step", "1", "--timeout-s", "10"],
            env=_env(TF_CONFIG=tf_config(ports, index)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for index in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=180)[0] for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert processes[1].returncode == 17, outputs[1][-2000:]
    assert processes[0].returncode != 0, outputs[0][-3000:]
    assert "WorkerLostError" in outputs[0], outputs[0][-3000:]
    # The lost worker is named from TensorFlow's message (its connection reset); only a collective that timed out
    # first (an extremely loaded host) may leave it unnamed.
    assert re.search(r"worker 1 is gone|DeadlineExceededError", outputs[0]), outputs[0][-3000:]
    assert not (tmp_path / "worker0.npz").exists()


@pytest.mark.slow
def test_backup_and_restore_resumes_after_a_killed_worker_with_nothing_lost(tmp_path):
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    done = subprocess.run([sys.executable, str(JOB), str(reference_dir), "--reference", "--epochs", "3"],
                          env=_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    reference = dict(np.load(reference_dir / "reference.npz"))
    backup = tmp_path / "backup"
    command = [sys.executable, "-m", "hetero_cs.cli", "launch", "--workers", "2", "--",
               sys.executable, str(JOB), str(tmp_path), "--split", "3,1", "--epochs", "3", "--backup", str(backup)]
    # First run: worker 1 dies in the second epoch (after the first epoch's backup); the launcher stops worker 0.
    first = subprocess.run(command + ["--die-at-epoch", "1", "--die-at-step", "1"], env=_env(), capture_output=True,
                           text=True, timeout=240)
    assert first.returncode == 17, first.stdout[-3000:]
    assert not (tmp_path / "worker0.npz").exists()
    # The rerun resumes from the backup of epoch 1 and ends where uninterrupted single-device training ends.
    _launch(tmp_path, 2, "--split", "3,1", "--epochs", "3", "--backup", str(backup))
    for index in range(2):
        result = np.load(tmp_path / f"worker{index}.npz")
        assert int(result["epochs_run"]) == 2  # epochs 2 and 3 only: the first came from the backup
        for key, expected in reference.items():
            if key in ("loss", "accuracy"):
                expected = expected[1:]
            if key == "epochs_run":
                continue
            np.testing.assert_allclose(result[key], expected, rtol=0, atol=TOLERANCE, err_msg=f"worker{index} {key}")


def test_launch_stops_every_worker_on_first_failure_and_returns_its_status(tmp_path):
    # No TensorFlow: worker 1 fails with status 3 while worker 0 would sleep for minutes.
    script = (
        "import json, os, sys, time\n"
        "index = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
        "open(os.path.join(sys.argv[1], f'pid{index}'), 'w').write(str(os.getpid()))\n"
        "print('started', index, flush=True)\n"
        "time.sleep(0.5)\n"
        "sys.exit(3) if index == 1 else time.sleep(600)\n"
    )
    command = [sys.executable, "-m", "hetero_cs.cli", "launch", "--workers", "2", "--grace-s", "5", "--",
               sys.executable, "-c", script, str(tmp_path)]
    started = time.monotonic()
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "[worker 0] started 0" in done.stdout and "[worker 1] started 1" in done.stdout
    assert "worker 1 exited with status 3" in done.stdout
    assert time.monotonic() - started < 110  # ended, long before worker 0's sleep (not a timing assertion)
    pid = int((tmp_path / "pid0").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_ctrl_c_stops_every_worker_even_one_that_ignores_sigterm(tmp_path):
    import signal

    # Worker 0 catches SIGTERM and goes on, as TensorFlow's preemption notifier does: the launcher's SIGINT stops it.
    # Worker 1 ignores both: it must be killed after --grace-s, and named. Status 130 = 128 + SIGINT.
    script = (
        "import json, os, signal, sys, time\n"
        "index = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
        "signal.signal(signal.SIGTERM, lambda *_: print('SIGTERM caught', flush=True))\n"
        "if index == 1: signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "open(os.path.join(sys.argv[1], f'pid{index}'), 'w').write(str(os.getpid()))\n"
        "print('started', index, flush=True)\n"
        "time.sleep(600)\n"
    )
    command = [sys.executable, "-m", "hetero_cs.cli", "launch", "--workers", "2", "--grace-s", "1", "--",
               sys.executable, "-c", script, str(tmp_path)]
    launcher = subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = set()
        while len(seen) < 2:
            line = launcher.stdout.readline()
            assert line, "the launcher ended before both workers started"
            if "started" in line:
                seen.add(line.split()[1])
        launcher.send_signal(signal.SIGINT)
        output, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 130, output
    assert "stopping all workers" in output
    assert "worker(s) [1] did not stop within 1 s of SIGINT and SIGTERM; killed (SIGKILL)" in output, output
    for index in range(2):
        pid = int((tmp_path / f"pid{index}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_launch_sets_tf_config_and_emulation_per_worker(tmp_path):
    script = (
        "import json, os\n"
        "config = json.loads(os.environ['TF_CONFIG'])\n"
        "print(config['task']['index'], len(config['cluster']['worker']), os.environ['HETERO_CS_EMULATE'])\n"
    )
    command = [sys.executable, "-m", "hetero_cs.cli", "launch", "--workers", "3", "--emulate", "A10,T4,P100", "--",
               sys.executable, "-c", script]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    for index in range(3):
        assert f"[worker {index}] {index} 3 A10,T4,P100" in done.stdout


def test_launch_rejects_an_emulate_list_of_the_wrong_length():
    from hetero_cs.errors import ConfigError
    from hetero_cs.launch import parse_emulate

    with pytest.raises(ConfigError, match="one comma-separated entry per worker.*--emulate A10,T4,P100"):
        parse_emulate("A10,T4", 3)
    with pytest.raises(ConfigError, match=r"different numbers of replicas.*\[2, 1\] per worker.*give each worker 2"):
        parse_emulate("A10+T4,P100", 2)
    assert parse_emulate("a10, T4", 2) == ["a10", "T4"]
    assert parse_emulate("A10 + T4,P100+t4", 2) == ["A10+T4", "P100+t4"]
    with pytest.raises(ConfigError, match="each worker 5 emulated replicas.*at most 4 per worker"):
        parse_emulate("A10+T4+P100+T4+A10,T4+T4+T4+T4+T4", 2)


def test_a_script_started_without_tf_config_is_warned_that_it_is_a_cluster_of_one():
    # ... and steps_per_execution > 1, which fails inside Keras' multi-step loop on MWMS, is refused with the fix.
    code = (
        "import hetero_cs, keras, numpy as np\n"
        "s = hetero_cs.HeteroMultiWorkerMirroredStrategy(); print(s.num_replicas_in_sync)\n"
        "with s.scope():\n"
        "    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])\n"
        "    m.compile(optimizer='sgd', loss='mse', steps_per_execution=2)\n"
        "try:\n"
        "    m.fit(np.zeros((8, 3), 'float32'), np.zeros((8, 2), 'float32'), batch_size=4, verbose=0)\n"
        "except hetero_cs.ConfigError as exc:\n"
        "    print(exc)\n"
    )
    env = _env()
    env.pop("TF_CONFIG", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and done.stdout.splitlines()[0] == "1", done.stderr[-3000:]
    assert "TF_CONFIG is not set, so this process is a cluster of one worker" in done.stderr, done.stderr[-3000:]
    assert "steps_per_execution=2 is not supported under HeteroMultiWorkerMirroredStrategy" in done.stdout, done.stdout


def test_a_bad_emulate_list_from_the_launcher_names_its_variable():
    # Two workers in TF_CONFIG (nothing connects: the names are checked before the cluster is formed). One process
    # for every case (TensorFlow starts once): each case sets HETERO_CS_EMULATE, or passes emulate=, and records the
    # error the constructor raised.
    cases = [("A10,XYZ", None), ("A10,T4,P100", None), ("A10+T4+P100,T4", None),
             (None, ["A10+T4", "P100+T4"])]  # in a script, emulate= is a flat list: the launcher's form is refused
    code = (
        "import json, os, sys, hetero_cs\n"
        "errors = []\n"
        "for value, emulate in json.loads(sys.argv[1]):\n"
        "    os.environ.pop('HETERO_CS_EMULATE', None)\n"
        "    if value is not None:\n"
        "        os.environ['HETERO_CS_EMULATE'] = value\n"
        "    try:\n"
        "        hetero_cs.HeteroMultiWorkerMirroredStrategy(**({} if emulate is None else {'emulate': emulate}))\n"
        "    except Exception as exc:\n"
        "        errors.append(str(exc))\n"
        "    else:\n"
        "        errors.append(None)\n"
        "print('ERRORS ' + json.dumps(errors))\n")
    two_workers = json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker",
                                                                                           "index": 0}})
    env = {**_env(), "TF_CONFIG": two_workers}
    env.pop("HETERO_CS_EMULATE", None)
    done = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], env=env, capture_output=True, text=True,
                          timeout=180)
    line = next((row for row in done.stdout.splitlines() if row.startswith("ERRORS ")), None)
    assert done.returncode == 0 and line is not None, done.stderr[-3000:]
    errors = json.loads(line[len("ERRORS "):])
    for (value, _), error, match in zip(cases[:3], errors, (
            "Unknown emulated device", "names 3 emulated devices for 2 workers.*multiple of 2",
            r"2 worker entries of \[3, 1\] devices.*same number of devices")):
        assert error is not None and f"HETERO_CS_EMULATE='{value}' (set by hetero-cs launch --emulate" in error, error
        assert re.search(match, error, re.S), error
    assert errors[3] is not None and "emulate= is a flat list" in errors[3], errors[3]


def test_deepcopy_gives_an_independent_strategy_as_stock_strategies_do():
    # Regression (issue 29): copy.deepcopy raised "TypeError: cannot pickle '_thread.lock' object" where stock
    # MultiWorkerMirroredStrategy copies. A cluster of one worker (no TF_CONFIG), in its own process: it sets up
    # collective ops for the whole process.
    code = (
        "import copy, keras, numpy as np, hetero_cs\n"
        "strategy = hetero_cs.HeteroMultiWorkerMirroredStrategy(emulate=['A10'])\n"
        "x, y = np.ones((20, 4), np.float32), np.ones((20, 1), np.float32)\n"
        "def fit(s):\n"
        "    with s.scope():\n"
        "        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])\n"
        "        model.compile('sgd', 'mse')\n"
        "    model.fit(x, y, batch_size=10, epochs=1, verbose=0)\n"
        "fit(strategy)\n"
        "copied = copy.deepcopy(strategy)\n"
        "assert type(copied) is type(strategy) and copied.extended is not strategy.extended\n"
        "assert copied.extended._container_strategy() is copied\n"
        "assert copied.balancer is not strategy.balancer and copied.emulator is not strategy.emulator\n"
        "fit(copied)\n"
        "fit(strategy)\n"
        "print('copied and trained')\n"
    )
    env = _env()
    env.pop("TF_CONFIG", None)
    env.pop("HETERO_CS_EMULATE", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and "copied and trained" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]


def test_a_device_error_on_one_worker_is_its_device_fault_error_and_the_others_stop_at_once(tmp_path):
    # Worker 1's card fails at its step 2 (an emulated ECC error). Worker 1's fit raises DeviceFaultError, naming its
    # device, and lingers 120 s after it; worker 0 must stop within seconds with a WorkerLostError that names worker 1
    # and the device error, without waiting for worker 1's process to exit (nor for the 200 s collective timeout).
    from hetero_cs.launch import free_ports, tf_config

    ports = free_ports(2)
    processes = [
        subprocess.Popen(
            [sys.executable, str(JOB), str(tmp_path), "--split", "1,1", "--fail", "1:2", "--timeout-s", "200",
             "--linger-s", "120"],
            env=_env(TF_CONFIG=tf_config(ports, index), HETERO_CS_EMULATE="A10,T4"), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        for index in range(2)
    ]
    try:
        output0 = processes[0].communicate(timeout=110)[0]  # well before worker 1 stops lingering
        assert processes[1].poll() is None  # worker 1 still lingers: worker 0 did not wait for its exit
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
        output1 = processes[1].communicate()[0]
    assert processes[0].returncode != 0
    assert re.search(r"WorkerLostError: model.fit stopped on worker 0: worker 1 stopped with a device error on "
                     r"\S+task:1/device:CPU:0 \(CUDA_ERROR_ECC_UNCORRECTABLE", output0), output0[-3000:]
    assert re.search(r"fit failed: DeviceFaultError: model.fit failed on worker 1 with a device error on "
                     r"\S+task:1/device:CPU:0 \(UnknownError: CUDA_ERROR_ECC_UNCORRECTABLE", output1), output1[-3000:]


@pytest.mark.slow  # two TensorFlow workers
def test_regression_a_python_error_in_one_workers_step_is_typed_and_the_others_stop_at_once(tmp_path):
    # A Python error in worker 1's step was a raw UnknownError there, and worker 0 waited 62.9 s in the collective.
    from hetero_cs.launch import free_ports, tf_config

    ports = free_ports(2)
    processes = [
        subprocess.Popen(
            [sys.executable, str(JOB), str(tmp_path), "--split", "1,1", "--bug-at-step", "2", "--timeout-s", "200",
             "--linger-s", "120"],
            env=_env(TF_CONFIG=tf_config(ports, index), HETERO_CS_EMULATE="A10,T4"), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        for index in range(2)
    ]
    try:
        output0 = processes[0].communicate(timeout=110)[0]  # well before worker 1 stops lingering
        assert processes[1].poll() is None  # worker 1 still lingers: worker 0 did not wait for its exit
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
        output1 = processes[1].communicate()[0]
    assert re.search(r"fit failed: ReplicaStepError: model.fit failed on worker 1 \((UnknownError|"
                     r"InvalidArgumentError): .*a bug in worker 1's forward pass", output1), output1[-3000:]
    assert re.search(r"WorkerLostError: model.fit stopped on worker 0: worker 1 stopped with an error in its step "
                     r"\(.*a bug in worker 1's forward pass.*See that worker's ReplicaStepError", output0), \
        output0[-3000:]


@pytest.mark.slow
def test_launch_relaunches_without_the_worker_whose_card_failed_and_the_job_resumes_exactly(tmp_path, reference):
    # Worker 1's card fails in the second epoch (its step 4), after the first epoch's BackupAndRestore backup.
    # `hetero-cs launch --max-restarts 1` relaunches the job on worker 0 alone, which resumes from that backup and
    # ends where uninterrupted single-device training ends.
    expected = reference(3)
    backup = tmp_path / "backup"
    output = _launch(tmp_path, 2, "--split", "even", "--epochs", "3", "--backup", str(backup), "--fail", "1:4",
                     "--timeout-s", "200", emulate="A10,T4", max_restarts=1)
    assert re.search(r"worker 1's card failed: relaunching 1 worker\(s\) without worker 1 \(emulating T4\)", output), \
        output[-3000:]
    _assert_resumed_after_the_first_epoch_equal_to(tmp_path / "worker0.npz", expected)


def test_out_of_memory_on_one_worker_relaunches_with_its_cap_halved_and_the_job_resumes_exactly(tmp_path, reference):
    # From its step 4 (the second epoch) the emulated T4 of worker 1 has memory for 4 examples, not its even slice of
    # 8 (as when another process takes memory; the strategy is told no caps, as on real cards). Worker 1's fit raises
    # StepOOMError naming replica 1 and the caps to restart with; worker 0 is told and stops with a WorkerLostError.
    # `hetero-cs launch --max-restarts 1` relaunches both with HETERO_CS_MAX_BATCH_SIZES=none,4: the T4's slices of 8
    # run as 2 micro-batches of 4, the job resumes from the first epoch's backup and ends where uninterrupted
    # single-device training ends.
    expected = reference(3)
    output = _launch(tmp_path, 2, "--split", "even", "--epochs", "3", "--backup", str(tmp_path / "backup"),
                     "--max-batch-sizes", "n,n", "--memory-drift", "1:1500:4", emulate="A10,T4", max_restarts=1)
    assert ("[worker 1] hetero_cs.errors.StepOOMError: model.fit ran out of memory on worker 1, replica 1 "
            "(/job:worker/replica:0/task:1/device:CPU:0), with 8 examples at once, its slice of a global batch of 16 "
            "(emulated: ResourceExhaustedError: Emulated out of memory: replica=1") in output, output[-4000:]
    assert re.search(r"\[worker 0\] hetero_cs.errors.WorkerLostError: model.fit stopped on worker 0: worker 1 "
                     r"stopped, out of memory on replica 1 .* Restart all workers with HETERO_CS_MAX_BATCH_SIZES="
                     r"none,4", output), output[-4000:]
    assert ("[launch] a replica of worker 1 ran out of memory: relaunching 2 worker(s) with "
            "HETERO_CS_MAX_BATCH_SIZES=none,4") in output, output[-4000:]
    # Relaunched, the T4's slices of 8 ran as micro-batches within its cap (a slice of 8 in one pass would have run out
    # of memory again, and no relaunch was left); the last batch of 6 ran as 3 and 3, one pass each.
    micro = json.loads((tmp_path / "micro_worker1.json").read_text())
    assert micro["active"] and micro["caps"] == [None, 4] and micro["sizes"] == [3, 3], micro
    _assert_resumed_after_the_first_epoch_equal_to(tmp_path / "worker0.npz", expected)
