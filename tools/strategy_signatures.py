"""The ``__init__`` of every strategy class (Trainer and Fabric), generated from its options dataclass.

    python tools/strategy_signatures.py --check   # exit 1 and one line per class whose __init__ has drifted
    python tools/strategy_signatures.py --write   # regenerate them in place

A strategy's options are its engine's options dataclass (``FSDPOptions``, ``MegatronOptions``...; ``AutoOptions`` for
``disttrain_auto``), their single source. Each adapter class in ``disttrain.strategies.ADAPTERS`` and
``disttrain.fabric.ADAPTERS`` gets an explicit ``__init__`` between two marker lines, so that ``help()``, IDEs, Sphinx
and LightningCLI (jsonargparse) see every option: Lightning's own arguments, then each field of the dataclass as a
keyword-only parameter with the field's type and default (a field whose default is built, ``field(default_factory=
dict)``, takes ``None`` for that default), and a docstring whose ``Args:`` are the dataclass docstring's entries
(read as docs/options.py reads them for the option tables). Fields the class lists in ``options_from_elsewhere`` are
left out. A class without the markers gets them at the end of its body.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import dataclasses
import inspect
import re
import sys
import textwrap
import typing
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "docs")]

import options as option_docs  # noqa: E402  (docs/options.py: the dataclass docstring parser)

BEGIN = "    # BEGIN generated options: tools/strategy_signatures.py --write, from {options} (edit the dataclass)"
END = "    # END generated options"
WIDTH = 120


@dataclasses.dataclass(frozen=True)
class Argument:
    """One of Lightning's own arguments of a strategy class: what the Trainer or Fabric sets."""

    name: str
    annotation: str
    doc: str


def lightning_arguments(entry: str) -> list[Argument]:
    """The arguments before the options, as Lightning's connector sets them (``entry``: "Trainer" or "Fabric")."""
    precision = "precision_plugin" if entry == "Trainer" else "precision"
    entry = "the Trainer" if entry == "Trainer" else "Fabric"
    return [
        Argument("accelerator", "Optional[Accelerator]", f"set by {entry} from its ``accelerator``."),
        Argument("parallel_devices", "Optional[list[torch.device]]", f"set by {entry} from its ``devices``."),
        Argument("cluster_environment", "Optional[ClusterEnvironment]", f"set by {entry} (torchrun, SLURM, ...)."),
        Argument(precision, "Optional[Precision]", f"set by {entry} from its ``precision``."),
        Argument("process_group_backend", "Optional[str]", '"gloo" or "nccl"; default: the devices\' own.'),
        Argument("timeout", "Union[float, timedelta, None]",
                 "seconds (or a ``timedelta``) a process may stay silent before every process ends the run; a"
                 " collective waits a few seconds longer. Default: ``$DISTTRAIN_TIMEOUT``, else 600."),
    ]


def adapters() -> list[tuple[type, str]]:
    """Every adapter class with its entry point ("Trainer" or "Fabric")."""
    import disttrain.fabric
    import disttrain.strategies

    return [(cls, "Trainer") for cls in disttrain.strategies.ADAPTERS] + \
           [(cls, "Fabric") for cls in disttrain.fabric.ADAPTERS]


def options_class(cls: type) -> type:
    from disttrain.parallel.registry import lookup

    return lookup(cls.strategy_name).options_cls


def option_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls``'s options dataclass that its ``__init__`` takes, in the dataclass's order."""
    elsewhere = getattr(cls, "options_from_elsewhere", {})
    return [f for f in dataclasses.fields(options_class(cls)) if f.name not in elsewhere]


def builds_default(field: dataclasses.Field) -> bool:
    return field.default_factory is not dataclasses.MISSING  # type: ignore[misc]


def field_annotation(field: dataclasses.Field) -> str:
    """The field's type as its dataclass spells it (``Optional[...]`` around it when ``None`` stands for a built
    default)."""
    if not isinstance(field.type, str):
        raise TypeError(f"{field.name}: its type is not source text; the options module needs"
                        " `from __future__ import annotations`")
    return f"Optional[{field.type}]" if builds_default(field) else field.type


def field_default(field: dataclasses.Field) -> str:
    if builds_default(field):
        return "None"
    if field.default is dataclasses.MISSING:
        raise ValueError(f"{field.name} has no default: a strategy option needs one")
    text = repr(field.default)
    if ast.literal_eval(text) != field.default:
        raise ValueError(f"{field.name}'s default {field.default!r} has no literal source form")
    return text


def field_docs(options: type) -> dict[str, str]:
    """Each field's entry in the docstring of the dataclass that declares it (bases included)."""
    docs: dict[str, str] = {}
    for cls in reversed(options.__mro__):
        if dataclasses.is_dataclass(cls):
            own = option_docs.field_docs(cls)
            docs.update({f.name: own[f.name] for f in option_docs.own_fields(cls) if f.name in own})
    return docs


