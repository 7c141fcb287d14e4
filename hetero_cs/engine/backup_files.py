"""The files of a supervised run's backups: the library's own subdirectory, its manifest, atomic writes.

``hetero-cs run --backup-dir DIR`` gives the script ``DIR/hetero_cs`` (``HETERO_CS_BACKUP_DIR``). Every file the
library writes there is first listed in ``MANIFEST.json``, so that the supervisor removes, once the script
succeeded, exactly what the library wrote: never a file of the user's, in ``DIR`` or beside it. Each file is
written to ``.<name>.tmp`` and then renamed over ``<name>`` (``os.replace``), so a reader finds the old file or the
new one, never a part.

This module imports neither TensorFlow nor Keras.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable, Iterable

OWNED_DIR = "hetero_cs"
"""The subdirectory of ``--backup-dir`` the library writes in."""

MANIFEST = "MANIFEST.json"


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
    for name in written(directory):
        for path in (directory / name, temp_path(directory / name)):
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass
    for path in (directory / MANIFEST, temp_path(directory / MANIFEST)):
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass
    try:
        directory.rmdir()  # only when empty
    except OSError:
        pass
