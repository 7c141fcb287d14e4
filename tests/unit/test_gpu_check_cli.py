"""benchmarks/gpu_check.py starts without TensorFlow: `--help` and a bad `--sections` answer at once (a subprocess).

The checks themselves need TensorFlow and, for most figures, a GPU: run the script (see docs/real_gpus.md).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
NO_TENSORFLOW = ("import runpy, sys; sys.argv = [sys.argv[1]] + sys.argv[2:]\n"
                 "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
                 "finally:\n    assert 'tensorflow' not in sys.modules, 'gpu_check imported TensorFlow'\n")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TENSORFLOW, str(SCRIPT), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_help_lists_the_sections_and_options_without_importing_tensorflow():
    done = _run("--help")
    assert done.returncode == 0, done.stderr
    for text in ("--sections", "--json", "--budget-s", "--params", "tests/gpu with TF32 off", "fused_update"):
        assert text in done.stdout
    assert "Traceback" not in done.stderr


def test_an_unknown_section_is_refused_before_anything_runs():
    done = _run("--sections", "a,z")
    assert done.returncode == 2 and "--sections takes letters from a,b,c,d,e" in done.stderr
    assert "Traceback" not in done.stderr
