"""The README and the packaging agree with what is tested (pure: reads files only)."""

from __future__ import annotations

import configparser
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


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


def test_the_readme_quotes_the_supported_range():
    from hetero_cs import _supported

    section = README.split("## Versions", 1)[1].split("\n## ", 1)[0]
    for name in _supported.SUPPORTED_VERSIONS:
        assert f"`{_supported.requirement(name)}`" in section
    assert "UnsupportedVersionError" in section and "UnsupportedVersionError" in README.split("## Versions")[0]


def test_ci_runs_the_newest_pair_only():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "tox -e py" in ci and "oldest" not in ci


def test_the_readme_says_which_pairs_are_tested():
    section = README.split("## Versions", 1)[1].split("\n## ", 1)[0]
    pins = _oldest_pins()
    assert f"| {pins['tensorflow']} | {pins['keras']} |" in section
    assert "tox -e oldest" in section


@pytest.mark.parametrize("topic", ["When not to use it", "MirroredStrategy", "saturates PCIe", "600 MB",
                                   "set_logical_device_configuration", "quiet machine", "profile=",
                                   "--model package.module:function"])
def test_the_readme_covers_what_a_newcomer_asks(topic):
    assert topic in README


def test_the_readme_python_snippets_are_valid_python():
    snippets = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert len(snippets) >= 4
    for snippet in snippets:
        compile(snippet.replace("[...]", "[]"), "README.md", "exec")
