"""On-disk cache of calibration results, keyed by devices, model, input, dtype policy and TensorFlow version (pure).

One JSON file per key, ``<directory>/<key>.json``::

    {"schema_version": 1, "key": "<sha256 hex>", "result": {...CalibrationResult.to_dict()...}}

Files are written atomically (a temporary file ``.<name>.<random>.tmp`` in the same directory, fsync, then
``os.replace``), so a reader sees the old file or the new one, never half of one, and two writers at once leave one
complete file. A writer killed mid-write leaves its temporary file; the next use of the store (and the next write of
the same result file) removes such files once no live writer holds them (an advisory lock where the platform has
one, else an age of ``STALE_TEMP_AGE_S``).

A file that cannot be used is never trusted, whatever it holds: corrupt JSON, bytes that are not UTF-8, JSON nested
thousands deep, numbers too large for a float, values of the wrong type, another schema version, unknown keys,
another key, more than ``MAX_PROFILE_BYTES``, or anything but a regular file (a FIFO, a device such as /dev/zero,
a directory). ``load`` warns once and returns None, and the caller calibrates afresh and overwrites it;
``load_result_file`` raises ``ProfileCacheError``. A wrong cache entry would give a wrong plan silently; a
recalibration only costs seconds.

The directory is, in order of precedence: the ``directory`` argument, ``$HETERO_CS_CACHE_DIR``,
``$XDG_CACHE_HOME/hetero_cs``, ``~/.cache/hetero_cs``.
"""

import contextlib
import errno
import hashlib
import json
import logging
import os
import pathlib
import re
import stat
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence

from calibration.result import CalibrationResult
from hetero_cs.errors import ConfigError, ProfileCacheError

__all__ = ["MAX_PROFILE_BYTES", "SCHEMA_VERSION", "ProfileStore", "check_output_path", "default_cache_dir",
           "load_result_file", "profile_key", "save_result_file"]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
"""Version of the file layout; a file with another version is ignored (one warning) and recalibrated."""

MAX_PROFILE_BYTES = 4 * 1024 * 1024
"""Largest profile file read, bytes. A profile of 64 devices is about 100 KB; anything larger is not ours."""

STALE_TEMP_AGE_S = 3600.0
"""Where no advisory lock is available, a temporary file of ours older than this (seconds) counts as abandoned."""

_LOCKED_TEMP_AGE_S = 10.0
"""With advisory locks, an unlocked temporary file older than this (seconds) is abandoned: it covers the moments
between creating a file and locking it, and between closing it and renaming it into place."""

_KEY_PATTERN = re.compile(r"^[0-9a-f]{64}$")
_FILE_KEYS = {"schema_version", "key", "result"}
_TEMP_SUFFIX = ".tmp"

try:  # POSIX advisory locks; absent on Windows, where the age alone decides.
    import fcntl
except ImportError:  # pragma: no cover - not on the platforms tested here
    fcntl = None  # type: ignore[assignment]


def default_cache_dir() -> pathlib.Path:
    """Returns $HETERO_CS_CACHE_DIR, else $XDG_CACHE_HOME/hetero_cs, else ~/.cache/hetero_cs (not created)."""
    if explicit := os.environ.get("HETERO_CS_CACHE_DIR"):
        return pathlib.Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return pathlib.Path(xdg).expanduser() / "hetero_cs"
    return pathlib.Path.home() / ".cache" / "hetero_cs"


