"""``hetero-cs run [--max-restarts N] [--backup-dir DIR] -- CMD``: restart a training script without a lost card.

A card that is lost (an uncorrectable ECC error, a card off the bus) takes the process that drove it down with it:
CUDA's errors are sticky, and TensorFlow aborts. Nothing inside that process survives it, so the supervisor stands
outside: it runs the script, and when the script dies of a lost card it starts it again without that card.

* **Which card.** The script's standard error passes through the supervisor (and on to its own). When the script
  dies of a fatal signal (SIGABRT after a sticky CUDA error, SIGSEGV, ...; not SIGKILL, SIGTERM, SIGINT or SIGHUP,
  which come from outside), the supervisor looks among its last 200 lines for a lost card: an emulated card's
  line (``hetero_cs emulation: lost replica=<i> (<name>) ...``; see :class:`hetero_cs.emulation.Drift`),
  or a sticky CUDA error on a line that names a GPU (``/device:GPU:<i>``,
  ``GPU_<i>_bfc``, ``device ordinal <i>``). On real GPUs, NVML is asked too (when ``nvidia-ml-py`` is installed):
  a GPU that NVML reports lost, or whose count of uncorrected ECC errors grew while the script ran.
* **Without it.** The restarted script gets ``HETERO_CS_EXCLUDED_DEVICES``, the positions of the cards lost in its
  first device list (e.g. ``"1"``), and on GPUs ``CUDA_VISIBLE_DEVICES`` without them. On emulated devices the
  strategy leaves those cards out of ``emulate=`` (and of ``compute_devices`` and ``batch_split`` given for every
  card); on GPUs it leaves their shares out of a ``batch_split`` given for every first GPU. It plans from the
  profiles calibrated before the restart (kept with the backups), without calibrating again.
  ``HETERO_CS_RESTART`` holds the number of restarts so far (0 at first).
* **Resumed, not replayed.** Under the supervisor (``HETERO_CS_BACKUP_DIR`` is set) ``model.fit`` backs training
  up by itself (:mod:`hetero_cs.engine.backup`): the model, the optimizer, the metrics, the epoch and the step,
  often enough to redo little and rarely enough to cost under 1 % of training time. The restarted ``fit`` resumes at
  the exact step of the last backup and skips the batches already applied (none is applied twice).
* **Exit status.** 0 when the script succeeds (its backup files are then removed, and the directory if that leaves
  it empty; other files in it are kept). A script that fails for another reason
  is not restarted: its status is passed on (128 + N for signal N). A card lost again after ``--max-restarts``
  restarts ends the run with the script's status and a message naming every card lost. Bad arguments: 2.

This module imports neither TensorFlow nor pynvml at import time.
"""

from __future__ import annotations

import dataclasses
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

from hetero_cs.errors import ConfigError

RESTART_ENV_VAR = "HETERO_CS_RESTART"
BACKUP_DIR_ENV_VAR = "HETERO_CS_BACKUP_DIR"
EXCLUDED_ENV_VAR = "HETERO_CS_EXCLUDED_DEVICES"
DEFAULT_MAX_RESTARTS = 3
MAX_RESTARTS = 1000
_MAX_LINE_BYTES = 1 << 16
_RECENT_LINES = 200  # a lost card's line is among the script's last lines on standard error

_EMULATED_LOST = re.compile(r"hetero_cs emulation: lost replica=(\d+) \(([^)]*)\)")
_STICKY = re.compile(r"CUDA_ERROR_(?:ECC_UNCORRECTABLE|ILLEGAL_ADDRESS|LAUNCH_FAILED|DEVICE_UNAVAILABLE|HARDWARE_STACK"
                     r"_ERROR|ILLEGAL_INSTRUCTION|MISALIGNED_ADDRESS)|uncorrectable ECC error|illegal memory access|"
                     r"unspecified launch failure|GPU is lost|fallen off the bus|\bXid\b", re.IGNORECASE)
