"""`hetero-cs run`: which card a dead script names, the restart without it, and the exit statuses (no TensorFlow).

The scripts here stand in for a training script: they print what a lost card prints and abort, as a process does
after a sticky CUDA error, so the supervisor's rules run in a fraction of a second.
"""

import io
import sys
import textwrap

import pytest

from hetero_cs import ConfigError
from hetero_cs.cli import main
from hetero_cs.supervisor import Supervisor, lost_card_in, nth_remaining


def test_only_an_emulated_cards_line_names_a_lost_card():
    found = lost_card_in("hetero_cs emulation: lost replica=2 (P100) at its step 7: CUDA_ERROR_ECC_UNCORRECTABLE ...")
    assert found is not None and (found.index, found.name) == (2, "P100")
    # A GPU's line points at a device; whether the card is lost is NVML's to say (test_supervisor_gpus.py).
    assert lost_card_in("failed to synchronize: CUDA_ERROR_ILLEGAL_ADDRESS on /job:localhost/replica:0/task:0/"
                        "device:GPU:1") is None


def test_positions_left_after_exclusions():
    assert [nth_remaining(i, []) for i in range(3)] == [0, 1, 2]
    assert [nth_remaining(i, [1]) for i in range(3)] == [0, 2, 3]
    assert [nth_remaining(i, [0, 2]) for i in range(2)] == [1, 3]


def script(tmp_path, body):
    path = tmp_path / "fake_train.py"
    path.write_text("import os, sys\nrestart = int(os.environ['HETERO_CS_RESTART'])\n"
                    "excluded = os.environ.get('HETERO_CS_EXCLUDED_DEVICES', '')\n" + textwrap.dedent(body))
    return [sys.executable, str(path)]


def lose(replica, name="T4"):
    return (f"sys.stderr.write('hetero_cs emulation: lost replica={replica} ({name}) at its step 3: "
            f"CUDA_ERROR_ECC_UNCORRECTABLE\\n'); sys.stderr.flush(); os.abort()")


def test_a_lost_card_is_left_out_and_the_restarted_script_succeeds(tmp_path):
    command = script(tmp_path, f"""
        print('run', restart, repr(excluded), os.environ['HETERO_CS_BACKUP_DIR'].endswith('b'), flush=True)
        if restart == 0:
            {lose(1)}
        if restart == 1:
            assert excluded == '1', excluded
            {lose(1, 'P100')}  # the script's replica 1 is now the third card
        assert excluded == '1,2', excluded
    """)
    output = io.StringIO()
    supervisor = Supervisor(command, max_restarts=3, backup_dir=tmp_path / "b", output=output)
    assert supervisor.run() == 0
    assert supervisor.restarts == 2 and supervisor.excluded == [1, 2]
    assert "the emulated T4 at position 1 of emulate=" in output.getvalue()
    assert "Restarting it without that card (restart 1 of at most 3)" in output.getvalue()
    assert "succeeded after 2 restart(s)" in output.getvalue()


def test_a_card_lost_again_after_the_last_restart_gives_up_with_the_scripts_status(tmp_path):
    command = script(tmp_path, lose(0) + "\n")
    output = io.StringIO()
    supervisor = Supervisor(command, max_restarts=1, backup_dir=tmp_path / "b", output=output)
    assert supervisor.run() == 134  # SIGABRT, passed on as a shell reports it
    assert supervisor.restarts == 1 and supervisor.excluded == [0, 1]
    assert "the most --max-restarts=1 allows: giving up with its status 134" in output.getvalue()


def test_a_script_that_fails_for_another_reason_is_not_restarted(tmp_path):
    command = script(tmp_path, "sys.stderr.write('ValueError: a bug\\n'); sys.exit(3)\n")
    output = io.StringIO()
    supervisor = Supervisor(command, backup_dir=tmp_path / "b", output=output)
    assert supervisor.run() == 3 and supervisor.restarts == 0
    assert "exited with status 3 and no card was lost: not restarting" in output.getvalue()


@pytest.mark.parametrize("verbose, level", [(False, "2"), (True, "unset")])
def test_the_script_run_starts_with_tensorflows_own_warnings_off_unless_verbose(tmp_path, monkeypatch, verbose, level):
    # A card failure in the script is told by hetero_cs' two WARNING lines; TensorFlow's C++ report of each failed
    # attempt (tracebacks, "Local rendezvous is aborting") is over 100 lines at its WARNING level.
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    command = script(tmp_path, f"sys.exit(0 if os.environ.get('TF_CPP_MIN_LOG_LEVEL', 'unset') == {level!r} else 5)\n")
    argv = ["-v"] * verbose + ["run", "--backup-dir", str(tmp_path / "b"), "--", *command]
    assert main(argv) == 0


