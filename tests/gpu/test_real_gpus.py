"""Checks on real GPUs (run with `tox -e gpu`); skipped on machines without one.

Nothing here configures logical devices: real GPUs need no emulation.
"""

import numpy as np
import pytest
import tensorflow as tf

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not tf.config.list_physical_devices("GPU"), reason="no GPU on this machine"),
]


def test_discovery_joins_nvml_facts_to_every_gpu():
    import hetero_cs

    gpus = [d for d in hetero_cs.discover_devices() if d.device_type == "GPU"]
    assert gpus
    for gpu in gpus:
        assert gpu.source == "nvml", gpu
        assert gpu.memory_total_bytes and gpu.memory_total_bytes > 0
        assert gpu.pci_bus_id or gpu.uuid


def _gpu_and_host_devices():
    """Two compute devices: two GPUs if present, else the GPU and a second logical CPU."""
    gpus = tf.config.list_logical_devices("GPU")
    if len(gpus) >= 2:
        return [gpus[0].name, gpus[1].name]
    cpus = tf.config.list_logical_devices("CPU")
    if len(cpus) < 2:
        pytest.skip("one GPU and one logical CPU: need a second compute device")
    return [gpus[0].name, cpus[1].name]


def _fit_on_one_device_and_on_the_split(build, devices, x, y):
    """(reference, model): ``build()`` trained on /cpu:0 alone, and on ``devices`` with the split [3, 1]."""
    from hetero_cs import HeteroCentralStorageStrategy

    with tf.device("/cpu:0"):
        reference = build()
        reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    strategy = HeteroCentralStorageStrategy(devices, batch_split=[3, 1], profile_cache=False)
    with strategy.scope():
        model = build()
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    return reference, model


def test_uneven_split_on_real_devices_matches_one_device():
    import keras

    devices = _gpu_and_host_devices()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    y = rng.normal(size=(64, 1)).astype(np.float32)

    def build():
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, "tanh", kernel_initializer=keras.initializers.GlorotUniform(1)),
             keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(2))]
        )
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return model

    reference, model = _fit_on_one_device_and_on_the_split(build, devices, x, y)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-4)  # GPU kernels (TF32, reduction order) differ from CPU's


def test_calibration_on_a_gpu_finds_a_memory_cap(tmp_path):
    import keras

    from calibration import calibrate

    gpu = tf.config.list_logical_devices("GPU")[0].name
    strategy = tf.distribute.experimental.CentralStorageStrategy([gpu], parameter_device="/cpu:0")
    with strategy.scope():
        model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(1024, "relu"), keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.zeros((512, 256), np.float32)
    y = np.zeros((512,), np.int64)
    result = calibrate(model, (x, y), devices=[gpu], store=False, progress=False)
    profile = result.profiles[0]
    assert profile.max_batch_size is not None and profile.max_batch_size >= 512
    assert profile.fit_error < 0.5


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_on_real_devices_skips_an_overflow_like_one_device(policy):
    import keras

    details = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])
    if policy == "mixed_bfloat16" and tuple(details.get("compute_capability") or (0, 0)) < (8, 0):
        pytest.skip("bfloat16 needs compute capability 8.0 (refused with UnsupportedPrecisionError below it)")
    devices = _gpu_and_host_devices()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    x[35, 0] = 1e6  # the second batch of 32 overflows (float16 inf; bfloat16 keeps it finite)
    y = rng.integers(0, 3, size=(64,)).astype(np.int32)
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(policy)
    try:
        def build():
            init = keras.initializers.GlorotUniform
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, "tanh", kernel_initializer=init(1)),
                                      keras.layers.Dense(3, kernel_initializer=init(2))])
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
            return model

        reference, model = _fit_on_one_device_and_on_the_split(build, devices, x, y)
    finally:
        keras.mixed_precision.set_global_policy(previous)
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())
    if policy == "mixed_float16":
        assert int(model.optimizer.iterations.numpy()) == 2  # both epochs' overflowing batch skipped
        assert float(model.optimizer.dynamic_scale.numpy()) == float(reference.optimizer.dynamic_scale.numpy())
    for a, b in zip(reference.get_weights(), model.get_weights()):
        assert np.all(np.isfinite(b))
        np.testing.assert_allclose(b, a, atol=5e-3)  # half-precision kernels on a GPU beside the CPU's
