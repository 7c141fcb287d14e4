"""`python -m calibration [options]`: the same as `hetero-cs calibrate [options]` (see calibration.cli)."""

import sys
from collections.abc import Sequence

from hetero_cs.cli import main as cli_main


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m calibration [options]`; returns the exit status (0 ok, 2 error)."""
    return cli_main(["calibrate", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
