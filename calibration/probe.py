"""Builds and times one replica's training step on one device (the only TensorFlow module of calibration).

A probe step is what one replica of a central-storage step does, minus the optimizer update: read the central
variables from the parameter device (broadcast), forward with training=True, loss, gradients with respect to the
trainable variables, and return the gradients to the parameter device. It is one ``tf.function`` traced once for all
batch sizes (an input signature with a None batch dimension). When an emulator is given, the step is timed by
hetero_cs.emulation's wall-clock stamps and its replica waits as long as the emulated device would take.

A probe never changes the model: no gradient is applied, and every non-trainable variable (BatchNormalization moving
statistics, Dropout seed state) and metric variable is snapshotted before probing and restored after
(``preserved_model_state``; ``DeviceProbe.time_step`` does it itself, ``run_step`` does not).

TensorFlow is imported inside functions, so importing this module does not initialise TensorFlow;
``model_fingerprint`` and ``search_memory_cap`` never need it.
"""

import contextlib
import hashlib
import json
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from calibration.probe_failure import probe_step_error
from hetero_cs.errors import CalibrationError, ConfigError

__all__ = ["DeviceProbe", "dtype_policy_name", "extrapolate_memory_cap", "input_signature", "model_fingerprint",
           "preserved_model_state", "sample_batch_size", "search_memory_cap"]

logger = logging.getLogger(__name__)

LossFn = Callable[..., Any]


def _qualified_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _walk_layers(layer: Any) -> Iterator[Any]:
    for sub in getattr(layer, "layers", None) or ():
        yield sub
        yield from _walk_layers(sub)


def _layer_config_text(layer: Any) -> str:
    """The layer's config without its name, as stable text ('' when the layer has no usable config)."""
    try:
        config = dict(layer.get_config())
    except Exception:  # noqa: BLE001 - custom layers may not implement get_config; the class name still counts.
        return ""
    # Nested layers are walked separately.
    return json.dumps({k: v for k, v in config.items() if k not in ("name", "layers")}, sort_keys=True,
                      default=lambda o: type(o).__qualname__)


def model_fingerprint(model: Any) -> str:
    """Returns a sha256 hex digest of what determines the model's step time.

    Covers the model class, every (nested) layer's class and config without its name (units, kernel sizes, strides,
    activations, dtype policy) and every variable's shape, dtype and trainability, in order. Variable values and
    layer names are left out, so two models built by the same code get the same fingerprint; changing a layer,
    a shape or a dtype changes it.

    Args:
        model: A built Keras model.

    Raises:
        ConfigError: If the model has no variables (it is not built yet; call it once or give it an Input).
    """
    variables = list(getattr(model, "variables", None) or ())
    if not variables:
        raise ConfigError(f"model_fingerprint needs a built model; {type(model).__name__} has no variables. Build it "
                          "first (keras.Input(...) as first layer, or call it on a batch).")
    description = {
        "model": _qualified_name(model),
        "layers": [[_qualified_name(layer), _layer_config_text(layer)] for layer in _walk_layers(model)],
        "variables": [[list(v.shape), str(v.dtype), bool(v.trainable)] for v in variables],
    }
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode("utf-8")).hexdigest()


def dtype_policy_name(model: Any) -> str:
    """The model's Keras dtype policy name, e.g. "mixed_float16" (in the profile cache key: another speed)."""
    policy = getattr(model, "dtype_policy", None)
    return str(getattr(policy, "name", None) or policy or "float32")


def _leaf_signature(leaf: Any, include_batch_dim: bool) -> str:
    dtype_name = getattr(getattr(leaf, "dtype", None), "name", None) or str(np.asarray(leaf).dtype)
    dims = [str(d) if i or include_batch_dim else "*" for i, d in enumerate(getattr(leaf, "shape", np.shape(leaf)))]
    return f"{dtype_name}[{','.join(dims)}]"


