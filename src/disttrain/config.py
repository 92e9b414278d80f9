"""Recipe configs (``model:``, ``data:``, ``train:``, ``strategy:``, ``daily:`` sections in one YAML file): the one
reader every recipe, trainer and the planner goes through, and the one did-you-mean line for an unknown key.

A *schema* says which keys a config may hold: a mapping from each allowed key to ``None`` (any value) or to the
schema of the mapping below it, e.g. ``{"train": {"batch_size": None, "lr": None}, "strategy": {...}}``. Each kind
of recipe is a :class:`Recipe` whose schema is built from the classes that consume the keys (``model:`` from the
model family's config class, see :mod:`disttrain.parallel.families`; the other sections from the trainer's
dataclasses and options, :func:`keys_of`), so the check and the consumer cannot disagree:

- ``disttrain.nlp.module.DIALOGUE_RECIPE`` (``configs/nlp``: ``model:`` LlamaConfig, ``data:``, ``train:``, ``lora:``),
- ``disttrain.vision.config.VIT_RECIPE`` (``configs/vision``: ``model:`` timm VisionTransformer, ``data:``,
  ``train:``),
- ``disttrain.recsys.model.DEEPFM_RECIPE`` (``configs/recsys``: ``model:`` DeepFMNet, ``train:``, ``strategy:``,
  ``daily:``).

A new key is added to the class that consumes it (and, for the shipped configs, commented in their YAML); a new
section to the recipe's ``sections`` and to :data:`SECTIONS`. The planner reads any recipe with
:func:`read_recipe` and no kind: it checks the section names and, through the model's family, the ``model:`` keys.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

Schema = Mapping[str, Optional["Schema"]]
ConfigSource = Union[str, os.PathLike, Mapping[str, Any]]

# Every section a recipe config may have, whatever its kind.
SECTIONS = ("model", "data", "train", "strategy", "daily", "lora")
# Where the shipped configs live (absent when disttrain is installed without its repository).
CONFIG_ROOT = Path(__file__).resolve().parents[2]
DICT_SOURCE = "the config dict"


class ConfigError(ValueError):
    """A recipe config that cannot be used: missing, not a mapping, or holding an unknown key (the message names
    the file, the section, the key and the valid keys)."""


def keys_of(obj: Any, exclude: Iterable[str] = ()) -> dict[str, None]:
    """A flat schema from a dataclass's fields or a callable's keyword parameters (minus ``exclude``)."""
    if dataclasses.is_dataclass(obj):
        names = [f.name for f in dataclasses.fields(obj)]
    else:
        names = [name for name, p in inspect.signature(obj).parameters.items()
                 if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return dict.fromkeys(n for n in names if n not in set(exclude))


def did_you_mean(key: str, valid: Iterable[str]) -> str:
    """``"did you mean 'x'? "`` for the closest valid key, or an empty string when none is close."""
    close = difflib.get_close_matches(str(key), [str(v) for v in valid], n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def check_keys(config: Mapping[str, Any], schema: Schema, source: str = "config", section: str = "") -> None:
    """Raise :class:`ConfigError` for the first key of ``config`` (recursively, where the schema goes deeper) that
    ``schema`` does not allow, or for a section that is not a mapping. ``source`` names the file in the message;
    ``section`` is the dotted path of ``config`` inside it ("" for the top level)."""
    if not isinstance(config, Mapping):
        where = f"{section}:" if section else "the top level"
        raise ConfigError(f"{source}: {where} must be a mapping of keys to values, not {type(config).__name__}"
                          f" {config!r}")
    for key, value in config.items():
        if key not in schema:
            valid = sorted(schema)
            if section:
                raise ConfigError(f"{source}: unknown key {key!r} in {section}:; {did_you_mean(key, valid)}valid keys"
                                  f" are: {', '.join(valid)}")
            raise ConfigError(f"{source}: unknown section {key!r}; {did_you_mean(key, valid)}valid sections are:"
                              f" {', '.join(valid)}")
        below = schema[key]
        if below is not None and value is not None:
            check_keys(value, below, source, f"{section}.{key}" if section else str(key))


def _missing(path: Path, example: str) -> FileNotFoundError:
    """The error for a config file that does not exist: a shipped example, and the configs next to it."""
    hint = ""
    if example:
        folder = CONFIG_ROOT / Path(example).parent
        found = sorted(p.name for p in folder.glob("*.yaml")) if folder.is_dir() else []
        hint = f"; pass e.g. {example}" + (f" (found in {Path(example).parent}: {', '.join(found)})" if found else "")
    return FileNotFoundError(f"config {str(path)!r} does not exist{hint}")


def read_config(path: Union[str, os.PathLike], schema: Schema, required: Iterable[str] = ("model",),
                example: str = "") -> dict[str, Any]:
    """A recipe YAML as a dict, read with ``yaml.safe_load`` and checked against ``schema``; ``required`` sections
    must be present. ``example`` (a shipped config's path) is named in the errors as a starting point."""
    import yaml

    path = Path(path)
    hint = f"; start from {example}" if example else ""
    if not path.is_file():
        raise _missing(path, example)
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{where} ({getattr(e, 'problem', None) or e}){hint}") from None
    config = {} if config is None else config
    check_keys(config, schema, str(path))
    for name in required:
        if not isinstance(config.get(name), Mapping):
            raise ConfigError(f"{path}: has no {name}: section{hint}")
    return config


@dataclass(frozen=True)
class Recipe:
    """One kind of recipe config. ``sections`` builds its schema (``{"model": ..., "train": ...}``) on first use:
    the classes it reads the keys from may import transformers or timm. ``example`` is a shipped config of the kind,
    named in the errors."""

    name: str
    example: str
    sections: Callable[[], Schema]
    required: tuple[str, ...] = ("model",)
    # The keys of a ``model:`` mapping, from the mapping itself (its ``model_type`` names the config class that
    # takes them); None: ``sections()["model"]``.
    model_schema: Optional[Callable[[Mapping[str, Any]], Schema]] = None

    def schema(self, model: Optional[Mapping[str, Any]] = None) -> Schema:
        sections = self.sections()
        if self.model_schema is not None:
            sections = {**sections, "model": self.model_schema(model if isinstance(model, Mapping) else {})}
        return sections

    def read(self, source: ConfigSource) -> dict[str, Any]:
        """The whole recipe: a YAML path read and checked, or a dict checked (named "the config dict")."""
        if isinstance(source, Mapping):
            config = dict(source)
            check_keys(config, self.schema(config.get("model")), DICT_SOURCE)
            return config
        if self.model_schema is None:
            return read_config(source, self.schema(), self.required, self.example)
        config = read_config(source, {**self.sections(), "model": None}, self.required, self.example)
        self._check_model(config["model"], str(source))
        return config

    def _check_model(self, model: Mapping[str, Any], source: str) -> None:
        """``model:`` against the schema its own ``model_type`` selects; a misspelt ``model_type`` is named first
        (without it the keys are checked against the default class, whose first complaint would mislead)."""
        schema = self.schema(model)["model"]
        if "model_type" not in model:
            for key in model:
                if key not in schema and did_you_mean(key, ["model_type"]):
                    check_keys({key: None}, schema, source, "model")
        check_keys(model, schema, source, "model")

    def model(self, source: ConfigSource) -> dict[str, Any]:
        """The ``model:`` section of a recipe: a YAML path, the whole recipe as a dict, or the ``model:`` mapping
        itself; checked either way."""
        if isinstance(source, Mapping):
            model = dict(source["model"] if isinstance(source.get("model"), Mapping) else source)
            if self.model_schema is not None:
                self._check_model(model, DICT_SOURCE)
            else:
                check_keys(model, self.schema(model)["model"], DICT_SOURCE, "model")
            return model
        return dict(self.read(source)["model"])


def read_recipe(source: Union[str, os.PathLike], recipe: Optional[Recipe] = None,
                model_schema: Optional[Callable[[Mapping[str, Any]], Optional[Schema]]] = None) -> dict[str, Any]:
    """A recipe YAML of ``recipe``'s kind, or of any kind (``recipe=None``: the planner's way): then the sections are
    checked against :data:`SECTIONS`, and ``model:`` against ``model_schema(model_mapping)`` when it gives one."""
    if recipe is not None:
        return recipe.read(source)
    config = read_config(source, dict.fromkeys(SECTIONS), ("model",),
                         example="configs/nlp/dialogue_10b.yaml")
    schema = model_schema(config["model"]) if model_schema is not None else None
    if schema is not None:
        check_keys(config["model"], schema, str(source), "model")
    return config
