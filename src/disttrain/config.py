"""Recipe configs (``model:``, ``data:``, ``train:``, ``strategy:``, ``daily:`` sections in one YAML file): reading
them safely and refusing unknown keys with one did-you-mean line.

A *schema* says which keys a config may hold: a mapping from each allowed key to ``None`` (any value) or to the
schema of the mapping below it, e.g. ``{"train": {"batch_size": None, "lr": None}, "strategy": {...}}``. A
domain builds its schema from the classes that consume the keys (:func:`keys_of` on a dataclass or a function
signature), so the check and the consumer cannot disagree.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional, Union

Schema = Mapping[str, Optional["Schema"]]


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


def read_config(path: Union[str, os.PathLike], schema: Schema, required: Iterable[str] = ("model",),
                example: str = "") -> dict[str, Any]:
    """A recipe YAML as a dict, read with ``yaml.safe_load`` and checked against ``schema``; ``required`` sections
    must be present. ``example`` (a shipped config's path) is named in the errors as a starting point."""
    import yaml

    path = Path(path)
    hint = f"; start from {example}" if example else ""
    if not path.is_file():
        raise FileNotFoundError(f"config {str(path)!r} does not exist{'; pass e.g. ' + example if example else ''}")
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
