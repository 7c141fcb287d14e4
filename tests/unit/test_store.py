"""Profile cache: keys, round trips, corrupt files, concurrent writers (pure; no TensorFlow)."""

from __future__ import annotations

import dataclasses
import json
import threading
import warnings

import pytest

from calibration.result import CalibrationResult, DeviceProfile
from calibration.store import (
    SCHEMA_VERSION,
    ProfileStore,
    default_cache_dir,
    load_result_file,
    profile_key,
    save_result_file,
)
from hetero_cs.planning.cost_model import LinearCostModel, PiecewiseLinearCostModel
from hetero_cs.errors import ConfigError, ProfileCacheError
from hetero_cs.planning.solver import solve_batch_split


def _result(wall_time_s: float = 3.5, *, emulated: bool = True) -> CalibrationResult:
    profiles = (
        DeviceProfile(
            device="/device:CPU:1",
            cost_model=LinearCostModel(fixed_overhead_s=0.01, seconds_per_example=1e-4),
            max_batch_size=None,
            fit_error=0.012,
            probe_batch_sizes=(1, 4, 16, 64, 256),
            median_step_times_s=(0.0101, 0.0104, 0.0116, 0.0164, 0.0356),
            mad_s=(1e-4, 1e-4, 2e-4, 1e-4, 3e-4),
            emulated_as="A10" if emulated else None,
        ),
        DeviceProfile(
            device="/device:CPU:2",
            cost_model=PiecewiseLinearCostModel(batch_sizes=(1, 16, 256), step_times_s=(0.02, 0.021, 0.08)),
            max_batch_size=200,
            fit_error=0.0,
            probe_batch_sizes=(1, 16, 256),
            median_step_times_s=(0.02, 0.021, 0.08),
            mad_s=(0.0, 1e-4, 2e-4),
            emulated_as="T4" if emulated else None,
        ),
    )
    plan = solve_batch_split([p.cost_model for p in profiles], 256, max_batch_sizes=[256, 200])
    return CalibrationResult(profiles=profiles, wall_time_s=wall_time_s, emulated=emulated, plan=plan)


def _key(fingerprint: str = "model-a", devices=("/device:CPU:1", "/device:CPU:2")) -> str:
    return profile_key(device_ids=list(devices), model_fingerprint=fingerprint,
                       input_signature="float32[*,8,8,1];int64[*]", tf_version="2.21.0")


def test_profile_key_is_a_stable_sha256():
    assert _key() == _key()
    assert len(_key()) == 64 and all(c in "0123456789abcdef" for c in _key())


def test_profile_key_changes_with_model_devices_order_signature_and_version():
    base = _key()
    assert _key(fingerprint="model-b") != base
    assert _key(devices=("/device:CPU:2", "/device:CPU:1")) != base
    other_signature = profile_key(device_ids=["/device:CPU:1", "/device:CPU:2"], model_fingerprint="model-a",
                                  input_signature="float32[*,64];int64[*]", tf_version="2.21.0")
    other_version = profile_key(device_ids=["/device:CPU:1", "/device:CPU:2"], model_fingerprint="model-a",
                                input_signature="float32[*,8,8,1];int64[*]", tf_version="2.22.0")
    assert len({base, other_signature, other_version}) == 3


def test_profile_key_validates():
    with pytest.raises(ConfigError, match="device_ids"):
        profile_key(device_ids=[], model_fingerprint="m", input_signature="s", tf_version="v")
    with pytest.raises(ConfigError, match="device_ids"):
        profile_key(device_ids="/device:CPU:1", model_fingerprint="m", input_signature="s", tf_version="v")


def test_save_then_load_round_trips(tmp_path):
    store = ProfileStore(tmp_path / "cache")
    result = _result()
    path = store.save(_key(), result)
    assert path.parent == tmp_path / "cache"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = store.load(_key())
    assert loaded == result
    assert loaded.plan.per_replica_batch_sizes == result.plan.per_replica_batch_sizes
    assert json.loads(path.read_text())["schema_version"] == SCHEMA_VERSION


