"""``hetero-cs run [--max-restarts N] [--backup-dir DIR] -- CMD``: restart a training script without a lost card.

A card that is lost (an uncorrectable ECC error, a card off the bus) takes the process that drove it down with it:
CUDA's errors are sticky, and TensorFlow aborts. Nothing inside that process survives it, so the supervisor stands
outside: it runs the script, and when the script fails because a card was lost it starts it again without that card.

* **A lost card is a fact about the card.** When the script fails (any non-zero status but a signal from outside:
  SIGKILL, SIGTERM, SIGINT, SIGHUP), a GPU counts as lost only on NVML's evidence, gathered while the script ran
  (:class:`hetero_cs.devices.gpu_health.CardWatch`): NVML reports it lost, its uncorrected ECC count grew, or a
  hardware Xid named it. A line of text (``CUDA_ERROR_ILLEGAL_ADDRESS ... /device:GPU:0``) proves nothing: illegal
  and misaligned addresses, illegal instructions and device-side asserts are the program's, so a failure with
  every card healthy is passed on (with ``--retry-transient``, a sticky CUDA error on healthy cards restarts the
  script once with the same cards). An emulated card's line (``hetero_cs emulation: lost replica=<i> (<name>)``,
  :class:`hetero_cs.emulation.Drift` with ``lost=True``) among the last 200 lines is that card's loss.
* **GPUs by UUID.** The GPUs the script may use are read once (CUDA's order, joined with NVML on UUID or PCI bus id,
  never by index); the script gets them in ``CUDA_VISIBLE_DEVICES`` as UUIDs, in the same order, and a restart gets
  the list without the lost cards. ``HETERO_CS_EXCLUDED_DEVICES`` holds the positions of the lost cards in the first
  list (the strategy leaves them out of ``emulate=``, ``compute_devices`` and ``batch_split`` given for every card);
  ``HETERO_CS_RESTART`` the restarts so far (0 at first).
* **Never the last GPU silently.** When no GPU would be left, the run stops with a line naming the cards lost;
  ``--allow-cpu`` restarts it on the CPU instead (``CUDA_VISIBLE_DEVICES=""``).
* **Resumed, not replayed.** The script's ``model.fit`` backs itself up in ``DIR/hetero_cs``
  (:mod:`hetero_cs.engine.faults.backup`) and resumes at the exact step of its last backup.
* **Signals.** SIGINT, SIGTERM and SIGHUP are passed on to the script (its process group); one that has not ended
  ``--grace-s`` seconds later is killed. The script dies with the supervisor (a parent-death signal on Linux).
* **Exit status.** 0 when the script succeeds: the files the library wrote are then removed (its manifest lists
  them; nothing else is touched). A failure that is not a lost card passes the script's status on (128 + N for
  signal N); a stop by signal N exits 128 + N and keeps the backups. Bad arguments, or a --backup-dir that cannot be
  written: 2.

``hetero-cs launch`` (:mod:`hetero_cs.launch`) runs its workers with this module's helpers too: the checks of the
command and the options, starting a child in its own process group, reading its lines, signalling its group and
handing stop signals over. This module imports neither TensorFlow nor pynvml at import time.
"""

import collections
import contextlib
import hashlib
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from hetero_cs.devices.fault_texts import STICKY_TEXT
from hetero_cs.devices.gpu_health import CardWatch, visible_gpus
from hetero_cs.engine.faults.supervised_run import (
    BACKUP_DIR_ENV_VAR, EXCLUDED_ENV_VAR, MANIFEST, OWNED_DIR, RESTART_ENV_VAR, register, remove_written, written)
from hetero_cs.errors import ConfigError

DEFAULT_MAX_RESTARTS = 3
DEFAULT_GRACE_S = 10.0
MAX_GRACE_S = 3600.0
"""Longest wait from the first stop signal to SIGKILL, seconds."""
MAX_RESTARTS = 1000
_MAX_LINE_BYTES = 1 << 16
_RECENT_LINES = 200  # a lost card's line is among the script's last lines on standard error
_OUTSIDE = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # deaths that come from outside

_EMULATED_LOST = re.compile(r"hetero_cs emulation: lost replica=(\d+) \(([^)]*)\)")


