"""The version table of docs/install.md, generated from pyproject.toml and the Makefile (its single sources).

    python docs/versions.py            # check: exit 1 and one line per difference when the table has drifted
    python docs/versions.py --write    # regenerate the table in place

The table sits between ``<!-- versions -->`` and ``<!-- /versions -->``. One row per package that either file names:
what ``pip install`` of this project requires (``requires-python``, the dependencies, each extra's) and what ``make
install`` installs (its own pins, ``--no-deps`` where it passes that, and the requirements of the extras it asks for).
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "install.md"
BEGIN, END = "<!-- versions -->", "<!-- /versions -->"
HEADER = ["| package | `pip install` of this project requires (pyproject.toml) | `make install` installs (Makefile) |",
          "|---|---|---|"]
FIRST = ("python", "torch", "torchvision", "lightning")  # the rows a reader looks for first, in this order


@dataclass
class Package:
    name: str
    required: Optional[str] = None  # the pyproject requirement as shown
    made: Optional[str] = None  # what `make install` pins, as shown
    extras: list[str] = field(default_factory=list)


def spec_text(requirement: Requirement) -> str:
    specs = sorted(requirement.specifier, key=lambda s: s.operator not in (">=", "==", "~="))  # lower bound first
    return f"`{','.join(str(s) for s in specs)}`" if specs else "any version"


INSTALLER = re.compile(r"pip install -q uv==")  # the line that installs the installer (uv) into the environment


def venv_python(makefile: str) -> str:
    """Which interpreter the Makefile makes .venv from: the distribution's when its version is within the bounds of
    the Makefile's ``SUPPORTED`` check, else ``python3`` on PATH."""
    found = re.search(r"\(3, (\d+)\) <= sys\.version_info\[:2\] <= \(3, (\d+)\)", makefile)
    if found is None:
        raise ValueError("the Makefile's SUPPORTED check names no Python versions")
    return f"the distribution's `/usr/bin/python3` if 3.{found[1]}-3.{found[2]}, else the `python3` on PATH"


def makefile_installs(makefile: str) -> tuple[list[tuple[str, str, bool]], list[str]]:
    """What the Makefile's install rule passes to pip: ``(name, shown version, with --no-deps)`` per pinned
    package, and the extras of its ``-e ".[...]"``. A ``$(VAR)`` is expanded; ``$(shell command -v TOOL ... &&
    echo A || echo B)`` gives both, A where TOOL is found."""
    variables = dict(re.findall(r"^(\w+)\s*:?=\s*(.*)$", makefile, flags=re.M))
    rule = re.search(r"^\$\(STAMP\):.*\n((?:\t.*\n)+)", makefile, flags=re.M)
    if rule is None:
        raise ValueError("the Makefile has no `$(STAMP):` install rule")
    pins: list[tuple[str, str, bool]] = []
    extras: list[str] = []
    for line in rule.group(1).splitlines():
        for name, value in variables.items():
            line = line.replace(f"$({name})", value)
        if "pip install" not in line or INSTALLER.search(line):
            continue
        no_deps = "--no-deps" in line
        found = re.search(r'-e\s+"?\.\[([\w,-]+)\]', line)
        if found:
            extras += found.group(1).split(",")
        pattern = r"\$\(shell command -v (\S+).*?&& echo (\S+) \|\| echo (\S+)\)|(?<![\w.-])([A-Za-z][\w.-]*)==([\w.]+)"
        for found in re.finditer(pattern, line):  # in the order the line names them
            tool, with_tool, without, name, version = found.groups()
            if tool is None:
                pins.append((name, f"=={version}", no_deps))
                continue
            for req, where in ((with_tool, f"where `{tool}` is found"), (without, f"where `{tool}` is not")):
                name, version = req.split("==")
                pins.append((name, f"=={version} {where}", no_deps))
    return pins, extras


