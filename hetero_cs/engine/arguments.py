"""Checks of the strategy's arguments: device names, batch_split shares, profile_cache, input options, environment.

Each raises the library's typed error with the values and the fix; none changes any state.
"""

import logging
import math
import os

import tensorflow as tf

from hetero_cs.devices.catalog import (
    MAX_EMULATED_MAKESPAN_S, MIN_TARGET_MAKESPAN_MS, TARGET_MAKESPAN_ENV_VAR, _float_or, get_device_spec)
# canonical_device is also the strategy's (arguments.canonical_device).
from hetero_cs.devices.device_errors import canonical_device, checked_device_names  # noqa: F401
from hetero_cs.errors import BatchSplitError, ConfigError, DeviceError, InputError
from hetero_cs.planning.plan import finite_real, ordered_values, short_repr, unordered_note

logger = logging.getLogger("hetero_cs.engine.central_storage")  # the messages users filter on


def emulation_names(emulate) -> tuple:
    """``emulate`` as (Emulator or None, list of catalog names or None); the names are checked against the catalog.

    Raises:
        ConfigError: ``emulate`` is not a non-empty list of names (or an Emulator); a set (no order) is not one.
        UnknownEmulatedDeviceError: A name is not in the catalog.
    """
    from hetero_cs.devices.emulation import Emulator

    if emulate is None:
        return None, None
    if isinstance(emulate, Emulator):
        return emulate, [spec.name for spec in emulate.specs]
    names = ordered_values(emulate)  # the order says which card each replica emulates: a set has none
    if not names:
        raise ConfigError(f"emulate must be a non-empty list of catalog names, one per compute device in order. "
                          f"Received: emulate={emulate!r}{unordered_note(emulate)}. Example: "
                          f"emulate=['A10', 'T4', 'P100'].")
    for name in names:
        get_device_spec(name)  # UnknownEmulatedDeviceError with the known names
    return None, list(names)


def checked_devices(compute_devices, parameter_device: str) -> list[str]:
    """``compute_devices`` as canonical device names, checked against ``parameter_device`` (canonical) and the
    devices TensorFlow sees. None: every GPU; with no GPU, every logical CPU device except the parameter device. A
    single name is one device.

    Raises:
        ConfigError: ``compute_devices`` is not a list of names.
        DeviceError: An empty, unparsable, unknown or repeated name, or the parameter device among several.
    """
    if compute_devices is None:
        gpus = [canonical_device(d.name) for d in tf.config.list_logical_devices("GPU")]
        cpus = [canonical_device(d.name) for d in tf.config.list_logical_devices("CPU")]
        compute_devices = gpus or [d for d in cpus if d != parameter_device] or cpus[:1]
    elif isinstance(compute_devices, str):
        compute_devices = [compute_devices]
    elif not isinstance(compute_devices, (list, tuple)):  # each name is checked by canonical_device
        raise ConfigError(f"compute_devices must be a list of device names, e.g. ['/gpu:0', '/gpu:1'], or None for "
                          f"every GPU. Received: compute_devices={compute_devices!r}.")
    if not compute_devices:
        raise DeviceError("compute_devices is empty. Give at least one device, e.g. ['/gpu:0'].")
    devices, _ = checked_device_names(compute_devices, parameter_device, argument="compute_devices")
    if parameter_device in devices and len(devices) > 1:
        raise DeviceError(f"The parameter device {parameter_device} is also a compute device in {devices}. Keep the "
                          f"variables on a device that does not run a replica (default '/device:CPU:0'), or drop it "
                          f"from compute_devices.")
    return devices


def checked_shares(batch_split, num_replicas: int) -> list:
    """batch_split as a list of R valid shares: an ordered sequence (list, tuple, range, 1-D array; a set or dict is
    not) of R finite numbers >= 0, not all 0, whose sum a float holds.

    Raises:
        BatchSplitError: It is not, with the values and an example.
    """
    shares = ordered_values(batch_split)
    if shares is None:
        raise BatchSplitError(
            f"batch_split must be a sequence of relative shares, one per replica in replica order. Received: "
            f"batch_split={short_repr(batch_split)}{unordered_note(batch_split)}. Example: batch_split=[2, 1, 1].")
    if len(shares) != num_replicas:
        raise BatchSplitError(
            f"batch_split has one share per replica: len(batch_split)={len(shares)}, but there are "
            f"R={num_replicas} compute devices. Give {num_replicas} shares, e.g. {[1] * num_replicas}.")
    if any(not finite_real(s) or s < 0 for s in shares) or not any(s > 0 for s in shares):
        raise BatchSplitError(f"batch_split shares must be finite numbers >= 0 with at least one > 0. Received: "
                              f"batch_split={short_repr(list(shares))}. Example: batch_split=[2, 1, 1] gives replica 0 "
                              f"half of each batch.")
    if not math.isfinite(sum(float(s) for s in shares)):
        raise BatchSplitError(
            f"batch_split shares sum to more than a float holds: batch_split={short_repr(list(shares))}. Only their "
            f"ratios matter; scale them down, e.g. batch_split=[2, 1, 1].")
    return list(shares)


