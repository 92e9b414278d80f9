"""Every strategy class (Trainer and Fabric) has an explicit signature whose keywords are its options dataclass:
names, types and defaults, in the source (tools/strategy_signatures.py generates it; a drift fails here), with the
dataclass docstring's descriptions for help(), Sphinx and jsonargparse; a keyword it does not take is the options'
own did-you-mean error."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import pydoc
import sys
import typing
from pathlib import Path
from typing import Optional

import pytest

import disttrain
from disttrain.parallel.options import UnknownOptionError
from disttrain.parallel.registry import lookup

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = [*disttrain.strategies.ADAPTERS, *disttrain.fabric.ADAPTERS]
LIGHTNING_ARGUMENTS = {"accelerator", "parallel_devices", "cluster_environment", "precision_plugin", "precision",
                       "process_group_backend", "timeout"}


def generator():
    """tools/strategy_signatures.py as a module (tools/ is not a package)."""
    if "strategy_signatures" not in sys.modules:
        spec = importlib.util.spec_from_file_location("strategy_signatures", ROOT / "tools" / "strategy_signatures.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclass needs its module registered
        spec.loader.exec_module(module)
    return sys.modules["strategy_signatures"]


def entry(cls: type) -> str:
    return "Trainer" if cls in disttrain.strategies.ADAPTERS else "Fabric"


def label(cls: type) -> str:
    return f"{entry(cls)}.{cls.__name__}"


def options_of(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(lookup(cls.strategy_name).options_cls)
            if f.name not in cls.options_from_elsewhere]


@pytest.mark.parametrize("cls", ADAPTERS, ids=label)
def test_the_signature_is_the_options_dataclass(cls):
    """Keyword-only parameters after Lightning's arguments: the dataclass's fields in order, with its defaults and
    types (resolved at run time, as jsonargparse resolves them); a built default (``field(default_factory=...)``)
    is ``None`` of the Optional type."""
    parameters = inspect.signature(cls).parameters
    hints = typing.get_type_hints(cls.__init__)
    options_cls = lookup(cls.strategy_name).options_cls
    field_hints = typing.get_type_hints(options_cls)
    leading = [p for p in parameters.values() if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert {p.name for p in leading} <= LIGHTNING_ARGUMENTS and all(p.default is None for p in leading), leading
    keywords = [p for p in parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    fields = options_of(cls)
    assert [p.name for p in keywords] == [f.name for f in fields]
    for parameter, field in zip(keywords, fields):
        built = field.default_factory is not dataclasses.MISSING  # type: ignore[misc]
        assert parameter.default == (None if built else field.default), field.name
        expected = Optional[field_hints[field.name]] if built else field_hints[field.name]
        assert hints[field.name] == expected, field.name
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())  # IDEs flag a typo too


def test_the_trainer_zero3_leaves_out_what_the_trainer_sets():
    names = inspect.signature(disttrain.strategies.ZeroStrategy).parameters
    assert "micro_batch_size" not in names and "gradient_accumulation_steps" not in names
    assert {"micro_batch_size", "gradient_accumulation_steps"} <= set(inspect.signature(disttrain.fabric.ZeroStrategy)
                                                                     .parameters)


def test_the_generated_source_is_current():
    tool = generator()
    found = [line for cls in ADAPTERS for line in tool.problems(Path(inspect.getsourcefile(cls)).read_text(), cls,
                                                                  entry(cls))]
    assert not found, "\n".join(found) + "\nregenerate with: python tools/strategy_signatures.py --write"


def test_the_check_finds_a_drift_a_missing_block_and_a_missing_import():
    tool = generator()
    cls = disttrain.strategies.FSDPStrategy
    text = Path(inspect.getsourcefile(cls)).read_text()
    drifted = text.replace("activation_checkpointing: bool = False,", "activation_checkpointing: bool = True,", 1)
    assert tool.problems(drifted, cls, "Trainer") == [
        "src/disttrain/strategies/fsdp.py: FSDPStrategy's __init__ differs from FSDPOptions"]
    lines = text.splitlines()
    begin = next(i for i, line in enumerate(lines) if line.startswith("    # BEGIN generated options"))
    end = lines.index(tool.END)
    bare = "\n".join(lines[:begin - 1] + lines[end + 1:]) + "\n"  # the block and the blank line before it
    assert tool.problems(bare, cls, "Trainer") == ["src/disttrain/strategies/fsdp.py: FSDPStrategy has no generated"
                                                   " __init__"]
    assert tool.regenerate(bare, cls, "Trainer") == text  # written back at the end of the class body
    unimported = text.replace("from disttrain.parallel.split.blocks import BlockSpec\n", "")
    assert tool.problems(unimported, cls, "Trainer") == [
        "src/disttrain/strategies/fsdp.py: FSDPStrategy needs `from disttrain.parallel.split.blocks import BlockSpec`"
        " at the top of its module"]


@pytest.mark.parametrize("cls", [disttrain.strategies.MegatronStrategy, disttrain.fabric.RecsysStrategy], ids=label)
def test_help_shows_every_option_with_its_description(cls):
    """help(): the signature and, for each option, the dataclass docstring's entry (an inherited FSDP option's from
    FSDPOptions)."""
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    assert "tensor_parallel_size: 'int' = 1" in text or "sparse_lr: 'float' = 0.05" in text
    for field in options_of(cls):
        assert f"    {field.name}: " in text, field.name
    if cls is disttrain.strategies.MegatronStrategy:
        assert "tensor_parallel_size: ranks that split each block's heads and MLP" in text
        assert "activation_checkpointing: recompute each block's activations in backward." in text
    else:
        assert "``None`` for ``constraints`` is its default." in text


@pytest.mark.parametrize("cls", ADAPTERS, ids=label)
def test_jsonargparse_sees_every_option_with_its_description(cls):
    """What LightningCLI reads for ``class_path`` + ``init_args``: every option as a typed argument, documented."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "strategy")
    defaults = parser.get_defaults().strategy
    docs = generator().field_docs(lookup(cls.strategy_name).options_cls)
    actions = {action.dest: action for action in parser._actions}
    for field in options_of(cls):
        assert field.name in defaults, field.name
        assert docs[field.name].split(";")[0][:40] in (actions[f"strategy.{field.name}"].help or ""), field.name


@pytest.mark.parametrize("cls", ADAPTERS, ids=label)
def test_a_misspelt_keyword_is_the_options_error(cls):
    first = options_of(cls)[0].name
    with pytest.raises(UnknownOptionError, match=rf"unknown option '{first}x' for strategy '{cls.strategy_name}';"
                                                 rf" did you mean '{first}'\?"):
        cls(**{first + "x": None})


def test_another_strategys_option_at_its_default_asks_for_nothing():
    """An option a strategy cannot serve (compile on ZeRO-3) is refused when set, accepted at its default: code that
    passes the same options to every strategy keeps working."""
    assert disttrain.strategies.ZeroStrategy(compile=False).engine.options == lookup("disttrain_zero3").options()
    with pytest.raises(ValueError, match=r"^compile=True is not supported by disttrain_zero3"):
        disttrain.fabric.ZeroStrategy(compile=True)


def test_a_built_default_is_none_and_a_value_is_kept():
    assert disttrain.fabric.RecsysStrategy().engine.options.constraints == {}
    constraints = {"t_cat_0": {"sharding_types": ["row_wise"]}}
    assert disttrain.strategies.RecsysStrategy(constraints=constraints).engine.options.constraints == constraints
