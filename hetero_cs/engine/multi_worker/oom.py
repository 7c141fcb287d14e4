"""Out of memory under :class:`hetero_cs.HeteroMultiWorkerMirroredStrategy`: the job restarts with a lower cap.

On one machine a replica that runs out of memory costs one retried step (:mod:`hetero_cs.engine.memory.oom_recovery`). On
several machines it cannot: the other workers wait for that worker's gradients inside the step's all-reduce, and
TensorFlow aborts every worker's collectives once one fails mid-step ("Collective ops is aborted by: ... Restart your
program to reset"), so no worker can run the step again in place. What hetero_cs does instead:

1. The worker whose replica ran out raises :class:`hetero_cs.errors.StepOOMError` from ``model.fit`` (or
   ``evaluate``, ``predict``), naming the replica (its cluster id), its device, the examples it held at once (its
   slice, or its micro-batch when the slice ran as micro-batches) and the caps for a restart: the caps in force with
   that replica's lowered to half what it held (:func:`hetero_cs.planning.restart_caps.lowered_caps`; 0 when one
   example did not fit: the card then takes no example).
2. It tells the other workers at once through TensorFlow's coordination service, so their call ends within
   seconds with a :class:`hetero_cs.errors.WorkerLostError` that names the replica and the same caps.
3. ``hetero-cs launch --max-restarts N`` relaunches every worker with ``HETERO_CS_MAX_BATCH_SIZES`` set to those
   caps (:mod:`hetero_cs.planning.restart_caps`); the strategy lowers its caps to them, a slice past its cap runs
   as micro-batches within it (:mod:`hetero_cs.engine.multi_worker.micro_batches`; where that would change the math the
   examples move to the other cards instead), and with ``keras.callbacks.BackupAndRestore`` the job resumes from
   its last backup. Each relaunch halves the cap again if it still does not fit. Workers restarted another way get
   the same caps as ``max_batch_sizes=`` or the environment variable.

``evaluate`` and ``predict`` go the same way: their slices past a cap run as micro-batches too, and they follow the
training split, which a lower cap bounds where micro-batches do not apply. A custom loop's ``strategy.run`` gets
TensorFlow's error unchanged.
"""

import dataclasses
import re
from collections.abc import Sequence

from hetero_cs.errors import StepOOMError
from hetero_cs.planning.restart_caps import CAPS_ENV_VAR, format_caps, lowered_caps

_EMULATED = re.compile(r"Emulated out of memory: replica=(\d+) \([^)]*\) needs \d+ bytes for a slice of "
                       r"batch_size=(\d+)")


@dataclasses.dataclass(frozen=True)
class ClusterOutOfMemory:
    """What one worker tells the others and raises when one of its replicas ran out of memory.

    Attributes:
        error: The :class:`hetero_cs.errors.StepOOMError` this worker raises.
        reason: The reason the other workers are told, ``"out of memory on replica <i> (<device>) ..."``, ending
            with ``"; relaunch with HETERO_CS_MAX_BATCH_SIZES=<caps>"`` in ``fit``.
        restart_caps: The caps for a restart (one per replica of the cluster), or None (evaluate, predict, or no
            replica named).
    """

    error: StepOOMError
    reason: str
    restart_caps: list | None


def out_of_memory_here(strategy, verb: str, exc: BaseException, replica_scopes: Sequence[str] = (),
                       model=None) -> ClusterOutOfMemory | None:
    """The :class:`ClusterOutOfMemory` for TensorFlow's error ``exc`` raised by ``model.<verb>`` (``"fit"``,
    ``"evaluate"`` or ``"predict"``) on this worker, or None when ``exc`` is not out of memory
    (:mod:`hetero_cs.devices.device_errors` decides, as on one machine)."""
    from hetero_cs.engine._compat import id_in_cluster
    from hetero_cs.devices.device_errors import OOM_FORMS, classify, first_line
    from hetero_cs.planning.cost_model import near_equal_micro_batches

    local = list(strategy.extended.worker_devices)
    oom = classify(exc, local, replica_scopes)
    if oom is None:
        return None
    first = strategy._first_replica  # noqa: SLF001
    emulated = _EMULATED.search(str(exc))
    replica_id = held = None
    if emulated is not None:  # the emulator numbers the replicas of the whole cluster and says what the slice held
        replica_id, held = int(emulated.group(1)), int(emulated.group(2))
        device = local[replica_id - first] if 0 <= replica_id - first < len(local) else None
    elif oom.replica_id is not None:
        replica_id, device = first + oom.replica_id, local[oom.replica_id]
    else:
        device = oom.device
    micro, split = strategy.micro_batching, strategy.last_split
    B = None if split is None else int(sum(split))
    caps = micro.known_caps
    cap = None if caps is None or replica_id is None else caps[replica_id]
    slice_size = None if split is None or replica_id is None else int(split[replica_id])
    as_micro = micro.runs_micro_batches(model, verb) and cap is not None and cap >= 1 and (slice_size or 0) > cap
    if held is None and slice_size:
        held = max(near_equal_micro_batches(slice_size, cap)) if as_micro else slice_size
    what = f"{oom.form}: {type(exc).__name__}: {first_line(exc, OOM_FORMS)}"
    stop = ("On several machines the step cannot be run again in place: TensorFlow aborts every worker's "
            "collectives once one fails in the middle of a step, so the job stops (the other workers were told and "
            "stop too, with a WorkerLostError). No update of this step was applied.")
    where = f"worker {id_in_cluster(strategy)}"
    if replica_id is None or not held:
        error = StepOOMError(
            f"model.{verb} ran out of memory on {where}{f' ({device})' if device else ''} ({what}), and the error "
            f"names no replica, so no cap can be lowered. {stop} Free that device's memory (another process may "
            f"hold it), or give each card's memory cap as max_batch_sizes on every worker. The original error is "
            f"chained below.",
            device=device, global_batch_size=B, last_error=exc)
        return ClusterOutOfMemory(error, f"out of memory on {device or 'one of its devices'}", None)
    holding = (f"with {held} examples at once, a micro-batch of its slice of {slice_size} within its cap {cap}"
               if as_micro else f"with {held} examples at once, its slice"
               + (f" of a global batch of {B}" if B is not None else ""))
    restart = lowered_caps(caps, strategy.num_replicas_in_sync, replica_id, held)
    text = format_caps(restart)
    error = StepOOMError(
        f"model.{verb} ran out of memory on {where}, replica {replica_id} ({device}), {holding} ({what}). {stop} "
        f"Restart every worker with that replica's cap at {restart[replica_id]} examples: hetero-cs launch "
        f"--max-restarts N does so by itself (relaunch with {CAPS_ENV_VAR}={text}); otherwise pass "
        f"max_batch_sizes={restart} to the strategy on every worker, or set {CAPS_ENV_VAR}={text} in every "
        f"worker's environment. Its slices past the cap then run as micro-batches within it (or, where that would "
        f"change the math, its examples move to the other cards), and with keras.callbacks.BackupAndRestore the "
        f"restarted job resumes from its last backup. The original error is chained below.",
        replica_id=replica_id, device=device, caps_tried=(held,), global_batch_size=B, last_error=exc)
    reason = f"out of memory on replica {replica_id} ({device}), {holding}; relaunch with {CAPS_ENV_VAR}={text}"
    return ClusterOutOfMemory(error, reason, restart)

