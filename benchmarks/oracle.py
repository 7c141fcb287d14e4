"""The generative oracle's counts: N random programs against single-device Keras, exact or refused, by form.

Draws programs as ``tests/integration/test_oracle.py`` does (the same generator), trains each on one device and under
HeteroCentralStorageStrategy, and prints one row per form (``loop:loss``): programs run, exact, refused, and any
that differed silently (each printed as a standalone script). Not a timing: the figures are counts.

    python benchmarks/oracle.py --programs 200 --seed 1 [--json counts.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
_TESTS = pathlib.Path(__file__).resolve().parent.parent / "tests" / "integration"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=100, help="how many programs to draw (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="the draw's seed (default 0)")
    parser.add_argument("--json", type=pathlib.Path, help="also write the counts to this file")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(_TESTS))
    import conftest  # noqa: F401 - configures the logical CPU devices before TensorFlow starts
    from hypothesis import given
    from oracle_programs import programs
    from test_oracle import SilentDifference, run_program, seeded_draw

    counts: dict = collections.defaultdict(collections.Counter)
    differences = []
    started = time.perf_counter()

    @seeded_draw(args.programs, args.seed, shrink=False)
    @given(program=programs())
    def run(program):
        try:
            outcome = run_program(program)
        except SilentDifference as failure:
            outcome = "differed"
            differences.append(str(failure))
            print(f"\n{failure}\n", flush=True)  # at once: a later crash of the process must not lose it
        except BaseException as exc:  # hypothesis' reject(): one device could not run the program
            if type(exc).__name__ != "UnsatisfiedAssumption":
                raise
            counts[program.kind]["invalid"] += 1
            print(f"     invalid  {program.kind}", flush=True)
            raise  # hypothesis draws another, as in the test: N valid programs, the test's own draw
        counts[program.kind][outcome] += 1
        valid = sum(row[key] for row in counts.values() for key in ("exact", "refused", "differed"))
        print(f"{valid:4d}/{args.programs} {outcome:8s} {program.kind}", flush=True)

    run()
    total = collections.Counter()
    print(f"\n{'form':44s} {'run':>5s} {'exact':>6s} {'refused':>8s} {'differed':>9s}  (one device failed)")
    for kind in sorted(counts):
        row = counts[kind]
        total.update(row)
        print(f"{kind:44s} {row['exact'] + row['refused'] + row['differed']:5d} {row['exact']:6d} "
              f"{row['refused']:8d} {row['differed']:9d}  ({row['invalid']})")
    print(f"{'all':44s} {total['exact'] + total['refused'] + total['differed']:5d} {total['exact']:6d} "
          f"{total['refused']:8d} {total['differed']:9d}  ({total['invalid']})")
    print(f"{time.perf_counter() - started:.0f} s")
    for text in differences:
        print("\n" + text)
    if args.json:
        args.json.write_text(json.dumps({kind: dict(row) for kind, row in counts.items()}, indent=1, sort_keys=True))
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
