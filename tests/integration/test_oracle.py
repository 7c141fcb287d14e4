"""The generative oracle: random valid Keras programs, each exact against single-device Keras or refused.

Hypothesis draws programs (``oracle_programs.programs``: data, model, loss form, training loop, split with 0 shares,
partial last batches), each is rendered as a standalone script and trained twice: on one device, and under
HeteroCentralStorageStrategy. Weights, optimizer variables, the History, evaluate's logs and predict's outputs must
match, or the program must be refused with a hetero_cs error before its first update (only the forms in
``MAY_REFUSE`` may be). A silent difference fails with the program printed as a script, shrunk to its smallest form.

The default run draws 50 programs from a fixed seed (without mixed precision, at most two hidden layers, one of them
recurrent or attention: the quickest to trace); ``tox -e slow`` draws 1,000 from the whole grammar (eight seeded draws
of 125, ``SLOW_DRAWS``, which ``benchmarks/oracle.py --seed`` repeats with counts by form), and 10 on two worker
processes. ``test_the_oracle_fails_on_a_mutant`` shows the oracle can fail: with the ``b_i / B`` weight perturbed, or
``stop_gradient`` read as linear.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pathlib

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings

import hetero_cs
from fixed_splits import strategy_for
from oracle_programs import MAY_REFUSE, QUICK_LOOPS, Program, programs, render

OUTCOMES: collections.Counter = collections.Counter()  # (form, outcome) over the process, for the report


class SilentDifference(AssertionError):
    """A program trained differently under the strategy, without an error."""


def tolerance(program: Program) -> dict:
    if program.loop == "mixed_precision":
        return {"atol": 3e-2, "rtol": 3e-2}
    return {"atol": 2e-4, "rtol": 2e-3}


def run_program(program: Program) -> str:
    """Trains ``program`` both ways; returns "exact" or "refused", raises SilentDifference (with the script) else."""
    source = render(program)
    if os.environ.get("HETERO_CS_ORACLE_LOG"):  # the program about to run, for a crash that kills the process
        pathlib.Path(os.environ["HETERO_CS_ORACLE_LOG"]).write_text(source)
    namespace: dict = {"__name__": "oracle_program"}
    exec(compile(source, "<oracle program>", "exec"), namespace)  # noqa: S102 - the program is ours, rendered
    expected = reference_run(namespace, program)
    strategy = strategy_for(list(program.shares))
    got: dict = {}
    try:
        namespace["train"](strategy, got)
    except hetero_cs.HeteroCSError as exc:
        if program.loss not in MAY_REFUSE:
            raise SilentDifference(_report(source, f"refused a form that must be exact: {type(exc).__name__}: {exc}"))
        model = got.get("model")
        if got.get("phase") == "fit" and model is not None and (
                int(model.optimizer.iterations) != 0 or compare({"weights": got["initial"]},
                                                                {"weights": model.get_weights()}, atol=0, rtol=0)):
            raise SilentDifference(_report(source, f"refused after its first update: {type(exc).__name__}: {exc}"))
        differences = compare({key: expected[key] for key in got if key in ("weights", "optimizer", "history")},
                              got, **tolerance(program))
        if differences:  # refused in evaluate or predict, after a fit that went wrong
            raise SilentDifference(_report(source, "\n".join(differences)))
        OUTCOMES[(program.kind, "refused")] += 1
        return "refused"
    except Exception as exc:  # noqa: BLE001 - any other error is a failure of the library, shown with the program
        raise SilentDifference(_report(source, f"raised {type(exc).__name__} (not a hetero_cs error): {exc}")) from exc
    differences = compare(expected, got, **tolerance(program))
    if differences:
        raise SilentDifference(_report(source, "\n".join(differences)))
    OUTCOMES[(program.kind, "exact")] += 1
    return "exact"


def reference_run(namespace: dict, program: Program) -> dict:
    """The program on one device; a program one device cannot run (a Keras limitation, e.g. some float16
    combinations) is not a valid program: rejected (hypothesis draws another)."""
    from hypothesis import reject

    try:
        return namespace["train"](None)
    except Exception:  # noqa: BLE001 - whatever Keras raises on one device
        OUTCOMES[(program.kind, "invalid")] += 1
        reject()


def compare(expected: dict, got: dict, *, atol: float, rtol: float) -> list:
    """Every difference between two runs' results, as lines naming what differs."""
    lines = []
    for key in ("weights", "optimizer", "predict"):
        if key not in expected:
            continue
        for i, (want, have) in enumerate(zip(_leaves(expected[key]), _leaves(got[key]))):
            if np.shape(want) != np.shape(have) or not np.allclose(have, want, atol=atol, rtol=rtol, equal_nan=True):
                lines.append(f"{key}[{i}]: one device {_brief(want)}, hetero_cs {_brief(have)}")
    for key in ("history", "evaluate"):
        if key not in expected:
            continue
        for name, want in expected[key].items():
            have = got[key].get(name)
            if have is None or not np.allclose(have, want, atol=atol, rtol=rtol, equal_nan=True):
                lines.append(f"{key}[{name!r}]: one device {want}, hetero_cs {have}")
    return lines