def docstring(cls: type, entry: str) -> list[str]:
    options = options_class(cls)
    docs = field_docs(options)
    fields = option_fields(cls)
    missing = [f.name for f in fields if f.name not in docs]
    if missing:
        raise ValueError(f"{options.__name__}'s docstring has no `name: text` entry for {', '.join(missing)}")
    built = [f.name for f in fields if builds_default(f)]
    sets = "the Trainer sets" if entry == "Trainer" else "Fabric sets"
    intro = (f"The options of ``{cls.strategy_name}`` as keywords (:class:`~{options.__module__}.{options.__name__}`),"
             f" after the arguments {sets}.")
    if built:
        intro += f" ``None`` for {', '.join(f'``{n}``' for n in built)} is its default."
    lines = textwrap.wrap(intro, WIDTH, initial_indent='        """', subsequent_indent="        ",
                          break_on_hyphens=False, break_long_words=False)
    lines += ["", "        Args:"]
    entries = [(a.name, a.doc) for a in lightning_arguments(entry)] + [(f.name, docs[f.name]) for f in fields]
    for name, text in entries:
        if '"""' in text or "\\" in text:
            raise ValueError(f"{options.__name__}.{name}: its docstring entry holds a backslash or triple quotes")
        lines += textwrap.wrap(f"{name}: {text}", WIDTH, initial_indent=" " * 12, subsequent_indent=" " * 16,
                               break_on_hyphens=False, break_long_words=False)
    return lines + ['        """']


def packed(prefix: str, items: list[str], indent: str, end: str) -> list[str]:
    """``prefix`` then ``items`` joined by ", " and wrapped at WIDTH, continuation lines at ``indent``."""
    lines, line = [], prefix
    for i, item in enumerate(items):
        piece = item + (end if i == len(items) - 1 else ",")
        if len(line) + len(piece) + 1 > WIDTH and line.strip():
            lines.append(line.rstrip())
            line = indent
        line += ("" if line.endswith(("(", "{")) or line == indent else " ") + piece
    return lines + [line]


def generated(cls: type, entry: str) -> list[str]:
    """The lines between (and including) the markers: ``@checked_options def __init__(...)``."""
    arguments, fields = lightning_arguments(entry), option_fields(cls)
    lines = [BEGIN.format(options=options_class(cls).__name__), "    @checked_options", "    def __init__(",
             "        self,"]
    lines += [f"        {a.name}: {a.annotation} = None," for a in arguments]
    lines += ["        *,"] + [f"        {f.name}: {field_annotation(f)} = {field_default(f)}," for f in fields]
    lines += ["    ) -> None:", *docstring(cls, entry)]
    lines += packed("        options = {", [f'"{f.name}": {f.name}' for f in fields], " " * 19, "}")
    lines += packed("        self._init_adapter(", [a.name for a in arguments] + ["options"], " " * 27, ")")
    return lines + [END]


def annotation_names(cls: type, entry: str) -> set[str]:
    """The names the generated annotations use (``torch.device`` uses ``torch``)."""
    texts = [a.annotation for a in lightning_arguments(entry)] + [field_annotation(f) for f in option_fields(cls)]
    return {node.id for text in texts for node in ast.walk(ast.parse(text, mode="eval")) if isinstance(node, ast.Name)}


# Where the names of Lightning's arguments and of the generated code come from, by entry point.
HOMES = {
    "Trainer": {"Accelerator": "lightning.pytorch.accelerators", "Precision": "lightning.pytorch.plugins.precision"},
    "Fabric": {"Accelerator": "lightning.fabric.accelerators", "Precision": "lightning.fabric.plugins.precision"},
    "both": {"ClusterEnvironment": "lightning.fabric.plugins.environments", "timedelta": "datetime",
             "Optional": "typing", "Union": "typing", "torch": None, "checked_options": "disttrain._lightning"},
}


def home(name: str, entry: str, options: type) -> Optional[str]:
    """The import line that gives ``name`` (a name of an option's type, found where its dataclass imports it)."""
    known = {**HOMES["both"], **HOMES[entry]}
    if name in known:
        return f"import {name}" if known[name] is None else f"from {known[name]} import {name}"
    # the module of the dataclass that declares a field of this type (a base's, for inherited fields)
    value = next((vars(sys.modules[c.__module__])[name] for c in options.__mro__
                  if name in vars(sys.modules[c.__module__])), None)
    if value is None:
        return None
    if getattr(typing, name, None) is value:
        return f"from typing import {name}"
    if isinstance(value, type):
        return f"from {value.__module__} import {name}"
    for module_name, module in sorted(sys.modules.items()):
        if module_name.startswith("disttrain") and vars(module).get(name) is value:
            try:
                source = inspect.getsource(module)
            except (OSError, TypeError):
                continue
            if re.search(rf"^{re.escape(name)}\b[^=\n]*=", source, re.M):
                return f"from {module_name} import {name}"
    return None


