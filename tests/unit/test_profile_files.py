"""Bad profile files never break anything: one warning and a fresh calibration, or one line and exit 2 (pure).

Every kind of unreadable file (bytes that are not UTF-8, JSON nested thousands deep, numbers too large for a
float, values of the wrong type, a file too large, a FIFO, a device) is, for the profile cache, one UserWarning and
a miss, after which a save replaces it; for ``load_result_file`` a ProfileCacheError; for ``hetero-cs plan
--profile`` one line on stderr and exit status 2. Temporary files of interrupted writes are removed when the store
is next used, and ``--output`` is checked before anything is calibrated.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
import warnings

import pytest

from calibration import store as store_module
from calibration.result import CalibrationResult, DeviceProfile
from calibration.store import MAX_PROFILE_BYTES, ProfileStore, check_output_path, load_result_file
from hetero_cs.cli import main as cli_main
from hetero_cs.errors import ConfigError, ProfileCacheError
from hetero_cs.planning.cost_model import LinearCostModel
from hetero_cs.planning.solver import solve_batch_split

KEY = "ab" * 32


def _result() -> CalibrationResult:
    profiles = tuple(
        DeviceProfile(device=f"/device:CPU:{i}", cost_model=LinearCostModel(0.001, c), max_batch_size=None,
                      fit_error=0.01, probe_batch_sizes=(1, 4), median_step_times_s=(0.0011, 0.0014),
                      mad_s=(0.0, 0.0))
        for i, c in ((1, 1e-4), (2, 3e-4))
    )
    plan = solve_batch_split([p.cost_model for p in profiles], 64)
    return CalibrationResult(profiles=profiles, wall_time_s=1.0, emulated=False, plan=plan)


def _good_text() -> str:
    return json.dumps({"schema_version": 1, "key": KEY, "result": _result().to_dict()}, indent=1)


def _replace_wall_time(literal: str) -> bytes:
    text = _good_text()
    assert '"wall_time_s": 1.0' in text
    return text.replace('"wall_time_s": 1.0', f'"wall_time_s": {literal}').encode()


def _with_result(edit) -> bytes:
    document = json.loads(_good_text())
    edit(document["result"])
    return json.dumps(document).encode()


# name -> bytes of the file. Each used to raise something other than a warning, or could.
HOSTILE_CONTENTS = {
    "regression_not_utf8": b'{"schema_version": 1, "key": "\xff\xfe"}',
    "regression_nested_thousands_deep": b"[" * 100_000 + b"]" * 100_000,
    "regression_object_nested_thousands_deep": b'{"a": ' * 50_000 + b"1" + b"}" * 50_000,
    "regression_float_too_large": _replace_wall_time("1e400"),
    "regression_int_too_large_for_a_float": _replace_wall_time("9" * 400),
    "int_with_more_digits_than_python_parses": _replace_wall_time("9" * 5000),
    "nan_literal": _replace_wall_time("NaN"),
    "infinity_literal": _replace_wall_time("-Infinity"),
    "regression_profiles_a_string": _with_result(lambda r: r.update(profiles="abc")),
    "regression_profile_a_number": _with_result(lambda r: r.update(profiles=[7])),
    "regression_cost_model_a_list": _with_result(lambda r: r["profiles"][0].update(cost_model=[1, 2])),
    "regression_median_times_huge_int": _with_result(
        lambda r: r["profiles"][0].update(median_step_times_s=[10**400, 10**401])),
    "regression_plan_a_string": _with_result(lambda r: r.update(plan="fast")),
    "plan_slices_strings": _with_result(lambda r: r["plan"].update(per_replica_batch_sizes=["a", "b"])),
    "result_null": _with_result(lambda r: r.clear()),
    "empty": b"",
    "nul_bytes": b"\x00" * 100,
    "too_large": b" " * (MAX_PROFILE_BYTES + 1),
}


def _write(path: pathlib.Path, kind: str) -> pathlib.Path:
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_bytes(HOSTILE_CONTENTS[kind])
    return path


KINDS = [*HOSTILE_CONTENTS, "fifo"]


@pytest.mark.parametrize("kind", KINDS)
def test_unreadable_cache_entry_is_one_warning_a_miss_and_is_replaced(tmp_path, kind):
    store = ProfileStore(tmp_path)
    _write(store.path(KEY), kind)
    with pytest.warns(UserWarning, match="unusable profile cache file") as record:
        assert store.load(KEY) is None
    assert len(record) == 1, [str(w.message) for w in record]
    assert "\n" not in str(record[0].message)
    store.save(KEY, _result())  # what calibrate does after the miss
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.load(KEY) == _result()


def test_a_directory_in_place_of_a_cache_entry_is_a_warning_and_a_miss(tmp_path):
    store = ProfileStore(tmp_path)
    store.path(KEY).mkdir()
    with pytest.warns(UserWarning, match="Cannot read the profile cache file") as record:
        assert store.load(KEY) is None
    assert len(record) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_unreadable_profile_file_is_a_profile_cache_error(tmp_path, kind):
    path = _write(tmp_path / "profile.json", kind)
    with pytest.raises(ProfileCacheError, match=r"Cannot use the calibration profile path=.*Recalibrate") as info:
        load_result_file(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_a_device_is_refused_without_reading_it(device):
    if not os.path.exists(device):
        pytest.skip(f"{device} does not exist here")
    with pytest.raises(ProfileCacheError, match="character device, not a regular file"):
        load_result_file(device)


@pytest.mark.parametrize("kind", [*KINDS, "dev_zero", "directory", "missing"])
def test_cli_plan_gives_one_line_and_exit_2_for_every_bad_file(tmp_path, capsys, kind):
    if kind == "dev_zero":
        path = pathlib.Path("/dev/zero")
    elif kind == "directory":
        path = tmp_path
    elif kind == "missing":
        path = tmp_path / "missing.json"
    else:
        path = _write(tmp_path / "profile.json", kind)
    status = cli_main(["plan", "--profile", str(path), "--global-batch-size", "8"])
    captured = capsys.readouterr()
    assert status == 2
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("hetero-cs plan: error: "), captured.err
    assert "Recalibrate" in captured.err


# ----------------------------------------------------------------------------------------------------------------
# Temporary files of interrupted writes
# ----------------------------------------------------------------------------------------------------------------
def _age(path: pathlib.Path, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past))


_KILLED_WRITER = """
import os, sys
sys.path.insert(0, sys.argv[3])
from calibration import store
from test_profile_files import KEY, _result
os.fsync = lambda fd: os._exit(9)  # the process dies with its temporary file written but not yet renamed
if sys.argv[2] == "cache":
    store.ProfileStore(sys.argv[1]).save(KEY, _result())