def test_miss_returns_none_without_warning(tmp_path):
    store = ProfileStore(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.load(_key()) is None


def test_model_change_misses(tmp_path):
    store = ProfileStore(tmp_path)
    store.save(_key("model-a"), _result())
    assert store.load(_key("model-a")) is not None
    assert store.load(_key("model-b")) is None


def _assert_one_warning_and_none(store, key, match):
    with pytest.warns(UserWarning, match=match) as record:
        assert store.load(key) is None
    assert len(record) == 1


def test_corrupt_file_warns_once_and_misses(tmp_path):
    store = ProfileStore(tmp_path)
    store.path(_key()).write_text('{"schema_version": 1, "key": "trunc')
    _assert_one_warning_and_none(store, _key(), "unusable profile cache file")


def test_unknown_top_level_key_is_rejected(tmp_path):
    store = ProfileStore(tmp_path)
    path = store.save(_key(), _result())
    document = json.loads(path.read_text())
    document["note"] = "hand edit"
    path.write_text(json.dumps(document))
    _assert_one_warning_and_none(store, _key(), r"unknown keys \['note'\]")


def test_unknown_nested_key_is_rejected(tmp_path):
    store = ProfileStore(tmp_path)
    path = store.save(_key(), _result())
    document = json.loads(path.read_text())
    document["result"]["profiles"][0]["speed"] = 3
    path.write_text(json.dumps(document))
    _assert_one_warning_and_none(store, _key(), "unknown keys")


def test_other_schema_version_is_rejected(tmp_path):
    store = ProfileStore(tmp_path)
    path = store.save(_key(), _result())
    document = json.loads(path.read_text())
    document["schema_version"] = SCHEMA_VERSION + 1
    path.write_text(json.dumps(document))
    _assert_one_warning_and_none(store, _key(), "schema_version")


def test_file_of_another_key_is_rejected(tmp_path):
    store = ProfileStore(tmp_path)
    store.save(_key("model-a"), _result())
    store.path(_key("model-b")).write_text(store.path(_key("model-a")).read_text())
    _assert_one_warning_and_none(store, _key("model-b"), "does not match the file name")


def test_invalid_values_are_rejected(tmp_path):
    store = ProfileStore(tmp_path)
    path = store.save(_key(), _result())
    document = json.loads(path.read_text())
    document["result"]["profiles"][1]["cost_model"]["step_times_s"] = [0.03, 0.02, 0.01]  # decreasing
    path.write_text(json.dumps(document))
    _assert_one_warning_and_none(store, _key(), "non-decreasing")


def test_malformed_key_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="sha256"):
        ProfileStore(tmp_path).load("../../etc/passwd")


def test_unwritable_directory_raises_profile_cache_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ProfileCacheError, match="Cannot write") as info:
        ProfileStore(blocker / "cache").save(_key(), _result())
    # The advice names the arguments users pass (the strategy's and the CLI's), not calibrate()'s store=False.
    message = str(info.value)
    assert "HETERO_CS_CACHE_DIR" in message and "profile_cache=False" in message and "--no-cache" in message
    assert "store=False" not in message


def test_concurrent_writers_leave_a_valid_file(tmp_path):
    store = ProfileStore(tmp_path)
    key = _key()
    results = [_result(wall_time_s=float(i)) for i in range(6)]
    store.save(key, results[0])
    problems: list[str] = []
    stop = threading.Event()

    def write(result):
        for _ in range(15):
            store.save(key, result)

    def read():
        while not stop.is_set():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loaded = store.load(key)
            if loaded is None or caught:
                problems.append(f"reader saw loaded={loaded!r}, warnings={[str(w.message) for w in caught]}")

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(r,)) for r in results]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    stop.set()
    reader.join()
    assert problems == []
    assert store.load(key) in results
    assert [p.name for p in tmp_path.iterdir()] == [f"{key}.json"]  # no temporary file left behind


