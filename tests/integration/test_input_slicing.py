"""Global batches cut by the plan each step decides when it starts; the cached plan spares the Python call per step.

The pipeline checks each global batch and hands it whole to the step; ``PlanSlicer.step_sizes`` decides the step's
slice sizes and ``cut`` cuts every component by them (what the strategy does inside ``strategy.run``).
"""

import collections

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hetero_cs
from hetero_cs import HeteroCentralStorageStrategy
from hetero_cs.errors import InputError
from hetero_cs.engine import _compat
from hetero_cs.engine.step.input_slicing import PlanSlicer, cut
from hetero_cs.planning.plan import split_by_shares
from hetero_cs.planning.solver import plan_from_split


class CountingSizes:
    """A slow path that splits by fixed shares, counts its calls and publishes the plan of the largest batch."""

    def __init__(self, shares, publish_reference=True):
        self.shares = shares
        self.calls = []
        self.slicer = None
        self.reference = 0
        self.publish_reference = publish_reference

    def __call__(self, global_batch_size, training=True):
        b = int(global_batch_size)
        self.calls.append(b)
        self.training = training
        split = split_by_shares(b, self.shares)
        if self.publish_reference and b >= self.reference:
            self.reference = b
            self.slicer.publish(plan_from_split(split))
        return np.asarray([*split, 1], dtype=np.int64)


def make_slicer(shares, *, cacheable=True, publish_reference=True):
    sizes = CountingSizes(shares, publish_reference)
    sizes.slicer = PlanSlicer(len(shares), sizes, device="/device:CPU:0", cacheable=cacheable)
    return sizes.slicer, sizes


def cut_batches(slicer, batch_sizes, width=3):
    """Slices of consecutive-integer batches of the given sizes, as lists of example ids per batch and replica."""
    total = sum(batch_sizes)
    x = np.arange(total * width, dtype=np.int64).reshape(total, width)
    offsets = np.cumsum([0, *batch_sizes])
    batches = [(x[a:b], x[a:b, 0]) for a, b in zip(offsets[:-1], offsets[1:])]
    dataset = tf.data.Dataset.from_generator(
        lambda: iter(batches),
        output_signature=(tf.TensorSpec([None, width], tf.int64), tf.TensorSpec([None], tf.int64)),
    )
    out = []
    R = slicer.num_replicas
    elements = list(slicer.pack(dataset))
    assert len(elements) == len(batch_sizes)  # one element per global batch
    for x_batch, y_batch in elements:
        sizes, _ = slicer.step_sizes(tf.shape(y_batch)[0])  # what a step decides when it starts
        assert slicer.last_step_sizes() == tuple(int(b) for b in sizes)
        per_replica = []
        for xi, yi in zip(cut(x_batch, sizes, R), cut(y_batch, sizes, R)):
            np.testing.assert_array_equal(xi.numpy()[:, 0], yi.numpy())  # components cut alike
            per_replica.append(yi.numpy().tolist())
        out.append(per_replica)
    return out, batches


def test_full_batches_read_the_cached_plan_without_calling_python():
    slicer, sizes = make_slicer([5, 3, 2])
    out, batches = cut_batches(slicer, [10, 10, 10, 10, 7])
    assert sizes.calls == [10, 7]  # the first full batch (cache empty) and the partial one
    for per_replica, (_, y) in zip(out, batches):
        assert [len(s) for s in per_replica] == list(split_by_shares(len(y), [5, 3, 2]))
        assert sum(per_replica, []) == y.tolist()  # every example once, in order


def test_not_cacheable_calls_python_for_every_step():
    slicer, sizes = make_slicer([1, 1], cacheable=False)
    assert not slicer.cacheable
    out, _ = cut_batches(slicer, [6, 6, 6, 5])
    assert sizes.calls == [6, 6, 6, 5]
    assert [[len(s) for s in b] for b in out] == [[3, 3], [3, 3], [3, 3], [3, 2]]


def test_a_published_plan_applies_to_the_next_step_and_none_clears_it():
    slicer, sizes = make_slicer([1, 1], publish_reference=False)
    slicer.publish(plan_from_split([6, 2]))
    out, _ = cut_batches(slicer, [8, 8])
    assert sizes.calls == [] and [[len(s) for s in b] for b in out] == [[6, 2], [6, 2]]
    slicer.publish(plan_from_split([1, 7]))
    out, _ = cut_batches(slicer, [8])
    assert [len(s) for s in out[0]] == [1, 7]
    slicer.publish(None)
    out, _ = cut_batches(slicer, [8])
    assert sizes.calls == [8] and [len(s) for s in out[0]] == [4, 4]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shares=st.lists(st.integers(0, 5), min_size=1, max_size=4).filter(any),
    batch_sizes=st.lists(st.integers(1, 12), min_size=1, max_size=5),
)
def test_slices_always_equal_the_python_plan(shares, batch_sizes):
    # Whatever the order of batch sizes (cache hits, misses, a larger batch replacing the reference), every batch is
    # cut exactly as the slow path would cut it, and every example lands once, in order.
    slicer, _ = make_slicer(shares)
    out, batches = cut_batches(slicer, batch_sizes)
    for per_replica, (_, y) in zip(out, batches):
        assert [len(s) for s in per_replica] == list(split_by_shares(len(y), shares))
        assert sum(per_replica, []) == y.tolist()


