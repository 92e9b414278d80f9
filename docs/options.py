"""The strategy option tables of docs/, generated from the option dataclasses (their single source).

    python docs/options.py            # check: exit 1 and one line per difference when a table has drifted
    python docs/options.py --write    # regenerate every table in place

A table sits between ``<!-- options: NAME -->`` and ``<!-- /options -->`` in any Markdown file under docs/, NAME
being a key of :func:`option_classes`. Each row is one field of the dataclass: its name, its default and what the
class docstring says of it (``name: text`` entries, continuation lines indented). Fields a dataclass inherits are
left to the base class's own table.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from pathlib import Path
from typing import Optional

DOCS = Path(__file__).resolve().parent
BEGIN = re.compile(r"^<!-- options: (\w+) -->$")
END = "<!-- /options -->"
HEADER = ["| option | default | what it does |", "|---|---|---|"]
MISSING = "(no docstring entry)"


def option_classes() -> dict[str, type]:
    """Every option dataclass a table may name: the options of each registered strategy, and their bases."""
    from disttrain.parallel.registry import STRATEGIES

    classes = {}
    for row in STRATEGIES:
        for cls in row.options_cls.__mro__:
            if dataclasses.is_dataclass(cls):
                classes[cls.__name__] = cls
    return classes


def own_fields(cls: type) -> list[dataclasses.Field]:
    """The fields ``cls`` declares itself (not those of a dataclass base)."""
    inherited = {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base)
                 for f in dataclasses.fields(base)}
    return [f for f in dataclasses.fields(cls) if f.name not in inherited]


def default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return repr(field.default_factory())  # type: ignore[misc]
    return "required"


def field_docs(cls: type) -> dict[str, str]:
    """``{field: text}`` from the class docstring's ``name: text`` (or ``a, b: text``) entries, including those that
    start a new sentence inside another entry. A field no entry names gets the text that mentions it, if any."""
    names = [f.name for f in dataclasses.fields(cls)]
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    entries: list[str] = []
    for line in lines[1:]:
        if line and not line[0].isspace():
            entries.append(line.strip())
        elif line.strip() and entries:
            entries[-1] += " " + line.strip()
    alternatives = "|".join(sorted(map(re.escape, names), key=len, reverse=True))
    start = re.compile(rf"(?:^|(?<=\. ))((?:{alternatives})(?:, (?:{alternatives}))*): ")
    docs: dict[str, str] = {}
    for entry in entries:
        found = list(start.finditer(entry))
        for i, match in enumerate(found):
            end = found[i + 1].start() if i + 1 < len(found) else len(entry)
            for name in match.group(1).split(", "):
                docs.setdefault(name, entry[match.end():end].strip().rstrip(";,"))
    for name in names:
        if name not in docs:
            mention = next((e for e in entries if f"``{name}``" in e), None)
            if mention is not None:
                owner = start.match(mention)
                docs[name] = f"see `{owner.group(1)}`" if owner else mention
    return docs


def markdown(text: str) -> str:
    return text.replace("``", "`").replace("|", "\\|")


def table(cls: type) -> list[str]:
    docs = field_docs(cls)
    rows = [f"| `{f.name}` | `{default_text(f)}` | {markdown(docs.get(f.name, MISSING))} |" for f in own_fields(cls)]
    return HEADER + rows


def parse_row(row: str) -> Optional[tuple[str, str]]:
    """``(option, default)`` of a table row, or None for a row that is not one."""
    cells = [c.strip() for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]]
    if len(cells) < 2 or not (cells[0].startswith("`") and cells[0].endswith("`")):
        return None
    return cells[0].strip("`"), cells[1].strip("`")


def problems(path: Path, text: str, classes: dict[str, type]) -> list[str]:
    """What differs between the tables in ``text`` and their dataclasses, one line each; names the missing field,
    the option no dataclass has, the wrong default, or that the text drifted."""
    out: list[str] = []
    for name, start, body in tables(text):
        where = f"{path}:{start + 1}"
        cls = classes.get(name)
        if cls is None:
            out.append(f"{where}: no option dataclass {name!r}; known: {', '.join(classes)}")
            continue
        fields = {f.name: default_text(f) for f in own_fields(cls)}
        shown = dict(filter(None, map(parse_row, body)))
        wrong = [f"{where}: {name}.{field} is missing from the table" for field in fields if field not in shown]
        wrong += [f"{where}: {name}.{field} shows default {shown[field]} but the dataclass has {default}"
                  for field, default in fields.items() if field in shown and shown[field] != default]
        wrong += [f"{where}: the table names option {option!r}, which {name} does not have"
                  for option in sorted(shown.keys() - fields.keys())]
        if not wrong and body != table(cls):
            wrong.append(f"{where}: the {name} table's text differs from the {name} docstring")
        out += wrong
    return out


def tables(text: str) -> list[tuple[str, int, list[str]]]:
    """``(class name, line index of the begin marker, the lines between the markers)`` for every table."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        match = BEGIN.match(line.strip())
        if match:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == END), None)
            if end is None:
                raise ValueError(f"line {i + 1}: {line.strip()} has no {END} after it")
            found.append((match.group(1), i, lines[i + 1:end]))
    return found


def regenerate(text: str, classes: dict[str, type]) -> str:
    lines = text.splitlines()
    for name, start, body in reversed(tables(text)):
        lines[start + 1:start + 1 + len(body)] = table(classes[name])
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="regenerate the tables in place")
    args = parser.parse_args(argv)
    classes = option_classes()
    found: list[str] = []
    for path in pages():
        text = path.read_text()
        if args.write:
            new = regenerate(text, classes)
            if new != text:
                path.write_text(new)
                print(f"updated {path.relative_to(DOCS.parent)}")
        else:
            found += problems(path.relative_to(DOCS.parent), text, classes)
    for line in found:
        print(line)
    if found:
        print("regenerate the tables with: python docs/options.py --write")
    return 1 if found else 0


if __name__ == "__main__":
    sys.path.insert(0, str(DOCS.parent / "src"))
    raise SystemExit(main())
