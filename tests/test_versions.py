"""The version table of docs/install.md equals what pyproject.toml and the Makefile say (docs/versions.py generates it),
and the check names the row that drifted."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def versions_module():
    spec = importlib.util.spec_from_file_location("docs_versions", ROOT / "docs" / "versions.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def sources() -> tuple[str, str]:
    return (ROOT / "pyproject.toml").read_text(), (ROOT / "Makefile").read_text()


def test_version_table_equals_pyproject_and_makefile():
    versions = versions_module()
    problems = versions.problems(versions.PAGE.read_text(), *sources())
    assert not problems, "\n".join(problems) + "\nregenerate the table with: python docs/versions.py --write"


def test_version_table_has_every_package_either_file_names():
    versions = versions_module()
    pyproject, makefile = sources()
    names = [p.name for p in versions.packages(pyproject, makefile)]
    assert names[:4] == ["Python", "torch", "torchvision", "lightning"]
    for wanted in ("deepspeed", "transformers", "peft", "torchao", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu"):
        assert wanted in names, names
    rows = {row.split("|")[1].strip(): row for row in versions.table(pyproject, makefile)}
    assert "`==1.9.2` (`--no-deps`)" in rows["`torchrec`"]
    assert "where `nvidia-smi` is not" in rows["`fbgemm-gpu-cpu`"] and "(extra `deepspeed`)" in rows["`deepspeed`"]


def test_version_check_names_a_changed_pin_bound_and_package():
    versions = versions_module()
    pyproject, makefile = sources()
    page = versions.PAGE.read_text()
    assert "torch==2.14.1" in makefile and '"lightning>=2.6,<2.7"' in pyproject and '"xxhash>=3.4",' in pyproject
    makefile = makefile.replace("torch==2.14.1", "torch==2.15.0")
    pyproject = pyproject.replace('"lightning>=2.6,<2.7"', '"lightning>=2.6,<2.8"')
    pyproject = pyproject.replace('"xxhash>=3.4",', '"xxhash>=3.4", "einops>=0.8",')
    found = versions.problems(page, pyproject, makefile)
    assert sorted(found) == sorted([
        "missing row for einops: | `einops` | `>=0.8` | `>=0.8` |",
        "row for torch shows '| `torch` | `>=2.6` | `==2.14.1` |', generated '| `torch` | `>=2.6` | `==2.15.0` |'",
        "row for lightning shows '| `lightning` | `>=2.6,<2.7` | `>=2.6,<2.7` |', generated"
        " '| `lightning` | `>=2.6,<2.8` | `>=2.6,<2.8` |'"]), found
    assert versions.problems(versions.regenerate(page, pyproject, makefile), pyproject, makefile) == []