def profile_key(*, device_ids: Sequence[str], model_fingerprint: str, input_signature: str, tf_version: str,
                dtype_policy: str = "float32") -> str:
    """Returns the cache key of one calibration: a sha256 hex digest (64 characters).

    Args:
        device_ids: One identifier per compute device in replica order (device name plus what makes its timing
            unique: the GPU model, or the emulated catalog name and time scale). Order matters.
        model_fingerprint: From calibration.probe.model_fingerprint (layer classes, weight shapes and dtypes).
        input_signature: From calibration.probe.input_signature, plus whatever else changes the result.
        tf_version: tf.__version__ (kernels and their speed change between versions).
        dtype_policy: The model's Keras dtype policy name ("float32", "mixed_float16", "mixed_bfloat16"): a step in
            float16 on tensor cores is several times faster than in float32, and not alike on every device, so a
            profile measured under one policy never serves another.

    Raises:
        ConfigError: If device_ids is empty or an argument is not a string.
    """
    if isinstance(device_ids, str) or not device_ids or not all(isinstance(d, str) for d in device_ids):
        raise ConfigError(f"device_ids must be a non-empty sequence of strings. Received: device_ids={device_ids!r}.")
    for name, value in (("model_fingerprint", model_fingerprint), ("input_signature", input_signature),
                        ("tf_version", tf_version), ("dtype_policy", dtype_policy)):
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string. Received: {name}={value!r}.")
    payload = json.dumps({"device_ids": list(device_ids), "model_fingerprint": model_fingerprint,
                          "input_signature": input_signature, "tf_version": tf_version, "dtype_policy": dtype_policy,
                          "schema_version": SCHEMA_VERSION}, sort_keys=True)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _write_result(path: pathlib.Path, result: CalibrationResult, key: str | None, *, what: str, fix: str) -> None:
    """Writes one file atomically: ``{"schema_version", "key" (a cache entry's), "result"}``.

    Raises:
        ProfileCacheError: If the file cannot be written (the OSError is chained; the message names ``what`` and
            gives ``fix``).
    """
    document = {"schema_version": SCHEMA_VERSION, "result": result.to_dict(), **({} if key is None else {"key": key})}
    try:
        _write_atomically(path, json.dumps(document, indent=1, sort_keys=True) + "\n")
    except OSError as exc:
        raise ProfileCacheError(f"Cannot write the {what} path={str(path)!r}: {exc}. {fix}") from exc