def input_signature(batch: Any, *, include_batch_dim: bool = False) -> str:
    """Returns a short text of a batch's structure, dtypes and shapes, e.g. "0=float32[*,8,8,1];1=int64[*]".

    Args:
        batch: A nested structure (tuple, list, dict) of arrays or tensors with a leading batch dimension.
        include_batch_dim: Keep the batch dimension's size instead of "*".
    """
    import keras

    return ";".join(f"{'/'.join(str(k) for k in path)}={_leaf_signature(leaf, include_batch_dim)}"
                    for path, leaf in keras.tree.flatten_with_path(batch))


def search_memory_cap(fits: Callable[[int], bool], *, largest_fitting: int, smallest_failing: int,
                      first_guess: int | None = None, max_steps: int = 8, relative_precision: float = 1 / 64) -> int:
    """Finds (approximately) the largest batch size that fits in memory by a bounded bisection.

    Invariant: ``largest_fitting`` fits and ``smallest_failing`` does not. Each step tries one size in between
    (``first_guess`` first, typically extrapolated from peak memory; then the midpoint) and narrows the interval.
    Stops after max_steps tries or when the interval is within relative_precision of largest_fitting.

    Args:
        fits: Runs one step at a batch size and says whether it completed without running out of memory.
        largest_fitting: A size known to fit, >= 1.
        smallest_failing: A size known not to fit, > largest_fitting.
        first_guess: Size to try first; ignored unless strictly between the bounds.
        max_steps: Most sizes tried, >= 0.
        relative_precision: Stop when smallest_failing - largest_fitting <= max(1, this * largest_fitting).

    Returns:
        The largest size seen to fit (never a size that failed).

    Raises:
        ConfigError: If the bounds are inconsistent.

    Examples:
        >>> search_memory_cap(lambda b: b <= 300, largest_fitting=256, smallest_failing=512, relative_precision=0)
        300
    """
    if not 1 <= largest_fitting < smallest_failing or max_steps < 0:
        raise ConfigError("search_memory_cap needs 1 <= largest_fitting < smallest_failing and max_steps >= 0. "
                          f"Received: largest_fitting={largest_fitting}, smallest_failing={smallest_failing}, "
                          f"max_steps={max_steps}.")
    low, high, guess = largest_fitting, smallest_failing, first_guess
    for _ in range(max_steps):
        if high - low <= max(1, math.floor(relative_precision * low)):
            break
        candidate = guess if guess is not None and low < guess < high else (low + high) // 2
        guess = None
        low, high = (candidate, high) if fits(candidate) else (low, candidate)
    return low


@contextlib.contextmanager
def preserved_model_state(model: Any) -> Iterator[None]:
    """Snapshots the model's non-trainable and metric variables and restores them on exit (also on error).

    Calling a model with training=True moves BatchNormalization statistics and seed-generator state; this undoes it.
    Trainable variables are never written by a probe (no optimizer step), so they are not copied.
    """
    variables = list(getattr(model, "non_trainable_variables", ())) + list(getattr(model, "metrics_variables", ()))
    snapshot = [(v, np.array(v.numpy(), copy=True)) for v in variables]
    try:
        yield
    finally:
        for variable, value in snapshot:
            variable.assign(value)


def _memory_device_name(device: str) -> str:
    """'/device:GPU:1' -> 'GPU:1', as tf.config.experimental's memory calls name a device."""
    from hetero_cs.devices.device_errors import canonical_device

    return canonical_device(device).removeprefix("/device:")


def _resolve_loss(model: Any, loss: LossFn | None) -> Callable[[Any, Any, Any, Any], Any]:
    """Returns f(x, y, y_pred, sample_weight) -> scalar loss, from the argument or the model's compiled loss."""
    import tensorflow as tf

    if loss is not None:
        if not callable(loss):
            raise ConfigError(f"loss must be callable(y_true, y_pred[, sample_weight]). Received: loss={loss!r}.")

        def explicit(x: Any, y: Any, y_pred: Any, sample_weight: Any) -> Any:
            del x
            value = loss(y, y_pred) if sample_weight is None else loss(y, y_pred, sample_weight)
            value = tf.reduce_mean(value)
            extra = list(getattr(model, "losses", ()))  # Regularisation terms, as compute_loss adds them.
            return value + tf.add_n(extra) if extra else value

        return explicit
    if getattr(model, "compiled", False) and hasattr(model, "compute_loss"):
        return lambda x, y, y_pred, sample_weight: model.compute_loss(x=x, y=y, y_pred=y_pred,
                                                                      sample_weight=sample_weight, training=True)
    if callable(getattr(model, "loss", None)):
        return _resolve_loss(model, model.loss)
    raise CalibrationError(f"Calibration needs a loss to time the backward pass, but model="
                           f"{getattr(model, 'name', model)!r} is not compiled and no loss was given. Compile the "
                           "model first (model.compile(optimizer=..., loss=...)), or, calling calibration.calibrate "
                           "directly, pass loss=keras.losses.<Loss>().")


