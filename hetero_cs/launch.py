"""``hetero-cs launch``: N worker processes of one command on this machine, each with its own ``TF_CONFIG``.

Every worker gets the same command and a ``TF_CONFIG`` that names all N workers on free 127.0.0.1 ports and its own
task index, which is what ``tf.distribute.MultiWorkerMirroredStrategy`` (and so
:class:`hetero_cs.HeteroMultiWorkerMirroredStrategy`) reads to form the cluster. With ``emulate`` each worker also
gets ``HETERO_CS_EMULATE`` (the catalog devices of every worker, in task order: ``"A10,T4"``, or ``"A10+T4,P100+T4"``
for two replicas per worker) so that the strategy emulates unlike devices on a CPU-only machine.

On a machine with GPUs (and without ``emulate``), each worker gets its own GPUs in ``CUDA_VISIBLE_DEVICES``, by
UUID: the GPUs CUDA shows the launcher, in CUDA's order, cut into equal runs (one GPU each when there are as many as
workers; fewer GPUs than workers is a ConfigError).

Every line a worker prints (stdout and stderr together) is printed with a ``[worker i]`` prefix. The launcher's
exit status is the first failing worker's (a worker killed by signal ``s`` counts as ``128 + s``), else 0. When a
worker fails, the others get up to 10 s (at most ``grace_s``) to end on their own: they learn of it from TensorFlow
within seconds and end with a clean ``WorkerLostError``. Then, or at once on Ctrl-C (SIGINT), SIGTERM or SIGHUP,
every worker still running is sent SIGINT (what Ctrl-C in a
terminal sends: Python raises KeyboardInterrupt, and TensorFlow, which catches SIGTERM for its preemption notifier
and goes on training, stops), SIGTERM after half of ``grace_s`` and SIGKILL after ``grace_s`` seconds, each worker's
whole process group included, so nothing is left running; a worker that had to be killed is named.

With ``max_restarts`` (``--max-restarts N``) the launcher relaunches the cluster after a failure, at most N times,
each worker's environment holding ``HETERO_CS_RESTART`` (the relaunches so far):

* **without a worker whose card failed**: on GPUs, the worker holding a card NVML showed failed while the cluster
  ran (lost, uncorrected ECC errors grown, a hardware Xid: :class:`hetero_cs.devices.gpu_health.CardWatch`; a line of
  text alone is no evidence); on emulated cards, its own ``DeviceFaultError``, another worker's ``WorkerLostError``
  naming its device error, or a lost card's line (:func:`hetero_cs.supervisor.lost_card_in`) among the last 200
  lines of a worker. The relaunched cluster has one worker fewer, without its GPUs or its ``--emulate`` entry;
* **with every worker and a lower memory cap** after a replica ran out of memory in ``fit``, ``evaluate`` or
  ``predict`` (:mod:`hetero_cs.engine.multi_worker.oom`): its ``StepOOMError``, or another worker's
  ``WorkerLostError``, names the caps to relaunch with (several workers' caps: the lowest of each replica), and every
  relaunched worker gets them in ``HETERO_CS_MAX_BATCH_SIZES`` (:mod:`hetero_cs.planning.restart_caps`; caps set
  there by hand are the start). Not when those are the caps in force already, or when no card would hold one
  example. A relaunch after a failed card keeps the caps of the workers left;
* **with every worker** after a worker killed by a signal without a failed card (a transient death).

Any other failure is the script's own and is not relaunched. With ``keras.callbacks.BackupAndRestore`` in the script
the relaunched job resumes from its last backup.
"""

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from hetero_cs.devices.gpu_health import CardWatch, visible_gpus
from hetero_cs.engine.faults.supervised_run import RESTART_ENV_VAR
from hetero_cs.launch_config import check_emulate, check_workers, free_ports, parse_emulate, tf_config, worker_gpus
from hetero_cs.planning.restart_caps import CAPS_ENV_VAR, NO_CAP, format_caps, lowest_caps, read_caps
from hetero_cs.supervisor import (
    DEFAULT_GRACE_S, MAX_RESTARTS, checked_command, checked_grace_s, checked_int, exit_status, lines_of, lost_card_in,
    signal_group, silence, start_child, stop_signals_to)

