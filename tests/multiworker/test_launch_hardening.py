"""hetero-cs launch leaves nothing running and fails clearly: bad commands, SIGHUP, a closed output, children."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _launch(*args: str) -> list[str]:
    return [sys.executable, "-m", "hetero_cs.cli", "launch", *args]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie waiting for its parent counts as gone
        return stat.read().split()[2] != "Z"


def _pids(folder: Path, count: int, timeout_s: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        files = sorted(folder.glob("pid*"))
        if len(files) == count and all(f.read_text().strip() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.1)
    raise AssertionError(f"workers did not start: {list(folder.iterdir())}")


def test_a_command_that_does_not_exist_is_a_one_line_error():
    done = subprocess.run(_launch("--workers", "2", "--", "no_such_command_hcs"), env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert "cannot run 'no_such_command_hcs'" in done.stderr and "Traceback" not in done.stderr


def test_children_left_by_workers_that_exited_cleanly_are_stopped(tmp_path):
    # Each worker exits at once, leaving a child that holds its output pipe: the launcher must neither wait the
    # 300 s grace for that pipe (the 100 s timeout would fail the test) nor leave the children running.
    script = ("import os, subprocess, sys\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
              "open(os.path.join(sys.argv[1], f'pid{os.getpid()}'), 'w').write(str(child.pid))\n")
    done = subprocess.run(_launch("--workers", "2", "--grace-s", "300", "--", sys.executable, "-c", script,
                                  str(tmp_path)), env=_env(), capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    children = _pids(tmp_path, 2)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in children)


def test_a_hangup_stops_every_worker(tmp_path):
    script = ("import os, sys, time\n"
              "open(os.path.join(sys.argv[1], f'pid{os.getpid()}'), 'w').write(str(os.getpid()))\n"
              "time.sleep(600)\n")
    launcher = subprocess.Popen(_launch("--workers", "2", "--grace-s", "2", "--", sys.executable, "-c", script,
                                        str(tmp_path)), env=_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    workers = _pids(tmp_path, 2)
    launcher.send_signal(signal.SIGHUP)  # the terminal closed, or the ssh session dropped
    assert launcher.wait(timeout=60) == 128 + signal.SIGHUP
    assert not any(_alive(pid) for pid in workers)


def test_workers_do_not_outlive_a_launcher_killed_outright(tmp_path):
    script = ("import os, sys, time\n"
              "open(os.path.join(sys.argv[1], f'pid{os.getpid()}'), 'w').write(str(os.getpid()))\n"
              "time.sleep(600)\n")
    launcher = subprocess.Popen(_launch("--workers", "2", "--", sys.executable, "-c", script, str(tmp_path)),
                                env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers = _pids(tmp_path, 2)
    launcher.kill()  # SIGKILL: no handler runs; the workers' parent-death signal stops them
    launcher.wait(timeout=60)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers)


def test_a_closed_output_does_not_hang_the_launch(tmp_path):
    script = "for i in range(200000): print(i)\n"
    with open(tmp_path / "stderr", "wb") as stderr:
        launcher = subprocess.Popen(_launch("--workers", "2", "--", sys.executable, "-c", script), env=_env(),
                                    stdout=subprocess.PIPE, stderr=stderr)
        launcher.stdout.readline()
        launcher.stdout.close()  # like `| head -1`
        status = launcher.wait(timeout=120)
    # The workers' output is drained to the end and they finish; the launcher's own exit does not fail on the
    # closed output either (Python exits with 120 when its last flush of stdout fails).
    assert status == 0, (tmp_path / "stderr").read_text()[-4000:]


def test_a_closed_output_is_pointed_at_devnull_so_the_exit_flush_cannot_fail():
    from hetero_cs.launch import Launch

    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody reads: every write to the pipe fails with EPIPE
    with os.fdopen(write_end, "w") as output:
        launch = Launch([sys.executable, "-c", "print('a line the closed output cannot take')"], num_workers=1,
                        output=output)
        assert launch.run() == 0
        output.write("text left in the buffer at exit\n")
        output.flush()  # would raise BrokenPipeError had the launcher left the closed pipe in place


def test_a_file_that_cannot_be_executed_is_a_one_line_error(tmp_path):
    script = tmp_path / "no_shebang.sh"
    script.write_text("echo hi\n")
    script.chmod(0o755)  # executable, but no #! line: exec fails with "Exec format error"
    done = subprocess.run(_launch("--workers", "2", "--", str(script)), env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "cannot run" in done.stderr and "#!" in done.stderr and "Traceback" not in done.stderr, done.stderr
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    done = subprocess.run(_launch("--workers", "1", "--", str(plain)), env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "not executable (chmod +x it" in done.stderr, done.stderr


def test_text_the_output_encoding_cannot_show_is_replaced_not_a_reason_to_go_silent():
    script = "import sys; sys.stdout.buffer.write('bar \\u2501\\u2501 done\\n'.encode()); sys.exit(3)"
    done = subprocess.run(_launch("--workers", "1", "--", sys.executable, "-c", script),
                          env={**_env(), "PYTHONIOENCODING": "ascii"}, capture_output=True, timeout=120)
    assert done.returncode == 3
    out = done.stdout.decode("ascii")
    assert "[worker 0] bar ?? done" in out and "[launch] worker 0 exited with status 3" in out, out


def test_a_launcher_without_stdout_still_drains_the_workers(tmp_path):
    script = "for i in range(100000): print(i)"
    launch = " ".join(f"'{part}'" for part in _launch("--workers", "2", "--", sys.executable, "-c", script))
    done = subprocess.run(["bash", "-c", f"exec >&-; {launch}"], env=_env(), capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_an_endless_line_is_printed_in_pieces():
    script = "import sys; sys.stdout.write('x' * 1_000_000); sys.stdout.flush()"  # no newline at all
    done = subprocess.run(_launch("--workers", "1", "--", sys.executable, "-c", script), env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    pieces = [line for line in done.stdout.splitlines() if line.startswith("[worker 0] ")]
    assert len(pieces) >= 15 and sum(len(p) - len("[worker 0] ") for p in pieces) == 1_000_000


def test_launch_arguments_are_checked_with_clear_errors():
    import pytest

    from hetero_cs.errors import ConfigError
    from hetero_cs.launch import Launch, parse_emulate

    with pytest.raises(ConfigError, match=r"empty name in 'A10,,'"):
        parse_emulate("A10,,", 3)
    with pytest.raises(ConfigError, match=r"\(1 entry\) for --workers 2"):
        parse_emulate("A10", 2)
    with pytest.raises(ConfigError, match=r"empty name in 'A10\+,T4\+P100'"):
        parse_emulate("A10+,T4+P100", 2)
    for bad in (dict(command="python train.py"), dict(command=["true", 3])):
        with pytest.raises(ConfigError, match="must be a list of str"):
            Launch(bad["command"], num_workers=1)
    with pytest.raises(ConfigError, match="--workers must be an int"):
        Launch(["true"], num_workers=True)
    with pytest.raises(ConfigError, match="grace_s must be"):
        Launch(["true"], num_workers=1, grace_s=True)
    with pytest.raises(ConfigError, match="list of catalog names"):
        Launch(["true"], num_workers=3, emulate="A10")
    from hetero_cs.errors import UnknownEmulatedDeviceError

    with pytest.raises(UnknownEmulatedDeviceError):
        Launch(["true"], num_workers=2, emulate=["XYZ", "T4"])
    done = subprocess.run(_launch("--workers", "0", "--emulate", "A10", "--", "true"), env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--workers must be an int" in done.stderr, done.stderr


FAKE_WORKER = """
import json, os, signal, sys
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
restart = int(os.environ["HETERO_CS_RESTART"])
workers = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
print(f"worker {index} of {workers}, restart {restart}, emulate {os.environ.get('HETERO_CS_EMULATE')}, caps "
      f"{os.environ.get('HETERO_CS_MAX_BATCH_SIZES')}", flush=True)
