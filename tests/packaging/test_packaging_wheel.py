"""The wheel that ``pip install trainguard`` installs: every package directory of the checkout is
in it, under the import name pyproject's package-dir gives it, with the data files the code reads.

The wheel is built from a copy of the files the Dockerfile copies (so nothing is written into the
checkout), by pip in an isolated build environment (the build backend pyproject.toml requires).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
#: Source folder -> the import name pyproject's package-dir installs it under.
SOURCE_TO_IMPORT = {"trainguard": "trainguard", "service": "trainguard.service",
                    "dashboards": "trainguard.dashboards", "trainer_agent": "trainer_agent"}
#: What a build reads from the checkout (the Dockerfile copies the same).
BUILD_INPUTS = ("pyproject.toml", "README.md", "LICENSE", *SOURCE_TO_IMPORT)


def package_dirs(root: Path = ROOT) -> dict[str, str]:
    """Every folder under the four source folders that holds an ``__init__.py`` -> the path its
    ``__init__.py`` must have inside the wheel."""
    found = {}
    for source, import_name in SOURCE_TO_IMPORT.items():
        for init in sorted((root / source).rglob("__init__.py")):
            relative = init.parent.relative_to(root / source)
            if "__pycache__" in relative.parts:
                continue
            installed = Path(*import_name.split("."), relative, "__init__.py").as_posix()
            found[init.parent.relative_to(root).as_posix()] = installed
    return found


def build_wheel(source_root: Path, out: Path) -> Path:
    work = out / "src"
    work.mkdir()
    for name in BUILD_INPUTS:
        src = source_root / name
        if src.is_dir():
            shutil.copytree(src, work / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, work / name)
    # An isolated build, as a user's pip runs it: the build backend pyproject names, from the index.
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-v",
                           "-w", str(out / "dist"), str(work)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    (out / "build.log").write_text(done.stdout + done.stderr, encoding="utf-8")
    (wheel,) = (out / "dist").glob("trainguard-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(ROOT, tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def wheel_names(wheel) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def test_the_wheel_declares_its_license_and_carries_its_text(wheel) -> None:
    """The license pyproject declares (an SPDX expression) and the checkout's LICENSE file, in the
    wheel's .dist-info/licenses/ (PEP 639), where pip installs it."""
    with zipfile.ZipFile(wheel) as zf:
        (dist_info,) = {n.split("/")[0] for n in zf.namelist() if n.split("/")[0].endswith(".dist-info")}
        metadata = zf.read(f"{dist_info}/METADATA").decode().split("\n\n")[0].splitlines()
        assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
        assert zf.read(f"{dist_info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0, January 2004" in (ROOT / "LICENSE").read_text()


def test_every_version_the_project_states_is_the_wheels(wheel, tmp_path) -> None:
    """``pip show trainguard``, ``trainguard.__version__``, the agent's version (what a run registers),
    the controller's OpenAPI version and the Helm chart's appVersion say one version."""
    import tomllib

    import trainer_agent
    import trainguard
    from trainguard.service.app import create_app
    from trainguard.service.config import Settings

    with zipfile.ZipFile(wheel) as zf:
        (metadata,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        (version,) = [line.split(": ", 1)[1] for line in zf.read(metadata).decode().splitlines() if line.startswith("Version: ")]
    chart = yaml.safe_load((ROOT / "deploy/helm/trainguard/Chart.yaml").read_text(encoding="utf-8"))
    stated = {
        "pyproject.toml": tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"],
        "trainguard.__version__": trainguard.__version__,
        "trainer_agent.__version__": trainer_agent.__version__,
        "the controller's OpenAPI": create_app(Settings(db=tmp_path / "tg.db")).version,
        "Chart.yaml appVersion": chart["appVersion"],
    }
    assert stated == dict.fromkeys(stated, version)


def test_the_build_warns_of_nothing_in_the_configuration(wheel) -> None:
    """The build backend's output (``pip wheel -v``) has no Python warning (setuptools' about
    pyproject's configuration, such as a data folder it would take for a package it ignores)."""
    log = (wheel.parent.parent / "build.log").read_text(encoding="utf-8")
    assert "Stored in directory" in log, log[-2000:]
    assert re.findall(r"\.py:\d+: (\w*Warning: .*)", log) == []


def test_the_checkout_has_the_package_dirs_this_test_walks():
    dirs = package_dirs()
    # the folders the README's imports and the extras rely on, found by the walk itself
    assert {"trainer_agent/integrations", "trainer_agent/data", "service/routes", "trainguard/protocol",
            "trainguard/demo", "dashboards"} <= dirs.keys()
    assert dirs["service/routes"] == "trainguard/service/routes/__init__.py"
    assert dirs["trainer_agent/integrations"] == "trainer_agent/integrations/__init__.py"


def test_every_package_dir_is_in_the_wheel(wheel_names):
    missing = sorted(src for src, installed in package_dirs().items() if installed not in wheel_names)
    assert not missing, f"package directories missing from the wheel (pyproject.toml [tool.setuptools] packages): {missing}"
    # and every module of each package, not only its __init__
    for source, import_name in SOURCE_TO_IMPORT.items():
        for module in (ROOT / source).rglob("*.py"):
            if (module.parent / "__init__.py").is_file():
                installed = Path(*import_name.split("."), module.relative_to(ROOT / source)).as_posix()
                assert installed in wheel_names, installed


def test_no_generic_top_level_name_is_installed(wheel_names):
    top = {name.split("/")[0] for name in wheel_names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"trainguard", "trainer_agent"}


@pytest.mark.parametrize("source_glob, installed_prefix", [
    ("service/ui/*", "trainguard/service/ui/"),
    ("service/ui/vendor/**/*", "trainguard/service/ui/vendor/"),
    ("service/*.yaml", "trainguard/service/"),
    ("dashboards/generated/**/*", "trainguard/dashboards/generated/"),
    ("dashboards/promtool/*", "trainguard/dashboards/promtool/"),
    ("trainguard/demo/*.yaml", "trainguard/demo/"),
])
def test_the_data_files_the_code_reads_are_in_the_wheel(wheel_names, source_glob, installed_prefix):
    source_dir, _, pattern = source_glob.partition("/")
    base = ROOT / source_dir
    files = [p for p in base.glob(pattern) if p.is_file() and p.suffix not in (".py", ".pyc")]
    if source_glob != "trainguard/demo/*.yaml":
        assert files, source_glob
    import_name = SOURCE_TO_IMPORT[source_dir]
    for path in files:
        installed = Path(*import_name.split("."), path.relative_to(base)).as_posix()
        assert installed.startswith(installed_prefix) and installed in wheel_names, installed


def test_the_check_fails_for_a_package_list_without_a_package(tmp_path):
    """Built from a pyproject whose package list lacks trainer_agent.integrations (as 0.1.0's did),
    the wheel misses that folder and the check names it."""
    source = tmp_path / "checkout"
    source.mkdir()
    for name in BUILD_INPUTS:
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy2)(ROOT / name, source / name)
    pyproject = (source / "pyproject.toml").read_text()
    assert '"trainer_agent.integrations"' in pyproject
    (source / "pyproject.toml").write_text(pyproject.replace('    "trainer_agent.integrations",\n', "", 1))
    out = tmp_path / "out"
    out.mkdir()
    with zipfile.ZipFile(build_wheel(source, out)) as zf:
        names = set(zf.namelist())
    missing = [src for src, installed in package_dirs(source).items() if installed not in names]
    assert missing == ["trainer_agent/integrations"]