def write_backup(names="'fit_0.json'"):
    return f"""
        import pathlib
        from hetero_cs.engine.faults.supervised_run import register
        owned = pathlib.Path(os.environ['HETERO_CS_BACKUP_DIR'])
        register(owned, [{names}])
        for name in [{names}]:
            (owned / name).write_text('{{}}')
"""


def test_backups_are_removed_once_the_script_succeeds(tmp_path):
    backups = tmp_path / "b"
    command = script(tmp_path, write_backup() + """
        if restart == 0:
            """ + lose(2) + "\n")
    assert Supervisor(command, backup_dir=backups, output=io.StringIO()).run() == 0
    assert not backups.exists()


@pytest.mark.parametrize("argv, message", [
    (["run", "--max-restarts", "-1", "--", sys.executable, "-c", "pass"], "--max-restarts must be an int in"),
    (["run", "--", "no-such-program-hetero"], "cannot run 'no-such-program-hetero'"),
])
def test_bad_arguments_exit_2_with_the_fix(argv, message, capsys, tmp_path):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_backup_dir_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        Supervisor([sys.executable, "-c", "pass"], backup_dir=path)


def test_a_backup_dir_of_the_users_keeps_its_other_files(tmp_path):
    backups = tmp_path / "ckpts"
    backups.mkdir()
    (backups / "my_model.keras").write_text("the user's")
    command = script(tmp_path, write_backup("'fit_0.json', 'fit_0.a.npz'"))
    assert Supervisor(command, backup_dir=backups, output=io.StringIO()).run() == 0
    assert sorted(p.name for p in backups.iterdir()) == ["my_model.keras"]


def test_regression_the_users_own_fit_and_profile_files_are_never_removed(tmp_path):
    # hetero-cs run removed every fit_*.json, fit_*.npz and profiles.json in --backup-dir after a success.
    backups = tmp_path / "ckpts"
    (backups / "hetero_cs").mkdir(parents=True)
    mine = ["fit_1.json", "fit_best.npz", "profiles.json", "hetero_cs/fit_9.json"]
    for name in mine:
        (backups / name).write_text("the user's")
    command = script(tmp_path, write_backup("'fit_0.json', 'profiles.json'"))
    assert Supervisor(command, backup_dir=backups, output=io.StringIO()).run() == 0
    assert sorted(str(p.relative_to(backups)) for p in backups.rglob("*") if p.is_file()) == sorted(mine)


def test_a_backup_dir_that_cannot_be_written_is_refused_naming_it(tmp_path, monkeypatch):
    import errno

    from hetero_cs.engine.faults import supervised_run as backup_files

    def read_only(path, write):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(backup_files, "write_atomically", read_only)
    supervisor = Supervisor([sys.executable, "-c", "pass"], backup_dir=tmp_path / "ro", output=io.StringIO())
    with pytest.raises(ConfigError, match=r"--backup-dir .*ro' cannot be written \(OSError: .*Read-only.*Give a "
                                          r"writable directory"):
        supervisor.run()


def test_an_unusable_cache_directory_is_a_config_error_that_names_backup_dir(monkeypatch):
    from hetero_cs import supervisor as module

    def no_cache(command):
        raise PermissionError("cannot create /nope")

    monkeypatch.setattr(module, "default_backup_dir", no_cache)
    with pytest.raises(ConfigError, match="Give one with --backup-dir DIR"):
        Supervisor([sys.executable, "-c", "pass"])


def test_the_supervisors_sticky_text_is_the_error_readers_sticky_forms_and_the_programs_sticky_codes():
    from hetero_cs.devices.fault_texts import DEVICE_FAULT_FORMS, STICKY_FORMS, STICKY_TEXT

    card = {"ecc": "CUDA_ERROR_ECC_UNCORRECTABLE", "illegal address": "cudaErrorIllegalAddress",
            "launch failure": "unspecified launch failure", "hardware stack": "CUDA_ERROR_HARDWARE_STACK_ERROR",
            "lost": "the GPU has fallen off the bus", "sync": "GPU sync failed"}
    assert set(card) == STICKY_FORMS
    for name, line in card.items():  # a sticky card fault to the error reader is one to the supervisor too
        assert next(form for form, pattern in DEVICE_FAULT_FORMS if pattern.search(line)) == name
        assert STICKY_TEXT.search(line), line
    for line in ("device-side assert triggered", "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_MISALIGNED_ADDRESS"):
        assert STICKY_TEXT.search(line), line  # the program's, sticky too: NVML tells whose
    for line in ("CUBLAS_STATUS_EXECUTION_FAILED", "OOM when allocating tensor", "ValueError: bad input"):
        assert not STICKY_TEXT.search(line), line