if restart == 0 and index == 1:
    {failure}
if restart == 1 and index == 0:
    {second_failure}
if restart == 0 and index == 0:
    {first_failure}
"""



def _out_of_memory(worker: int, caps: str) -> str:
    """What a worker whose replica ran out of memory in fit prints last (hetero_cs.engine.multi_worker.oom),
    shortened, then its exit."""
    return (f"print('hetero_cs.errors.StepOOMError: model.fit ran out of memory on worker {worker}, replica {worker} "
            f"(...), with 8 examples at once, its slice of a global batch of 16 (...). ... (relaunch with "
            f"HETERO_CS_MAX_BATCH_SIZES={caps}); ...', flush=True); sys.exit(1)")


OUT_OF_MEMORY = _out_of_memory(1, "none,4")


def _relaunch_run(tmp_path, failure: str, *extra: str, second_failure: str = "pass", max_restarts: int = 1,
                  workers: int = 2, emulate: str = "A10,T4", first_failure: str = "pass", **env):
    script = tmp_path / "fake.py"
    script.write_text(FAKE_WORKER.replace("{failure}", failure).replace("{second_failure}", second_failure)
                      .replace("{first_failure}", first_failure))
    return subprocess.run(_launch("--workers", str(workers), "--emulate", emulate, "--max-restarts",
                                  str(max_restarts), *extra, "--", sys.executable, str(script)),
                          env={**_env(), **env}, capture_output=True, text=True, timeout=120)


def test_launch_relaunches_every_worker_after_a_transient_death():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        done = _relaunch_run(Path(tmp), "os.kill(os.getpid(), signal.SIGKILL)")
    assert done.returncode == 0, done.stdout[-2000:]
    assert "worker 1 was killed by signal 9 (a transient death): relaunching 2 worker(s) with every worker" in \
        done.stdout
    assert "worker 1 of 2, restart 1, emulate A10,T4" in done.stdout


def test_launch_relaunches_without_a_worker_that_lost_its_card():
    import tempfile

    lost = ("sys.stderr.write('hetero_cs emulation: lost replica=1 (T4) at its step 3: CUDA_ERROR_ECC_UNCORRECTABLE"
            "\\\\n'); sys.stderr.flush(); os.abort()")
    with tempfile.TemporaryDirectory() as tmp:
        done = _relaunch_run(Path(tmp), lost)
    assert done.returncode == 0, done.stdout[-2000:]
    assert "worker 1's card failed: relaunching 1 worker(s) without worker 1 (emulating T4)" in done.stdout
    assert "worker 0 of 1, restart 1, emulate A10" in done.stdout


def test_launch_does_not_relaunch_a_scripts_own_failure():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        done = _relaunch_run(Path(tmp), "sys.exit(5)")
    assert done.returncode == 5
    assert "worker 1 failed with status 5 and no card of it failed: not relaunching" in done.stdout
    assert "restart 1" not in done.stdout


def test_launch_relaunches_every_worker_with_a_lower_cap_after_a_replica_ran_out_of_memory():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        done = _relaunch_run(Path(tmp), OUT_OF_MEMORY)
    assert done.returncode == 0, done.stdout[-2000:]
    assert ("a replica of worker 1 ran out of memory: relaunching 2 worker(s) with HETERO_CS_MAX_BATCH_SIZES=none,4 "
            "(relaunch 1 of at most 1") in done.stdout
    for index in (0, 1):
        assert f"worker {index} of 2, restart 1, emulate A10,T4, caps none,4" in done.stdout


def test_a_relaunch_without_a_failed_card_keeps_the_lowered_caps_of_the_workers_left():
    import tempfile

    lost = ("sys.stderr.write('hetero_cs emulation: lost replica=0 (A10) at its step 3: CUDA_ERROR_ECC_UNCORRECTABLE"
            "\\n'); sys.stderr.flush(); os.abort()")
    with tempfile.TemporaryDirectory() as tmp:
        done = _relaunch_run(Path(tmp), OUT_OF_MEMORY, second_failure=lost, max_restarts=2)
    assert done.returncode == 0, done.stdout[-2000:]
    assert "worker 0's card failed: relaunching 1 worker(s) without worker 0 (emulating A10)" in done.stdout
    assert "worker 0 of 1, restart 2, emulate T4, caps 4" in done.stdout


def test_replicas_of_two_workers_out_of_memory_in_one_step_lower_both_caps_in_one_relaunch():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        done = _relaunch_run(Path(tmp), _out_of_memory(1, "none,4"), first_failure=_out_of_memory(0, "4,none"))
    assert done.returncode == 0, done.stdout[-2000:]
    assert ("replicas of workers 0, 1 ran out of memory: relaunching 2 worker(s) with HETERO_CS_MAX_BATCH_SIZES=4,4"
            in done.stdout), done.stdout[-2000:]


@pytest.mark.parametrize("failure, env, note", [
    # A script of its own that prints the words and fails: not the library's error, so no relaunch.
    ("print('my log: relaunch with HETERO_CS_MAX_BATCH_SIZES=none,4', flush=True); sys.exit(1)", {},
     "worker 1 failed with status 1 and no card of it failed: not relaunching"),
    # The caps named are those in force already: a relaunch would run out of memory the same way.
    (OUT_OF_MEMORY, {"HETERO_CS_MAX_BATCH_SIZES": "none,4"},
     "a replica of worker 1 ran out of memory, but the caps it names (HETERO_CS_MAX_BATCH_SIZES=none,4) are those in "
     "force: not relaunching"),
    # No card would hold one example.
    (_out_of_memory(1, "0,0"), {},
     "with HETERO_CS_MAX_BATCH_SIZES=0,0 no card would hold one example: not relaunching"),
])
def test_launch_does_not_relaunch_where_lower_caps_cannot_help(failure, env, note):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        done = _relaunch_run(Path(tmp), failure, max_restarts=3, **env)
    assert done.returncode == 1, done.stdout[-2000:]
    assert note in done.stdout, done.stdout[-2000:]
    assert "restart 1" not in done.stdout


def test_caps_set_by_hand_are_trimmed_to_the_workers_left_after_a_failed_card():
    import tempfile

    lost = ("sys.stderr.write('hetero_cs emulation: lost replica=1 (T4) at its step 3: CUDA_ERROR_ECC_UNCORRECTABLE"
            "\\n'); sys.stderr.flush(); os.abort()")
    with tempfile.TemporaryDirectory() as tmp:
        done = _relaunch_run(Path(tmp), lost, workers=3, emulate="A10,T4,P100",
                             HETERO_CS_MAX_BATCH_SIZES="none,4,2")
    assert done.returncode == 0, done.stdout[-2000:]
    assert "worker 1 of 2, restart 1, emulate A10,P100, caps none,2" in done.stdout, done.stdout[-2000:]
