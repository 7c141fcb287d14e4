"""Preparing a strategy's balancing for one model: emulated device sizes, calibration (or a profile file), the plan
to try.

``HeteroCentralStorageStrategy.calibrate`` (called by ``model.fit`` on its first global batch) delegates here.
"""

import dataclasses
import logging
import os
import warnings

import tensorflow as tf

from calibration.probe import dtype_policy_name, model_fingerprint
from calibration.store import ProfileStore, load_result_file
from calibration.workload import estimate_workload
from hetero_cs.devices.catalog import emulated_identity
from hetero_cs.engine import _compat, arguments
from hetero_cs.engine.faults.restart_profiles import keep_for_restart, profiles_before_restart
from hetero_cs.engine.step import tensors
from hetero_cs.engine.step.input_slicing import is_unbatched_marker
from hetero_cs.errors import ConfigError, InputError, ProfileCacheError

logger = logging.getLogger("hetero_cs.engine.central_storage")  # the messages users filter on


def check_policy_support(strategy, model) -> None:
    """Refuses ``mixed_bfloat16`` on a real GPU without bfloat16 arithmetic (emulated devices: the emulator does)."""
    policy = dtype_policy_name(model)
    if policy != "mixed_bfloat16" or not any(":GPU:" in d for d in strategy._compute_devices):
        return
    from hetero_cs.devices.discovery import discover_devices
    from hetero_cs.devices.precision import check_policy_support as check

    capabilities = {info.name: info.compute_capability for info in discover_devices()}
    check(policy, [(d, capabilities.get(d)) for d in strategy._compute_devices])


def calibrate(strategy, model, data, *, force: bool = False, progress: bool = True):
    """``HeteroCentralStorageStrategy.calibrate`` (see there for the arguments, result and errors)."""
    from calibration import calibrate as run_calibration  # looked up when called (a test replaces it)

    check_policy_support(strategy, model)
    emulation_pending = strategy._emulation_pending()
    fingerprint = model_fingerprint(model) if strategy._balancer.auto_balance else None
    if fingerprint is not None and not (force or emulation_pending) and _done(strategy, fingerprint, force):
        return strategy._calibration  # calibrated already: no batch is read
    batch = first_global_batch(strategy, data)
    batched = [leaf for leaf in tf.nest.flatten(batch) if not is_unbatched_marker(leaf)]
    if not batched:
        raise InputError(
            "The first dataset element holds only None or Optional components; there is nothing to calibrate on.")
    global_batch_size = int(tensors.leading_dim_value(batched[0]))
    if global_batch_size < 1:
        raise InputError("The first dataset element holds 0 examples; calibration needs a global batch of at least "
                         "one. Drop empty batches, e.g. dataset.filter(lambda x, *rest: tf.shape(x)[0] > 0).")
    if isinstance(batch, (tuple, list)) and len(batch) in (2, 3) and batch[1] is not None:
        strategy._idle_probes.use(model, batch)  # idle cards are probed on its first example
    restarted = (profiles_before_restart(strategy, fingerprint, global_batch_size)  # a restart without a lost card
                 if fingerprint is not None and strategy._profile is None else None)
    if emulation_pending:
        target_s = arguments.emulated_makespan_target_s()  # before anything changes: a bad value leaves no trace
        strategy._emulator.set_workload(estimate_workload(model))
        strategy._emulator.calibrate_time_scale(global_batch_size, target_makespan_s=target_s)
    if not strategy._balancer.auto_balance:
        strategy.plan_for(global_batch_size)
        return None
    if _done(strategy, fingerprint, force):
        return strategy._calibration
    if strategy._profile is not None:  # a profile file stands in for calibration
        return _use(strategy, strategy._profile, fingerprint, global_batch_size, "from the profile file")
    if restarted is not None:
        return _use(strategy, restarted, fingerprint, global_batch_size, "from the profiles before the restart")
    if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3) or batch[1] is None:
        raise ConfigError(
            f"auto_balance calibrates each device on the model's training step with (x, y) or "
            f"(x, y, sample_weight) batches, but this data's batches have no labels (got a "
            f"{type(batch).__name__}{f' of length {len(batch)}' if isinstance(batch, (tuple, list)) else ''}; "
            f"e.g. x only, with a loss from add_loss). Pass batch_split=[...] (fixed shares) or "
            f"auto_balance=False to train on such data.")
    with warnings.catch_warnings():
        if strategy._micro_batching.enabled:  # a batch that does not fit in one step trains as micro-batches
            warnings.filterwarnings("ignore", message="Calibration finished, but no plan fits")
        result = run_calibration(
            model, batch, devices=list(strategy._compute_devices), parameter_device=strategy._parameter_device,
            global_batch_size=global_batch_size, emulator=strategy._emulator, store=_store(strategy), progress=progress)
    keep_for_restart(strategy, result, fingerprint, global_batch_size)  # under `hetero-cs run` only
    return _use(strategy, result, fingerprint, global_batch_size, "")


def _done(strategy, fingerprint: str, force: bool) -> bool:
    """True when nothing is to calibrate: unless ``force``, this model was calibrated already, or cost models set with
    ``set_cost_models`` stand in for calibration (logged once)."""
    if force or strategy._balancer.cost_models is None:
        return False
    if strategy._calibrated_fingerprint == fingerprint:
        return True
    if strategy._models_set_by_user and not getattr(strategy, "_user_models_logged", False):
        strategy._user_models_logged = True
        logger.info("hetero_cs: the cost models set with set_cost_models are kept; no calibration runs "
                    "(strategy.calibrate(model, data, force=True) calibrates, or loads this model's cached "
                    "calibration on these devices, and replaces them).")
    return strategy._models_set_by_user


