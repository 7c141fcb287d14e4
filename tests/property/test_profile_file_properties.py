"""Whatever a profile file holds, reading it gives a valid result, or one warning (cache) / ProfileCacheError (file).

Hypothesis edits a valid profile document at a random place (any value of any JSON type, huge numbers and NaN
included), or writes random bytes; no other exception may escape, and a cache entry that fails is replaced by the
next save.
"""

from __future__ import annotations

import json
import math
import warnings

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from calibration.result import CalibrationResult, DeviceProfile
from calibration.store import ProfileStore, load_result_file
from hetero_cs.errors import ProfileCacheError
from hetero_cs.planning.cost_model import LinearCostModel, PiecewiseLinearCostModel
from hetero_cs.planning.solver import solve_batch_split

KEY = "cd" * 32


def _result() -> CalibrationResult:
    profiles = (
        DeviceProfile(device="/device:CPU:1", cost_model=LinearCostModel(0.001, 1e-4), max_batch_size=None,
                      fit_error=0.01, probe_batch_sizes=(1, 4), median_step_times_s=(0.0011, 0.0014),
                      mad_s=(0.0, 0.0), emulated_as="A10"),
        DeviceProfile(device="/device:CPU:2",
                      cost_model=PiecewiseLinearCostModel(batch_sizes=(1, 16), step_times_s=(0.002, 0.004)),
                      max_batch_size=40, fit_error=0.0, probe_batch_sizes=(1, 16),
                      median_step_times_s=(0.002, 0.004), mad_s=(0.0, 1e-5)),
    )
    plan = solve_batch_split([p.cost_model for p in profiles], 48, max_batch_sizes=[None, 40])
    return CalibrationResult(profiles=profiles, wall_time_s=1.0, emulated=True, plan=plan)


DOCUMENT = {"schema_version": 1, "key": KEY, "result": _result().to_dict()}

numbers = st.one_of(
    st.integers(), st.integers(min_value=10**300, max_value=10**400), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1, 2**63, -(2**63), 1e308, -1e308, 5e-324]),
)
leaves = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=8))
json_values = st.recursive(
    leaves, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner,
                                                                                   max_size=4)),
    max_leaves=12,
)


def _paths(value, prefix=()):
    """Every place in a JSON value: key paths to each dict entry and list item (the root included)."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*prefix, index))


PATHS = list(_paths(DOCUMENT))


def _edited(path, value):
    document = json.loads(json.dumps(DOCUMENT))
    if not path:
        return value
    parent = document
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = value
    return document


def _text(document) -> str:
    def default(o):  # pragma: no cover - json_values hold only JSON types
        raise TypeError(o)

    try:
        return json.dumps(document, default=default)
    except ValueError:  # an int too long for str(): write it as a very long literal ourselves
        return json.dumps(DOCUMENT).replace('"wall_time_s": 1.0', '"wall_time_s": ' + "9" * 5000)


def _check(tmp_path_factory, data: bytes) -> None:
    directory = tmp_path_factory.mktemp("store")
    store = ProfileStore(directory)
    store.path(KEY).write_bytes(data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = store.load(KEY)
    try:  # a result file has no key to match: it may accept what the cache refuses, but raises nothing else
        assert isinstance(load_result_file(store.path(KEY)), CalibrationResult)
    except ProfileCacheError as exc:
        assert loaded is None and "\n" not in str(exc)
    if loaded is None:
        assert len(caught) == 1 and "unusable profile cache file" in str(caught[0].message)
        store.save(KEY, _result())
        assert store.load(KEY) == _result()
    else:
        assert caught == []
        assert isinstance(loaded, CalibrationResult)
        for profile in loaded.profiles:  # whatever was accepted is usable by the solver
            for b in (0, 1, 7, 48):
                assert math.isfinite(profile.cost_model.predict_step_time_s(b))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(PATHS), value=json_values)
def test_any_edit_of_a_profile_gives_a_result_or_one_warning(tmp_path_factory, path, value):
    _check(tmp_path_factory, _text(_edited(path, value)).encode("utf-8"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=200))
def test_any_bytes_give_one_warning(tmp_path_factory, data):
    _check(tmp_path_factory, data)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(min_value=0, max_value=len(json.dumps(DOCUMENT)) - 1))
def test_any_truncation_gives_one_warning(tmp_path_factory, cut):
    _check(tmp_path_factory, json.dumps(DOCUMENT)[:cut].encode())
