"""hetero-cs calibrate --model package.module:function imports the user's package from the working directory."""

import sys

from calibration.user_model import load_model_function


def test_the_users_package_is_found_in_the_working_directory_without_it_on_the_path(tmp_path, monkeypatch):
    # The console script, unlike `python -m calibration`, starts without the working directory on sys.path.
    package = tmp_path / "hcs_cwd_models"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text("def build_model():\n    return 'built'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "hcs_cwd_models", raising=False)
    monkeypatch.delitem(sys.modules, "hcs_cwd_models.models", raising=False)
    assert load_model_function("hcs_cwd_models.models:build_model")() == "built"
