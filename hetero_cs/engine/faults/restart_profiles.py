"""The calibrated profiles of a supervised run, kept with its backups, so a restart without a lost card plans at once.

Under ``hetero-cs run`` (:mod:`hetero_cs.supervisor`), every calibration result the strategy plans from is written
next to ``fit``'s backups (``profiles.json``, with ``profiles.meta.json``: the positions of its devices in the
script's first device list, the model's fingerprint, the global batch size and an emulator's time scale). When the
script is restarted without a lost card, the strategy finds there a profile for each card it still has, takes
those, and plans from them without calibrating again: the restart costs TensorFlow's start and the model's build,
not a calibration. On emulated devices the time scale of those profiles is kept, so the emulated cards run at the
speeds they were timed at. Anything that does not match (another model or batch size, a card with no profile)
calibrates as usual.
"""

import dataclasses
import json
import logging
import os

from calibration.result import CalibrationResult
from calibration.store import load_result_file, save_result_file
from hetero_cs.engine.faults.supervised_run import (
    RESTART_ENV_VAR, backup_dir, excluded_positions, register, write_atomically)
from hetero_cs.errors import ProfileCacheError

logger = logging.getLogger("hetero_cs.engine.central_storage")  # the messages users filter on

PROFILES = "profiles.json"
META = "profiles.meta.json"


def _positions(num_replicas: int) -> list[int]:
    """The positions of this run's replicas in the script's first device list (the cards left after a restart)."""
    excluded = excluded_positions()
    return [p for p in range(num_replicas + len(excluded)) if p not in excluded][:num_replicas]


def keep_for_restart(strategy, result, fingerprint: str, global_batch_size: int) -> None:
    """Writes ``result`` (a CalibrationResult the strategy plans from) next to the backups, when supervised."""
    directory = backup_dir()
    if directory is None:
        return
    meta = {"positions": _positions(len(strategy.compute_devices)), "fingerprint": fingerprint,
            "global_batch_size": int(global_batch_size),
            "time_scale": None if strategy.emulator is None else float(strategy.emulator.time_scale)}
    try:
        register(directory, [PROFILES, META])
        save_result_file(directory / PROFILES, result)
        write_atomically(directory / META, lambda stream: stream.write(json.dumps(meta).encode()))
    except (OSError, ProfileCacheError) as exc:  # read-only, full, or removed: a restart calibrates again
        logger.warning("hetero_cs: the profiles cannot be kept in %s for a restart (%s): a restart calibrates again. "
                       "Give hetero-cs run a writable --backup-dir with room.", directory, exc)


def profiles_before_restart(strategy, fingerprint: str, global_batch_size: int):
    """The CalibrationResult for this run's cards from the profiles kept before a restart, or None.

    On emulated devices it also fixes the emulator's time scale to theirs (call it before the scale is chosen).
    """
    directory = backup_dir()
    if directory is None or os.environ.get(RESTART_ENV_VAR, "0").strip() in ("", "0"):
        return None
    try:
        meta = json.loads((directory / META).read_text())
        kept = load_result_file(directory / PROFILES)
    except (OSError, ValueError, ProfileCacheError):
        return None
    positions = _positions(len(strategy.compute_devices))
    if (meta.get("fingerprint") != fingerprint or meta.get("global_batch_size") != int(global_batch_size)
            or not all(p in meta.get("positions", []) for p in positions)
            or len(kept.profiles) != len(meta["positions"])):
        return None
    profiles = [dataclasses.replace(kept.profiles[meta["positions"].index(p)], device=device)
                for p, device in zip(positions, strategy.compute_devices)]
    if strategy.emulator is not None and meta.get("time_scale"):
        strategy.emulator.fix_time_scale(meta["time_scale"], "the time scale of the profiles before the restart")
    logger.warning("hetero_cs: planning from the profiles calibrated before the restart (%s), for the cards at "
                   "positions %s of the first run: not calibrating again.", directory / PROFILES, positions)
    return CalibrationResult(profiles=tuple(profiles), wall_time_s=0.0, emulated=kept.emulated)