def sample_batch_size(sample_batch: Any) -> int:
    """The number of examples n in a (x, y[, sample_weight]) batch.

    Raises:
        ConfigError: If the batch is not such a tuple, or its arrays disagree on the leading dimension or have none.
    """
    import keras

    shapes = [tuple(getattr(leaf, "shape", np.shape(leaf)))
              for leaf in keras.tree.flatten(_split_batch(sample_batch)) if leaf is not None]
    sizes = {int(shape[0]) if shape and shape[0] is not None else -1 for shape in shapes}
    if len(sizes) != 1 or min(sizes) < 1:
        raise ConfigError("Every array of sample_batch needs the same leading batch dimension >= 1. Received: "
                          f"leading sizes {sorted(sizes)} (-1: no batch dimension).")
    return sizes.pop()


def _split_batch(sample_batch: Any) -> tuple[Any, ...]:
    """(x, y[, sample_weight]) as a tuple; a sample_weight of None is left out."""
    if not isinstance(sample_batch, (tuple, list)) or len(sample_batch) not in (2, 3):
        length = len(sample_batch) if hasattr(sample_batch, "__len__") else "?"
        raise ConfigError("sample_batch must be a tuple (x, y) or (x, y, sample_weight) with a leading batch "
                          f"dimension. Received: {type(sample_batch).__name__} of length {length}.")
    return tuple(sample_batch[:2]) + tuple(w for w in sample_batch[2:] if w is not None)