def missing_imports(cls: type, entry: str, text: str) -> list[str]:
    """The import lines the generated ``__init__`` needs that its module's source ``text`` lacks (a name that cannot
    be placed is named alone)."""
    defined = set()
    for node in ast.parse(text).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.Assign)):
            defined |= {getattr(t, "id", None) for t in getattr(node, "targets", [])} | {getattr(node, "name", None)}
    needed = annotation_names(cls, entry) | {"checked_options"}
    absent = sorted(n for n in needed if n not in defined and not hasattr(builtins, n))
    return [home(name, entry, options_class(cls)) or name for name in absent]


def with_imports(text: str, lines: list[str]) -> str:
    """``text`` with ``lines`` added after its last top-level import."""
    last = max(node.end_lineno or 0 for node in ast.parse(text).body if isinstance(node, (ast.Import, ast.ImportFrom)))
    rows = text.splitlines()
    rows[last:last] = lines
    return "\n".join(rows) + "\n"


def class_block(lines: list[str], cls: type) -> tuple[int, int, Optional[tuple[int, int]]]:
    """``(first line, end line, (begin marker, end marker) or None)`` of ``cls``'s body in its module's lines."""
    start = next((i for i, line in enumerate(lines) if re.match(rf"class {cls.__name__}\b", line)), None)
    if start is None:
        raise LookupError(f"class {cls.__name__} is not at the top level of {cls.__module__}")
    end = next((i for i in range(start + 1, len(lines)) if lines[i] and not lines[i][0].isspace()
                and not lines[i].startswith(")")), len(lines))
    while end > start and not lines[end - 1].strip():
        end -= 1
    begin = next((i for i in range(start, end) if lines[i].startswith("    # BEGIN generated options")), None)
    stop = next((i for i in range(start, end) if lines[i] == END), None)
    if (begin is None) != (stop is None):
        raise ValueError(f"{cls.__module__}.{cls.__name__} has only one of the two generated-options markers")
    return start, end, (begin, stop) if begin is not None else None


def source_path(cls: type) -> Path:
    return Path(inspect.getsourcefile(cls) or "")


def regenerate(text: str, cls: type, entry: str) -> str:
    """``text`` with ``cls``'s generated ``__init__`` (at the end of the class body if it had none) and the imports
    it needs."""
    lines = text.splitlines()
    _, end, markers = class_block(lines, cls)
    new = generated(cls, entry)
    if markers is None:
        lines[end:end] = ["", *new]
    else:
        lines[markers[0]:markers[1] + 1] = new
    text = "\n".join(lines) + "\n"
    imports = [line for line in missing_imports(cls, entry, text) if line.startswith(("from ", "import "))]
    return with_imports(text, imports) if imports else text


def problems(text: str, cls: type, entry: str) -> list[str]:
    """What differs between ``cls``'s generated ``__init__`` in ``text`` and its dataclass, one line each."""
    where = f"{source_path(cls).relative_to(ROOT)}: {cls.__name__}"
    lines = text.splitlines()
    _, _, markers = class_block(lines, cls)
    if markers is None:
        return [f"{where} has no generated __init__"]
    found = []
    if lines[markers[0]:markers[1] + 1] != generated(cls, entry):
        found.append(f"{where}'s __init__ differs from {options_class(cls).__name__}")
    found += [f"{where} needs `{hint}` at the top of its module" for hint in missing_imports(cls, entry, text)]
    return found


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="report drifted classes (the default)")
    mode.add_argument("--write", action="store_true", help="regenerate them in place")
    args = parser.parse_args(argv)
    found: list[str] = []
    for cls, entry in adapters():
        path = source_path(cls)
        text = path.read_text()
        if args.write:
            new = regenerate(text, cls, entry)
            if new != text:
                path.write_text(new)
                print(f"updated {cls.__name__} in {path.relative_to(ROOT)}")
            found += [f"{path.relative_to(ROOT)}: {cls.__name__} needs `{hint}` at the top of its module"
                      for hint in missing_imports(cls, entry, new) if not hint.startswith(("from ", "import "))]
        else:
            found += problems(text, cls, entry)
    for line in found:
        print(line)
    if found and not args.write:
        print("regenerate them with: python tools/strategy_signatures.py --write")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
