"""The `hetero-cs` command: devices, calibrate, plan, bench, launch, run.

    hetero-cs devices                                   # TF devices joined with NVML facts
    hetero-cs calibrate --emulate A10,T4,P100 --output profile.json
    hetero-cs plan --profile profile.json --global-batch-size 512
    hetero-cs bench [benchmark options]                 # benchmarks/balance.py (shipped in the wheel)
    hetero-cs launch --workers 2 --emulate A10,T4 -- python train.py   # N workers with TF_CONFIG on loopback
    hetero-cs run --max-restarts 3 -- python train.py   # restarted without a lost card, resumed from fit's backup
"""

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from calibration.cli import add_calibrate_arguments, add_plan_arguments, run_calibrate, run_plan
from calibration.store import check_output_path
from hetero_cs.errors import ConfigError, HeteroCSError
from hetero_cs.launch import add_launch_arguments, run_launch
from hetero_cs.supervisor import add_run_arguments, run_supervised, silence


def start_tensorflow_quietly(verbose: bool = False) -> None:
    """Imports TensorFlow and lists its devices with the process's stderr (file descriptor 2) on /dev/null.

    TensorFlow's C++ start-up lines (the absl note, oneDNN, "Could not find cuda drivers", CPU instruction notes and,
    on a machine without GPUs, an ``E0000 ... failed call to cuInit`` that reads like a failure) would otherwise
    come before the command's own output; ``TF_CPP_MIN_LOG_LEVEL`` does not silence all of them. ``verbose`` keeps
    them (``--verbose`` of the CLI and the main job). Listing physical devices does not start the runtime, so
    logical devices can still be set up afterwards.
    """
    if verbose:
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        import tensorflow as tf

        tf.config.list_physical_devices()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _devices(args: argparse.Namespace) -> int:
    start_tensorflow_quietly(args.verbose)
    from hetero_cs.devices import discover_devices, format_device_table

    print(format_device_table(discover_devices()))
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    if args.output is not None:
        check_output_path(args.output)  # a bad --output is refused before TensorFlow loads
    start_tensorflow_quietly(args.verbose)
    return run_calibrate(args)


def _plan(args: argparse.Namespace) -> int:
    if getattr(args, "model", None) is not None:  # a model sizes the what-if's workload: TensorFlow loads
        start_tensorflow_quietly(args.verbose)
    return run_plan(args)


def _bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    # The source checkout: the working directory, or where an editable install of hetero_cs lives.
    for checkout in (Path.cwd(), Path(__file__).resolve().parents[1]):
        if (checkout / "benchmarks" / "balance.py").is_file() and (checkout / "hetero_cs").is_dir():
            if str(checkout) not in sys.path:
                sys.path.insert(0, str(checkout))
            break
    try:
        from benchmarks.balance import main as balance_main
    except ImportError as exc:  # the wheel ships the benchmarks package: an install that lost it
        raise ConfigError(f"`hetero-cs bench` runs the benchmarks package (benchmarks/balance.py), which the hetero_cs "
                          f"wheel installs beside hetero_cs, but it could not be imported ({exc}). Reinstall hetero_cs "
                          f"(pip install --force-reinstall hetero_cs), or run `python benchmarks/balance.py` in a "
                          f"source checkout.") from exc
    return int(balance_main(args.bench_args) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetero-cs", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log at DEBUG, and show TensorFlow's own start-up lines")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="{devices,calibrate,plan,bench,launch,run}")
    run_help = "run a training script, restarting it without a card it lost (resumes from fit's backup)"
    for name, run, add_arguments, options in (
        ("devices", _devices, lambda verb: None, dict(help="list compute devices (TensorFlow joined with NVML facts)")),
        ("calibrate", _calibrate, add_calibrate_arguments,
         dict(help="time each device on a reference model and write a profile")),
        ("plan", _plan, add_plan_arguments,
         dict(help="solve and print the batch plan of a profile for a global batch size",
              description="Solve and print the batch plan of a calibrated profile (or of catalog devices) for a "
                          "global batch size.")),
        ("bench", _bench, lambda bench: bench.add_argument("bench_args", nargs=argparse.REMAINDER),
         dict(help="run benchmarks/balance.py (emulated mixes); options after `bench` go to it", add_help=False)),
        ("launch", run_launch, add_launch_arguments,
         dict(help="run a command as N MultiWorkerMirroredStrategy workers on 127.0.0.1")),
        ("run", run_supervised, add_run_arguments,
         dict(help=run_help, description=run_help[0].upper() + run_help[1:] + ": see docs/failover.md.")),
    ):
        verb = verbs.add_parser(name, **options)
        add_arguments(verb)
        verb.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hetero-cs` console script; returns the exit status (0 ok, 2 a hetero_cs error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after `bench` belongs to benchmarks/balance.py, --help included.
    args = (argparse.Namespace(verb="bench", bench_args=argv[1:], run=_bench, verbose=False) if argv[:1] == ["bench"]
            else build_parser().parse_args(argv))
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if not args.verbose:
        # TensorFlow's C++ INFO and WARNING lines stay off here and in the scripts `run` and `launch` start (they
        # inherit it): a card failure would else print each op's traceback and "Local rendezvous is aborting" lines
        # around the two WARNING lines of hetero_cs that tell it. A value the user set stands.
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for name in ("hetero_cs", "calibration"):  # our progress at INFO; TensorFlow's own INFO lines stay quiet
        logging.getLogger(name).setLevel(logging.DEBUG if args.verbose else logging.INFO)
    try:
        return args.run(args)
    except HeteroCSError as exc:
        print(f"hetero-cs {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        silence(sys.stdout)  # our output was closed (`| head`): stop quietly
        return 128 + 13  # as a shell reports a process ended by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