class DeviceProbe:
    """Times one replica's step (broadcast, forward, loss, backward, gradient return) on one device.

    Examples:
        >>> probe = DeviceProbe(model, (x, y), device="/device:CPU:1")
        >>> samples_s = probe.time_step(64, warmup_steps=2, trials=5)  # model unchanged afterwards
    """

    def __init__(self, model: Any, sample_batch: Any, *, device: str, parameter_device: str = "/device:CPU:0",
                 loss: LossFn | None = None, replica_id: int = 0, emulator: Any = None,
                 stateless: bool = False) -> None:
        """Builds the probe step (traced lazily on the first call, once for all batch sizes).

        Args:
            model: A built Keras model; its variables may be central AggregatingVariables of a
                CentralStorageStrategy (they are read in cross-replica context).
            sample_batch: (x, y) or (x, y, sample_weight), arrays or tensors with a leading batch dimension of
                n >= 1 examples; larger batches repeat its examples.
            device: Device that computes the step, e.g. "/device:GPU:0".
            parameter_device: Device that receives the gradients (where the central variables live).
            loss: callable(y_true, y_pred[, sample_weight]); None uses the model's compiled loss.
            replica_id: Replica index of this device, passed to the emulator.
            emulator: A hetero_cs.emulation.Emulator whose device replica_id this device plays, or None.
            stateless: Change no variable at all (Keras' ``StatelessScope``: the step's BatchNormalization, seed and
                metric updates are dropped), so that the step may run beside training, in another thread.

        Raises:
            ConfigError: If sample_batch is not (x, y[, sample_weight]) or has an empty batch.
            CalibrationError: If no loss is available.
        """
        import tensorflow as tf

        self.device = device
        self.parameter_device = parameter_device
        self.replica_id = int(replica_id)
        self.emulator = emulator
        self._model = model
        self._loss = _resolve_loss(model, loss)
        self.sample_size = sample_batch_size(sample_batch)
        with tf.device(parameter_device):  # (x, y[, sample_weight])
            self._sample = tf.nest.map_structure(tf.convert_to_tensor, _split_batch(sample_batch))
        self._batches: dict[int, Any] = {}
        self._has_run = False
        self._stateless = bool(stateless)
        spec = tf.nest.map_structure(lambda t: tf.TensorSpec([None, *t.shape[1:]], t.dtype), self._sample)
        self._step = tf.function(self._step_fn, input_signature=[spec])

    def _step_fn(self, batch: Any) -> Any:
        import tensorflow as tf

        from hetero_cs.devices.step_clock import end_replica_step, tie_to_stamp, wall_clock_stamp

        x, y = batch[0], batch[1]
        sample_weight = batch[2] if len(batch) == 3 else None
        batch_size = tf.shape(tf.nest.flatten(x)[0])[0]
        trainable = self._model.trainable_variables
        with tf.device(self.device):
            start = wall_clock_stamp(tf.nest.flatten(x)[0])
            x = tie_to_stamp(x, start)  # The forward pass starts after the start stamp (a data dependency).
            import keras

            with tf.GradientTape() as tape:
                # Stateless: the trainable variables are read (on the tape) into the scope, where Keras' weight
                # regularizers look their values up; no variable is written.
                with (keras.StatelessScope([(v, v.value) for v in trainable], collect_losses=True) if self._stateless
                      else contextlib.nullcontext()):
                    y_pred = self._model(x, training=True)
                    loss = self._loss(x, y, y_pred, sample_weight)
            gradients = tape.gradient(loss, trainable)
        with tf.device(self.parameter_device):
            returned = [tf.identity(g) for g in gradients if g is not None]  # Gradient return to the host.
            checksum = tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) for g in returned]) if returned else loss
            # advance=False: probes are not training steps and must not move the emulator's drift counters.
            end = end_replica_step(start, checksum, replica_id=self.replica_id, batch_size=batch_size,
                                   emulator=self.emulator, advance=False)
            # A data dependency keeps the stateless end stamp (and its emulated wait) from being pruned; a control
            # dependency alone is not enough under Grappler (see hetero_cs.devices.step_clock.end_replica_step).
            return tie_to_stamp(checksum, end), end - start

    def batch(self, batch_size: int) -> Any:
        """The probe input of batch_size examples (the sample's first examples, repeated when larger), cached."""
        import tensorflow as tf

        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ConfigError(f"A probe batch size is an integer >= 1. Received: batch_size={batch_size!r}.")
        batch_size = int(batch_size)
        if batch_size not in self._batches:
            indices = tf.range(batch_size) % self.sample_size
            with tf.device(self.parameter_device):
                self._batches[batch_size] = tf.nest.map_structure(lambda t: tf.gather(t, indices, axis=0), self._sample)
        return self._batches[batch_size]

    def trace(self, batch_size: int) -> None:
        """Traces the step now, without running it (e.g. in the thread that runs training, to run it in another)."""
        self._step.get_concrete_function(self.batch(batch_size))

    def run_step(self, batch_size: int) -> float:
        """Runs one step; returns its seconds from the input's arrival to the gradients' arrival on the parameter
        device, stamped in the step: the training monitor's span and clock (so calibrated and measured times compare).

        This moves BatchNormalization statistics and seed state like any training-mode call; time_step restores
        them, or wrap calls in preserved_model_state.

        Raises:
            tf.errors.OpError: e.g. out of memory, in any form (the caller decides what to do).
        """
        elapsed_s = float(self._step(self.batch(batch_size))[1].numpy())
        self._emulated_peak_size = max(getattr(self, "_emulated_peak_size", 0), int(batch_size))
        self._has_run = True
        return elapsed_s

    def time_step(self, batch_size: int, *, warmup_steps: int = 2, trials: int = 5) -> list[float]:
        """Runs warmup_steps untimed steps, then returns the times of `trials` steps (``run_step``), seconds.

        The probe's very first step (which traces the tf.function) is always untimed, even with warmup_steps=0.
        """
        if warmup_steps < 0 or trials < 1:
            raise ConfigError(f"Need warmup_steps >= 0 and trials >= 1. Received: warmup_steps={warmup_steps}, "
                              f"trials={trials}.")
        with preserved_model_state(self._model):
            if not self._has_run:  # The first call traces the step function: never time it.
                self.run_step(batch_size)
            for _ in range(warmup_steps):
                self.run_step(batch_size)
            return [self.run_step(batch_size) for _ in range(trials)]

    def step_error(self, exc: Exception, batch_size: int) -> CalibrationError:
        """The CalibrationError for a probe step that failed with TensorFlow's ``exc`` at ``batch_size``: it blames
        the sample batch when its values explain the failure, else the device (see calibration.probe_failure)."""
        return probe_step_error(exc, device=self.device, batch_size=batch_size, model=self._model,
                                sample=[t.numpy() for t in self._sample], sample_size=self.sample_size)

    @property
    def tracks_memory(self) -> bool:
        """True when the device reports peak memory: GPUs, and emulated devices (their memory model)."""
        return _memory_device_name(self.device).startswith("GPU:") or self.emulator is not None

    def reset_peak_memory(self) -> None:
        """Resets the device's peak-memory counter (no-op on devices that do not track memory)."""
        import tensorflow as tf

        self._emulated_peak_size = 0
        if self.tracks_memory and self.emulator is None:
            tf.config.experimental.reset_memory_stats(_memory_device_name(self.device))

    def peak_memory_bytes(self) -> int | None:
        """Peak device memory since the last reset_peak_memory, bytes; None where not tracked. An emulated device
        reports what its largest slice since then needs (hetero_cs.emulation.slice_memory_bytes)."""
        import tensorflow as tf

        if self.emulator is not None:
            from hetero_cs.devices.workload import slice_memory_bytes

            return slice_memory_bytes(self.emulator.workload, getattr(self, "_emulated_peak_size", 0))
        if not self.tracks_memory:
            return None
        return int(tf.config.experimental.get_memory_info(_memory_device_name(self.device))["peak"])

    def memory_limit_bytes(self) -> int | None:
        """The device's memory limit when a logical-device memory_limit was configured for it, else None.

        Logical GPUs are numbered in order over the physical GPUs, each contributing its configured logical devices
        (or one when none was configured).
        """
        import tensorflow as tf

        if self.emulator is not None:
            return self.emulator.memory_bytes(self.replica_id)
        if not self.tracks_memory:
            return None
        wanted = tf.DeviceSpec.from_string(self.device).device_index or 0
        configs = [config for physical in tf.config.list_physical_devices("GPU")
                   for config in tf.config.get_logical_device_configuration(physical) or [None]]
        limit_mb = getattr(configs[wanted], "memory_limit", None) if wanted < len(configs) else None
        return int(limit_mb) * 1024 * 1024 if limit_mb else None


def extrapolate_memory_cap(peaks_bytes: Sequence[tuple[int, int]], *, memory_limit_bytes: int | None,
                           headroom: float = 0.9) -> int | None:
    """Extrapolates the largest batch that fits from peak memory at two or more batch sizes.

    Fits peak(b) = base + per_example * b through the two largest measured sizes and solves
    peak(b) = headroom * memory_limit_bytes.

    Args:
        peaks_bytes: (batch_size, peak_bytes) pairs, any order.
        memory_limit_bytes: The device's usable memory, bytes; None gives None.
        headroom: Fraction of the limit to plan for, in (0, 1].

    Returns:
        The extrapolated cap in examples (>= 1), or None when it cannot be estimated.
    """
    if memory_limit_bytes is None or len(peaks_bytes) < 2:
        return None
    (b1, p1), (b2, p2) = sorted(peaks_bytes)[-2:]
    if b2 <= b1 or p2 <= p1:
        return None
    per_example = (p2 - p1) / (b2 - b1)
    base = p1 - per_example * b1
    return max(1, int((headroom * memory_limit_bytes - base) // per_example))