def packages(pyproject: str, makefile: str) -> list[Package]:
    project = tomllib.loads(pyproject)["project"]
    table: dict[str, Package] = {"python": Package("Python", required=f"`{project['requires-python']}`")}

    def add(requirement: Requirement, extra: Optional[str]) -> None:
        package = table.setdefault(canonicalize_name(requirement.name), Package(requirement.name))
        shown = spec_text(requirement)
        if extra is None:
            package.required = shown
        else:
            package.extras.append(extra)
            package.required = f"{shown} (extra `{extra}`)"

    for text in project.get("dependencies", []):
        add(Requirement(text), None)
    for extra, texts in project.get("optional-dependencies", {}).items():
        for text in texts:
            add(Requirement(text), extra)
    pins, made_extras = makefile_installs(makefile)
    for name, version, no_deps in pins:
        package = table.setdefault(canonicalize_name(name), Package(name))
        pin, _, where = version.partition(" ")
        shown = f"`{pin}`" + (f" {where}" if where else "")
        shown += " (`--no-deps`)" if no_deps else ""
        package.made = f"{package.made}; {shown}" if package.made else shown
    for key, package in table.items():
        if key == "python":
            package.made = venv_python(makefile)
        elif package.made is None:
            installed = package.required is not None and (
                not package.extras or any(extra in made_extras for extra in package.extras))
            package.made = package.required.split(" (extra")[0] if installed else "not installed"
        if package.required is None:
            package.required = "not listed: install it separately (above)"
    first = [table[key] for key in FIRST if key in table]
    return first + [p for key, p in table.items() if key not in FIRST]


def table(pyproject: str, makefile: str) -> list[str]:
    rows = [f"| {'Python' if p.name == 'Python' else f'`{p.name}`'} | {p.required} | {p.made} |"
            for p in packages(pyproject, makefile)]
    return HEADER + rows


def current(text: str) -> tuple[int, int]:
    """Line indexes of the begin and end markers in the page."""
    lines = [line.strip() for line in text.splitlines()]
    if BEGIN not in lines or END not in lines:
        raise ValueError(f"{PAGE.relative_to(ROOT)} has no {BEGIN} ... {END} table")
    return lines.index(BEGIN), lines.index(END)


def problems(page: str, pyproject: str, makefile: str) -> list[str]:
    """One line per row of the page's table that differs from the generated one (missing, extra or changed)."""
    start, end = current(page)
    shown = page.splitlines()[start + 1:end]
    wanted = table(pyproject, makefile)
    if shown == wanted:
        return []
    key = lambda row: row.split("|")[1].strip().strip("`")  # noqa: E731
    have, want = {key(r): r for r in shown[2:]}, {key(r): r for r in wanted[2:]}
    out = [] if shown[:2] == wanted[:2] else ["the table's header differs from the generated one"]
    out += [f"missing row for {k}: {want[k]}" for k in want if k not in have]
    out += [f"row for {k} is not in pyproject.toml or the Makefile: {have[k]}" for k in have if k not in want]
    out += [f"row for {k} shows {have[k]!r}, generated {want[k]!r}" for k in want if k in have and have[k] != want[k]]
    return out or ["the rows are in another order than generated"]


def regenerate(page: str, pyproject: str, makefile: str) -> str:
    start, end = current(page)
    lines = page.splitlines()
    lines[start + 1:end] = table(pyproject, makefile)
    return "\n".join(lines) + ("\n" if page.endswith("\n") else "")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="regenerate the table in place")
    args = parser.parse_args(argv)
    page, sources = PAGE.read_text(), ((ROOT / "pyproject.toml").read_text(), (ROOT / "Makefile").read_text())
    if args.write:
        new = regenerate(page, *sources)
        if new != page:
            PAGE.write_text(new)
            print(f"updated {PAGE.relative_to(ROOT)}")
        return 0
    found = problems(page, *sources)
    for line in found:
        print(line)
    if found:
        print("regenerate the table with: python docs/versions.py --write")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