def test_mismatched_components_still_reach_the_python_check():
    strategy = HeteroCentralStorageStrategy(
        ["/cpu:1", "/cpu:2"], auto_balance=False, rebalance=False, profile_cache=False
    )
    batches = [
        (np.zeros((4, 2), np.float32), np.zeros(4, np.int64)),
        (np.zeros((4, 2), np.float32), np.zeros(3, np.int64)),
    ]
    dataset = tf.data.Dataset.from_generator(
        lambda: iter(batches),
        output_signature=(tf.TensorSpec([None, 2], tf.float32), tf.TensorSpec([None], tf.int64)),
    )
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    next(iterator)
    with pytest.raises(tf.errors.OpError) as raised:
        next(iterator)  # x has 4 examples, y has 3: the pipeline's check goes to Python, which raises
    assert isinstance(strategy._input_error_raised(raised.value), InputError)  # noqa: SLF001 - what model.fit re-raises


def test_a_plan_change_reaches_the_cached_path():
    strategy = HeteroCentralStorageStrategy(
        ["/cpu:1", "/cpu:2", "/cpu:3"], auto_balance=False, rebalance=False, batch_split=[5, 3, 2], profile_cache=False
    )
    dataset = tf.data.Dataset.range(200).batch(20)

    def sizes_of_first_batches(count):
        iterator = iter(strategy.experimental_distribute_dataset(dataset))
        return [[int(t.shape[0]) for t in strategy.experimental_local_results(next(iterator))] for _ in range(count)]

    assert sizes_of_first_batches(3) == [[10, 6, 4]] * 3
    strategy.set_batch_split([1, 1, 2])
    assert sizes_of_first_batches(3) == [[5, 5, 10]] * 3
    strategy.set_batch_split(None)  # back to the even split
    assert sizes_of_first_batches(2) == [[7, 7, 6]] * 2


def test_online_rebalancing_keeps_the_python_path():
    strategy = HeteroCentralStorageStrategy(
        ["/cpu:1", "/cpu:2"], auto_balance=True, rebalance=True, profile_cache=False
    )
    assert not strategy._slicer.cacheable  # noqa: SLF001 - the re-balancing check runs in the Python path


def test_namedtuple_elements_keep_their_structure():
    Example = collections.namedtuple("Example", ["x", "y"])
    slicer, _ = make_slicer([1, 1])
    dataset = tf.data.Dataset.from_tensor_slices(Example(np.arange(6.0), np.arange(6))).batch(6)
    packed = slicer.pack(dataset)
    assert isinstance(packed.element_spec, Example)
    (element,) = list(packed)
    assert isinstance(element, Example)
    sizes, _ = slicer.step_sizes(6)
    assert [t.numpy().tolist() for t in cut(element.y, sizes, 2)] == [[0, 1, 2], [3, 4, 5]]


def test_a_dataset_that_claims_to_be_infinite_may_still_end():
    # repeat() over a generator reports an infinite length but stops when a pass yields nothing; the sliced
    # dataset then ends too, as the source does (no "expected infinite elements" error).
    passes = []

    def generate():
        passes.append(1)
        if len(passes) == 1:
            yield from (np.arange(i, i + 4) for i in range(0, 12, 4))

    source = tf.data.Dataset.from_generator(generate, output_signature=tf.TensorSpec([None], tf.int64)).repeat()
    assert int(source.cardinality()) == tf.data.INFINITE_CARDINALITY
    slicer, _ = make_slicer([1, 1])
    assert len(list(slicer.pack(source))) == 3


