"""The replicas' gradients are summed, clipped and applied on the parameter device: nothing goes back to a replica."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from hetero_cs import HeteroCentralStorageStrategy

DEVICES = ["/cpu:1", "/cpu:2", "/cpu:3"]


def _device_index(op):
    spec = tf.DeviceSpec.from_string(op.device or "")
    return spec.device_index if (spec.device_type or "").upper() == "CPU" else None


def _origin_device(tensor):
    op = tensor.op
    while op.type == "Identity" and op.inputs:  # through the copies and ties to where the value was computed
        op = op.inputs[0].op
    return _device_index(op)


def _graphs(graph):
    """``graph`` and, recursively, the graphs of its control flow's branches (tf.switch_case, tf.cond)."""
    yield graph
    for op in graph.get_operations():
        if op.type in ("Case", "StatelessCase"):
            names = [f.name for f in op.get_attr("branches")]
        elif op.type in ("If", "StatelessIf"):
            names = [op.get_attr("then_branch").name, op.get_attr("else_branch").name]
        else:
            continue
        for name in names:
            yield from _graphs(graph._get_function(name).graph)  # noqa: SLF001  (a test reading TF's graph)


def _traced_step(optimizer, timed):
    if timed:  # auto-balanced: every step is timed, and each replica's gradients are copied to the host first
        strategy = HeteroCentralStorageStrategy(DEVICES, profile_cache=False, guard=False, rebalance=False)
    else:
        strategy = HeteroCentralStorageStrategy(DEVICES, batch_split=[3, 2, 1], profile_cache=False)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
        opt = optimizer()
        opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    rng = np.random.default_rng(0)
    dataset = tf.data.Dataset.from_tensor_slices(
        (rng.normal(size=(48, 8)).astype(np.float32), rng.integers(0, 2, size=48))).batch(24)
    element = next(iter(strategy.experimental_distribute_dataset(dataset)))

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True)) / 24.0
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def step(element):
        strategy.run(replica_step, args=element)

    return step.get_concrete_function(element).graph


@pytest.mark.parametrize("timed", [False, True], ids=["untimed", "timed"])
@pytest.mark.parametrize("optimizer", [lambda: keras.optimizers.SGD(0.1),
                                       lambda: keras.optimizers.Adam(1e-3, global_clipnorm=1.0)],
                         ids=["sgd", "adam_clipnorm"])
def test_no_summed_gradient_is_sent_back_to_a_replica(optimizer, timed):
    """Regression: Keras' all_reduce broadcast every summed gradient from the host to each replica's device, and the
    update read replica 0's copy back (a parameter-sized round trip per step on GPUs)."""
    graph = _traced_step(optimizer, timed)
    sums_per_graph = []
    for g in _graphs(graph):  # the step's graph and its branches (a custom loop's step gets a branch per active set)
        ops = g.get_operations()
        consumers = {}
        for op in ops:
            for tensor in op.inputs:
                consumers.setdefault(tensor.op.name, []).append(op)
        # The sums: ops on the parameter device (CPU:0) adding tensors computed on several replica devices.
        sums = [op for op in ops if op.type in ("AddN", "AddV2") and _device_index(op) == 0
                and len({_origin_device(t) for t in op.inputs} - {0, None}) >= 2]
        sums_per_graph.append(len(sums))
        seen, frontier, reached = set(), list(sums), []
        while frontier:
            op = frontier.pop()
            for consumer in consumers.get(op.name, []):
                if consumer.name in seen:
                    continue
                seen.add(consumer.name)
                if _device_index(consumer) not in (0, None):
                    reached.append(f"{consumer.name} on {consumer.device}")
                frontier.append(consumer)
        assert not reached, (g.name, reached)
    assert max(sums_per_graph) == 4  # one per trainable variable, in the branch of every replica


def test_the_makespan_includes_the_host_tail(monkeypatch):
    """A step's makespan runs from its start to the end of the host's update, not only to the last replica's end."""
    monkeypatch.setenv("HETERO_CS_TIMING", "1")  # time every step of this fixed split
    strategy = HeteroCentralStorageStrategy(DEVICES, batch_split=[2, 1, 1], profile_cache=False)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(96, 8)).astype(np.float32), rng.integers(0, 2, size=96)
    model.fit(x, y, batch_size=24, epochs=1, verbose=0)
    samples = strategy.monitor.window()
    assert samples
    for sample in samples:  # the update runs after every replica's gradients reached the host: a tail > 0
        assert sample.host_tail_s > 0.0
        assert sample.makespan_s == pytest.approx(sample.replica_makespan_s + sample.host_tail_s)