def validate_profile_cache(profile_cache) -> None:
    from calibration.store import ProfileStore

    if not (profile_cache is None or profile_cache is False
            or isinstance(profile_cache, (str, os.PathLike, ProfileStore))):
        raise ConfigError(f"profile_cache must be None (the default cache directory), False (no cache), a directory "
                          f"path or a calibration.ProfileStore. Received: profile_cache={profile_cache!r}.")


_DEFAULT_INPUT_OPTIONS = tf.distribute.InputOptions()


def warn_unused_input_options(options) -> None:
    """Warns about InputOptions settings that cannot apply when every global batch is cut on the host."""
    if options is not None and not isinstance(options, tf.distribute.InputOptions):
        raise InputError(
            f"options must be a tf.distribute.InputOptions or None; got {type(options).__name__}: {options!r}.")
    # InputOptions is a namedtuple: fetch to device, replication mode, placement on device, per-replica buffer size.
    changed = {f: v for f, v in (options or _DEFAULT_INPUT_OPTIONS)._asdict().items()
               if v != getattr(_DEFAULT_INPUT_OPTIONS, f)}
    if changed:
        logger.warning("hetero_cs: InputOptions %s are ignored: every global batch goes to the host and is cut there "
                       "inside strategy.run, so there is no per-replica input to place or buffer. Add .prefetch(...) "
                       "to the dataset for more buffering.", changed)


def emulated_makespan_target_s() -> float:
    """Emulated even-split makespan to aim for, seconds: HETERO_CS_EMULATION_TARGET_MAKESPAN_MS, default 100 ms.

    Real compute of the logical CPU replicas shares the host's cores; the emulated waits must stay well above it
    so that the emulated devices, not CPU contention, set each replica's step time. Bounded to
    [MIN_TARGET_MAKESPAN_MS, MAX_EMULATED_MAKESPAN_S * 1000] = [1, 5000] ms: calibration alone runs about a hundred
    emulated steps.

    Raises:
        ConfigError: If the variable is not a number in that range (the message names the variable).
    """
    raw = os.environ.get(TARGET_MAKESPAN_ENV_VAR, "").strip()
    if not raw:
        return 0.1
    value_ms = _float_or(raw, math.nan)
    high_ms = MAX_EMULATED_MAKESPAN_S * 1e3
    if not math.isfinite(value_ms) or not MIN_TARGET_MAKESPAN_MS <= value_ms <= high_ms:
        raise ConfigError(f"{TARGET_MAKESPAN_ENV_VAR}={raw!r} must be a positive number of milliseconds, e.g. 100, "
                          f"from {MIN_TARGET_MAKESPAN_MS:g} to {high_ms:g} (an emulated step of at most "
                          f"{MAX_EMULATED_MAKESPAN_S:g} s). Unset it for the default of 100.")
    return value_ms / 1e3


def env_flag(name: str) -> bool:
    """Whether the environment variable ``name`` is on: 1, true, yes or on; off when unset, empty, 0, false, no or off.

    Raises:
        ConfigError: Any other value.
    """
    value = os.environ.get(name, "").strip().lower()
    if value not in ("", "0", "false", "no", "off", "1", "true", "yes", "on"):
        raise ConfigError(f"{name}={os.environ[name]!r} is not a flag: set it to 1 (on) or 0 (off), or leave it unset.")
    return value in ("1", "true", "yes", "on")


def memory_policy(oom_recovery):
    """The MemoryRecoveryPolicy for ``oom_recovery`` (True or None: the defaults; False: None, recovery off).

    Raises:
        ConfigError: ``oom_recovery`` is neither a bool nor a MemoryRecoveryPolicy.
    """
    from hetero_cs.planning.memory_caps import MemoryRecoveryPolicy

    if not (oom_recovery is None or isinstance(oom_recovery, (bool, MemoryRecoveryPolicy))):
        raise ConfigError(f"oom_recovery must be None (the default), True, False or a MemoryRecoveryPolicy. Received: "
                          f"oom_recovery={oom_recovery!r}. Example: oom_recovery=MemoryRecoveryPolicy(max_retries=2).")
    return oom_recovery if isinstance(oom_recovery, MemoryRecoveryPolicy) else None


def validate_flags(**flags) -> None:
    """Raises ConfigError unless every flag is a bool (``auto_balance="no"`` would otherwise count as True)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be True or False. Received: {name}={value!r} ({type(value).__name__}).")


def validate_setting(name: str, value, choices: str) -> None:
    """Raises ConfigError unless the setting ``name`` is None, True or False; ``choices`` says what each means."""
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"{name} must be {choices}. Received: {name}={value!r}.")


MICRO_BATCHES_CHOICES = (
    "None (micro-batch where it is exact and helps), True (also accept per-micro-batch statistics: "
    "BatchNormalization's on one machine, a layer's own state on both strategies) or False (never)")