# An emulated card the script died of: its ``index`` in ``emulate=`` order as the script saw it, its catalog ``name``
# and the ``line`` that named it.
LostCard = collections.namedtuple("LostCard", "index name line")


def lost_card_in(line: str) -> LostCard | None:
    """The emulated lost card a line of the script's standard error names, or None."""
    match = _EMULATED_LOST.search(line)
    return LostCard(int(match.group(1)), match.group(2), line.strip()) if match else None


def nth_remaining(index: int, excluded: Sequence[int]) -> int:
    """The original position of the ``index``-th card left after ``excluded`` (original positions) were taken out.

    >>> nth_remaining(1, [1])   # cards 0, 2, 3 are left: the script's card 1 is card 2
    2
    """
    return [p for p in range(index + len(excluded) + 1) if p not in excluded][index]


def default_backup_dir(command: Sequence[str]) -> pathlib.Path:
    """``<cache dir>/backups/<hash of the working directory and the command>``: the same script, run again from the
    same place, finds its backups."""
    from calibration.store import default_cache_dir

    digest = hashlib.sha256("\0".join([os.getcwd(), *command]).encode()).hexdigest()[:16]
    return default_cache_dir() / "backups" / digest


def die_with_parent() -> None:
    """In a child, before exec: SIGKILL it when its parent dies, even by SIGKILL (Linux prctl PR_SET_PDEATHSIG);
    elsewhere nothing (the parent's signal handlers still stop it)."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def checked_command(command, verb: str) -> list[str]:
    """``command`` (argv; a leading ``--`` dropped) as a list, checked: ``hetero-cs run`` and ``launch`` share it.

    Raises:
        ConfigError: Not a list of str, empty, or its program is not an executable file (on PATH or as a path).
    """
    if isinstance(command, (str, bytes)) or not all(isinstance(part, str) for part in (command or ())):
        raise ConfigError(f"The command must be a list of str (argv), e.g. ['python', 'train.py']. Received: "
                          f"{command!r}.")
    command = list(command[1:] if command[:1] == ["--"] else command)
    if not command:
        raise ConfigError(f"hetero-cs {verb} needs a command after `--`, e.g. hetero-cs {verb} -- python train.py.")
    if not command[0] or shutil.which(command[0]) is None:
        what = ("not executable (chmod +x it, or run it through its interpreter)"
                if os.path.isfile(command[0]) else "no such executable file (on PATH or as a path)")
        raise ConfigError(f"cannot run {command[0]!r}: {what}. Received the command {command!r}.")
    return command


def checked_int(value, option: str, low: int, high: int, meaning: str) -> int:
    """``value`` if it is an int in ``[low, high]``, else a ConfigError naming ``option`` and its ``meaning``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{option} must be an int in [{low}, {high}] ({meaning}). Received: {value!r}.")
    return value


def checked_grace_s(grace_s) -> float:
    """``grace_s`` (seconds from a stop signal to SIGKILL) as a float in (0, MAX_GRACE_S], else a ConfigError."""
    if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or not 0 < grace_s <= MAX_GRACE_S:
        raise ConfigError(f"--grace-s: grace_s must be a number of seconds in (0, {MAX_GRACE_S:g}]. Received: "
                          f"grace_s={grace_s!r}.")
    return float(grace_s)


def start_child(command: list[str], env: dict[str, str], **pipes) -> subprocess.Popen:
    """Starts ``command`` in a process group of its own, without standard input, dying with this process.

    Raises:
        ConfigError: The command cannot run (e.g. a script without a ``#!`` line, or whose ``#!`` names a missing
            interpreter).
    """
    try:
        return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=die_with_parent, **pipes)
    except OSError as exc:
        raise ConfigError(f"cannot run {command[0]!r}: {exc.strerror or exc} (errno {exc.errno}). A script needs a "
                          f"first line #!/path/to/interpreter naming an interpreter that exists, or run it through "
                          f"one (-- python script.py). Received the command {command!r}.") from None


def lines_of(stream):
    """The lines a child writes to ``stream``, decoded, until it closes; a line longer than 64 KiB comes in pieces,
    so one endless line cannot fill this process's memory. Drained to the end: the child never blocks on a full pipe.
    """
    for raw in iter(lambda: stream.readline(_MAX_LINE_BYTES), b""):
        yield raw.decode(errors="replace")
    stream.close()