def test_one_element_per_global_batch_and_local_results_are_the_slices():
    strategy = HeteroCentralStorageStrategy(
        ["/cpu:1", "/cpu:2", "/cpu:3"], auto_balance=False, rebalance=False, batch_split=[5, 3, 2], profile_cache=False
    )
    dataset = tf.data.Dataset.range(40).batch(20)
    distributed = strategy.experimental_distribute_dataset(dataset)
    elements = list(distributed)
    assert len(elements) == 2
    assert [t.numpy().tolist() for t in strategy.experimental_local_results(elements[1])] == [
        list(range(20, 30)), list(range(30, 36)), list(range(36, 40))
    ]
    # Inside strategy.run every replica gets its slice of the same element, on its own device.
    sizes = strategy.run(lambda x: (tf.shape(x)[0], tf.reduce_sum(x)), args=(elements[0],))
    assert [int(t) for t in strategy.experimental_local_results(sizes[0])] == [10, 6, 4]
    assert int(strategy.reduce("SUM", sizes[1], axis=None)) == sum(range(20))
    assert int(strategy.reduce("SUM", elements[0], axis=0).numpy().sum()) == sum(range(20))


def test_ragged_components_are_cut_by_rows():
    strategy = HeteroCentralStorageStrategy(
        ["/cpu:1", "/cpu:2"], auto_balance=False, rebalance=False, batch_split=[3, 1], profile_cache=False
    )
    rows = [[1], [2, 2], [], [4, 4, 4], [5], [6], [7, 7], [8]]
    dataset = tf.data.Dataset.from_tensors(tf.ragged.constant(rows, dtype=tf.int64))
    element = next(iter(strategy.experimental_distribute_dataset(dataset)))
    slices = strategy.experimental_local_results(element)
    assert [s.to_list() for s in slices] == [rows[:6], rows[6:]]
    totals = strategy.run(lambda x: tf.reduce_sum(x.flat_values), args=(element,))
    assert [int(t) for t in strategy.experimental_local_results(totals)] == [1 + 4 + 12 + 5 + 6, 14 + 8]


def test_sparse_components_are_refused_with_the_fix():
    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2"], auto_balance=False, rebalance=False,
                                            profile_cache=False)
    sparse = tf.sparse.SparseTensor(indices=[[0, 0], [1, 2]], values=[1.0, 2.0], dense_shape=[4, 3])
    dataset = tf.data.Dataset.from_tensors(sparse)
    with pytest.raises(InputError, match="tf.sparse.to_dense"):
        strategy.experimental_distribute_dataset(dataset)


def test_a_single_component_value_is_taken_as_one_global_batch():
    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2"], batch_split=[3, 1], profile_cache=False)
    lonely = _compat.per_replica([tf.constant([1.0, 2.0, 3.0, 4.0])])
    parts = strategy.run(lambda x: x, args=(lonely,))
    assert [t.numpy().tolist() for t in strategy.experimental_local_results(parts)] == [[1.0, 2.0, 3.0], [4.0]]


def test_local_results_of_a_nested_element_are_per_replica_structures():
    strategy = HeteroCentralStorageStrategy(
        ["/cpu:1", "/cpu:2", "/cpu:3"], auto_balance=False, rebalance=False, batch_split=[2, 1, 1], profile_cache=False
    )
    features = {"a": np.arange(8.0), "b": np.arange(16).reshape(8, 2)}
    dataset = tf.data.Dataset.from_tensors((features, np.arange(8) * 10))
    element = next(iter(strategy.experimental_distribute_dataset(dataset)))
    local = strategy.experimental_local_results(element)
    assert len(local) == 3
    assert [f["a"].numpy().tolist() for f, _ in local] == [[0, 1, 2, 3], [4, 5], [6, 7]]
    assert [f["b"].shape[0] for f, _ in local] == [4, 2, 2]
    assert [y.numpy().tolist() for _, y in local] == [[0, 10, 20, 30], [40, 50], [60, 70]]


def test_an_element_of_another_strategy_is_cut_for_this_one():
    # Elements are whole global batches until a step cuts them, so the replica count they are cut for is the
    # step's strategy's.
    three = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2", "/cpu:3"], auto_balance=False, rebalance=False,
                                         profile_cache=False)
    two = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2"], auto_balance=False, rebalance=False, profile_cache=False)
    element = next(iter(three.experimental_distribute_dataset(tf.data.Dataset.range(6).batch(6))))
    parts = two.run(lambda x: x, args=(element,))
    assert [t.numpy().tolist() for t in two.experimental_local_results(parts)] == [[0, 1, 2], [3, 4, 5]]


def test_input_options_that_cannot_apply_are_ignored_with_a_warning(caplog):
    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2"], auto_balance=False, rebalance=False,
                                            profile_cache=False)
    dataset = tf.data.Dataset.range(8).batch(4)
    with caplog.at_level("WARNING", logger="hetero_cs"):
        strategy.experimental_distribute_dataset(dataset, tf.distribute.InputOptions())
        assert not caplog.records  # the defaults: nothing to say
        options = tf.distribute.InputOptions(experimental_fetch_to_device=False, experimental_per_replica_buffer_size=3)
        distributed = strategy.experimental_distribute_dataset(dataset, options)
    assert "experimental_fetch_to_device" in caplog.text and "experimental_per_replica_buffer_size" in caplog.text
    local = strategy.experimental_local_results(next(iter(distributed)))
    assert [t.numpy().tolist() for t in local] == [[0, 1], [2, 3]]
    with pytest.raises(InputError, match="InputOptions"):
        strategy.experimental_distribute_dataset(dataset, {"experimental_fetch_to_device": False})


