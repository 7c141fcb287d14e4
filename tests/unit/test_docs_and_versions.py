"""The docs and the packaging agree with what is tested (pure: reads files only).

The README is the entrance; the sections it held are pages under docs/ (tests/unit/test_docs_site.py checks the
site itself: navigation, links, snippets)."""

from __future__ import annotations

import configparser
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
VERSIONS = (ROOT / "docs" / "versions.md").read_text(encoding="utf-8")
ERRORS = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")


def _page(name: str) -> str:
    return (ROOT / "docs" / name).read_text(encoding="utf-8")


def _setup_requirements() -> dict[str, str]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = [line.strip() for line in config["options"]["install_requires"].splitlines() if line.strip()]
    return dict(re.match(r"^([A-Za-z0-9_.-]+)(.*)$", line).groups() for line in lines)


def _oldest_pins() -> dict[str, str]:
    config = configparser.ConfigParser()
    config.read(ROOT / "tox.ini")
    deps = [line.strip() for line in config["testenv:oldest"]["deps"].splitlines() if line.strip()]
    return dict(line.split("==") for line in deps)


def test_the_oldest_tox_pair_is_the_lower_bound_of_the_requirements():
    requirements, pins = _setup_requirements(), _oldest_pins()
    assert set(pins) == {"tensorflow", "keras"}
    for name, version in pins.items():
        bound = requirements[name]
        assert bound.startswith(">="), f"{name}{bound}"
        lowest = bound[2:].split(",")[0]
        assert tuple(map(int, version.split("."))) == tuple(map(int, (lowest + ".0.0").split(".")[:3])), (
            f"tox -e oldest pins {name}=={version}, setup.cfg allows {name}{bound}")


def test_keras_before_3_8_is_not_allowed():
    assert _setup_requirements()["keras"].split(",")[0] == ">=3.8"


def test_the_requirements_are_the_supported_range_with_upper_bounds():
    from hetero_cs import _supported

    requirements = _setup_requirements()
    for name, (low, high) in _supported.SUPPORTED_VERSIONS.items():
        assert name + requirements[name] == _supported.requirement(name) == f"{name}>={low},<{high}"
    # The newest tested pair (what CI runs) sits inside the range: TensorFlow 2.21.x, Keras 3.15.x.
    assert _supported.SUPPORTED_VERSIONS == {"tensorflow": ("2.16.2", "2.22"), "keras": ("3.8", "3.16")}


def test_the_docs_quote_the_supported_range():
    from hetero_cs import _supported

    for name in _supported.SUPPORTED_VERSIONS:
        assert f"`{_supported.requirement(name)}`" in VERSIONS
        assert _supported.requirement(name) in ERRORS   # what to do about an UnsupportedVersionError
    assert "UnsupportedVersionError" in VERSIONS and "`UnsupportedVersionError`" in ERRORS


def test_ci_runs_the_newest_pair_only():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "tox -e py" in ci and "oldest" not in ci


def test_the_docs_say_which_pairs_are_tested():
    pins = _oldest_pins()
    assert f"| {pins['tensorflow']} | {pins['keras']} |" in VERSIONS
    assert "tox -e oldest" in VERSIONS


@pytest.mark.parametrize("topic", ["When not to use it", "MirroredStrategy", "saturates PCIe", "600 MB"])
def test_the_readme_covers_what_a_newcomer_asks(topic):
    assert topic in README


@pytest.mark.parametrize("page,topic", [("real_gpus.md", "set_logical_device_configuration"),
                                        ("main_job.md", "quiet machine"), ("command_line.md", "profile="),
                                        ("command_line.md", "--model package.module:function")])
def test_the_docs_cover_what_a_newcomer_asks(page, topic):
    assert topic in _page(page)
