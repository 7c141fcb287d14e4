"""On-disk cache of calibration results, keyed by devices, model, input and TensorFlow version (pure: no TF).

One JSON file per key, ``<directory>/<key>.json``::

    {"schema_version": 1, "key": "<sha256 hex>", "result": {...CalibrationResult.to_dict()...}}

Files are written atomically (a temporary file in the same directory, fsync, then ``os.replace``), so a reader sees
the old file or the new one, never half of one, and two writers at once leave one complete file. A file that cannot
be used (corrupt JSON, another schema version, unknown keys, another key) is never trusted: ``load`` warns once and
returns None, and the caller calibrates afresh and overwrites it. A wrong cache entry would give a wrong plan
silently; a recalibration only costs seconds.

The directory is, in order of precedence: the ``directory`` argument, ``$HETERO_CS_CACHE_DIR``,
``$XDG_CACHE_HOME/hetero_cs``, ``~/.cache/hetero_cs``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pathlib
import re
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from calibration.result import CalibrationResult
from hetero_cs.errors import ConfigError, ProfileCacheError

__all__ = ["SCHEMA_VERSION", "ProfileStore", "default_cache_dir", "load_result_file", "profile_key",
           "save_result_file"]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
"""Version of the file layout; a file with another version is ignored (one warning) and recalibrated."""

_KEY_PATTERN = re.compile(r"^[0-9a-f]{64}$")
_FILE_KEYS = {"schema_version", "key", "result"}


def default_cache_dir() -> pathlib.Path:
    """Returns $HETERO_CS_CACHE_DIR, else $XDG_CACHE_HOME/hetero_cs, else ~/.cache/hetero_cs (not created)."""
    explicit = os.environ.get("HETERO_CS_CACHE_DIR")
    if explicit:
        return pathlib.Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return pathlib.Path(xdg).expanduser() / "hetero_cs"
    return pathlib.Path.home() / ".cache" / "hetero_cs"


def profile_key(*, device_ids: Sequence[str], model_fingerprint: str, input_signature: str, tf_version: str) -> str:
    """Returns the cache key of one calibration: a sha256 hex digest (64 characters).

    Args:
        device_ids: One identifier per compute device in replica order (device name plus what makes its timing
            unique: the GPU model, or the emulated catalog name and time scale). Order matters.
        model_fingerprint: From calibration.probe.model_fingerprint (layer classes, weight shapes and dtypes).
        input_signature: From calibration.probe.input_signature, plus whatever else changes the result.
        tf_version: tf.__version__ (kernels and their speed change between versions).

    Raises:
        ConfigError: If device_ids is empty or an argument is not a string.
    """
    if isinstance(device_ids, str) or not device_ids or not all(isinstance(d, str) for d in device_ids):
        raise ConfigError(f"device_ids must be a non-empty sequence of strings. Received: device_ids={device_ids!r}.")
    for name, value in (("model_fingerprint", model_fingerprint), ("input_signature", input_signature),
                        ("tf_version", tf_version)):
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string. Received: {name}={value!r}.")
    payload = json.dumps(
        {"device_ids": list(device_ids), "model_fingerprint": model_fingerprint,
         "input_signature": input_signature, "tf_version": tf_version, "schema_version": SCHEMA_VERSION},
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _document(result: CalibrationResult, key: str | None) -> dict[str, Any]:
    document: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "result": result.to_dict()}
    if key is not None:
        document["key"] = key
    return document


def _result_from_document(document: Any, *, expected_key: str | None) -> CalibrationResult:
    """Parses one file's JSON value; raises ProfileCacheError on any mismatch."""
    if not isinstance(document, Mapping):
        raise ProfileCacheError(f"top level is {type(document).__name__}, not an object")
    unknown = sorted(set(document) - _FILE_KEYS)
    if unknown:
        raise ProfileCacheError(f"unknown keys {unknown}")
    if document.get("schema_version") != SCHEMA_VERSION:
        raise ProfileCacheError(
            f"schema_version={document.get('schema_version')!r}, this version reads {SCHEMA_VERSION}"
        )
    if "result" not in document:
        raise ProfileCacheError("no 'result' entry")
    if expected_key is not None and document.get("key") != expected_key:
        raise ProfileCacheError(f"key={document.get('key')!r} does not match the file name")
    return CalibrationResult.from_dict(document["result"])