_FILE_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _read_text(path: pathlib.Path) -> str:
    """The UTF-8 text of a regular file of at most MAX_PROFILE_BYTES.

    Never blocks on a FIFO and never reads a device: the file type is checked before and after opening.

    Raises:
        OSError: If the file is missing, a directory or unreadable.
        ProfileCacheError: If it is not a regular file, is too large, or is not UTF-8.
    """
    def refuse_special(mode: int) -> None:
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
            raise ProfileCacheError(f"it is {kind}, not a regular file; a profile is a JSON file")

    refuse_special(os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    with os.fdopen(fd, "rb") as handle:
        status = os.fstat(handle.fileno())
        refuse_special(status.st_mode)  # it may have been swapped since the first check
        data = handle.read(MAX_PROFILE_BYTES + 1)
    if len(data) > MAX_PROFILE_BYTES:
        raise ProfileCacheError(f"it holds more than MAX_PROFILE_BYTES={MAX_PROFILE_BYTES} bytes (size "
                                f"{status.st_size}); a profile is a few kilobytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProfileCacheError(f"it is not UTF-8 text ({exc})") from exc


_PARSE_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, RecursionError)
"""What parsing a hostile document can raise: JSON syntax and UTF-8 (ValueError), nesting thousands deep
(RecursionError), integers too large for a float (OverflowError), values of the wrong type (TypeError, KeyError,
IndexError, AttributeError). ProfileCacheError is a ValueError."""


def _parse(text: str, *, expected_key: str | None) -> CalibrationResult:
    """Parses one file's text; raises ProfileCacheError (chained) for anything it cannot use."""
    try:
        # NaN, Infinity and numbers too large for a float (1e400 reads as inf) parse; the field checks reject them
        # with the field's name.
        document = json.loads(text)
        if not isinstance(document, Mapping):
            raise ProfileCacheError(f"top level is {type(document).__name__}, not an object")
        if unknown := sorted(set(document) - _FILE_KEYS):
            raise ProfileCacheError(f"unknown keys {unknown}")
        if document.get("schema_version") != SCHEMA_VERSION:
            raise ProfileCacheError(
                f"schema_version={document.get('schema_version')!r}, this version reads {SCHEMA_VERSION}")
        if "result" not in document:
            raise ProfileCacheError("no 'result' entry")
        if expected_key is not None and document.get("key") != expected_key:
            raise ProfileCacheError(f"key={document.get('key')!r} does not match the file name")
        return CalibrationResult.from_dict(document["result"])
    except ProfileCacheError:
        raise
    except RecursionError as exc:
        raise ProfileCacheError("its JSON is nested too deeply") from exc
    except _PARSE_ERRORS as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        raise ProfileCacheError(message) from exc


def _remove_stale_temp_files(directory: pathlib.Path, name: str | None = None) -> list[pathlib.Path]:
    """Removes temporary files of ours that no live writer holds; returns them. ``name``: only those of that file
    (``tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp")``); None: those of any cache entry.

    A writer holds an exclusive advisory lock on its temporary file until it closes it; a killed writer's lock is
    gone. Without locks (Windows), files older than STALE_TEMP_AGE_S count as abandoned. Errors are ignored: this
    is housekeeping, and a file another process removes first is fine.
    """
    ours = re.escape(name) if name is not None else r"[0-9a-f]{64}\.json"
    pattern = re.compile(rf"^\.{ours}\.[A-Za-z0-9_]+{re.escape(_TEMP_SUFFIX)}$")
    try:
        candidates = [entry for entry in os.scandir(directory) if pattern.match(entry.name)]
    except OSError:
        return []
    removed, now = [], time.time()
    for entry in candidates:
        with contextlib.suppress(OSError):
            status = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(status.st_mode) or (
                    now - status.st_mtime <= (STALE_TEMP_AGE_S if fcntl is None else _LOCKED_TEMP_AGE_S)):
                continue
            if fcntl is not None:
                fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError (an OSError): a writer is alive
                    if os.fstat(fd).st_ino != status.st_ino:
                        continue
                    os.unlink(entry.path)
                finally:
                    os.close(fd)
            else:
                os.unlink(entry.path)
            removed.append(pathlib.Path(entry.path))
    if removed:
        logger.info("Removed %d abandoned temporary profile file(s) in %s", len(removed), directory)
    return removed


def _write_atomically(path: pathlib.Path, text: str) -> None:
    """Writes text to path via a locked temporary file in the same directory and os.replace.

    First removes temporary files an interrupted earlier write of the same path left behind.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_files(path.parent, path.name)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=_TEMP_SUFFIX)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released when the file is closed, or when this process dies
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise


def check_output_path(path: str | os.PathLike[str], *, option: str = "--output") -> pathlib.Path:
    """Checks, before any work, that a profile can be written to path; returns it as a Path.

    The path must not be a directory, and the nearest existing folder above it must be a directory this process
    can create files in (missing folders are created when the file is written).

    Raises:
        ConfigError: If the path is empty, a directory, or its folder is not a writable directory.
    """
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not text:
        raise ConfigError(f"{option} must name a file. Received: {option}={path!r}. Example: {option} profile.json.")
    target = pathlib.Path(text).expanduser()
    if target.is_dir() or text.endswith(("/", os.sep)):
        raise ConfigError(f"{option}={text!r} is a directory; it must name a file to write. Example: {option} "
                          f"{str(target / 'profile.json')!r}.")
    if target.exists() and not target.is_file():
        raise ConfigError(f"{option}={text!r} exists and is not a regular file. Name a new or a regular file.")
    folder = next((parent for parent in target.parents if parent.exists()), target.parents[-1])  # the nearest one
    problem = (f"{str(folder)!r} is not a directory" if not folder.is_dir()
               else f"the directory {str(folder)!r} is not writable" if not os.access(folder, os.W_OK | os.X_OK)
               else None)
    if problem is not None:
        raise ConfigError(f"{option}={text!r} cannot be written: {problem}. Choose a path in a writable directory.")
    return target


def save_result_file(path: str | os.PathLike[str], result: CalibrationResult) -> None:
    """Writes one result to a JSON file atomically (the format of `hetero-cs calibrate --output`).

    Raises:
        ProfileCacheError: If the file cannot be written (the OSError is chained).
    """
    _write_result(pathlib.Path(path), result, None, what="calibration profile", fix="Choose a writable path.")


def load_result_file(path: str | os.PathLike[str]) -> CalibrationResult:
    """Reads a file written by save_result_file (or a ProfileStore entry).

    Raises:
        ProfileCacheError: If the file is missing, unreadable, corrupt, of another schema version or has unknown
            keys; the message names the path and says to recalibrate.
    """
    source = pathlib.Path(path)
    try:
        return _parse(_read_text(source), expected_key=None)
    except (OSError, ProfileCacheError) as exc:
        reason = " ".join(str(exc).split()).rstrip(".")  # one line, whatever the cause
        raise ProfileCacheError(f"Cannot use the calibration profile path={str(source)!r}: {reason}. "
                                "Recalibrate with `hetero-cs calibrate ... --output PATH`.") from exc


class ProfileStore:
    """A directory of cached CalibrationResults, one JSON file per profile_key (``directory``: the cache directory).

    Examples:
        >>> store = ProfileStore("/tmp/hetero_cs_cache")
        >>> key = profile_key(device_ids=["/device:GPU:0"], model_fingerprint="f", input_signature="s",
        ...                   tf_version="2.21.0")
        >>> store.load(key) is None  # a miss: calibrate, then store.save(key, result)
        True
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        """Args:
            directory: Cache directory (created on the first save); None means default_cache_dir().

        Raises:
            ConfigError: If directory is not a path, or the directory (from the argument, $HETERO_CS_CACHE_DIR or
                the default) exists but is a file.
        """
        if directory is not None and not isinstance(directory, (str, os.PathLike)):
            raise ConfigError(f"ProfileStore directory must be a path (str or os.PathLike) or None. Received: "
                              f"directory={directory!r}.")
        self.directory = pathlib.Path(directory).expanduser() if directory is not None else default_cache_dir()
        if self.directory.exists() and not self.directory.is_dir():
            env = os.environ.get("HETERO_CS_CACHE_DIR")
            source = (f"directory={str(directory)!r}" if directory is not None else f"HETERO_CS_CACHE_DIR={env!r}"
                      if env else f"the default cache directory {str(self.directory)!r}")
            raise ConfigError(f"The profile cache directory is not a directory: {source} names an existing file. "
                              "Point it at a directory (it is created if missing), or disable the cache "
                              "(profile_cache=False, --no-cache).")

    def __repr__(self) -> str:
        return f"ProfileStore(directory={str(self.directory)!r})"

    def path(self, key: str) -> pathlib.Path:
        """The file that holds key's result.

        Raises:
            ConfigError: If key is not a 64-character lowercase sha256 hex digest.
        """
        if not isinstance(key, str) or not _KEY_PATTERN.match(key):
            raise ConfigError(f"A profile key is a sha256 hex digest from profile_key(). Received: key={key!r}.")
        return self.directory / f"{key}.json"

    def load(self, key: str) -> CalibrationResult | None:
        """Returns the cached result for key, or None on a miss.

        A file that exists but cannot be used, whatever it holds (see the module docstring), gives one
        warnings.warn (UserWarning, naming the file and the reason) and None, so the caller recalibrates and
        overwrites it. Temporary files that interrupted writes left in the directory are removed first.

        Raises:
            ConfigError: If key is malformed.
        """
        path = self.path(key)
        _remove_stale_temp_files(self.directory)
        try:
            result = _parse(_read_text(path), expected_key=key)
        except FileNotFoundError:
            logger.debug("Profile cache miss: %s", path)
            return None
        except OSError as exc:
            warnings.warn(f"Cannot read the profile cache file {str(path)!r} ({exc}); recalibrating.", stacklevel=2)
            return None
        except ProfileCacheError as exc:
            reason = " ".join(str(exc).split()).rstrip(".")
            warnings.warn(f"Ignoring the unusable profile cache file {str(path)!r}: {reason}. Recalibrating; the file "
                          "will be overwritten.", stacklevel=2)
            return None
        logger.debug("Profile cache hit: %s", path)
        return result

    def save(self, key: str, result: CalibrationResult) -> pathlib.Path:
        """Stores result under key atomically; returns the file written.

        Raises:
            ConfigError: If key is malformed.
            ProfileCacheError: If the file cannot be written (the OSError is chained).
        """
        path = self.path(key)
        _write_result(path, result, key, what="profile cache file", fix="Set HETERO_CS_CACHE_DIR to a writable "
                      "directory, or disable the cache (profile_cache=False, --no-cache).")
        logger.debug("Profile cache saved: %s", path)
        return path