EMULATE_ENV_VAR = "HETERO_CS_EMULATE"
_POLL_S = 0.05
_SELF_STOP_S = 10.0  # after a worker failed: how long the others may take to end on their own before SIGINT
_TAIL_LINES = 200  # each worker's last lines kept to tell why it failed
_DRAIN_S = 1.0  # after the workers exited: how long their output may still arrive before leftover children die


class Launch:
    """N workers of one command; see the module docstring. :meth:`run` returns the exit status.

    Args:
        command: The command every worker runs (argv list, non-empty).
        num_workers: N >= 1.
        emulate: One entry per worker: a catalog device name, or several joined by ``+`` (the same number on every
            worker: that many local replicas each); or None.
        grace_s: Seconds from the first signal (SIGINT) to SIGKILL when stopping workers, > 0.
        output: Where the prefixed lines go (default: this process's stdout).
        max_restarts: Relaunches after a failure that a relaunch can get past (see the module docstring), an int in
            [0, 1000]; 0 (the default): none.

    Raises:
        ConfigError: An empty command, N < 1, grace_s <= 0, or max_restarts out of range.
    """

    def __init__(self, command: Sequence[str], *, num_workers: int, emulate: Sequence[str] | None = None,
                 grace_s: float = DEFAULT_GRACE_S, output: TextIO | None = None, max_restarts: int = 0):
        self._command = checked_command(command, "launch")
        self._num_workers = check_workers(num_workers)
        self._grace_s = checked_grace_s(grace_s)
        self._max_restarts = checked_int(max_restarts, "--max-restarts", 0, MAX_RESTARTS,
                                         "relaunches of the cluster after a worker failed")
        self._emulate = None if emulate is None else check_emulate(emulate, num_workers)
        # Each worker's own GPUs, by UUID (None: no GPU, or emulated cards); a lost card is NVML's to say.
        self._gpus = worker_gpus(visible_gpus() if self._emulate is None else [], num_workers)
        self._evidence: list = []  # (Gpu, why) of the cards NVML showed failed in the last launch
        self.restarts = 0
        # HETERO_CS_MAX_BATCH_SIZES's caps (set by hand, or after an out-of-memory relaunch), one per replica.
        self._caps: list[int | None] | None = read_caps(os.environ.get(CAPS_ENV_VAR, ""))
        # No stdout at all (started with `>&-`): the lines go nowhere, but the workers' pipes are still drained.
        self._output = output or sys.stdout or open(os.devnull, "w")  # noqa: SIM115 - lives as long as the launch
        self._print_lock = threading.Lock()
        self._writable = True  # False once our own output is closed
        self._stop = threading.Event()
        self._signal = signal.SIGINT  # the signal that asked to stop (Ctrl-C unless told otherwise)

    def _environment(self, ports: Sequence[int], index: int) -> dict[str, str]:
        # PYTHONUNBUFFERED: lines arrive as they are printed
        env = {**os.environ, "TF_CONFIG": tf_config(ports, index), "PYTHONUNBUFFERED": "1",
               RESTART_ENV_VAR: str(self.restarts)}
        if self._emulate is not None:
            env[EMULATE_ENV_VAR] = ",".join(self._emulate)
        if self._caps is not None:
            env[CAPS_ENV_VAR] = format_caps(self._caps)
        if self._gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu.uuid for gpu in self._gpus[index])
        return env

    def _pump(self, index: int, stream) -> None:
        for line in lines_of(stream):  # a piece of an endless line is prefixed too
            line = line.rstrip("\n")
            self._tails[index].append(line)
            self._write(f"[worker {index}] {line}\n")

    def _write(self, text: str) -> None:
        """Writes and flushes one line; once our own output is closed (e.g. `| head -1`), drops every line."""
        with self._print_lock:
            if not self._writable:
                return
            try:
                try:
                    self._output.write(text)
                except UnicodeEncodeError:  # an output encoding that cannot show the worker's text (e.g. ascii)
                    encoding = getattr(self._output, "encoding", None) or "ascii"
                    self._output.write(text.encode(encoding, errors="replace").decode(encoding))
                self._output.flush()
            except (BrokenPipeError, ValueError, OSError):
                # The text layer still holds the unwritten line: without silence() Python would exit with status
                # 120 at its last flush instead of the workers' status.
                self._writable = False
                silence(self._output)

    def run(self) -> int:
        """Starts the workers, waits for them, and returns the exit status (see the module docstring); with
        ``max_restarts``, relaunches the cluster after a failure that a relaunch can get past (:meth:`_relaunch`)."""
        while True:
            with CardWatch([gpu for gpus in self._gpus or [] for gpu in gpus]) as watch:
                status = self._run_cluster()
                self._evidence = watch.lost([line for tail in self._tails for line in tail]) if status else []
            if status != 0 and self._max_restarts and self.restarts >= self._max_restarts and not self._stop.is_set():
                self._note(f"not relaunching: --max-restarts={self._max_restarts} relaunch(es) used")
            if status == 0 or self._stop.is_set() or self._failed is None or self.restarts >= self._max_restarts \
                    or not self._relaunch(status):
                return status

    def _relaunch(self, status: int) -> bool:
        """Prepares the next launch after a worker failed: without the worker whose card failed (a device error
        it raised or another worker was told of, a lost card), or with every worker after a process killed by a
        signal (a transient death). Returns False (no relaunch) for any other failure: the script's own."""
        worker, code = self._failed
        if (card := self._worker_whose_card_failed()) is not None:
            if self._num_workers == 1:
                self._note(f"worker {card}'s card failed and no other worker is left: not relaunching")
                return False
            dropped = self._emulate.pop(card) if self._emulate is not None else None
            if self._gpus is not None:
                dropped = ", ".join(f"{gpu}: {why}" for gpu, why in self._evidence if gpu in self._gpus[card])
                del self._gpus[card]
            if self._caps is not None:  # the caps of the workers left (every worker runs as many replicas)
                per_worker = len(self._caps) // self._num_workers
                del self._caps[card * per_worker:(card + 1) * per_worker]
            self._num_workers -= 1
            what = f"without worker {card}" + (f" ({'its GPU ' if self._gpus is not None else 'emulating '}{dropped})"
                                               if dropped else "")
            why = f"worker {card}'s card failed"
        elif (found := self._caps_after_out_of_memory()) is not None:
            workers, caps = found
            why = (f"a replica of worker {workers[0]}" if len(workers) == 1 else
                   f"replicas of workers {', '.join(map(str, workers))}") + " ran out of memory"
            if caps == self._caps:
                self._note(f"{why}, but the caps it names ({CAPS_ENV_VAR}={format_caps(caps)}) are those in force: "
                           f"not relaunching")
                return False
            if all(c == 0 for c in caps):
                self._note(f"{why}: with {CAPS_ENV_VAR}={format_caps(caps)} no card would hold one example: not "
                           f"relaunching (give the cards more memory, or use a smaller model)")
                return False
            self._caps = caps
            what = f"with {CAPS_ENV_VAR}={format_caps(caps)}"
        elif code < 0:
            what, why = "with every worker", f"worker {worker} was killed by signal {-code} (a transient death)"
        else:
            self._note(f"worker {worker} failed with status {status} and no card of it failed: not relaunching (the "
                       f"script's own failure)")
            return False
        self.restarts += 1
        self._note(f"{why}: relaunching {self._num_workers} worker(s) {what} (relaunch {self.restarts} of at most "
                   f"{self._max_restarts}, HETERO_CS_RESTART={self.restarts}); with keras.callbacks.BackupAndRestore "
                   f"the job resumes from its last backup")
        return True

    def _worker_whose_card_failed(self) -> int | None:
        """The worker whose card failed, or None: on GPUs, the one holding a card NVML showed failed (never a line
        of text alone); on emulated cards, the worker whose device error (DeviceFaultError) or lost card its own or
        another worker's last lines name."""
        if self._gpus is not None:
            return next((i for gpu, _ in self._evidence for i, gpus in enumerate(self._gpus) if gpu in gpus), None)

        for index, tail in enumerate(self._tails):
            for line in tail:
                own = re.search(r"DeviceFaultError: model\.\w+ failed on worker (\d+) with a device error", line)
                told = re.search(r"worker (\d+) stopped with a device error", line)
                for match in (own, told):
                    if match and int(match.group(1)) < self._num_workers:
                        return int(match.group(1))
                if lost_card_in(line) is not None:
                    return index
        return None

    def _caps_after_out_of_memory(self) -> tuple[list[int], list[int | None]] | None:
        """(the workers whose replicas ran out of memory, the caps to relaunch with) when a worker's StepOOMError,
        or another worker's WorkerLostError, names caps (:mod:`hetero_cs.engine.multi_worker.oom`); else None.
        Several workers that ran out in the same step name theirs each: the lowest cap of each replica is kept, and
        never one above the caps in force."""
        caps_text = rf"relaunch with {CAPS_ENV_VAR}=((?:\d+|{NO_CAP})(?:,(?:\d+|{NO_CAP}))*)"
        own = re.compile(rf"StepOOMError: model\.\w+ ran out of memory on worker (\d+), .*{caps_text}")
        told = re.compile(rf"WorkerLostError: model\.\w+ stopped on worker \d+: worker (\d+) stopped, out of memory "
                          rf".*?{caps_text}")
        found = [match for tail in self._tails for line in tail if (match := own.search(line) or told.search(line))]
        # The caps each names, and those in force.
        named = [caps for caps in (*(read_caps(match.group(2)) for match in found), self._caps) if caps is not None]
        if not found or len({len(caps) for caps in named}) != 1:
            return None
        return sorted({int(match.group(1)) for match in found}), lowest_caps(*named)

    def _run_cluster(self) -> int:
        """One launch of the N workers: starts them, waits, and returns the exit status."""
        self._processes: list[subprocess.Popen] = []
        self._failed: tuple[int, int] | None = None  # (worker, exit code) of the first failure
        # Each worker's last lines, to tell why it failed.
        self._tails = [collections.deque(maxlen=_TAIL_LINES) for _ in range(self._num_workers)]
        ports = free_ports(self._num_workers)
        pumps = []
        with stop_signals_to(self._on_signal):  # restored last: a signal until then still stops what is left
            try:
                for index in range(self._num_workers):
                    self._processes.append(start_child(self._command, self._environment(ports, index),
                                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
                # Pumps start once every worker is started: preexec_fn runs between fork and exec, which is safe
                # only while this process has no other threads.
                for index, process in enumerate(self._processes):
                    pumps.append(threading.Thread(target=self._pump, args=(index, process.stdout), daemon=True))
                    pumps[-1].start()
                return self._wait()
            except BaseException:
                self._stop_all()
                raise
            finally:
                # The workers have exited. Their output may still arrive for a moment; a pipe still open after that
                # is held by a child a worker left behind in its process group, which is killed with the group.
                deadline = time.monotonic() + _DRAIN_S
                for pump in pumps:
                    pump.join(timeout=max(0.0, deadline - time.monotonic()))
                for process in self._processes:  # children a worker left behind, even after a clean exit
                    signal_group(process, signal.SIGKILL)
                for pump in pumps:
                    pump.join(timeout=self._grace_s)
                self._write("")  # flushes now, so the interpreter's flush at exit cannot fail on a closed output

    def _on_signal(self, signum, _frame) -> None:
        self._stop.set()
        self._signal = signum

    def _wait(self) -> int:
        while True:
            codes = [p.poll() for p in self._processes]
            if (failed := next(((i, c) for i, c in enumerate(codes) if c not in (None, 0)), None)) is not None:
                self._failed = index, code = failed
                status = exit_status(code)
                # The others find out themselves within seconds (a WorkerLostError naming the worker, from
                # TensorFlow's collectives and coordination service) and end with a clean error; a SIGINT in the
                # middle of that would end them in a raw KeyboardInterrupt trace from inside TensorFlow instead.
                waited = _all_exit(self._processes, min(_SELF_STOP_S, self._grace_s), self._stop)
                self._note(f"worker {index} exited with status {status}; "
                           + ("the others ended on their own" if waited else "stopping the others"))
                self._stop_all()
                return status
            if self._stop.is_set():
                signum = self._signal
                self._note(f"received signal {signum}; stopping all workers")
                self._stop_all()
                return 128 + int(signum)
            if all(c is not None for c in codes):
                return 0
            time.sleep(_POLL_S)

    def _note(self, message: str) -> None:
        self._write(f"[launch] {message}\n")

    def _stop_all(self) -> None:
        """SIGINT to every running worker's process group, SIGTERM after grace_s / 2, SIGKILL after grace_s;
        returns when all have exited."""
        running = [p for p in self._processes if p.poll() is None]
        for sig in (signal.SIGINT, signal.SIGTERM):
            for process in [p for p in running if p.poll() is None]:
                signal_group(process, sig)
            _all_exit(running, self._grace_s / 2)
        killed = [self._processes.index(p) for p in running if p.poll() is None]
        for process in self._processes:
            # The group too: a worker that exited may have left children behind.
            signal_group(process, signal.SIGKILL)
        for process in running:
            process.wait()
        if killed:
            self._note(f"worker(s) {killed} did not stop within {self._grace_s:g} s of SIGINT and SIGTERM; "
                       f"killed (SIGKILL)")


def _all_exit(processes: list, timeout_s: float, stop: threading.Event | None = None) -> bool:
    """Waits up to ``timeout_s`` (cut short when ``stop`` is set) for ``processes`` to exit; True when they did."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
        if all(p.poll() is not None for p in processes):
            return True
        time.sleep(_POLL_S)
    return all(p.poll() is not None for p in processes)


def add_launch_arguments(parser) -> None:
    """The ``hetero-cs launch`` options."""
    parser.add_argument("--workers", type=int, required=True, help="number of worker processes (N >= 1)")
    parser.add_argument("--emulate", default=None, help="the catalog devices of each worker, comma-separated (e.g. "
                        "A10,T4); several replicas per worker joined by + (e.g. A10+T4,P100+T4); sets "
                        "HETERO_CS_EMULATE")
    parser.add_argument("--grace-s", type=float, default=DEFAULT_GRACE_S, help=f"seconds from SIGINT (SIGTERM at "
                        f"half) to SIGKILL when stopping workers (default {DEFAULT_GRACE_S:g})")
    parser.add_argument("--max-restarts", type=int, default=0, help="relaunch the cluster after a failure at most "
                        "this often (default 0): without a worker whose card failed, with a lower memory cap after a "
                        "replica ran out of memory (in HETERO_CS_MAX_BATCH_SIZES), or with every worker after a worker "
                        "killed by a signal")
    parser.add_argument("command", nargs="+", help="the command every worker runs, after `--`")


def run_launch(args) -> int:
    """``hetero-cs launch`` from parsed arguments; returns the exit status."""
    check_workers(args.workers)  # before the --emulate list is measured against it
    return Launch(args.command, num_workers=args.workers, emulate=parse_emulate(args.emulate, args.workers),
                  grace_s=args.grace_s, max_restarts=args.max_restarts).run()
