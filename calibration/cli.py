"""The options and the work of `hetero-cs calibrate` (also `python -m calibration`) and `hetero-cs plan`.

    hetero-cs calibrate --model digits_cnn --emulate A10,T4,P100 --global-batch-size 256 --output profile.json
    hetero-cs calibrate --model mypackage.models:build_model --output profile.json    # your own model
    hetero-cs plan --profile profile.json --global-batch-size 512

A profile written with --output is what ``HeteroCentralStorageStrategy(profile="profile.json")`` uses instead of
calibrating (same devices, same model); see calibration.user_model for what ``--model package.module:function``
returns.

Calibration sets up the devices before TensorFlow initialises: with --emulate (or on a machine without GPUs, where
A10,T4,P100 are emulated by default) the host CPU is split into a parameter device (/device:CPU:0) and one logical
compute device per emulated name. The model is built inside a tf.distribute.experimental.CentralStorageStrategy
scope over the compute devices, as in training, so the probe reads the same central variables a training step
would. The sample batch is the one your function returns, else random data of the model's input shape (step time
does not depend on the values).
"""

import argparse
import logging
import math
from collections.abc import Callable

from calibration.store import ProfileStore, load_result_file, save_result_file
from calibration.user_model import build_calibration_model, model_spec
from hetero_cs.devices.catalog import MAX_EMULATED_MAKESPAN_S, MAX_TIME_SCALE, _float_or
from hetero_cs.errors import ConfigError

__all__ = ["add_calibrate_arguments", "add_plan_arguments", "run_calibrate", "run_plan"]

logger = logging.getLogger(__name__)

DEFAULT_EMULATED_DEVICES = ("A10", "T4", "P100")
"""Emulated when the machine has no GPU and --emulate is not given."""


MAX_PLANNED_BATCH = 10_000_000
"""The largest global batch `hetero-cs plan` plans: a micro-batched plan's what-if walks its sub-steps (a batch of
1e7 takes seconds; of 1e9, minutes and gigabytes)."""


def _int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer >= minimum (and <= maximum, if given)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"from {minimum} to {maximum:,}" if maximum is not None else f">= {minimum}"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {text!r}")
        return value

    return parse


def _positive_float(maximum: float) -> Callable[[str], float]:
    """An argparse type: a finite number in (0, maximum]."""
    def parse(text: str) -> float:
        value = _float_or(text, math.nan)
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:g}, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1)


def _name_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"needs at least one comma-separated name, got {text!r}")
    return names


