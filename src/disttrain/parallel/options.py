"""Strategy options as dataclasses, with one clear error for a misspelt or unknown option."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, TypeVar

T = TypeVar("T")


def build_options(cls: type[T], strategy: str, options: dict[str, Any]) -> T:
    """``cls(**options)``, but an unknown key names the strategy, the closest valid option and the full list."""
    valid = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    for key in options:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TypeError(
                f"unknown option {key!r} for strategy {strategy!r}; {hint}valid options are: {', '.join(valid)}"
            )
    return cls(**options)