def _leaves(value) -> list:
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _leaves(item)]
    return [np.asarray(value)]


def _brief(array) -> str:
    flat = np.ravel(array)
    return f"shape {np.shape(array)} {np.array2string(flat[:4], precision=5)}{' ...' if flat.size > 4 else ''}"


def _report(source: str, what: str) -> str:
    return f"{what}\n\nThe program (a standalone script):\n{'-' * 80}\n{source}{'-' * 80}"


def oracle(max_examples: int):
    """The settings of an oracle run: ``max_examples`` programs from a fixed seed, no example database."""
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


@oracle(50)
@given(program=programs(loops=QUICK_LOOPS, max_layers=2, max_recurrent=1))
def test_random_programs_match_one_device_or_are_refused(program):
    run_program(program)


@oracle(10)
@given(program=programs(loops=("fit", "train_step", "grad_accum", "mixed_precision"), max_layers=2, max_recurrent=1,
                        one_card=True))
def test_random_programs_on_a_card_alone_match_one_device_or_are_refused(program):
    # A card alone runs model.fit's steps after the first as one device's step on the whole batch (StepPerSet):
    # nothing weighed, num_replicas_in_sync 1 in the replica. Each program has two steps or more.
    assert run_program(program) in ("exact", "refused")


@oracle(4)
@given(program=programs(loops=("on_batch",), max_layers=2, max_recurrent=1))
def test_random_on_batch_programs_match_one_device_or_are_refused(program):
    # train_on_batch, test_on_batch and predict_on_batch run as fit, evaluate and predict on their one batch
    # (hetero_cs.engine._compat.on_batch); the quick draw above does not draw this loop.
    run_program(program)


# tox -e slow: eight draws of 125 programs, one per seed, spread over the processes (a process that trains
# programs grows by about 35 MB a program, Keras' own state included, so no draw runs all 1,000 in one).
SLOW_DRAWS = tuple(range(2, 10))


def seeded_draw(max_examples: int, draw: int, *, shrink: bool = True):
    """The settings of the draw of ``max_examples`` programs from seed ``draw``, the same in ``tox -e slow`` and in
    ``benchmarks/oracle.py --seed DRAW`` (which counts by form and does not shrink): both draw the same programs."""
    phases = [Phase.generate, Phase.shrink] if shrink else [Phase.generate]

    def decorate(test):
        return seed(draw)(settings(max_examples=max_examples, deadline=None, database=None, phases=phases,
                                   print_blob=False, suppress_health_check=list(HealthCheck))(test))
    return decorate


