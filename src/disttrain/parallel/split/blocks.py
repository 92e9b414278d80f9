"""Find the repeated blocks of a model (transformer layers, ViT blocks): the units FSDP shards one at a time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

from torch import nn

BlockSpec = Union[str, type, Sequence[Union[str, type]], None]


def _normalize(spec: BlockSpec) -> list[str | type]:
    if spec is None:
        return []
    if isinstance(spec, (str, type)):
        return [spec]
    return list(spec)


def _repeated_children(container: nn.Module) -> list[nn.Module] | None:
    """Children of a ModuleList/Sequential when there are at least two, all of one class, holding parameters."""
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        return None
    children = list(container.children())
    if len(children) < 2 or len({type(c) for c in children}) != 1:
        return None
    if not any(True for _ in children[0].parameters()):
        return None
    return children


def block_candidates(model: nn.Module) -> dict[str, int]:
    """Class name -> count of every repeated block in the model (what a user can pass as ``wrap_classes``)."""
    counts: dict[str, int] = {}
    for module in model.modules():
        children = _repeated_children(module)
        if children:
            name = type(children[0]).__name__
            counts[name] = counts.get(name, 0) + len(children)
    return counts


def find_blocks(model: nn.Module, wrap_classes: BlockSpec = None) -> list[nn.Module]:
    """The modules to shard as separate FSDP units, outermost first, never nested in each other.

    ``wrap_classes`` (a class, a class name, or a list of them) overrides the automatic choice. Otherwise:
    the classes HF models list in ``_no_split_modules`` (decoder layers), else every ``nn.ModuleList`` /
    ``nn.Sequential`` of two or more identical blocks (timm ViT ``blocks``, any stack of layers).
    """
    wanted = _normalize(wrap_classes)
    if wanted:
        def matches(module: nn.Module, spec: str | type) -> bool:
            return isinstance(module, spec) if isinstance(spec, type) else type(module).__name__ == spec

        found = [m for m in model.modules() if any(matches(m, w) for w in wanted)]
        missing = [w if isinstance(w, str) else w.__name__ for w in wanted if not any(matches(m, w) for m in found)]
        if missing:
            known = ", ".join(f"{n} (x{c})" for n, c in block_candidates(model).items()) or "none found"
            raise ValueError(
                f"wrap_classes names {missing} but the model ({type(model).__name__}) has no module of that"
                f" class; pass a class the model contains. Repeated blocks in this model: {known}"
            )
        return _outermost(model, found)

    hf_names = set(getattr(model, "_no_split_modules", None) or [])
    if hf_names:
        found = [m for m in model.modules() if type(m).__name__ in hf_names]
        if found:
            return _outermost(model, found)

    found = []
    for module in model.modules():
        found.extend(_repeated_children(module) or [])
    return _outermost(model, found)


def _outermost(model: nn.Module, found: list[nn.Module]) -> list[nn.Module]:
    """Drop blocks nested inside other chosen blocks, and the root itself (it is wrapped last anyway)."""
    chosen = {id(m) for m in found}
    result: list[nn.Module] = []

    def visit(module: nn.Module, inside: bool) -> None:
        is_block = id(module) in chosen and module is not model
        if is_block and not inside:
            result.append(module)
        for child in module.children():
            visit(child, inside or is_block)

    visit(model, False)
    return result
