"""Settings for every test: the benchmarks' helpers importable, and Hypothesis checks no wall-clock time, so the
default suite passes on a busy host.

Hypothesis' per-example ``deadline`` and its ``too_slow`` health check (data generation that took too long) both
read the clock. The property tests set ``deadline=None`` one by one; this profile makes it the default and turns
the health check off, so a test that forgets it cannot fail because the host is busy. Explicit ``@settings``
keep what they set and inherit the rest from here.
"""

import pathlib
import sys

from hypothesis import HealthCheck, settings

# The benchmark scripts are not part of the installed package; tests that check their helpers import them from the
# repository. Appended, so `hetero_cs` itself still comes from the installed package (what tox tests).
_REPOSITORY = str(pathlib.Path(__file__).resolve().parent.parent)
if _REPOSITORY not in sys.path:
    sys.path.append(_REPOSITORY)

settings.register_profile("hetero_cs", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("hetero_cs")


# ---------------------------------------------------------------------------------------------------------------
# Python's full garbage collections in a long TensorFlow test run. Every traced function, graph and model stays
# reachable for a while (strategies cached per module, Keras' and TensorFlow's own caches), so the heap grows to
# millions of objects, and each full collection walks all of them: measured in the default run, single pauses of
# 7-11 s inside tests that take 1-2 s alone, and one test at 61 s. After each test module, its garbage is collected
# and what survives is frozen (gc.freeze: later collections skip it), so a collection walks only the objects of the
# module that runs. Nothing a test asserts depends on it.
# ---------------------------------------------------------------------------------------------------------------
import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the module's fixtures are finalised first
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        gc.collect()
        gc.freeze()