@pytest.mark.slow
@pytest.mark.parametrize("draw", SLOW_DRAWS)
def test_a_thousand_random_programs_match_one_device_or_are_refused(draw):
    @seeded_draw(1000 // len(SLOW_DRAWS), draw)
    @given(program=programs())
    def check(program):
        run_program(program)
    check()


def run_on_two_workers(program: Program, tmp_path) -> str:
    """Trains ``program`` on one device here and on two worker processes (``hetero-cs launch --workers 2``, one
    replica each, split by its two shares); returns "exact" or "refused", raises SilentDifference else."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    program = dataclasses.replace(program, step_statistics=False)  # see Program.step_statistics
    source = render(program)
    script = tmp_path / "program.py"
    script.write_text(source)
    namespace: dict = {"__name__": "oracle_program"}
    exec(compile(source, "<oracle program>", "exec"), namespace)  # noqa: S102
    expected = reference_run(namespace, program)
    out = tmp_path / "results.npz"
    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    done = subprocess.run([sys.executable, "-m", "hetero_cs.cli", "launch", "--workers", "2", "--", sys.executable,
                           str(script), str(out)], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0 or not out.exists():
        raise SilentDifference(_report(source, f"two workers failed (status {done.returncode}):\n"
                                               f"{done.stdout[-3000:]}{done.stderr[-2000:]}"))
    logs = json.loads(out.with_suffix(".json").read_text())
    if "refused" in logs:
        if program.loss not in MAY_REFUSE:
            raise SilentDifference(_report(source, f"refused a form that must be exact: {logs['refused']}"))
        OUTCOMES[(program.kind + " (2 workers)", "refused")] += 1
        return "refused"
    arrays = np.load(out, allow_pickle=True)
    got = dict(logs)
    for key in ("weights", "optimizer", "predict"):
        got[key] = [arrays[name] for name in sorted(arrays.files, key=lambda n: int(n.rsplit("_", 1)[1]))
                    if name.rsplit("_", 1)[0] == key]
    differences = compare(expected, got, **tolerance(program))
    if differences:
        raise SilentDifference(_report(source, "on two workers:\n" + "\n".join(differences)))
    OUTCOMES[(program.kind + " (2 workers)", "exact")] += 1
    return "exact"


@pytest.mark.slow
@oracle(10)
@given(program=programs(loops=("fit", "train_step", "custom_loop"), replicas=(2, 2),
                        data_kinds=("vectors", "sequences", "tokens")))
def test_random_programs_on_two_workers_match_one_device_or_are_refused(program, tmp_path_factory):
    run_on_two_workers(program, tmp_path_factory.mktemp("two_workers"))


# ---------------------------------------------------------------------------------------------------------------
# The oracle can fail: a mutant of the library must be caught.
# ---------------------------------------------------------------------------------------------------------------
MUTANT_PROGRAMS = [
    Program(data="vectors", form="functional", body=("dense_relu",), loss="keras", loop="fit", optimizer="sgd",
            shares=(3, 0, 1), batch_size=8, examples=14, epochs=1, seed=1),
    Program(data="vectors", form="functional", body=("dense",), loss="stop_gradient", loop="train_step",
            optimizer="sgd", shares=(2, 1), batch_size=6, examples=12, epochs=1, seed=2),
    Program(data="vectors", form="functional", body=("dense",), loss="stop_gradient", loop="custom_loop",
            optimizer="sgd", shares=(1, 3), batch_size=8, examples=16, epochs=1, seed=3),
]


@pytest.mark.parametrize("mutation", ["weight", "stop_gradient"])
def test_the_oracle_fails_on_a_mutant(monkeypatch, mutation):
    from hetero_cs.engine._compat import loss_reader

    if mutation == "weight":  # b_i / B perturbed: each mean over the batch weighs 10 % more
        original = loss_reader._weigh
        monkeypatch.setattr(loss_reader, "_weigh", lambda value, weight=None: original(value, weight) * 1.1)
    else:  # stop_gradient read as a linear pass-through: the stopped term's gradient flows
        monkeypatch.setitem(loss_reader._REEMIT, "StopGradient", lambda op, x: x[0])
    caught = []
    for program in MUTANT_PROGRAMS:
        try:
            run_program(program)
        except SilentDifference as failure:
            caught.append(str(failure).splitlines()[0])
    assert caught, f"the oracle passed every program under the {mutation} mutant: it cannot fail"
