"""The TensorFlow / Keras versions hetero_cs supports: the one place that says so.

hetero_cs patches private Keras and TensorFlow internals (``hetero_cs/engine/_compat``), so it works only with the
versions it was tested on. The range below is what ``setup.cfg``'s ``install_requires`` pins (a unit test keeps
them equal, and docs/versions.md quotes it) and what a version error names. Lower bounds: the
oldest pair ``tox -e oldest`` runs; upper bounds: just above the newest tested pair (TensorFlow 2.21.x,
Keras 3.15.x). Pure: importing this module loads neither TensorFlow nor Keras.
"""

import sys

# name -> (lowest supported, first unsupported), as in setup.cfg: tensorflow>=2.16.2,<2.22 and keras>=3.8,<3.16.
SUPPORTED_VERSIONS: dict[str, tuple[str, str]] = {"tensorflow": ("2.16.2", "2.22"), "keras": ("3.8", "3.16")}


def requirement(name: str) -> str:
    """The pip requirement of ``name``, e.g. ``"keras>=3.8,<3.16"`` (what setup.cfg lists)."""
    low, high = SUPPORTED_VERSIONS[name]
    return f"{name}>={low},<{high}"


def supported_range() -> str:
    """E.g. ``"tensorflow>=2.16.2,<2.22 with keras>=3.8,<3.16"``."""
    return " with ".join(requirement(name) for name in SUPPORTED_VERSIONS)


def installed_version(name: str) -> str:
    """The version of ``name`` this process runs (the loaded module's ``__version__``), or what pip installed."""
    if version := getattr(sys.modules.get(name), "__version__", None):
        return str(version)
    try:
        from importlib import metadata

        return metadata.version(name)
    except Exception:  # noqa: BLE001 - not installed, or no metadata: say so in the message
        return "unknown"


def unsupported_installed() -> list[str]:
    """The installed packages outside the supported range, e.g. ``["keras 3.16.0"]`` (unknown versions: none).

    Pre-releases count as their release (``2.22.0rc1`` is 2.22.0), as the ranges in setup.cfg mean them.
    """
    from packaging.version import InvalidVersion, Version  # TensorFlow's and Keras' own dependency

    outside = []
    for name, (low, high) in SUPPORTED_VERSIONS.items():
        version = installed_version(name)
        try:
            release = Version(version).release
        except InvalidVersion:
            continue
        if not Version(low).release <= release < Version(high).release:
            outside.append(f"{name} {version}")
    return outside


def version_advice() -> str:
    """The sentence every version error ends with: what is installed, what is supported, the fix."""
    installed = ", ".join(f"{name} {installed_version(name)}" for name in SUPPORTED_VERSIONS)
    return (f"Installed: {installed}; hetero_cs supports {supported_range()} (the newest tested pair is tensorflow "
            f"2.21 with keras 3.15). Install a supported pair, e.g. pip install '{requirement('tensorflow')}' "
            f"'{requirement('keras')}'.")