def _use(strategy, result, fingerprint: str, global_batch_size: int, source: str):
    """Hands a calibration result's cost models and caps to the balancer (the plan is tried by the guard)."""
    strategy._models_set_by_user = False  # measured models replace any set by hand
    strategy._calibration = result
    strategy._calibrated_fingerprint = fingerprint
    logger.info("hetero_cs calibration%s:\n%s", f" {source}" if source else "", result.format_table())
    strategy._balancer.set_cost_models(
        list(result.cost_models), max_batch_sizes=list(result.max_batch_sizes),
        contention_factors=result.contention_factors, trial=True,
        # Micro-batched (memory caps bind): the balancer plans the sub-steps, the size it serves.
        reference_batch_size=strategy._micro_batching.reference_batch_size(
            global_batch_size, result.cost_models, result.max_batch_sizes))
    return result


def load_profile(path, devices, emulate, *, auto_balance: bool):
    """Reads a profile file for a strategy over ``devices`` (emulating ``emulate``, or None) and checks it fits.

    The profile must hold one device profile per compute device, for the same devices in the same order, and be
    emulated as the same catalog devices (or measured on real ones, when nothing is emulated). It cannot tell
    whether it was calibrated on the same model: calibrate with ``hetero-cs calibrate --model
    package.module:function`` on the model you train.

    Returns:
        The ``calibration.CalibrationResult``.

    Raises:
        ConfigError: ``path`` is not a path; the profile is for other devices or emulated devices; or
            auto_balance is off (a fixed batch_split or auto_balance=False leave nothing for a profile to do).
        ProfileCacheError: The file cannot be read or is not a profile (calibration.store.load_result_file).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"profile must be the path of a file written by `hetero-cs calibrate --output PATH`. "
                          f"Received: profile={path!r}.")
    if not auto_balance:
        raise ConfigError(f"profile={os.fspath(path)!r} holds calibrated cost models, which only auto_balance uses; "
                          f"with batch_split=[...] or auto_balance=False it would be ignored. Drop one or the other.")
    result = load_result_file(path)
    profiled = [arguments.canonical_device(d) for d in result.devices]
    profiled_as = [p.emulated_as or None for p in result.profiles]
    wanted_as = list(emulate) if emulate is not None else [None] * len(devices)
    if profiled != list(devices) or [*map(emulated_identity, profiled_as)] != [*map(emulated_identity, wanted_as)]:
        def describe(names, emulated):
            return f"{names}" + (f" emulating {emulated}" if any(emulated) else " (not emulated)")

        raise ConfigError(
            f"profile={os.fspath(path)!r} was calibrated on {describe(profiled, profiled_as)}, but this strategy "
            f"runs on {describe(list(devices), wanted_as)}. Calibrate for these devices (hetero-cs calibrate "
            f"--devices ... or --emulate ... --output PATH), or build the strategy on the profile's devices.")
    return result


def first_global_batch(strategy, data):
    """The first global batch of ``data`` (a dataset, or one batch), read so that the dataset does not move.

    A dataset is read through the pipeline training iterates, and that pipeline's next iterator over the same
    dataset object starts from the first batch again, with the same shuffle order and random state
    (:mod:`hetero_cs.engine._compat.input_state`): training sees the batches single-device training sees.
    """
    if not isinstance(data, tf.data.Dataset):
        return tensors.first_batch(data)
    try:
        distributed = _compat.distribute_on_host(strategy, strategy._slicer.pack(data), source=data)
    except InputError:
        return tensors.first_batch(data)  # a dataset that cannot be cut: the checks below say what is wrong with it
    try:
        element = strategy._first_batches.read(distributed, data)
    except StopIteration:
        raise InputError("The dataset is empty; calibration needs one global batch.") from None
    except tf.errors.OpError as exc:
        error = strategy._input_error_raised(exc)  # None: TensorFlow's error is not the one it kept
        if error is None:
            raise
        raise error from exc

    def whole(leaf):  # a leaf of a distributed element (one component: the global batch) -> that batch
        parts = _compat.components(leaf)
        return leaf if parts is None else parts[0]

    return tf.nest.map_structure(whole, element)


def write_back_caps(strategy) -> None:
    """Writes the balancer's memory caps in force into the profile cache entry the calibration came from.

    After an out-of-memory recovery (or a cap's growth) the next run then starts from the caps that held. Does
    nothing without a cache entry (no cache, a profile file, caps set by hand); a write that fails is one warning.
    """
    result, caps = strategy._calibration, strategy._balancer.max_batch_sizes
    store = _store(strategy)
    if result is None or result.cache_key is None or store is False or caps is None:
        return
    # A cap of 0 in force that calibration did not find (a card set aside after a device error) is no property
    # of the card: its profile keeps its own cap. A card calibrated at 0 (it holds no example) stays at 0.
    caps = [p.max_batch_size if c == 0 and not p.holds_no_example else c for p, c in zip(result.profiles, caps)]
    if caps == [p.max_batch_size for p in result.profiles]:
        return  # nothing new to write
    profiles = tuple(dataclasses.replace(p, max_batch_size=c) for p, c in zip(result.profiles, caps))
    updated = dataclasses.replace(result, profiles=profiles)
    try:
        path = store.save(result.cache_key, updated)
    except ProfileCacheError as exc:
        logger.warning("hetero_cs: the memory caps %s were not written to the profile cache: %s", caps, exc)
        return
    strategy._calibration = updated
    logger.info("hetero_cs: memory caps %s written to the profile cache %s.", caps, path)


def _store(strategy):
    """The strategy's profile cache: False (none), its ProfileStore, or one for its directory (None: the default)."""
    cache = strategy._profile_cache
    return cache if cache is False or isinstance(cache, ProfileStore) else ProfileStore(cache)
