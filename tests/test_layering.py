"""The layers import one way: ``disttrain.parallel``, ``disttrain.planner`` and ``disttrain.simulate`` (torch only)
import neither Lightning nor the adapters nor the domain packages; no module imports one that imports it back;
``import disttrain`` has no side effect but making the registered names available to Lightning, which cannot lose a
strategy whatever is imported first."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
UPPER_LAYERS = ("lightning", "disttrain.strategies", "disttrain.fabric", "disttrain._lightning", "disttrain.names",
                "disttrain.callbacks", "disttrain.nlp", "disttrain.vision", "disttrain.recsys")


def fresh(code: str) -> dict:
    """Run ``code`` in a new interpreter (nothing imported yet) and return the JSON it prints last."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(SRC), "PYTHONWARNINGS": "ignore", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def modules_of(package: str) -> list[str]:
    """Every module of ``package`` (the package itself and its subpackages included), by name."""
    folder = SRC / package.replace(".", "/")
    names = {".".join((package, *p.relative_to(folder).with_suffix("").parts)) for p in folder.rglob("*.py")}
    return sorted(name.removesuffix(".__init__") for name in names)


TORCH_ONLY = ("disttrain.parallel", "disttrain.planner", "disttrain.simulate")


@pytest.fixture(scope="module")
def torch_only_import() -> dict:
    """One fresh interpreter: the import finders before and after ``import disttrain.parallel`` (its first import),
    then the modules loaded once every module of each torch-only layer is imported, layer after layer (a layer that
    leaks shows in its own list: the lists before it are checked to be clean)."""
    return fresh("import importlib, json, sys\nfinders = [type(f).__name__ for f in sys.meta_path]\n"
                 "import disttrain.parallel\nout = {'finders': [finders, [type(f).__name__ for f in sys.meta_path]]}\n"
                 f"for layer, names in {[(layer, modules_of(layer)) for layer in TORCH_ONLY]!r}:\n"
                 "    for m in names: importlib.import_module(m)\n"
                 "    out[layer] = sorted(sys.modules)\n"
                 "print(json.dumps(out))")


@pytest.mark.parametrize("layer", TORCH_ONLY)
def test_torch_only_layers_import_no_upper_layer(layer, torch_only_import):
    """Every module of the layer imported: nothing of Lightning, the adapters or the domain packages is loaded
    (``python -c "import disttrain.parallel"`` works where Lightning is not wanted)."""
    loaded = torch_only_import[layer]
    leaked = sorted(m for m in loaded if m.split(".")[0] == "lightning" or m.startswith(UPPER_LAYERS[1:]))
    assert not leaked, f"{layer} imports {leaked[:10]}"


