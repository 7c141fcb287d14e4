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
