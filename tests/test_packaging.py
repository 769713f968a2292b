"""A non-editable install ships everything the source tree has, checked without building a wheel.

``pip install .`` takes the packages setuptools finds (folders with an ``__init__.py``: pyproject.toml
sets ``namespaces = false``) and, of the other files, only those matching the package-data globs
of pyproject.toml. An editable install hides both mistakes because it reads the source tree; these
tests catch them. ``make check-wheel`` (scripts/ci/check_wheel.sh) checks a real wheel end to end.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_slim"
_NOT_SOURCE = {"__pycache__"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _files() -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(PACKAGE):
        dirnames[:] = [
            d for d in dirnames if d not in _NOT_SOURCE and not d.startswith(".") and not d.endswith(".egg-info")
        ]
        out += [Path(dirpath) / f for f in filenames if not f.endswith((".pyc", ".pyo")) and not f.startswith(".")]
    return sorted(out)


def test_every_folder_of_python_files_is_a_package():
    folders = {f.parent for f in _files() if f.suffix == ".py"}
    missing = sorted(str(d.relative_to(ROOT)) for d in folders if not (d / "__init__.py").is_file())
    assert not missing, f"folders with .py files but no __init__.py (left out of a wheel): {missing}"


def test_packages_found_by_pyproject_are_every_python_folder():
    find = _pyproject()["tool"]["setuptools"]["packages"]["find"]
    assert find.get("namespaces") is False and find["include"] == ["megatron_slim", "megatron_slim.*"]
    setuptools = pytest.importorskip("setuptools")
    found = set(setuptools.find_packages(where=str(ROOT), include=find["include"]))
    folders = {".".join(f.parent.relative_to(ROOT).parts) for f in _files() if f.suffix == ".py"}
    assert found == folders


def test_every_non_python_file_is_package_data():
    """Each file under megatron_slim/ that is not Python matches a package-data glob of its package
    (setuptools resolves a glob against the package's folder, as ``Path.glob`` does here)."""
    config = _pyproject()["tool"]["setuptools"]
    assert config.get("include-package-data") is False  # the globs are the whole story
    package_data: dict[str, list[str]] = config["package-data"]
    covered: set[Path] = set()
    for package, globs in package_data.items():
        packages = (
            [d for d in {f.parent for f in _files()} if (d / "__init__.py").is_file()]
            if package == "*"
            else [ROOT.joinpath(*package.split("."))]
        )
        for folder in packages:
            for pattern in globs:
                covered.update(p for p in folder.glob(pattern) if p.is_file())
    data = [f for f in _files() if f.suffix != ".py"]
    missing = sorted(str(f.relative_to(ROOT)) for f in data if f not in covered)
    assert not missing, f"files under megatron_slim/ that no package-data glob in pyproject.toml ships: {missing}"
    shipped = {f.relative_to(PACKAGE).as_posix() for f in data}
    assert {"py.typed", "configs/tiny-cpu.yaml", "configs/hardware/cpu.yaml"} <= shipped


def test_configs_are_found_inside_the_package(monkeypatch):
    from megatron_slim.plan.hardware import available_profiles
    from megatron_slim.plan.paths import CONFIGS_ENV, config_dir
    from megatron_slim.plan.recipe import available_recipes

    monkeypatch.delenv(CONFIGS_ENV, raising=False)
    assert config_dir() == PACKAGE / "configs"
    assert {"tiny-cpu", "llama2-7b-64k"} <= set(available_recipes())
    assert {"cpu", "h100"} <= set(available_profiles())


def test_configs_env_overrides_the_folder(monkeypatch, tmp_path):
    from megatron_slim.plan.paths import CONFIGS_ENV, config_dir
    from megatron_slim.plan.recipe import available_recipes

    (tmp_path / "hardware").mkdir()
    (tmp_path / "mine.yaml").write_text((PACKAGE / "configs" / "tiny-cpu.yaml").read_text())
    monkeypatch.setenv(CONFIGS_ENV, str(tmp_path))
    assert config_dir() == tmp_path and available_recipes() == ["mine"]


def test_one_version_source():
    import megatron_slim

    project = _pyproject()["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert _pyproject()["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "megatron_slim.__version__"}
    assert megatron_slim.__version__


def test_the_metadata_names_license_authors_and_pythons_and_plots_are_an_extra():
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0" and (ROOT / "LICENSE").is_file()
    assert project["license-files"] == ["LICENSE"] and project["authors"] and project["urls"]
    assert project["requires-python"] == ">=3.11"  # the Pythons CI runs (3.11, 3.12)
    hard = " ".join(project["dependencies"])
    assert "matplotlib" not in hard and any("matplotlib" in d for d in project["optional-dependencies"]["plot"])