def test_ragged_inputs_alone_give_the_replicas_their_weights():
    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2"], auto_balance=False, rebalance=False,
                                            batch_split=[3, 1], profile_cache=False)
    rows = tf.ragged.constant([[1.0], [2.0, 2.0], [], [4.0]])
    element = next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors(rows))))
    weights = strategy.run(lambda r: hetero_cs.replica_weight(), args=(element,))
    assert [float(w) for w in strategy.experimental_local_results(weights)] == [0.75, 0.25]


def test_ragged_components_with_int32_row_splits():
    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2"], auto_balance=False, rebalance=False,
                                            batch_split=[1, 1], profile_cache=False)
    rows = tf.ragged.constant([[1], [2, 2], [3], [4]], row_splits_dtype=tf.int32)
    element = next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors(rows))))
    slices = strategy.experimental_local_results(element)
    assert [s.to_list() for s in slices] == [[[1], [2, 2]], [[3], [4]]]
    assert all(s.row_splits.dtype == tf.int32 for s in slices)


def test_none_components_reach_every_replica_as_none():
    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2"], auto_balance=False, rebalance=False,
                                            batch_split=[3, 1], profile_cache=False)
    dataset = tf.data.Dataset.range(8).batch(4).map(lambda x: (x, x * 2, None))
    element = next(iter(strategy.experimental_distribute_dataset(dataset)))
    seen = strategy.run(lambda x, y, w: tf.constant(w is None), args=element)
    assert [bool(v) for v in strategy.experimental_local_results(seen)] == [True, True]
    assert strategy.reduce("MEAN", element, axis=None)[2] is None
    x_all, y_all, w_all = strategy.gather(element, axis=0)
    assert x_all.numpy().tolist() == [0, 1, 2, 3] and y_all.numpy().tolist() == [0, 2, 4, 6] and w_all is None


def test_a_none_or_optional_first_component_does_not_decide_the_batch_size():
    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2"], auto_balance=False, rebalance=False,
                                            batch_split=[3, 1], profile_cache=False)
    dataset = tf.data.Dataset.from_tensors({"a": None, "x": np.ones((8, 2), np.float32)})  # "a" flattens first
    element = next(iter(strategy.experimental_distribute_dataset(dataset)))
    weights = strategy.run(lambda d: hetero_cs.replica_weight(), args=(element,))
    assert [float(w) for w in strategy.experimental_local_results(weights)] == [0.75, 0.25]


def test_a_plan_change_applies_to_the_very_next_step():
    """Regression: the cut was decided in the input pipeline, which reads ahead, so a change came a step or two late."""
    strategy = HeteroCentralStorageStrategy(
        ["/cpu:1", "/cpu:2", "/cpu:3"], auto_balance=False, rebalance=False, batch_split=[5, 3, 2], profile_cache=False
    )
    iterator = iter(strategy.experimental_distribute_dataset(tf.data.Dataset.range(200).batch(20)))

    @tf.function
    def step(element):
        return strategy.run(lambda x: tf.shape(x)[0], args=(element,))

    def sizes(element):
        return [int(n) for n in strategy.experimental_local_results(step(element))]

    assert sizes(next(iterator)) == [10, 6, 4]
    strategy.set_batch_split([1, 1, 2])
    assert sizes(next(iterator)) == [5, 5, 10]  # the element the pipeline read ahead is cut by the new split
    strategy.set_batch_split(None)
    assert sizes(next(iterator)) == [7, 7, 6]
    assert step.experimental_get_tracing_count() == 1  # and the step was never retraced


def test_the_plan_is_served_once_per_step_that_runs():
    """Regression: the pipeline served plans for the batches it read ahead, which never ran."""
    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2"], profile_cache=False, guard=False)
    strategy.set_cost_models([hetero_cs.LinearCostModel(1e-3, 1e-5)] * 2)
    served = []
    original = strategy.balancer.serve
    strategy.balancer.serve = lambda B, **kwargs: served.append(B) or original(B, **kwargs)
    iterator = iter(strategy.experimental_distribute_dataset(tf.data.Dataset.range(100).batch(10)))

    @tf.function
    def step(element):
        return strategy.run(lambda x: tf.reduce_sum(x), args=(element,))

    for _ in range(3):
        step(next(iterator))
    assert served == [10, 10, 10]
