"""A bounded CPU-burning neighbour process for benchmarks (``--noise``).

``busy_neighbour()`` is a context manager: it starts one Python process that spins on one core and stops it on
exit - normal, an exception or Ctrl-C. The process also stops by itself after ``max_seconds`` or as soon as its
parent is gone, so it cannot outlive a benchmark that was killed.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

_BURNER = r"""
import os, sys, time
parent, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
x = 0
while time.monotonic() < deadline:
    for _ in range(200_000):  # ~10 ms of pure-Python work between checks
        x = (x * 1103515245 + 12345) % 2147483648
    if os.getppid() != parent:  # orphaned: the benchmark is gone
        break
"""


@contextlib.contextmanager
def busy_neighbour(*, max_seconds: float = 3600.0, processes: int = 1) -> Iterator[list[int]]:
    """Runs ``processes`` CPU-burning neighbours for the duration of the ``with`` block; yields their pids.

    Args:
        max_seconds: > 0. Each neighbour stops by itself after this long, whatever happens to the benchmark.
        processes: >= 1 neighbours, one core each.
    """
    if not max_seconds > 0 or processes < 1:
        raise ValueError(f"need max_seconds > 0 and processes >= 1. Received: {max_seconds=}, {processes=}.")
    started: list[subprocess.Popen] = []
    try:
        for _ in range(processes):
            started.append(subprocess.Popen(
                [sys.executable, "-c", _BURNER, str(os.getpid()), str(max_seconds)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))
        yield [p.pid for p in started]
    finally:
        for process in started:
            if process.poll() is None:
                process.terminate()
        for process in started:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
