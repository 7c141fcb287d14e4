"""Your own model from the command line, and the profile it writes used by the strategy instead of calibrating.

`hetero-cs calibrate --model package.module:function --output PATH` (here: calibration.__main__.main, the same
code) calibrates the model the function returns; ``HeteroCentralStorageStrategy(profile=PATH)`` on the same devices
then trains with that profile's cost models and caps, and never calibrates.
"""

from __future__ import annotations

import json
import re
import textwrap

import numpy as np
import pytest

import calibration
from calibration import probe as probe_module
from calibration.__main__ import main as calibration_main
from calibration.store import load_result_file
from hetero_cs import HeteroCentralStorageStrategy
from hetero_cs.errors import ConfigError, ProfileCacheError

EMULATED = ["A10", "T4", "P100"]
USER_MODULE = '''
import keras
import numpy as np


def build():
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def build_with_data():
    rng = np.random.default_rng(1)
    return build(), (rng.normal(size=(40, 12)).astype("float32"), rng.integers(0, 4, 40))


def regression():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def uncompiled():
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(4)])


def not_a_model():
    return 42


NOT_CALLABLE = 3
'''


@pytest.fixture(scope="module")
def user_package(tmp_path_factory):
    root = tmp_path_factory.mktemp("user_code")
    (root / "hcs_user_models").mkdir()
    (root / "hcs_user_models" / "__init__.py").write_text("")
    (root / "hcs_user_models" / "models.py").write_text(textwrap.dedent(USER_MODULE))
    return root


@pytest.fixture
def on_path(user_package, monkeypatch):
    monkeypatch.syspath_prepend(str(user_package))
    monkeypatch.setenv("HETERO_CS_EMULATION_TARGET_MAKESPAN_MS", "20")


def _calibrate_cli(spec, output, *extra):
    return calibration_main(["--model", spec, "--emulate", ",".join(EMULATED), "--global-batch-size", "48",
                             "--no-cache", "--output", str(output), "--trials", "1", "--warmup-steps", "1",
                             "--target-step-ms", "20", "--probe-batch-sizes", "1,8,48", "--no-progress", *extra])


def _no_calibration(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a strategy with profile= must not calibrate")

    monkeypatch.setattr(calibration, "calibrate", refuse)
    monkeypatch.setattr(probe_module, "DeviceProbe", refuse)


@pytest.mark.parametrize("function", ["build", "build_with_data"])
def test_calibrate_your_own_model_then_train_with_its_profile_without_calibrating(on_path, tmp_path, monkeypatch,
                                                                                  capsys, function):
    output = tmp_path / "profile.json"
    assert _calibrate_cli(f"hcs_user_models.models:{function}", output) == 0
    assert f"HeteroCentralStorageStrategy(emulate={EMULATED}, profile=" in capsys.readouterr().out
    profile = load_result_file(output)
    assert [p.emulated_as for p in profile.profiles] == EMULATED and profile.plan.global_batch_size == 48

    from hcs_user_models.models import build

    _no_calibration(monkeypatch)
    strategy = HeteroCentralStorageStrategy(emulate=EMULATED, profile=str(output))
    with strategy.scope():
        model = build()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(192, 12)).astype(np.float32), rng.integers(0, 4, 192)
    history = model.fit(x, y, batch_size=48, epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert strategy.calibration == profile  # the profile stood in for calibration
    assert strategy.balancer.calibrated_models == list(profile.cost_models)
    assert strategy.balancer.max_batch_sizes == list(profile.max_batch_sizes)
    assert strategy.plan.global_batch_size == 48


def test_a_regression_model_without_sample_data_gets_a_made_up_batch(on_path, tmp_path):
    output = tmp_path / "regression.json"
    assert _calibrate_cli("hcs_user_models.models:regression", output) == 0
    assert len(load_result_file(output).profiles) == 3


@pytest.mark.parametrize("spec,match", [
    ("hcs_user_models.nope:build", r"cannot import module 'hcs_user_models\.nope'"),
    ("hcs_user_models.models:missing", r"module 'hcs_user_models\.models' has no attribute 'missing'"),
    ("hcs_user_models.models:NOT_CALLABLE", r"names a int, not a function that returns a model"),
    ("hcs_user_models.models:uncompiled", r"returned an uncompiled model.*compile it"),
    ("hcs_user_models.models:not_a_model", r"returned int; it must return a compiled keras\.Model"),
])
def test_cli_model_function_errors_are_one_line_and_exit_2(on_path, tmp_path, capsys, spec, match):
    from hetero_cs.cli import main as cli_main

    status = cli_main(["calibrate", "--model", spec, "--emulate", ",".join(EMULATED), "--no-cache",
                       "--output", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and err.startswith("hetero-cs calibrate: error: --model="), err
    assert re.search(match, err), err
    assert not (tmp_path / "p.json").exists()


def test_cli_model_spec_syntax_is_checked_by_the_parser(capsys):
    from hetero_cs.cli import main as cli_main

    with pytest.raises(SystemExit) as info:
        cli_main(["calibrate", "--model", "resnet"])
    assert info.value.code == 2
    assert "must be one of mlp, digits_cnn or package.module:function" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------
# A profile that does not fit the strategy
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def emulated_profile(tmp_path_factory):
    """A profile of three devices /device:CPU:1..3 emulating A10, T4, P100 (made up: only its shape matters)."""
    from calibration.result import CalibrationResult, DeviceProfile
    from calibration.store import save_result_file
    from hetero_cs import LinearCostModel

    profiles = tuple(
        DeviceProfile(device=f"/device:CPU:{i + 1}", cost_model=LinearCostModel(0.01, c), max_batch_size=None,
                      fit_error=0.0, probe_batch_sizes=(1, 8), median_step_times_s=(0.01, 0.02), mad_s=(0.0, 0.0),
                      emulated_as=name)
        for i, (name, c) in enumerate(zip(EMULATED, (1e-4, 3e-4, 4e-4)))
    )
    path = tmp_path_factory.mktemp("profiles") / "emulated.json"
    save_result_file(path, CalibrationResult(profiles=profiles, wall_time_s=1.0, emulated=True))
    return path


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(compute_devices=["/cpu:1", "/cpu:2"], emulate=["A10", "T4"]), ConfigError,
     r"was calibrated on \['/device:CPU:1', '/device:CPU:2', '/device:CPU:3'\] emulating \['A10', 'T4', 'P100'\], "
     r"but this strategy runs on \['/device:CPU:1', '/device:CPU:2'\] emulating \['A10', 'T4'\]"),
    (dict(compute_devices=["/cpu:1", "/cpu:2", "/cpu:3"], emulate=["A10", "T4", "T4"]), ConfigError,
     r"emulating \['A10', 'T4', 'T4'\]\. Calibrate for these devices"),
    (dict(compute_devices=["/cpu:1", "/cpu:2", "/cpu:3"]), ConfigError, r"runs on .* \(not emulated\)"),
    (dict(compute_devices=["/cpu:2", "/cpu:1", "/cpu:3"], emulate=EMULATED), ConfigError, r"this strategy runs on "
     r"\['/device:CPU:2', '/device:CPU:1', '/device:CPU:3'\]"),
    (dict(emulate=EMULATED, batch_split=[1, 1, 1]), ConfigError, r"only auto_balance uses.*Drop one or the other"),
    (dict(emulate=EMULATED, auto_balance=False), ConfigError, r"only auto_balance uses"),
])
def test_a_profile_for_other_devices_or_without_auto_balance_is_a_config_error(emulated_profile, kwargs, error,
                                                                               match):
    with pytest.raises(error, match=match):
        HeteroCentralStorageStrategy(profile=emulated_profile, profile_cache=False, **kwargs)