def _imports(path: Path, module: str) -> set[str]:
    """The disttrain modules ``path`` imports anywhere (module level and inside functions)."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return {name for name in found if name.startswith("disttrain")}


@pytest.mark.parametrize("layer", TORCH_ONLY)
def test_torch_only_layers_name_no_upper_layer_even_inside_functions(layer):
    """What running the layer's code could import (function-level imports included): no Lightning, no adapter, no
    domain package (``disttrain simulate`` of a DeepFM builds the network from the torch-only family module)."""
    upper = [m for m in UPPER_LAYERS if m != "lightning"]
    found = {module: sorted(i for i in _imports(SRC / (module.replace(".", "/") + (
        "/__init__.py" if (SRC / module.replace(".", "/")).is_dir() else ".py")), module)
        if i.startswith(tuple(upper))) for module in modules_of(layer)}
    assert not {m: i for m, i in found.items() if i}


def test_no_import_cycles():
    """No disttrain module imports (directly or through others, at module level or inside a function) a module
    that imports it back. The implicit import of a parent package is not counted: Python runs it before any of its
    submodules."""
    files = {m: SRC / (m.replace(".", "/") + ("/__init__.py" if (SRC / m.replace(".", "/")).is_dir() else ".py"))
             for m in modules_of("disttrain")}
    graph = {m: {i for i in _imports(path, m) if i in files and i != m and not m.startswith(i + ".") and i != "disttrain"}
             for m, path in files.items()}
    cycles = []

    def visit(node: str, stack: list[str], done: set[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in stack:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, stack + [nxt], done)
        done.add(node)

    done: set[str] = set()
    for start in sorted(graph):
        if start not in done:
            visit(start, [start], done)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:5])


def test_every_registered_strategy_has_a_trainer_and_a_fabric_class():
    import lightning.fabric.strategies as fabric_strategies
    import lightning.pytorch.strategies as trainer_strategies

    from disttrain.names import adapters
    from disttrain.parallel.registry import STRATEGIES

    assert len({row.name for row in STRATEGIES}) == len(STRATEGIES)
    for row in STRATEGIES:
        trainer, fabric = adapters(row)
        assert isinstance(trainer, type) and issubclass(trainer, trainer_strategies.Strategy), row
        assert isinstance(fabric, type) and issubclass(fabric, fabric_strategies.Strategy), row
        assert trainer_strategies.StrategyRegistry[row.name]["strategy"] is trainer
        assert fabric_strategies.STRATEGY_REGISTRY[row.name]["strategy"] is fabric
        # Lightning's registries are of Lightning's own class again once read
        assert type(trainer_strategies.StrategyRegistry).__module__.startswith("lightning.")


CHECK_REGISTERED = """
import atexit, json
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
from disttrain.parallel.registry import STRATEGIES
names = [row.name for row in STRATEGIES]
print(json.dumps({"trainer": [n for n in names if n in StrategyRegistry],
                  "fabric": [n for n in names if n in STRATEGY_REGISTRY], "names": names,
                  "atexit": atexit._ncallbacks()}))
"""


# Each case is a fresh interpreter importing Lightning (seconds of CPU): the orders that differ in who imports
# Lightning first (disttrain, the user, a torch-only disttrain layer, one of disttrain's Lightning modules).
@pytest.mark.parametrize("first", ["import disttrain; import lightning", "import lightning; import disttrain",
                                   "import disttrain.parallel; import lightning.fabric",
                                   "from disttrain.strategies import FSDPStrategy"])
def test_names_are_registered_whatever_is_imported_first(first):
    """``import disttrain`` registers the names whether Lightning comes before or after it, also when a Lightning
    module of disttrain is what imports Lightning first."""
    result = fresh(f"{first}\n{CHECK_REGISTERED}")
    assert result["trainer"] == result["fabric"] == result["names"]


def test_import_has_no_side_effect_beyond_registration(torch_only_import):
    """No exit handler is installed by importing disttrain and its adapters (it is installed where a process group
    is created), and ``import disttrain.parallel`` leaves the import system as it found it apart from the one
    finder that waits for Lightning (gone once Lightning is imported)."""
    result = fresh("import atexit, json, sys\nimport lightning, deepspeed, torchrec\nbefore = atexit._ncallbacks()\n"
                   "import disttrain, disttrain.strategies, disttrain.fabric, disttrain.callbacks\n"
                   "print(json.dumps({'before': before, 'after': atexit._ncallbacks()}))")
    assert result["after"] == result["before"]
    before, after = torch_only_import["finders"]
    assert after == ["_WhenLightningLoads"] + before


def test_the_launcher_checks_a_name_without_importing_the_engines():
    """``disttrain run`` checks ``--strategy`` and starts torchrun without importing the engines (FSDP, DTensor,
    torch's pipelining and checkpointing: ~1 s of CPU at every launch, before any process starts): the registry
    imports a row's engine when ``row.engine`` is first read, and the launcher's ``--verbose`` switch lives in
    guards.reports, away from guards.failures' imports."""
    heavy = ("torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.pipelining",
             "torch.distributed.checkpoint", "disttrain.parallel.engines", "lightning")
    result = fresh("import json, sys\nfrom torch.distributed import run\nfrom disttrain import cli\n"
                   "cli.check_strategy_name('disttrain_fsdp', 'disttrain run')\n"
                   "from disttrain.parallel.guards.reports import VERBOSE_ENV, verbose\n"
                   f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({heavy!r}))))")
    assert result == []
    from disttrain.parallel.registry import FSDP
    from disttrain.parallel.engines.fsdp import FSDPEngine

    assert FSDP.engine is FSDPEngine  # read: imported
