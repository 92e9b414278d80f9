"""CITATION.cff and CHANGELOG.md stay in step with the package: the citation's version is pyproject's, and the
changelog keeps Keep a Changelog's shape (an Unreleased section, dated version sections, known change types)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def project_version() -> str:
    return re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


def test_citation_file_is_cff_1_2_0_with_the_package_version():
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0"
    assert cff["title"] == "disttrain" and cff["message"] and cff["type"] == "software"
    assert cff["authors"] and all("name" in a or "family-names" in a for a in cff["authors"])
    assert str(cff["version"]) == project_version(), "CITATION.cff's version is not pyproject.toml's"
    assert cff["license"] == "Apache-2.0"


def test_changelog_has_keep_a_changelog_sections():
    text = (ROOT / "CHANGELOG.md").read_text()
    versions = re.findall(r"^## \[([^\]]+)\](?: - (\S+))?$", text, re.M)
    assert versions and versions[0][0] == "Unreleased", "the first section is ## [Unreleased]"
    for version, date in versions[1:]:
        assert re.fullmatch(r"\d+\.\d+\.\d+", version) and re.fullmatch(r"\d{4}-\d{2}-\d{2}", date), (version, date)
    kinds = set(re.findall(r"^### (\w+)$", text, re.M))
    assert kinds and kinds <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, kinds