else:
    store.save_result_file(sys.argv[1], _result())
"""


def _killed_writer(target: pathlib.Path, *, cache: bool) -> None:
    """Runs a process that dies in the middle of writing target (a cache directory, or a profile file)."""
    root = str(pathlib.Path(__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    argv = [sys.executable, "-c", _KILLED_WRITER, str(target), "cache" if cache else "file",
            str(pathlib.Path(__file__).parent)]
    assert subprocess.run(argv, env=env, check=False).returncode == 9


def test_regression_a_killed_cache_writer_leaves_no_temp_file_after_the_next_use(tmp_path):
    _killed_writer(tmp_path, cache=True)
    leftovers = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(leftovers) == 1 and leftovers[0].name.startswith(f".{KEY}.json.")  # what the kill left
    _age(leftovers[0], 60)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ProfileStore(tmp_path).load(KEY) is None  # the next run: a miss, and the store is tidied
    assert list(tmp_path.iterdir()) == []


def test_regression_a_killed_profile_writer_leaves_no_temp_file_after_the_next_write(tmp_path):
    target = tmp_path / "profile.json"
    _killed_writer(target, cache=False)
    (leftover,) = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    _age(leftover, 60)
    store_module.save_result_file(target, _result())
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]
    assert load_result_file(target) == _result()


def test_temp_files_of_live_writers_and_other_files_are_kept(tmp_path):
    store = ProfileStore(tmp_path)
    fresh = tmp_path / f".{KEY}.json.fresh1.tmp"  # a writer that started a moment ago
    held = tmp_path / f".{KEY}.json.held22.tmp"  # an old file a live writer still holds (locked)
    foreign = tmp_path / ".notes.json.abc.tmp"  # not ours: another name
    for path in (fresh, held, foreign):
        path.write_text("partial")
    _age(held, 600)
    _age(foreign, 600)
    if store_module.fcntl is None:
        pytest.skip("no advisory locks on this platform")
    with open(held, "rb") as handle:
        store_module.fcntl.flock(handle.fileno(), store_module.fcntl.LOCK_EX)
        assert store.load(KEY) is None
        assert fresh.exists() and held.exists() and foreign.exists()
    assert store.load(KEY) is None  # released: now it is abandoned
    assert fresh.exists() and not held.exists() and foreign.exists()


# ----------------------------------------------------------------------------------------------------------------
# --output is checked before calibrating
# ----------------------------------------------------------------------------------------------------------------
def test_check_output_path_accepts_new_and_existing_files(tmp_path):
    assert check_output_path(tmp_path / "profile.json") == tmp_path / "profile.json"
    assert check_output_path(tmp_path / "new" / "dir" / "profile.json") == tmp_path / "new" / "dir" / "profile.json"
    existing = tmp_path / "old.json"
    existing.write_text("{}")
    assert check_output_path(existing) == existing


def _unwritable_dir(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.access(locked, os.W_OK):  # e.g. running as root
        pytest.skip("permissions are not enforced for this user")
    return locked


OUTPUT_CASES = {
    "directory": (lambda tmp: tmp, r"--output=.* is a directory; it must name a file"),
    "trailing_slash": (lambda tmp: f"{tmp}/newdir/", r"is a directory; it must name a file"),
    "under_a_file": (lambda tmp: (tmp / "file.txt").write_text("x") and tmp / "file.txt" / "p.json",
                     r"file\.txt' is not a directory"),
    "not_a_regular_file": (lambda tmp: os.mkfifo(tmp / "pipe") or tmp / "pipe", r"exists and is not a regular file"),
    "unwritable_directory": (lambda tmp: _unwritable_dir(tmp) / "p.json", r"is not writable"),
    "empty": (lambda tmp: "", r"--output must name a file"),
}


@pytest.mark.parametrize("case", list(OUTPUT_CASES))
def test_check_output_path_rejects(tmp_path, case):
    make, match = OUTPUT_CASES[case]
    with pytest.raises(ConfigError, match=match):
        check_output_path(make(tmp_path))


@pytest.mark.parametrize("case", ["directory", "under_a_file", "unwritable_directory"])
def test_regression_cli_calibrate_checks_output_before_calibrating(tmp_path, capsys, monkeypatch, case):
    from calibration import cli as calibration_main

    def calibrating(*args, **kwargs):
        raise AssertionError("--output must be checked before any device is set up or probed")

    monkeypatch.setattr(calibration_main, "_setup_devices", calibrating)
    make, match = OUTPUT_CASES[case]
    status = cli_main(["calibrate", "--output", str(make(tmp_path))])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and err.startswith("hetero-cs calibrate: error: "), err
