"""disttrain installed as docs/install.md tells a user to: a wheel of this checkout, built without downloading
anything, installed with ``--no-deps`` into another virtual environment that already has torch, Lightning and the
rest (the test suite's own packages, seen through a ``.pth`` file: ``--system-site-packages`` would only show the
base interpreter's). Its console scripts run and ``disttrain`` is imported from the wheel, not from ``src/``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow  # a wheel build and three interpreters: about 20 s


def run(*argv: str | Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)
    assert proc.returncode == 0, f"{' '.join(map(str, argv))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The ``bin/`` of a fresh virtual environment where the wheel of this checkout is installed."""
    tmp = tmp_path_factory.mktemp("install")
    # a copy of what the build reads: setuptools writes build/ and *.egg-info next to the sources it builds
    project = tmp / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    shutil.copytree(ROOT / "src", project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    wheels = tmp / "wheels"
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
        "-w", wheels, project)
    venv = tmp / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    # the existing environment's packages, with its .pth files processed, after the new environment's own
    (site / "existing-environment.pth").write_text(
        f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    # --ignore-installed: the suite's environment has disttrain itself (editable); pip must neither skip the wheel
    # for it nor try to remove it
    run(python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed",
        *sorted(wheels.glob("disttrain-*.whl")), env=clean_env())
    return venv / "bin"


def clean_env() -> dict[str, str]:
    """The environment without this checkout on PYTHONPATH and without the suite's virtual environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PYTHONWARNINGS="ignore", PYTHONNOUSERSITE="1")
    return env


def test_the_wheel_holds_the_package_and_both_console_scripts(installed):
    wheel = next((installed.parents[1] / "wheels").glob("disttrain-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert all(n.startswith(("disttrain/", "disttrain-")) for n in names), [n for n in names if "/" not in n]
    assert "disttrain/_bootstrap.py" in names  # what the launcher runs in each process
    assert "disttrain/vision/digits.npz" in names  # the ViT demo's data
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "disttrain = disttrain.cli:main" in entry_points and "lightning = disttrain.cli:lightning_main" in entry_points


def test_installed_disttrain_is_the_wheel_and_its_commands_run(installed, tmp_path):
    env = clean_env()
    where = run(installed / "python", "-c", "import disttrain; print(disttrain.__file__)", env=env, cwd=tmp_path)
    assert Path(where.strip()).is_relative_to(installed.parent / "lib"), where  # not src/ of this checkout
    from disttrain.parallel.registry import STRATEGIES

    listed = run(installed / "disttrain", "strategies", env=env, cwd=tmp_path)
    assert [line.split()[0] for line in listed.splitlines()] == [row.name for row in STRATEGIES]
    proc = subprocess.run([installed / "lightning"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 2 and "usage: lightning run model SCRIPT" in proc.stderr
