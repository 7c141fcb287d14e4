"""Out of memory on one worker of HeteroMultiWorkerMirroredStrategy: the error it raises, what it tells the others
and the caps a restart takes (hetero_cs.engine.multi_worker.oom). The whole path across worker processes, the
launcher's relaunch included, is tested in tests/multiworker/test_multi_worker.py."""

import types

import pytest
import tensorflow as tf

from hetero_cs import StepOOMError, WorkerLostError
from hetero_cs.engine._compat import multi_worker as compat_multi_worker
from hetero_cs.engine.multi_worker.oom import out_of_memory_here

TASK = "/job:worker/replica:0/task:1"


def _strategy(split=(4, 4, 6, 10), caps=None, active=False, setting=None, whole_evaluate=False):
    """Worker 1 of a cluster of 2 workers x 2 GPUs (cluster replicas 2 and 3 are its own)."""
    def runs_micro_batches(model, verb):
        return active if verb == "fit" else setting is not False and not (verb == "evaluate" and whole_evaluate)

    return types.SimpleNamespace(
        extended=types.SimpleNamespace(worker_devices=[f"{TASK}/device:GPU:0", f"{TASK}/device:GPU:1"],
                                       _id_in_cluster=1),
        _first_replica=2, num_replicas_in_sync=4, last_split=split,
        micro_batching=types.SimpleNamespace(known_caps=caps, setting=setting, runs_micro_batches=runs_micro_batches))


def _bfc(gpu):
    return tf.errors.ResourceExhaustedError(
        None, None, f"Graph execution error:\n\nOOM when allocating tensor with shape[10,4096] and type float on "
                    f"{TASK}/device:GPU:{gpu} by allocator GPU_{gpu}_bfc\n\t [[{{{{node replica_1/dense/MatMul}}}}]]")


def test_a_replica_out_of_memory_in_fit_gives_the_caps_for_a_restart_with_its_cap_halved():
    found = out_of_memory_here(_strategy(), "fit", _bfc(1))
    assert found.restart_caps == [None, None, None, 5]  # cluster replica 3 held its slice of 10
    error = found.error
    assert isinstance(error, StepOOMError) and error.replica_id == 3 and error.device == f"{TASK}/device:GPU:1"
    assert error.global_batch_size == 24 and error.caps_tried == (10,)
    text = str(error)
    assert "worker 1, replica 3" in text and "with 10 examples at once, its slice of a global batch of 24" in text
    assert "OOM when allocating tensor" in text  # TensorFlow's own line, not "Graph execution error:"
    assert "relaunch with HETERO_CS_MAX_BATCH_SIZES=none,none,none,5" in text
    assert "max_batch_sizes=[None, None, None, 5]" in text and "No update of this step was applied" in text
    assert found.reason.endswith("; relaunch with HETERO_CS_MAX_BATCH_SIZES=none,none,none,5")


def test_a_micro_batched_slice_lowers_the_cap_below_the_micro_batch_that_ran_out():
    # Replica 3's slice of 10 ran as micro-batches of 5 and 5 within its cap 6: 5 did not fit, so the cap becomes 2.
    found = out_of_memory_here(_strategy(caps=[None, 8, None, 6], active=True), "fit", _bfc(1))
    assert found.restart_caps == [None, 8, None, 2]
    assert "with 5 examples at once, a micro-batch of its slice of 10 within its cap 6" in str(found.error)


def test_one_example_that_does_not_fit_leaves_the_card_idle_after_the_restart():
    found = out_of_memory_here(_strategy(split=(4, 4, 15, 1)), "fit", _bfc(1))
    assert found.restart_caps == [None, None, None, 0]


def test_an_emulated_device_names_its_cluster_replica_and_what_it_held():
    exc = tf.errors.ResourceExhaustedError(
        None, None, "Graph execution error:\n\nEmulatedOutOfMemoryError: Emulated out of memory: replica=2 (T4@48MB) "
                    "needs 1724 bytes for a slice of batch_size=6 at its step 4, but the device has memory_bytes=1500.")
    found = out_of_memory_here(_strategy(), "fit", exc)
    assert found.error.replica_id == 2 and found.error.device == f"{TASK}/device:GPU:0"
    assert found.restart_caps == [None, None, 3, None]


@pytest.mark.parametrize("verb", ["evaluate", "predict"])
def test_out_of_memory_in_evaluate_or_predict_lowers_the_cap_their_micro_batches_run_within(verb):
    found = out_of_memory_here(_strategy(caps=[None, None, 4, None]), verb, _bfc(0))
    assert found.restart_caps == [None, None, 1, None]  # replica 2's slice of 6 ran as micro-batches of 3 and 3
    text = str(found.error)
    assert f"model.{verb} ran out of memory on worker 1, replica 2" in text
    assert "with 3 examples at once, a micro-batch of its slice of 6 within its cap 4" in text
    assert "relaunch with HETERO_CS_MAX_BATCH_SIZES=none,none,1,none" in text


def test_an_evaluate_slice_that_ran_whole_lowers_the_cap_below_the_slice():
    # A loss normalised by the whole global batch: evaluate runs each slice in one pass (the training split, which
    # the lower cap bounds after the restart).
    found = out_of_memory_here(_strategy(caps=[None, None, 4, None], whole_evaluate=True), "evaluate", _bfc(0))
    assert found.restart_caps == [None, None, 3, None]
    assert "with 6 examples at once, its slice of a global batch of 24" in str(found.error)


def test_an_error_that_names_no_replica_lowers_no_cap():
    exc = tf.errors.ResourceExhaustedError(None, None, "Graph execution error:\n\nOut of memory while trying to "
                                                       "allocate 1073741824 bytes.")
    found = out_of_memory_here(_strategy(), "fit", exc)
    assert found.restart_caps is None and found.error.replica_id is None
    assert "names no replica, so no cap can be lowered" in str(found.error)


def test_other_errors_are_not_out_of_memory():
    exc = tf.errors.InvalidArgumentError(None, None, "Incompatible shapes: [8,3] vs. [8,4]")
    assert out_of_memory_here(_strategy(), "fit", exc) is None


def test_another_worker_learns_which_replica_ran_out_and_the_caps_to_restart_with():
    strategy = _strategy()
    strategy.extended._id_in_cluster = 0
    exc = tf.errors.UnavailableError(
        None, None, "Collective ops is aborted by: Error reported from /job:worker/task:1: hetero_cs: worker 1 "
                    "(/job:worker/replica:0/task:1) stopped: out of memory on replica 3 (/job:worker/replica:0/task:1/"
                    "device:GPU:1), with 10 examples at once, its slice of a global batch of 24; relaunch with "
                    "HETERO_CS_MAX_BATCH_SIZES=none,none,none,5; the other workers cannot go on without it.")
    error = compat_multi_worker._worker_lost(strategy, "fit", exc)
    assert isinstance(error, WorkerLostError)
    text = str(error)
    assert text.startswith("model.fit stopped on worker 0: worker 1 stopped, out of memory on replica 3")
    assert "Restart all workers with HETERO_CS_MAX_BATCH_SIZES=none,none,none,5" in text