def _size_list(text: str) -> list[int]:
    return sorted({_positive_int(part) for part in _name_list(text)})


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the calibration options to parser (used by `python -m calibration` and `hetero-cs calibrate`)."""
    parser.add_argument("--model", type=model_spec, default="digits_cnn", metavar="MODEL",
                        help="digits_cnn or mlp (reference models), or your own as package.module:function, a "
                             "function returning a compiled Keras model or (model, (x, y)) (default: digits_cnn)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--emulate", type=_name_list, default=None, metavar="NAMES",
                       help="comma-separated catalog devices to emulate on logical CPU devices, e.g. A10,T4,P100 "
                            "(default on a machine without GPUs: A10,T4,P100)")
    where.add_argument("--devices", type=_name_list, default=None, metavar="DEVICES",
                       help="comma-separated compute devices, e.g. /device:GPU:0,/device:GPU:1 (default: every GPU)")
    parser.add_argument("--global-batch-size", type=_positive_int, default=256, metavar="B",
                        help="examples per optimizer step (default: 256)")
    parser.add_argument("--trials", type=_positive_int, default=5, help="timed steps per probe size (default: 5)")
    parser.add_argument("--warmup-steps", type=_int_at_least(0), default=2,
                        help="untimed steps per probe size (default: 2)")
    parser.add_argument("--probe-batch-sizes", type=_size_list, default=None, metavar="SIZES",
                        help="comma-separated probe sizes (default: 5 geometric sizes up to B)")
    parser.add_argument("--time-scale", type=_positive_float(MAX_TIME_SCALE), default=None,
                        help="emulation time scale, at most 1000 (default: chosen so an even-split step takes "
                             "--target-step-ms)")
    parser.add_argument("--target-step-ms", type=_positive_float(MAX_EMULATED_MAKESPAN_S * 1e3), default=100.0,
                        help="emulated even-split step time when --time-scale is not given, at most 5000 (default: "
                             "100, as HeteroCentralStorageStrategy)")
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--cache-dir", default=None,
                       help="profile cache directory (default: $HETERO_CS_CACHE_DIR, $XDG_CACHE_HOME/hetero_cs or "
                            "~/.cache/hetero_cs)")
    cache.add_argument("--no-cache", action="store_true", help="always calibrate; neither read nor write the cache")
    parser.add_argument("--policy", choices=("float32", "mixed_float16", "mixed_bfloat16"), default=None,
                        help="Keras dtype policy to build and time the model under (default: the model's own); a "
                             "profile is only good for the policy it was measured under")
    parser.add_argument("--output", default=None, metavar="FILE", help="write the profile (JSON) to FILE")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def add_plan_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the options of `hetero-cs plan` to parser."""
    parser.add_argument("--profile", metavar="FILE",
                        help="profile written by `hetero-cs calibrate --output FILE` (or give --devices)")
    parser.add_argument("--devices", type=_name_list, metavar="A10,T4,P100",
                        help="what-if, without the hardware or a profile: catalog cards (NAME, NAME@MEMORY, "
                             "NAME~LINK such as P100~x1, or NAME@MEMORY~LINK), "
                             "planned from their published figures (hetero_cs.devices.what_if)")
    parser.add_argument("--add", action="append", default=[], metavar="NAME", help="with --devices: add a card")
    parser.add_argument("--drop", action="append", default=[], metavar="NAME", help="with --devices: drop a card")
    parser.add_argument("--model", type=model_spec, default=None, metavar="MODEL",
                        help="with --devices: the workload of this model (as for calibrate: package.module:function "
                             "or a reference model name); default: ResNet-50 at 224x224 with Adam")
    parser.add_argument("--tf32", choices=("on", "off"), default=None,
                        help="with --devices: whether float32 matmuls and convolutions run on TF32 tensor cores "
                             "where a card has them (Ampere and newer), as TensorFlow does by default (default: on; "
                             "off as after tf.config.experimental.enable_tensor_float_32_execution(False))")
    parser.add_argument("--global-batch-size", type=_int_at_least(1, MAX_PLANNED_BATCH), default=None, metavar="B",
                        help="examples per optimizer step, at most 10,000,000 (default: the profile's plan's; needed "
                             "with --devices)")
    parser.add_argument("--multiple-of", type=_positive_int, default=1,
                        help="every slice a multiple of this (default: 1)")
    parser.add_argument("--min-batch-size", type=_int_at_least(0), default=None,
                        help="smallest slice per replica; 0 lets a replica sit idle (default: 1, or 0 when the "
                             "profile has a device that cannot hold one example)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="with --devices: also draw the plan (each card's busy and waiting time per step, and "
                             "examples/s against the even split and the fastest card alone); needs matplotlib")
    return parser


def _setup_devices(args: argparse.Namespace) -> tuple[list[str], list[str] | None]:
    """Returns (compute devices, emulated names or None); must run before TensorFlow initialises."""
    import tensorflow as tf

    from hetero_cs.devices.logical import setup_logical_devices

    emulate = args.emulate
    if emulate is None and args.devices is None and not tf.config.list_physical_devices("GPU"):
        emulate = list(DEFAULT_EMULATED_DEVICES)
        logger.info("No GPU found: emulating %s on logical CPU devices.", ",".join(emulate))
    if emulate is not None:
        return setup_logical_devices(emulate), list(emulate)
    if args.devices is not None:
        return list(args.devices), None
    return [f"/device:GPU:{i}" for i in range(len(tf.config.list_physical_devices("GPU")))], None


def run_calibrate(args: argparse.Namespace) -> int:
    """Runs a calibration from parsed add_calibrate_arguments options; prints the table and plan; returns 0.

    Raises:
        ConfigError: If --model names a function that cannot be imported or does not return a compiled model (see
            calibration.user_model). (`hetero-cs calibrate` checks --output before TensorFlow loads.)
    """
    devices, emulated = _setup_devices(args)  # Before anything below touches TensorFlow's runtime.
    import tensorflow as tf

    from calibration.calibrate import _check_devices, calibrate
    from calibration.workload import estimate_workload
    from hetero_cs.devices.emulation import Emulator

    devices, parameter_device = _check_devices(devices, "/device:CPU:0")  # DeviceError before TF's own ValueError
    if args.policy is not None:
        import keras

        keras.mixed_precision.set_global_policy(args.policy)  # before the user's function builds the model
    strategy = tf.distribute.experimental.CentralStorageStrategy(devices, parameter_device=parameter_device)
    batch = args.global_batch_size
    with strategy.scope():  # the user's function builds its variables here, as central ones
        model, sample = build_calibration_model(args.model, global_batch_size=batch)

    emulator = None
    if emulated is not None:
        emulator = Emulator(emulated, workload=estimate_workload(model), time_scale=args.time_scale)
        emulator.calibrate_time_scale(batch, target_makespan_s=args.target_step_ms / 1e3)
        print("\n".join(emulator.describe(batch)))
    result = calibrate(model, sample, devices=devices, parameter_device=parameter_device, global_batch_size=batch,
                       emulator=emulator, probe_batch_sizes=args.probe_batch_sizes, warmup_steps=args.warmup_steps,
                       trials=args.trials, store=False if args.no_cache else ProfileStore(args.cache_dir),
                       progress=not args.no_progress)
    print(result.format_table())
    if result.plan is not None:
        print(result.plan)
    if args.output:
        save_result_file(args.output, result)
        given = f"emulate={[p.emulated_as for p in result.profiles]}, " if result.emulated else ""
        print(f"profile written to {args.output}; use it with HeteroCentralStorageStrategy({given}"
              f"profile={args.output!r}) on the same devices and model")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    """Loads a profile and prints the plan solved for the requested global batch size, or (``--devices``) the
    what-if plan of catalog cards; returns 0."""
    from hetero_cs.planning.solver import solve_batch_split

    if (args.profile is None) == (getattr(args, "devices", None) is None):
        raise ConfigError("hetero-cs plan needs exactly one of --profile FILE (a calibrated profile) or --devices "
                          "A10,T4,P100 (a what-if from catalog figures).")
    if args.devices is not None:
        return _run_what_if(args)
    if args.add or args.drop or args.model is not None or args.plot is not None or args.tf32 is not None:
        raise ConfigError("--add, --drop, --model, --tf32 and --plot go with --devices (a what-if); a profile's "
                          "cards and model are fixed by its calibration.")
    result = load_result_file(args.profile)
    batch = args.global_batch_size
    if batch is None:
        if result.plan is None:
            raise ConfigError(f"The profile path={args.profile!r} holds no plan; pass --global-batch-size B.")
        batch = result.plan.global_batch_size
    # By default a device that holds no example (cap 0) sits idle; the others get at least one.
    min_batch_size = args.min_batch_size if args.min_batch_size is not None else (
        0 if any(p.holds_no_example for p in result.profiles) else 1)
    plan = solve_batch_split(result.cost_models, batch, max_batch_sizes=result.max_batch_sizes,
                             min_batch_size=min_batch_size, multiple_of=args.multiple_of)
    if args.json:
        print(plan.to_json())
    else:
        print(f"profile {args.profile} (its 'solved plan:' line is the plan solved at calibration time):")
        print(result.format_table())
        print(f"\nplan for global batch size {batch}:")
        print(plan)
    return 0


def _run_what_if(args: argparse.Namespace) -> int:
    import json

    from hetero_cs.devices.what_if import DEFAULT_WORKLOAD, format_what_if, mix, what_if

    if args.global_batch_size is None:
        raise ConfigError("hetero-cs plan --devices needs --global-batch-size B (examples per optimizer step).")
    if args.multiple_of != 1 or args.min_batch_size is not None:
        raise ConfigError("--multiple-of and --min-batch-size go with --profile; the what-if plans as the strategies "
                          "do (any slice size, a card may be left out).")
    workload = DEFAULT_WORKLOAD
    if args.model is not None:
        from calibration.workload import estimate_workload

        model, _ = build_calibration_model(args.model, global_batch_size=args.global_batch_size)
        workload = estimate_workload(model)
    if args.tf32 is not None:
        import dataclasses

        workload = dataclasses.replace(workload, tensor_float_32=args.tf32 == "on")
    if args.plot is not None:
        from hetero_cs.devices.what_if_plot import check_plot_path, plot_what_if

        check_plot_path(args.plot)  # before the work: a missing matplotlib or folder fails at once
    result = what_if(mix(args.devices, add=args.add, drop=args.drop), args.global_batch_size, workload)
    print(json.dumps(result) if args.json else format_what_if(result))
    if args.plot is not None:
        path = plot_what_if(result, args.plot)
        if not args.json:
            print(f"plot: {path}")
    return 0
