"""What a script run under ``hetero-cs run`` shares with its supervisor: the environment, and the backups' files.

The supervisor (:mod:`hetero_cs.supervisor`) tells the script, through the environment, how many times it restarted
it (:data:`RESTART_ENV_VAR`), where its backups go (:data:`BACKUP_DIR_ENV_VAR`) and which cards it left out after
losing them (:data:`EXCLUDED_ENV_VAR`: the strategy then leaves them out, :func:`leave_out_excluded`).

``hetero-cs run --backup-dir DIR`` gives the script ``DIR/hetero_cs`` (``HETERO_CS_BACKUP_DIR``). Every file the
library writes there is first listed in ``MANIFEST.json``, so that the supervisor removes, once the script
succeeded, exactly what the library wrote: never a file of the user's, in ``DIR`` or beside it. Each file is
written to ``.<name>.tmp`` and then renamed over ``<name>`` (``os.replace``), so a reader finds the old file or the
new one, never a part.

This module imports neither TensorFlow nor Keras.
"""

import contextlib
import json
import logging
import os
import pathlib
import re
from collections.abc import Callable, Iterable

from hetero_cs.errors import ConfigError

logger = logging.getLogger("hetero_cs.engine.central_storage")

RESTART_ENV_VAR = "HETERO_CS_RESTART"
"""Restarts so far (0 on the first run), set by the supervisor and the launcher; hetero_cs itself never reads it."""
BACKUP_DIR_ENV_VAR = "HETERO_CS_BACKUP_DIR"
"""The library's own backup directory (``--backup-dir``/hetero_cs)."""
EXCLUDED_ENV_VAR = "HETERO_CS_EXCLUDED_DEVICES"
"""Positions, in the script's first device list, of the cards the script was restarted without."""

OWNED_DIR = "hetero_cs"
"""The subdirectory of ``--backup-dir`` the library writes in."""

MANIFEST = "MANIFEST.json"


def backup_dir() -> pathlib.Path | None:
    """The directory ``hetero-cs run`` gave this process for backups, or None outside the supervisor."""
    text = os.environ.get(BACKUP_DIR_ENV_VAR, "").strip()
    return pathlib.Path(text) if text else None


def temp_path(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(f".{path.name}.tmp")


def write_atomically(path: pathlib.Path, write: Callable) -> None:
    """Writes ``path`` through ``write(stream)`` to its temporary name, flushed to disk, then renames it over."""
    temp = temp_path(path)
    try:
        with open(temp, "wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def written(directory: pathlib.Path) -> list[str]:
    """The names the manifest of ``directory`` lists ([] without one, or one that cannot be read)."""
    try:
        files = json.loads((directory / MANIFEST).read_text()).get("files", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [name for name in files if isinstance(name, str) and "/" not in name and "\\" not in name
            and name not in ("", ".", "..", MANIFEST)]


def register(directory: pathlib.Path, names: Iterable[str]) -> None:
    """Lists ``names`` in the manifest of ``directory`` (created if missing) before they are written."""
    known = written(directory)
    new = [name for name in names if name not in known]
    if not new:
        return
    directory.mkdir(parents=True, exist_ok=True)
    manifest = {"written_by": "hetero_cs", "files": known + new}
    write_atomically(directory / MANIFEST, lambda stream: stream.write(json.dumps(manifest).encode()))


def remove_written(directory: pathlib.Path) -> None:
    """Removes the files the manifest lists (and their temporary names), the manifest, then ``directory`` if that
    left it empty. Files the manifest does not list are kept."""
    for name in [*written(directory), MANIFEST]:  # the manifest last
        for path in (directory / name, temp_path(directory / name)):
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        directory.rmdir()  # only when empty


def leave_out_excluded(emulator, names, compute_devices, batch_split):
    """``(emulator, names, compute_devices, batch_split)`` without the cards ``HETERO_CS_EXCLUDED_DEVICES`` names.

    ``hetero-cs run`` (:mod:`hetero_cs.supervisor`) sets it to the positions in ``emulate=`` of emulated cards the
    script lost (e.g. ``"1"`` or ``"0,2"``) when it restarts the script; the strategy then leaves them out of
    ``emulate=`` and, when given with one entry per card, of ``compute_devices`` and ``batch_split``. Unset or
    empty: unchanged. (A lost real GPU is left out by ``CUDA_VISIBLE_DEVICES`` instead.)

    Raises:
        ConfigError: The variable is not a comma-separated list of positions in ``emulate=``, or leaves no card.
    """
    text = os.environ.get(EXCLUDED_ENV_VAR, "").strip()
    positions = excluded_positions()  # checked: a ConfigError for a malformed value
    if not text or names is None:  # real GPUs: CUDA_VISIBLE_DEVICES left them out (shares_without_lost_gpus)
        return emulator, names, compute_devices, batch_split
    if any(not 0 <= i < len(names) for i in positions) or len(positions) >= len(names):
        raise ConfigError(f"{EXCLUDED_ENV_VAR}={text!r} must list positions in emulate={names} (0..{len(names) - 1}, "
                          f"comma-separated) and leave at least one card; `hetero-cs run` sets it when it restarts a "
                          f"script without a lost card. Unset it to use every card.")
    if compute_devices is not None and (not isinstance(compute_devices, (list, tuple))
                                        or len(compute_devices) != len(names)):
        return emulator, names, compute_devices, batch_split  # the checks that follow explain what is wrong
    keep = [i for i in range(len(names)) if i not in positions]
    logger.warning("hetero_cs: restarted without the lost emulated card(s) %s (%s=%s): emulating %s.",
                   [names[i] for i in positions], EXCLUDED_ENV_VAR, text, [names[i] for i in keep])
    if isinstance(batch_split, (list, tuple)) and len(batch_split) == len(names):  # one share per card
        batch_split = [batch_split[i] for i in keep]
    return (None if emulator is None else emulator.without(positions), [names[i] for i in keep],
            None if compute_devices is None else [list(compute_devices)[i] for i in keep], batch_split)


def excluded_positions() -> list[int]:
    """The positions of the cards ``hetero-cs run`` restarted the script without (``HETERO_CS_EXCLUDED_DEVICES``),
    in the script's first device list; [] outside the supervisor or before any card was lost."""
    text = os.environ.get(EXCLUDED_ENV_VAR, "").strip()
    if not text:
        return []
    parts = text.split(",")
    if not all(re.fullmatch(r"[0-9]+", part.strip()) for part in parts) or len(set(map(int, parts))) != len(parts):
        raise ConfigError(f"{EXCLUDED_ENV_VAR}={text!r} must list distinct positions in the script's first device "
                          f"list, as comma-separated non-negative integers (e.g. '1' or '0,2'); `hetero-cs run` sets "
                          f"it when it restarts a script without a lost card. Unset it to use every card.")
    return sorted(int(part) for part in parts)


def shares_without_lost_gpus(batch_split, num_replicas: int, emulated: bool):
    """``batch_split`` given for the script's first GPUs, without the shares of those ``hetero-cs run`` restarted it
    without (``CUDA_VISIBLE_DEVICES`` hid them, so R fell): cut when it has one share per first GPU."""
    positions = [] if emulated else excluded_positions()
    if not positions or not isinstance(batch_split, (list, tuple)) or len(batch_split) != num_replicas + len(
            positions) or any(p >= len(batch_split) for p in positions):
        return batch_split
    return [share for i, share in enumerate(batch_split) if i not in positions]