def test_a_profile_of_any_case_matches_its_emulated_names(emulated_profile):
    strategy = HeteroCentralStorageStrategy(emulate=["a10", "t4", "p100"], profile=emulated_profile)
    assert strategy.calibration is None  # read and checked now, used when fit first sees the model


@pytest.mark.parametrize("content,match", [("{", "Cannot use the calibration profile"),
                                           (None, "No such file")])
def test_an_unreadable_profile_is_a_profile_cache_error(tmp_path, content, match):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ProfileCacheError, match=match):
        HeteroCentralStorageStrategy(emulate=EMULATED, profile=path)


def test_a_profile_that_is_not_a_path_is_a_config_error():
    with pytest.raises(ConfigError, match=r"profile must be the path of a file.*Received: profile=\{\}"):
        HeteroCentralStorageStrategy(emulate=EMULATED, profile={})


def test_the_profile_is_json_written_by_the_cli(emulated_profile):
    assert json.loads(emulated_profile.read_text())["schema_version"] == 1


def test_cli_calibrates_under_the_policy_asked_for_and_refuses_bf16_on_a_t4(on_path, tmp_path, capsys):
    import keras

    previous = keras.mixed_precision.global_policy()
    try:
        assert _calibrate_cli("hcs_user_models.models:build", tmp_path / "fp16.json", "--policy", "mixed_float16") == 0
        assert keras.mixed_precision.global_policy().name == "mixed_float16"  # the user's model was built under it
        capsys.readouterr()
        assert _calibrate_cli("hcs_user_models.models:build", tmp_path / "bf16.json", "--policy", "mixed_bfloat16") == 2
        assert "error: Emulated device T4 has no bfloat16 arithmetic" in capsys.readouterr().err
        assert not (tmp_path / "bf16.json").exists()
    finally:
        keras.mixed_precision.set_global_policy(previous)


def test_a_profile_calibrated_with_a_memory_override_matches_the_same_memory_only(tmp_path):
    from calibration.result import CalibrationResult, DeviceProfile
    from calibration.store import save_result_file
    from hetero_cs import LinearCostModel

    names = ["A10", "T4@48MB", "P100"]  # as `hetero-cs calibrate --emulate A10,T4@48MB,P100` records them
    profiles = tuple(
        DeviceProfile(device=f"/device:CPU:{i + 1}", cost_model=LinearCostModel(0.01, 1e-4), max_batch_size=None,
                      fit_error=0.0, probe_batch_sizes=(1, 8), median_step_times_s=(0.01, 0.02), mad_s=(0.0, 0.0),
                      emulated_as=name)
        for i, name in enumerate(names)
    )
    path = tmp_path / "override.json"
    save_result_file(path, CalibrationResult(profiles=profiles, wall_time_s=1.0, emulated=True))
    for same in (names, ["a10", "t4@48mb", "p100"], ["A10", "T4@48000000B", "P100"]):
        HeteroCentralStorageStrategy(emulate=same, profile=path, profile_cache=False)
    with pytest.raises(ConfigError, match=r"emulating \['A10', 'T4@48MB', 'P100'\], but this strategy runs on .* "
                                          r"emulating \['A10', 'T4', 'P100'\]"):
        HeteroCentralStorageStrategy(emulate=["A10", "T4", "P100"], profile=path, profile_cache=False)
