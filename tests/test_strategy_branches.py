"""A strategy's behaviour is declared once, by its engine's layout (disttrain.parallel.engines.layout), and read from
there: no code outside the engines and the registry branches on an engine class or a strategy name.

An AST scan of src/disttrain and recipes/ finds, outside parallel/engines/ and parallel/registry.py:
- ``isinstance(x, SomeEngine)`` / ``issubclass``, ``x is SomeEngine``, ``==``/``in`` with an engine class, a
  comparison of an ``.engine`` attribute with anything but None, and dicts keyed by engine classes;
- comparisons with a registry row (``c.row is registry.DDP``);
- ``==``/``!=``/``in``/``is``, ``startswith``/``endswith`` and ``case`` patterns with a string constant that is a
  registered name, an engine class's name, or a fragment of the names (``"disttrain_"``, ``"_offload"``,
  ``"disttrain_zero"``...).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from disttrain.parallel import registry
from disttrain.parallel.engines.base import Engine

ROOT = Path(__file__).resolve().parents[1]
SCANNED = (ROOT / "src" / "disttrain", ROOT / "recipes")
EXEMPT = ("src/disttrain/parallel/engines/", "src/disttrain/parallel/registry.py")

# Sites that still branch on a name, each with why it may. Matched by file and the branch's source text, so moving
# code does not break them; an entry that no longer matches anything is harmless (its code was rewritten).
ALLOWED = {
    # The Lightning side of the registry: each row's Trainer and Fabric adapters are the ones over its engine.
    ("src/disttrain/names.py", "lookup(cls.strategy_name).engine is row.engine"),
}


def engine_classes() -> set[str]:
    found, todo = set(), [Engine]
    while todo:
        cls = todo.pop()
        found.add(cls.__name__)
        todo += cls.__subclasses__()
    return found


ENGINES = engine_classes()
NAMES = set(registry.names())
ROWS = {name for name in registry.__all__ if isinstance(getattr(registry, name), registry.Registered)}


def names_a_strategy(value: object) -> bool:
    """A string constant that names a registered strategy or an engine class, or is a fragment of the names."""
    if not isinstance(value, str) or len(value) < 4:
        return False
    return (value in NAMES or value in ENGINES or value.startswith("disttrain_")
            or (value.startswith("_") and any(name.endswith(value) for name in NAMES)))


def elements(node: ast.AST) -> list[ast.AST]:
    return list(node.elts) if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]


def name_of(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def is_engine_class(node: ast.AST) -> bool:
    return name_of(node) in ENGINES


def is_row(node: ast.AST) -> bool:
    """``registry.DDP``, or ``DDP`` imported from the registry."""
    if isinstance(node, ast.Attribute):
        return node.attr in ROWS and name_of(node.value) == "registry"
    return isinstance(node, ast.Name) and node.id in ROWS


def is_constant_name(node: ast.AST) -> bool:
    return any(isinstance(e, ast.Constant) and names_a_strategy(e.value) for e in elements(node))


def branches(tree: ast.AST) -> list[ast.AST]:
    """The nodes of ``tree`` that branch on an engine class or a strategy name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(is_constant_name(o) for o in operands):
                found.append(node)
            elif any(is_engine_class(e) or is_row(e) for o in operands for e in elements(o)):
                found.append(node)
            elif any(name_of(o) in ("engine", "engine_cls") for o in operands) and not any(
                    isinstance(o, ast.Constant) and o.value is None for o in operands):
                found.append(node)
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("isinstance", "issubclass") and len(node.args) == 2 and \
                    any(is_engine_class(e) for e in elements(node.args[1])):
                found.append(node)
            elif isinstance(func, ast.Attribute) and func.attr in ("startswith", "endswith") and \
                    any(is_constant_name(a) for a in node.args):
                found.append(node)
        elif isinstance(node, ast.Dict) and any(k is not None and is_engine_class(k) for k in node.keys):
            found.append(node)
        elif isinstance(node, ast.MatchValue) and is_constant_name(node.value):
            found.append(node)
    return found


def scan() -> list[tuple[str, int, str]]:
    sites = []
    for folder in SCANNED:
        for path in sorted(folder.rglob("*.py")):
            where = path.relative_to(ROOT).as_posix()
            if where.startswith(EXEMPT):
                continue
            for node in branches(ast.parse(path.read_text(), filename=where)):
                sites.append((where, node.lineno, ast.unparse(node)))
    return sites


def test_nothing_outside_the_engines_branches_on_an_engine_class_or_a_strategy_name():
    found = [f"{where}:{line}: {code}" for where, line, code in scan() if (where, code) not in ALLOWED]
    assert not found, ("these branch on an engine class or a strategy name; read the engine's layout instead"
                       " (Engine.layout(options), disttrain.parallel.engines.layout):\n" + "\n".join(found))
    stale = ALLOWED - {(where, code) for where, _, code in scan()}
    assert not stale, f"allowed sites that no longer exist (remove them from ALLOWED): {sorted(stale)}"


CAUGHT = ["isinstance(engine, ZeroEngine)", "issubclass(cls, (FSDPEngine, DDPEngine))", "row.engine is MegatronEngine",
          "row.engine == RecsysEngine", "engine in (DDPEngine, FSDPEngine)", "x = {DDPEngine: 1}",
          "c.row is registry.DDP", "a.engine is b.engine", 'strategy == "disttrain_fsdp"',
          'strategy in ("disttrain_ddp", "x")', 'name.endswith("_offload")', 'name.startswith("disttrain_")',
          'name.startswith("disttrain_zero")', 'type(engine).__name__ == "ZeroEngine"',
          'match name:\n    case "disttrain_megatron":\n        pass']
PASSED = ["row.engine is None", "layout.tables and not layout.split_by", 'precision.endswith("-true")',
          'key in ("cpu", "cuda")', 'row.name == name', 'layout.params.units is Units.FSDP',
          'record.name == "disttrain"']


@pytest.mark.parametrize("code", CAUGHT)
def test_the_scan_catches(code):
    assert len(branches(ast.parse(code))) == 1


@pytest.mark.parametrize("code", PASSED)
def test_the_scan_lets_pass(code):
    assert branches(ast.parse(code)) == []