def signal_group(process: subprocess.Popen, sig: int) -> None:
    """Sends ``sig`` to ``process``'s group (it leads one: :func:`start_child`), with what it left behind there."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def exit_status(code: int) -> int:
    """A child's return code as a shell reports it: 128 + N for a child killed by signal N."""
    return 128 - code if code < 0 else code


@contextlib.contextmanager
def stop_signals_to(handler):
    """Within: SIGINT, SIGTERM and SIGHUP call ``handler`` (only the main thread can set handlers); then the
    previous handlers again."""
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP) if main}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def silence(stream) -> None:
    """Points a closed output's file descriptor (e.g. ``| head``) at /dev/null, so that the interpreter's last flush
    at exit does not fail too (the recipe of Python's `signal` docs, "Note on SIGPIPE")."""
    try:
        fd = stream.fileno()
    except (AttributeError, ValueError, OSError):
        return  # not backed by a file descriptor: nothing is flushed to it at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


class Supervisor:
    """Runs ``command``, restarting it without a lost card, at most ``max_restarts`` times.

    Args:
        command: argv of the training script, non-empty.
        max_restarts: Restarts after a lost card, an int in [0, MAX_RESTARTS].
        backup_dir: The script's backups go to its ``hetero_cs`` subdirectory; None: :func:`default_backup_dir`.
        output: Where the supervisor's own lines go (default: standard error).
        allow_cpu: When the last GPU is lost, restart on the CPU instead of stopping.
        retry_transient: After a sticky CUDA error with every card healthy, restart once with the same cards.
        grace_s: Seconds from a stop signal passed on to SIGKILL, > 0.

    Raises:
        ConfigError: An empty command, a command that cannot run, max_restarts out of range, or a backup
            directory that cannot be written.
    """

    def __init__(self, command: Sequence[str], *, max_restarts: int = DEFAULT_MAX_RESTARTS,
                 backup_dir: str | os.PathLike | None = None, output: TextIO | None = None, allow_cpu: bool = False,
                 retry_transient: bool = False, grace_s: float = DEFAULT_GRACE_S) -> None:
        self._command = checked_command(command, "run")
        self._max_restarts = checked_int(max_restarts, "--max-restarts", 0, MAX_RESTARTS, "restarts after a lost card")
        self._allow_cpu, self._retry_transient = bool(allow_cpu), bool(retry_transient)
        self._grace_s = checked_grace_s(grace_s)
        if backup_dir is not None and not str(backup_dir).strip():
            raise ConfigError("--backup-dir is empty; give a directory for fit's backups (created if missing), or "
                              "leave it out for the default under the cache directory.")
        try:
            self.backup_dir = pathlib.Path(backup_dir) if backup_dir is not None else default_backup_dir(self._command)
        except Exception as exc:  # noqa: BLE001 - the cache directory cannot be used (ProfileCacheError, OSError)
            raise ConfigError(f"no directory for fit's backups: the default one, under the cache directory, cannot "
                              f"be used ({exc}). Give one with --backup-dir DIR (a writable directory), or set "
                              f"HETERO_CS_CACHE_DIR to a writable directory.") from exc
        if self.backup_dir.exists() and not self.backup_dir.is_dir():
            raise ConfigError(f"--backup-dir {str(self.backup_dir)!r} exists and is not a directory; give a "
                              f"directory (it is created if missing).")
        self._created_dir = not self.backup_dir.exists()
        self.owned_dir = self.backup_dir / OWNED_DIR
        self._output = output or sys.stderr
        self._gpus = visible_gpus()  # the script's first GPU list, in CUDA's order
        self.excluded: list[int] = []  # positions in the script's first device list (emulate=, or the GPUs)
        self.lost_names: list[str] = []  # as the supervisor's lines name them
        self.restarts = 0
        self._retried = self._on_cpu = False  # restarted after a sticky error with healthy cards; on the CPU now
        self._tail: collections.deque = collections.deque(maxlen=_RECENT_LINES)
        self._child: subprocess.Popen | None = None
        self._stop_signal, self._stop_deadline = None, float("inf")  # a stop signal passed on; when its grace ends

    def _note(self, message: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._output.write(f"[hetero-cs run] {message}\n")
            self._output.flush()

    def _remaining_gpus(self) -> list:
        return [gpu for i, gpu in enumerate(self._gpus) if i not in self.excluded]

    def _environment(self) -> dict[str, str]:
        env = {**os.environ, RESTART_ENV_VAR: str(self.restarts), BACKUP_DIR_ENV_VAR: str(self.owned_dir),
               "PYTHONUNBUFFERED": "1"}
        if self.excluded:
            env[EXCLUDED_ENV_VAR] = ",".join(str(i) for i in sorted(self.excluded))
        if self._gpus:
            env["CUDA_VISIBLE_DEVICES"] = "" if self._on_cpu else ",".join(g.uuid for g in self._remaining_gpus())
        return env

    def _pump(self, stream) -> None:
        """Passes the script's standard error on, keeping its last lines."""
        for line in lines_of(stream):
            self._tail.append(line)
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(line)
                sys.stderr.flush()

    def _on_signal(self, signum, _frame) -> None:
        self._stop_signal = signum
        self._stop_deadline = min(self._stop_deadline, time.monotonic() + self._grace_s)
        if self._child is not None and self._child.poll() is None:
            signal_group(self._child, signum)

    def _run_once(self) -> int:
        self._tail.clear()
        self._child = child = start_child(self._command, self._environment(), stderr=subprocess.PIPE)
        pump = threading.Thread(target=self._pump, args=(child.stderr,), daemon=True)
        pump.start()
        while (code := child.poll()) is None:
            time.sleep(0.05)
            if time.monotonic() > self._stop_deadline:  # a stop signal passed on was not obeyed in time
                self._note(f"the script did not stop within {self._grace_s:g} s of signal {self._stop_signal}: "
                           f"killing it (SIGKILL)")
                signal_group(child, signal.SIGKILL)
                self._stop_deadline = float("inf")
        signal_group(child, signal.SIGKILL)  # what the script left behind there: its pipe would keep the pump waiting
        pump.join(timeout=10.0)
        return exit_status(code)

    def _decide(self, status: int, watch) -> str | None:
        """After a failure: why and how the script is restarted, in words, or None to pass the status on."""
        lines = list(self._tail)
        if (card := next((c for c in map(lost_card_in, reversed(lines)) if c is not None), None)) is not None:
            position = nth_remaining(card.index, self.excluded)
            self.excluded.append(position)
            what = f"the emulated {card.name} at position {position} of emulate="
            self.lost_names.append(what)
            return f"it lost {what} (its line: {card.line[:200]}). Restarting it without that card"
        if found := watch.lost(lines):  # (Gpu, evidence) pairs: those GPUs are left out of the next run
            for gpu, why in found:
                self.excluded.append(self._gpus.index(gpu))
                self.lost_names.append(f"{gpu} ({why})")
            if not self._remaining_gpus():
                lost = "; ".join(self.lost_names)
                if not self._allow_cpu:
                    self._note(f"the script lost its last GPU: {lost}. No GPU is left, so it is not restarted (it "
                               f"would train on the CPU). Replace the card, or run with --allow-cpu to go on on the "
                               f"CPU. Status {status}. Backups kept in {self.owned_dir}")
                    return None
                self._on_cpu = True
                self._note(f"no GPU is left ({lost}); --allow-cpu: restarting on the CPU (CUDA_VISIBLE_DEVICES='')")
            return "it lost {}. Restarting it without {}".format(
                "; ".join(f"{gpu} ({why})" for gpu, why in found), "any GPU" if self._on_cpu else "that card")
        if (sticky := next((line.strip() for line in reversed(lines) if STICKY_TEXT.search(line)), None)) is None:
            self._note(f"the script exited with status {status} and no card was lost: not restarting (a failure of "
                       f"the script itself is passed on)")
            return None
        health = "; ".join(f"{gpu}: {watch.health(gpu)}" for gpu in self._remaining_gpus()) or (
            "which GPUs the script sees is not known (no CUDA driver or NVML here)")
        if self._retry_transient and not self._retried:
            self._retried = True
            return (f"it died of a sticky CUDA error ({sticky[:200]}) with no card lost ({health}). --retry-transient: "
                    f"restarting it once with the same cards")
        self._note(f"the script died of a sticky CUDA error ({sticky[:200]}), but no card is lost: {health}. An "
                   f"illegal or misaligned address, an illegal instruction or a device-side assert is the program's "
                   f"error: passed on with status {status}, not restarted (--retry-transient restarts once with the "
                   f"same cards)")
        return None

    def run(self) -> int:
        """Runs the script until it succeeds, fails for another reason, or runs out of restarts; returns the exit
        status (see the module docstring)."""
        try:  # the library's subdirectory and its manifest: a ConfigError naming --backup-dir when they cannot be made
            register(self.owned_dir, ["profiles.json", "profiles.meta.json"])
        except OSError as exc:
            raise ConfigError(
                f"--backup-dir {str(self.backup_dir)!r} cannot be written ({type(exc).__name__}: {exc}). Give a "
                f"writable directory with room for a copy of the model and its optimizer (--backup-dir DIR).") from exc
        with stop_signals_to(self._on_signal):
            if any(name.startswith("fit_") for name in written(self.owned_dir)) and any(
                    self.owned_dir.glob("fit_*.json")):
                self._note(f"resuming from the backups in {self.owned_dir} (remove that directory to start over)")
            while True:
                started = time.monotonic()
                with CardWatch([] if self._on_cpu else self._remaining_gpus()) as watch:
                    status = self._run_once()
                    if status == 0 and self._stop_signal is None:
                        remove_written(self.owned_dir)
                        if self._created_dir:
                            with contextlib.suppress(OSError):
                                self.backup_dir.rmdir()  # only when empty
                        if self.lost_names:
                            self._note(f"the script succeeded after {self.restarts} restart(s), without "
                                       f"{'; '.join(self.lost_names)}")
                        return 0
                    if self._stop_signal is not None:
                        self._note(f"stopped by signal {self._stop_signal}; not restarting (backups kept in "
                                   f"{self.owned_dir}, {MANIFEST} lists them)")
                        return 128 + int(self._stop_signal)
                    if status > 128 and status - 128 in _OUTSIDE:
                        self._note(f"the script was killed by signal {status - 128}, from outside: not restarting")
                        return status
                    what = self._decide(status, watch)
                if what is None:
                    return status
                if self.restarts >= self._max_restarts:
                    self._note(f"the script failed after {self.restarts} restart(s), the most --max-restarts="
                               f"{self._max_restarts} allows: giving up with its status {status}. Cards lost: "
                               f"{'; '.join(self.lost_names) or 'none'}. Backups kept in {self.owned_dir}")
                    return status
                self.restarts += 1
                self._note(f"the script failed after {time.monotonic() - started:.1f} s: {what} (restart "
                           f"{self.restarts} of at most {self._max_restarts}); fit resumes from its last backup")


def add_run_arguments(parser) -> None:
    """The ``hetero-cs run`` options."""
    parser.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS,
                        help=f"restarts after a lost card before giving up (default {DEFAULT_MAX_RESTARTS})")
    parser.add_argument("--backup-dir", default=None, help="fit's backups go to its hetero_cs subdirectory (default: "
                        "under the cache directory, one per working directory and command)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="when the last GPU is lost, restart on the CPU instead of stopping")
    parser.add_argument("--retry-transient", action="store_true",
                        help="after a sticky CUDA error with every card healthy, restart once with the same cards")
    parser.add_argument("--grace-s", type=float, default=DEFAULT_GRACE_S, help=f"seconds from a stop signal passed "
                        f"on to the script to SIGKILL (default {DEFAULT_GRACE_S:g})")
    parser.add_argument("command", nargs="+", help="the training script's command, after `--`")


def run_supervised(args) -> int:
    """``hetero-cs run`` from parsed arguments; returns the exit status."""
    return Supervisor(args.command, max_restarts=args.max_restarts, backup_dir=args.backup_dir,
                      allow_cpu=args.allow_cpu, retry_transient=args.retry_transient, grace_s=args.grace_s).run()