def test_default_directory_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HETERO_CS_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    assert ProfileStore().directory == tmp_path / "explicit"
    assert ProfileStore(tmp_path / "arg").directory == tmp_path / "arg"
    monkeypatch.delenv("HETERO_CS_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "xdg" / "hetero_cs"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "hetero_cs"


def test_result_file_round_trip_and_corrupt_file(tmp_path):
    path = tmp_path / "profile.json"
    result = _result()
    save_result_file(path, result)
    assert load_result_file(path) == result
    path.write_text("[]")
    with pytest.raises(ProfileCacheError, match="Recalibrate"):
        load_result_file(path)
    with pytest.raises(ProfileCacheError, match="profile.missing"):
        load_result_file(tmp_path / "profile.missing")


def test_result_dict_round_trip_without_plan():
    result = dataclasses.replace(_result(), plan=None, measured_makespan_s=0.031)
    assert CalibrationResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result


def test_profile_from_dict_rejects_unknown_keys():
    data = _result().profiles[0].to_dict()
    data["extra"] = 1
    with pytest.raises(ProfileCacheError, match=r"unknown keys \['extra'\]"):
        DeviceProfile.from_dict(data)


def test_format_table_says_when_timings_are_emulated():
    emulated = _result().format_table()
    assert "EMULATED" in emulated
    assert "A10" in emulated and "T4" in emulated
    assert "a=10.000 ms" in emulated  # the linear model's overhead
    assert "200" in emulated  # the memory cap
    assert "plan: per_replica_batch_sizes=" in emulated
    measured = _result(emulated=False).format_table()
    assert "EMULATED" not in measured and "measured timings" in measured


def test_result_validates_plan_length():
    result = _result()
    with pytest.raises(ProfileCacheError, match="one slice per profile"):
        CalibrationResult(profiles=result.profiles[:1], wall_time_s=1.0, emulated=True, plan=result.plan)


def test_from_cache_is_a_bool_and_is_not_stored():
    result = _result()
    assert not result.from_cache
    cached = dataclasses.replace(result, from_cache=True)
    assert cached == result  # the same calibration, wherever it came from
    assert "from_cache" not in cached.to_dict()
    assert not CalibrationResult.from_dict(cached.to_dict()).from_cache
    with pytest.raises(ProfileCacheError, match="from_cache must be a bool. Received: 'no'"):
        dataclasses.replace(result, from_cache="no")


def test_a_device_that_cannot_hold_one_example_round_trips_as_an_idle_profile(tmp_path):
    from hetero_cs.planning.cost_model import OutOfMemoryCostModel

    idle = DeviceProfile(device="/device:CPU:3", cost_model=OutOfMemoryCostModel(), max_batch_size=0, fit_error=0.0,
                         probe_batch_sizes=(), median_step_times_s=(), mad_s=(), emulated_as="P100")
    base = _result()
    profiles = (*base.profiles, idle)
    plan = solve_batch_split([p.cost_model for p in profiles], 256, max_batch_sizes=[256, 200, 0], min_batch_size=0)
    assert plan.per_replica_batch_sizes[2] == 0
    result = CalibrationResult(profiles=profiles, wall_time_s=1.0, emulated=True, plan=plan)
    store = ProfileStore(tmp_path / "cache")
    store.save(_key(devices=("/device:CPU:1", "/device:CPU:2", "/device:CPU:3")), result)
    loaded = store.load(_key(devices=("/device:CPU:1", "/device:CPU:2", "/device:CPU:3")))
    assert loaded == result and loaded.profiles[2].holds_no_example and loaded.max_batch_sizes[2] == 0
    row = [line for line in result.format_table().splitlines() if line.startswith("2 ")][0]
    assert "idle: out of memory at 1 example" in row
    # Its model keeps it out of a plan solved without the caps too.
    assert OutOfMemoryCostModel().predict_step_time_s(1) >= 86_400.0


@pytest.mark.parametrize("change", [
    dict(probe_batch_sizes=(1,), median_step_times_s=(0.01,), mad_s=(0.0,)),  # a cap of 0 was never timed
    dict(cost_model=LinearCostModel(0.01, 1e-4)),  # nor fitted
])
def test_a_profile_with_a_cap_of_zero_has_no_samples_and_no_fitted_model(change):
    from hetero_cs.planning.cost_model import OutOfMemoryCostModel

    fields = dict(device="/device:CPU:3", cost_model=OutOfMemoryCostModel(), max_batch_size=0, fit_error=0.0,
                  probe_batch_sizes=(), median_step_times_s=(), mad_s=())
    with pytest.raises(ProfileCacheError, match="max_batch_size=0 .* has no probed sizes and an OutOfMemoryCostModel"):
        DeviceProfile(**{**fields, **change})
    for cap in (-1, 10**400):  # the second overflowed a float once the cap reached fit's figures
        with pytest.raises(ProfileCacheError, match=r"max_batch_size must be None or an int in \[0, 2\*\*63\)"):
            DeviceProfile(**{**fields, "max_batch_size": cap})


def test_contention_factors_round_trip_and_scale_the_cost_models_and_an_older_profile_has_none(tmp_path):
    result = dataclasses.replace(_result(), contention_factors=(1.25, 1.0))
    back = CalibrationResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert back == result and back.contention_factors == (1.25, 1.0)
    assert back.cost_models[0].predict_step_time_s(64) == pytest.approx(1.25 * 0.0164)
    assert back.cost_models[1] is back.profiles[1].cost_model
    older = result.to_dict()
    del older["contention_factors"]  # written before the concurrent probe existed
    assert CalibrationResult.from_dict(older).contention_factors is None


@pytest.mark.parametrize("factors", [(1.25,), (0.9, 1.0), (float("nan"), 1.0), "12"])
def test_contention_factors_are_one_number_of_at_least_one_per_profile(factors):
    with pytest.raises(ProfileCacheError, match="contention_factors must hold one finite number >= 1 per profile"):
        dataclasses.replace(_result(), contention_factors=factors)