_GPU_NAMED = re.compile(r"/device:GPU:(\d+)|\bGPU_(\d+)_bfc|device ordinal (\d+)|\bGPU[: ](\d+)\b", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class LostCard:
    """A card the script died of: ``kind`` ``"emulated"`` or ``"gpu"``, its ``index`` as the script saw it (the
    replica in ``emulate=`` order, or TensorFlow's GPU number), the ``line`` that named it, and the emulated card's
    catalog ``name`` (None for a GPU)."""

    kind: str
    index: int
    line: str
    name: str | None = None


def lost_card_in(line: str) -> LostCard | None:
    """The lost card a line of the script's standard error names, or None (the rules of the module docstring)."""
    match = _EMULATED_LOST.search(line)
    if match:
        return LostCard("emulated", int(match.group(1)), line.strip(), match.group(2))
    if _STICKY.search(line):
        gpu = _GPU_NAMED.search(line)
        if gpu:
            return LostCard("gpu", int(next(g for g in gpu.groups() if g is not None)), line.strip())
    return None


def nth_remaining(index: int, excluded: Sequence[int]) -> int:
    """The original position of the ``index``-th card left after ``excluded`` (original positions) were taken out.

    >>> nth_remaining(1, [1])   # cards 0, 2, 3 are left: the script's card 1 is card 2
    2
    """
    position = -1
    for _ in range(index + 1):
        position += 1
        while position in excluded:
            position += 1
    return position


def default_backup_dir(command: Sequence[str]) -> pathlib.Path:
    """``<cache dir>/backups/<hash of the working directory and the command>``: the same script, run again from the
    same place, finds its backups."""
    from calibration.store import default_cache_dir

    digest = hashlib.sha256("\0".join([os.getcwd(), *command]).encode()).hexdigest()[:16]
    return default_cache_dir() / "backups" / digest


class _NvmlWatch:
    """Uncorrected ECC error counts of the visible GPUs at the start, to find a card whose count grew (or that NVML
    reports lost) after the script died. Nothing when nvidia-ml-py or a GPU is missing."""

    def __init__(self, physical: Sequence[int]) -> None:
        self._physical = list(physical)
        self._start = {g: self._ecc(g) for g in self._physical}

    @staticmethod
    def _ecc(gpu: int) -> int | None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
            return int(pynvml.nvmlDeviceGetTotalEccErrors(handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                          pynvml.NVML_VOLATILE_ECC))
        except Exception as exc:  # noqa: BLE001 - no NVML, no ECC support, or a lost GPU (below)
            return -1 if type(exc).__name__ == "NVMLError_GPUIsLost" else None

    def lost(self) -> int | None:
        """The physical GPU NVML now reports lost or with more uncorrected ECC errors, or None."""
        for gpu in self._physical:
            now = self._ecc(gpu)
            if now == -1 or (now is not None and self._start[gpu] is not None and now > self._start[gpu]):
                return gpu
        return None


def _visible_gpus() -> list[int]:
    """Physical GPU ids the script may use: ``CUDA_VISIBLE_DEVICES`` as set, else every GPU NVML counts."""
    text = os.environ.get("CUDA_VISIBLE_DEVICES")
    if text is not None:
        return [int(part) for part in text.split(",") if part.strip().isdigit()]
    try:
        import pynvml

        pynvml.nvmlInit()
        return list(range(pynvml.nvmlDeviceGetCount()))
    except Exception:  # noqa: BLE001 - no NVML or no GPU: emulated or CPU devices only
        return []


class Supervisor:
    """Runs ``command``, restarting it without a lost card, at most ``max_restarts`` times.

    Args:
        command: argv of the training script, non-empty.
        max_restarts: Restarts after a lost card, an int in [0, MAX_RESTARTS].
        backup_dir: Where the script's ``fit`` keeps its backups; None: :func:`default_backup_dir`.
        output: Where the supervisor's own lines go (default: standard error).

    Raises:
        ConfigError: An empty command, a command that cannot run, or max_restarts out of range.
    """

    def __init__(self, command: Sequence[str], *, max_restarts: int = DEFAULT_MAX_RESTARTS,
                 backup_dir: str | os.PathLike | None = None, output: TextIO | None = None) -> None:
        if isinstance(command, (str, bytes)) or not all(isinstance(part, str) for part in (command or ())):
            raise ConfigError(f"The command must be a list of str (argv), e.g. ['python', 'train.py']. Received: "
                              f"{command!r}.")
        if not command:
            raise ConfigError("hetero-cs run needs a command after `--`, e.g. hetero-cs run -- python train.py.")
        if not command[0] or shutil.which(command[0]) is None:
            raise ConfigError(f"cannot run {command[0]!r}: no such executable file (on PATH or as a path). Received "
                              f"the command {list(command)!r}.")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or not 0 <= max_restarts <= MAX_RESTARTS:
            raise ConfigError(f"--max-restarts must be an int in [0, {MAX_RESTARTS}] (restarts after a lost card). "
                              f"Received: {max_restarts!r}.")
        self._command = list(command)
        self._max_restarts = max_restarts
        if backup_dir is not None and not str(backup_dir).strip():
            raise ConfigError("--backup-dir is empty; give a directory for fit's backups (created if missing), or "
                              "leave it out for the default under the cache directory.")
        self.backup_dir = pathlib.Path(backup_dir) if backup_dir is not None else default_backup_dir(command)
        if self.backup_dir.exists() and not self.backup_dir.is_dir():
            raise ConfigError(f"--backup-dir {str(self.backup_dir)!r} exists and is not a directory; give a "
                              f"directory (it is created if missing).")
        self._output = output or sys.stderr
        self.excluded: list[int] = []  # positions in the script's first device list (emulate=, or visible GPUs)
        self._visible = _visible_gpus()
        self.excluded_gpus: list[int] = []  # physical ids of the GPUs among them
        self.lost: list[LostCard] = []
        self.lost_names: list[str] = []  # as the supervisor's lines name them
        self.restarts = 0
        self._found: LostCard | None = None
        self._child: subprocess.Popen | None = None
        self._stop_signal: int | None = None

    def _note(self, message: str) -> None:
        try:
            self._output.write(f"[hetero-cs run] {message}\n")
            self._output.flush()
        except (OSError, ValueError):
            pass

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env[RESTART_ENV_VAR] = str(self.restarts)
        env[BACKUP_DIR_ENV_VAR] = str(self.backup_dir)
        env["PYTHONUNBUFFERED"] = "1"
        if self.excluded:
            env[EXCLUDED_ENV_VAR] = ",".join(str(i) for i in sorted(self.excluded))
        if self.excluded_gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(
                str(g) for i, g in enumerate(self._visible) if i not in self.excluded)
        return env

    def _pump(self, stream, found: list) -> None:
        """Passes the script's standard error on; keeps in ``found`` the last lost-card line and the number of
        lines after it."""
        for raw in iter(lambda: stream.readline(_MAX_LINE_BYTES), b""):
            line = raw.decode(errors="replace")
            card = lost_card_in(line)
            if card is not None:
                found[:] = [card, 0]
            elif found:
                found[1] += 1
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
        stream.close()

    def _on_signal(self, signum, _frame) -> None:
        self._stop_signal = signum
        child = self._child
        if child is not None and child.poll() is None:
            try:
                os.killpg(child.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def _run_once(self) -> int:
        found: list = []
        self._found = None
        try:
            child = subprocess.Popen(self._command, env=self._environment(), stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            raise ConfigError(
                f"cannot run {self._command[0]!r}: {exc.strerror or exc} (errno {exc.errno}). A script needs a "
                f"first line #!/path/to/interpreter, or run it through one (-- python script.py).") from None
        self._child = child
        pump = threading.Thread(target=self._pump, args=(child.stderr, found), daemon=True)
        pump.start()
        code = child.wait()
        try:  # what the script left behind in its process group (it leads one): its pipe would keep the pump waiting
            os.killpg(child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        pump.join(timeout=10.0)
        # A lost card ends the process abnormally (SIGABRT after a sticky CUDA error, or another fatal signal), and
        # its line is among the last the script wrote: an earlier line of a fault the script survived, or one
        # before an ordinary failure, names no lost card.
        fatal = code < 0 and -code not in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        if fatal and found and found[1] <= _RECENT_LINES:
            self._found = found[0]
        return 128 - code if code < 0 else code

    def _card_lost(self, watch: _NvmlWatch) -> LostCard | None:
        found = self._found
        if found is None and self._visible:
            physical = watch.lost()
            if physical is not None:
                remaining = [g for i, g in enumerate(self._visible) if i not in self.excluded]
                found = LostCard("gpu", remaining.index(physical), f"NVML reports GPU {physical} lost or with new "
                                                                   f"uncorrected ECC errors")
        return found

    def _exclude(self, card: LostCard) -> str | None:
        """Records ``card`` as lost; returns how the lines name it, or None when a GPU cannot be left out (which
        GPUs the script sees is not known)."""
        if card.kind == "gpu" and not self._visible:
            return None
        position = nth_remaining(card.index, self.excluded)
        self.excluded.append(position)
        if card.kind == "emulated":
            what = f"the emulated {card.name} at position {position} of emulate="
        else:
            physical = self._visible[position] if position < len(self._visible) else position
            self.excluded_gpus.append(physical)
            what = f"GPU {physical}"
        self.lost_names.append(what)
        return what

    def _remove_backups(self) -> None:
        """Removes the backups of fit and the kept profiles (only those files), then the directory if that left it
        empty: a --backup-dir that holds other files keeps them."""
        from hetero_cs.engine.backup import BACKUP_PATTERNS

        for pattern in BACKUP_PATTERNS:
            for path in self.backup_dir.glob(pattern):
                try:
                    path.unlink()
                except OSError:
                    pass
        try:
            self.backup_dir.rmdir()  # only when empty
        except OSError:
            pass

    def run(self) -> int:
        """Runs the script until it succeeds, fails for another reason, or runs out of restarts; returns the exit
        status (see the module docstring)."""
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                previous[sig] = signal.signal(sig, self._on_signal)
        try:
            if any(self.backup_dir.glob("fit_*.json")):
                self._note(f"resuming from the backups in {self.backup_dir} (remove that directory to start over)")
            while True:
                watch = _NvmlWatch([g for i, g in enumerate(self._visible) if i not in self.excluded])
                started = time.monotonic()
                status = self._run_once()
                if status == 0:
                    self._remove_backups()
                    if self.lost:
                        self._note(f"the script succeeded after {self.restarts} restart(s), without "
                                   f"{'; '.join(self.lost_names)}")
                    return 0
                if self._stop_signal is not None:
                    self._note(f"stopped by signal {self._stop_signal}; not restarting (backups kept in "
                               f"{self.backup_dir})")
                    return 128 + int(self._stop_signal)
                card = self._card_lost(watch)
                if card is None:
                    self._note(f"the script exited with status {status} and no lost card was named: not restarting "
                               f"(a failure of the script itself is passed on)")
                    return status
                what = self._exclude(card)
                if what is None:
                    self._note(f"the script died of a lost GPU ({card.line[:200]}), but which GPUs it sees is not "
                               f"known (CUDA_VISIBLE_DEVICES is unset and NVML, from nvidia-ml-py, is not "
                               f"available), so it cannot be restarted without that GPU: not restarting. Set "
                               f"CUDA_VISIBLE_DEVICES (e.g. 0,1,2) or install nvidia-ml-py. Status {status}")
                    return status
                self.lost.append(card)
                if self.restarts >= self._max_restarts:
                    self._note(f"the script lost {what} after {self.restarts} restart(s), the most --max-restarts="
                               f"{self._max_restarts} allows: giving up with its status {status}. Cards lost: "
                               f"{'; '.join(self.lost_names)}. Backups kept in {self.backup_dir}")
                    return status
                self.restarts += 1
                self._note(f"the script died of a lost card after {time.monotonic() - started:.1f} s: {what} (its "
                           f"line: {card.line[:200]}). Restarting it without that card (restart {self.restarts} of "
                           f"at most {self._max_restarts}); fit resumes from its last backup")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def add_run_arguments(parser) -> None:
    """The ``hetero-cs run`` options."""
    parser.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS,
                        help=f"restarts after a lost card before giving up (default {DEFAULT_MAX_RESTARTS})")
    parser.add_argument("--backup-dir", default=None,
                        help="where fit keeps its backups (default: under the cache directory, one per working "
                             "directory and command)")
    parser.add_argument("command", nargs="+", help="the training script's command, after `--`")


def run_supervised(args) -> int:
    """``hetero-cs run`` from parsed arguments; returns the exit status."""
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    return Supervisor(command, max_restarts=args.max_restarts, backup_dir=args.backup_dir).run()