def _write_atomically(path: pathlib.Path, text: str) -> None:
    """Writes text to path via a temporary file in the same directory and os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise


def save_result_file(path: str | os.PathLike[str], result: CalibrationResult) -> None:
    """Writes one result to a JSON file atomically (the format of `python -m calibration --output`).

    Raises:
        ProfileCacheError: If the file cannot be written (the OSError is chained).
    """
    target = pathlib.Path(path)
    try:
        _write_atomically(target, json.dumps(_document(result, None), indent=1, sort_keys=True) + "\n")
    except OSError as exc:
        raise ProfileCacheError(
            f"Cannot write the calibration profile path={str(target)!r}: {exc}. Choose a writable path."
        ) from exc


def load_result_file(path: str | os.PathLike[str]) -> CalibrationResult:
    """Reads a file written by save_result_file (or a ProfileStore entry).

    Raises:
        ProfileCacheError: If the file is missing, unreadable, corrupt, of another schema version or has unknown
            keys; the message names the path and says to recalibrate.
    """
    source = pathlib.Path(path)
    try:
        document = json.loads(source.read_text(encoding="utf-8"))
        return _result_from_document(document, expected_key=None)
    except (OSError, ValueError) as exc:  # ProfileCacheError and JSONDecodeError are ValueErrors.
        raise ProfileCacheError(
            f"Cannot use the calibration profile path={str(source)!r}: {str(exc).rstrip('.')}. "
            "Recalibrate with `python -m calibration ... --output PATH`."
        ) from exc


class ProfileStore:
    """A directory of cached CalibrationResults, one JSON file per profile_key.

    Example:
        >>> store = ProfileStore("/tmp/hetero_cs_cache")
        >>> key = profile_key(device_ids=["/device:GPU:0"], model_fingerprint="f", input_signature="s",
        ...                   tf_version="2.21.0")
        >>> store.load(key) is None  # a miss: calibrate, then store.save(key, result)
        True
    """

    profile_key = staticmethod(profile_key)

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        """Args:
            directory: Cache directory (created on the first save); None means default_cache_dir().

        Raises:
            ConfigError: If directory is not a path, or the directory (from the argument, $HETERO_CS_CACHE_DIR or
                the default) exists but is a file.
        """
        if directory is not None and not isinstance(directory, (str, os.PathLike)):
            raise ConfigError(
                f"ProfileStore directory must be a path (str or os.PathLike) or None. Received: directory={directory!r}."
            )
        self._directory = pathlib.Path(directory).expanduser() if directory is not None else default_cache_dir()
        if self._directory.exists() and not self._directory.is_dir():
            if directory is not None:
                source = f"directory={str(directory)!r}"
            elif os.environ.get("HETERO_CS_CACHE_DIR"):
                source = f"HETERO_CS_CACHE_DIR={os.environ['HETERO_CS_CACHE_DIR']!r}"
            else:
                source = f"the default cache directory {str(self._directory)!r}"
            raise ConfigError(
                f"The profile cache directory is not a directory: {source} names an existing file. Point it at a "
                "directory (it is created if missing), or disable the cache (profile_cache=False, --no-cache)."
            )

    def __repr__(self) -> str:
        return f"ProfileStore(directory={str(self._directory)!r})"

    @property
    def directory(self) -> pathlib.Path:
        """The cache directory."""
        return self._directory

    def path(self, key: str) -> pathlib.Path:
        """The file that holds key's result.

        Raises:
            ConfigError: If key is not a 64-character lowercase sha256 hex digest.
        """
        if not isinstance(key, str) or not _KEY_PATTERN.match(key):
            raise ConfigError(f"A profile key is a sha256 hex digest from profile_key(). Received: key={key!r}.")
        return self._directory / f"{key}.json"

    def load(self, key: str) -> CalibrationResult | None:
        """Returns the cached result for key, or None on a miss.

        A file that exists but cannot be used gives one warnings.warn (UserWarning, naming the file and the reason)
        and None, so the caller recalibrates and overwrites it.

        Raises:
            ConfigError: If key is malformed.
        """
        path = self.path(key)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            logger.debug("Profile cache miss: %s", path)
            return None
        except OSError as exc:
            warnings.warn(f"Cannot read the profile cache file {str(path)!r} ({exc}); recalibrating.", stacklevel=2)
            return None
        try:
            result = _result_from_document(json.loads(text), expected_key=key)
        except ValueError as exc:  # JSONDecodeError and ProfileCacheError are ValueErrors.
            warnings.warn(
                f"Ignoring the unusable profile cache file {str(path)!r}: {exc}. Recalibrating; the file will be "
                "overwritten.",
                stacklevel=2,
            )
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
        try:
            _write_atomically(path, json.dumps(_document(result, key), indent=1, sort_keys=True) + "\n")
        except OSError as exc:
            raise ProfileCacheError(
                f"Cannot write the profile cache file path={str(path)!r}: {exc}. Set HETERO_CS_CACHE_DIR to a "
                "writable directory or pass store=False."
            ) from exc
        logger.debug("Profile cache saved: %s", path)
        return path
