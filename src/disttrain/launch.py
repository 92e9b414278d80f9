"""From a strategy name and its options to the strategy Fabric or the Trainer runs, for every recipe and tool; and
the command-line flags the recipes share.

:func:`build_strategy` is the one way from a name (a registered ``disttrain_*`` name, or one of Lightning's own) and
options to a strategy:

- the options are checked against the named strategy before any process starts: one that belongs to another
  strategy is one line naming it (and, for a recipe, the flag that set it), as are degrees that do not divide the
  world size;
- a row's own defaults come with it (``disttrain_fsdp_offload`` is ``FSDPStrategy(cpu_offload=True)``), the same
  object ``Fabric(strategy=name)`` or ``Trainer(strategy=name)`` builds;
- ``disttrain_auto`` gets the model to plan for (Fabric starts its processes before it sees the model);
- under ``lightning run model`` / ``disttrain run`` the launcher's ``--strategy`` (``LT_STRATEGY``) names the
  strategy, and since Fabric refuses a strategy object next to ``LT_STRATEGY``, the variable is taken over once the
  object is built.

:func:`fabric_kwargs` leaves to Fabric what the launcher decides (it started the processes: accelerator, devices,
nodes, and the precision when it names one; Fabric reads its ``LT_*`` variables itself) and passes the rest. :func:`add_recipe_flags` adds the flags every recipe
takes, with one help text and the recipe's defaults shown; :func:`strategy_options` turns the parallel sizes given
into options.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from disttrain.parallel import registry
from disttrain.parallel.options import OptionError

Entry = Literal["fabric", "trainer"]
# Variables `lightning run model` / `disttrain run` set for Fabric in every process (disttrain.cli.launch).
LAUNCHED, LAUNCHER_STRATEGY = "LT_CLI_USED", "LT_STRATEGY"
LAUNCHER_SETTINGS = {"accelerator": "LT_ACCELERATOR", "devices": "LT_DEVICES", "num_nodes": "LT_NUM_NODES",
                     "precision": "LT_PRECISION"}


class LaunchError(OptionError):
    """A strategy, option or flag that cannot run, found before any process starts; the message is one line that
    names the value and the fix (an :class:`~disttrain.parallel.options.OptionError`: launchers and recipes print
    it alone)."""


def launched() -> bool:
    """Whether this process was started by ``lightning run model`` / ``disttrain run`` (which started them all)."""
    return bool(os.environ.get(LAUNCHED))


def launcher_setting(name: str) -> Optional[str]:
    """What the launcher set for ``name`` ("strategy", "accelerator", "devices", "num_nodes", "precision"), or
    None where it set nothing."""
    return os.environ.get(LAUNCHER_SETTINGS.get(name, f"LT_{name.upper()}")) or None


def world_size(devices: Optional[int], num_nodes: int = 1) -> Optional[int]:
    """The processes a run will have: the launcher's (``WORLD_SIZE``, set by torchrun in every process) when it was
    started by one, else ``devices`` x ``num_nodes`` (None when ``devices`` is)."""
    if os.environ.get("WORLD_SIZE"):
        return int(os.environ["WORLD_SIZE"])
    return None if devices is None else int(devices) * int(num_nodes)


def option_names(name: str) -> list[str]:
    """The options a registered disttrain strategy takes (its options dataclass's fields); [] for other names."""
    row = _row(name)
    return [] if row is None else [f.name for f in dataclasses.fields(row.options_cls)]


def takes(name: str, option: str) -> bool:
    """Whether the named strategy takes ``option`` (asked through the registry, e.g. whether it splits heads:
    ``takes(name, "tensor_parallel_size")``)."""
    return option in option_names(name)


def owners(option: str) -> list[str]:
    """The registered disttrain strategies that take ``option``."""
    return [row.name for row in registry.STRATEGIES if option in option_names(row.name)]


def degree_options() -> set[str]:
    """The options that set a parallel degree, of every registered strategy (``MegatronOptions.degrees``)."""
    return {option for row in registry.STRATEGIES for option in getattr(row.options_cls, "degrees", {}).values()}


def _row(name: str) -> Optional[registry.Registered]:
    return next((row for row in registry.STRATEGIES if row.name == name), None)


def _lightning_registry(entry: Entry) -> Any:
    if entry == "fabric":
        from lightning.fabric.strategies import STRATEGY_REGISTRY

        return STRATEGY_REGISTRY
    if entry == "trainer":
        from lightning.pytorch.strategies import StrategyRegistry

        return StrategyRegistry
    raise ValueError(f"entry={entry!r} is not an entry point; pass 'fabric' or 'trainer'")


def _said(option: str, value: Any, flags: Optional[Mapping[str, str]]) -> str:
    """How the user gave an option: the recipe's flag (``--tensor-parallel-size 2``) or the keyword."""
    if flags and option in flags:
        return f"{flags[option]} {value}"
    return f"{option}={value!r}"


def _use_strategy(name: str, flags: Optional[Mapping[str, str]]) -> str:
    return f"--strategy {name}" if flags else f"strategy={name!r}"


def check_options(name: str, options: Mapping[str, Any], flags: Optional[Mapping[str, str]] = None) -> Any:
    """The options dataclass of a registered disttrain strategy built from its row's defaults and ``options``; an
    option of another strategy is one :class:`LaunchError` naming the strategies that take it (and the flag that
    set it, from ``flags``: option -> flag); a misspelt one the registry's did-you-mean."""
    row = registry.lookup(name)
    valid = option_names(name)
    for option, value in options.items():
        if option in valid:
            continue
        takers = owners(option)
        if takers:
            raise LaunchError(f"{_said(option, value, flags)} is an option of {', '.join(takers)}, not of {name}: pass"
                              f" {_use_strategy(takers[0], flags)} with it, or leave"
                              f" {flags[option] if flags and option in flags else option} out")
    try:
        return row.options(**options)
    except TypeError as e:
        raise LaunchError(str(e)) from None


def check_degrees(name: str, options: Mapping[str, Any], world: int) -> None:
    """The degrees the options give on ``world`` processes exist (sizes divide the world), before any process
    starts; else one :class:`LaunchError`."""
    row = registry.lookup(name)
    if row.engine is None:
        return  # disttrain_auto: the plan's degrees are its own
    try:
        row.dims(world, dict(options))
    except ValueError as e:
        raise LaunchError(f"{name} on {world} process{'es' if world != 1 else ''}: {e}") from None


def strategy_name(name: Optional[str], entry: Entry = "fabric") -> str:
    """The name a run uses: the launcher's ``--strategy`` (Fabric under ``lightning run model``) when it gave one,
    else ``name``, else ``"auto"`` (Lightning chooses)."""
    launcher = launcher_setting("strategy") if entry == "fabric" else None
    return launcher or name or "auto"


def build_strategy(name: Optional[str] = None, options: Optional[Mapping[str, Any]] = None, *,
                   entry: Entry = "fabric", model: Any = None, planner: Optional[Mapping[str, Any]] = None,
                   world: Optional[int] = None, flags: Optional[Mapping[str, str]] = None) -> Union[str, Any]:
    """The strategy for ``lightning.Fabric(strategy=...)`` (``entry="fabric"``) or ``lightning.Trainer(strategy=...)``
    (``entry="trainer"``).

    name: a registered ``disttrain_*`` name, one of Lightning's own (``"ddp"``, ``"auto"``, ...) or None; under
        ``lightning run model`` (Fabric) the launcher's ``--strategy`` wins (:func:`strategy_name`).
    options: keyword options of that strategy, on top of its row's defaults (``disttrain_fsdp_offload`` keeps
        ``cpu_offload=True``). An option of another strategy is one :class:`LaunchError` naming the strategies that
        take it; ``flags`` (option -> command-line flag) makes the message name the user's flag.
    model, planner: for a strategy that plans (``disttrain_auto``), what it plans for (a recipe YAML, its ``model:``
        dict, a module; required under Fabric, which starts its processes before it sees the model) and what the
        run fixes (``micro_batch``, ``seq_len``, ``activation_checkpointing``, options of
        :class:`~disttrain.parallel.registry.AutoOptions`); the other strategies do not use them, so a recipe passes
        them whatever the name.
    world: the number of processes, when known: the degrees the options give are checked against it now, before
        any process starts.

    Returns the strategy object for a disttrain name (the object ``Fabric(strategy=name)`` would build, with the
    options), or Lightning's own name itself when no options come with it (Lightning builds it, as for a name
    passed directly). Under the launcher, ``LT_STRATEGY`` is removed once an object is built: Fabric refuses an
    object beside it, and the object is the launcher's strategy with the recipe's options.
    """
    options = dict(options or {})
    name = strategy_name(name, entry)
    lightning_registry = _lightning_registry(entry)
    row = _row(name)
    if row is None:
        strategy = _lightning_strategy(name, options, lightning_registry, flags)
    else:
        if row.engine is None:  # the planner: what the run fixes, under the user's own options
            options = {**{k: v for k, v in (planner or {}).items() if v is not None}, **options}
            if model is not None:
                options["model"] = model
        check_options(name, options, flags)
        if world is not None:
            check_degrees(name, options, world)
        if row.engine is None and entry == "fabric" and options.get("model") is None:
            raise LaunchError(f"{name} under Fabric needs the model to plan for (Fabric starts its processes before it"
                              " sees the model): pass model= a recipe YAML, its model: dict or a module")
        entry_row = lightning_registry[name] if name in lightning_registry else None
        if entry_row is None:
            raise LaunchError(f"{name} is not registered with Lightning's {entry} registry: `import disttrain` (or"
                              " disttrain.register_strategies()) registers every disttrain name")
        strategy = entry_row["strategy"](**{**entry_row["init_params"], **options})
    if entry == "fabric" and not isinstance(strategy, str):
        os.environ.pop(LAUNCHER_STRATEGY, None)
    return strategy


def _lightning_strategy(name: str, options: dict[str, Any], lightning_registry: Any,
                        flags: Optional[Mapping[str, str]]) -> Union[str, Any]:
    """Lightning's own strategy ``name``: the name itself without options, else its registry row with them."""
    if name not in lightning_registry and name != "auto":
        known = [*registry.names(), *sorted(n for n in lightning_registry.available_strategies()
                                            if n not in registry.names())]
        close = registry.closest_names(name, known)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise LaunchError(f"strategy {name!r} is not registered; {hint}choose a disttrain strategy"
                          f" ({', '.join(registry.names())}) or one of Lightning's own (auto, ddp, fsdp, deepspeed,"
                          " ...)")
    if not options:
        return name
    entry_row = lightning_registry[name] if name != "auto" else None
    parameters = inspect.signature(entry_row["strategy"]).parameters if entry_row is not None else {}
    # Lightning's DDP strategies pass unknown keywords on to torch's DDP (find_unused_parameters=...); a parallel
    # size is never one of those.
    passes_on = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    for option, value in options.items():
        takers = owners(option)
        if takers and option not in parameters and (option in degree_options() or not passes_on):
            raise LaunchError(f"{_said(option, value, flags)} is an option of {', '.join(takers)}, not of Lightning's"
                              f" {name}: pass {_use_strategy(takers[0], flags)} with it, or leave"
                              f" {flags[option] if flags and option in flags else option} out")
    if entry_row is None:
        raise LaunchError(f"strategy 'auto' takes no options (got {', '.join(sorted(options))}): name the strategy"
                          " they belong to")
    try:
        return entry_row["strategy"](**{**entry_row["init_params"], **options})
    except TypeError as e:
        raise LaunchError(f"Lightning's {name}: {e}") from None


def fabric_kwargs(strategy: Any = None, *, accelerator: Any = None, devices: Any = None, num_nodes: Any = None,
                  precision: Any = None, **other: Any) -> dict[str, Any]:
    """Keyword arguments for ``lightning.Fabric`` (the ones given, not None). Under ``lightning run model`` the
    launcher started the processes, so accelerator, devices and nodes are its own (Fabric reads ``LT_ACCELERATOR``,
    ``LT_DEVICES``, ``LT_NUM_NODES`` itself; unset, Fabric's "auto", as the launcher counted the devices), and so is
    the precision when it gave one (``LT_PRECISION``): Fabric would refuse a different value beside it. ``other``:
    loggers, plugins, ..."""
    kwargs = {key: value for key, value in other.items() if value is not None}
    settings = {"precision": precision} if launched() else \
        {"accelerator": accelerator, "devices": devices, "num_nodes": num_nodes, "precision": precision}
    for key, value in settings.items():
        if value is not None and launcher_setting(key) is None:
            kwargs[key] = value
    if strategy is not None:
        kwargs["strategy"] = strategy
    return kwargs


# ---- the flags every recipe takes -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Flag:
    """One shared recipe flag: its name, type and help (the default is the recipe's)."""

    name: str
    help: str
    type: Any = str
    metavar: Optional[str] = None
    neutral: Any = None  # a value that asks for nothing (a parallel size of 1): accepted where the flag cannot apply

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")


BOOL = "bool"  # a --flag / --no-flag pair


def _parallel(option: str, what: str) -> Flag:
    return Flag(f"--{option.replace('_', '-')}", f"{what}; the {option} option of"
                f" {', '.join(owners(option)) or 'no registered strategy'}", int, "N", neutral=1)


def shared_flags() -> tuple[Flag, ...]:
    """Every flag the recipes share, in the order ``--help`` lists them."""
    return (
        Flag("--strategy", "a registered strategy: a disttrain name (`disttrain strategies` lists them) or one of"
             " Lightning's own (auto, ddp, ...); under `lightning run model` the launcher's --strategy", str, "NAME"),
        Flag("--accelerator", "cpu, gpu or auto; under `lightning run model` the launcher's", str, "cpu|gpu|auto"),
        Flag("--devices", "processes per node (one per device); under `lightning run model` the launcher's", int, "N"),
        Flag("--num-nodes", "machines, each running --devices processes", int, "N"),
        Flag("--precision", "32-true, bf16-mixed, 16-mixed, bf16-true, ...; under `lightning run model` the"
             " launcher's", str, "P"),
        _parallel("tensor_parallel_size", "ranks that split each block's attention heads and MLP"),
        _parallel("pipeline_parallel_size", "pipeline stages; each rank holds only its stage's layers"),
        _parallel("context_parallel_size", "ranks that split each sequence (long sequences)"),
        _parallel("expert_parallel_size", "ranks that split an MoE model's experts"),
        Flag("--seq-len", "tokens per sample", int, "N"),
        Flag("--steps", "optimizer steps to train", int, "N"),
        Flag("--micro-batch", "samples per data-parallel rank per micro-step", int, "N"),
        Flag("--global-batch", "samples per optimizer step over all data-parallel ranks; gradient accumulation makes"
             " up what micro batch x data-parallel ranks leaves (it must be a multiple of it)", int, "N"),
        Flag("--lr", "peak learning rate", float, "LR"),
        Flag("--activation-checkpointing", "recompute each block's activations in backward (less memory, about a"
             " third more compute), under every strategy", BOOL),
        Flag("--resume", "a checkpoint folder this recipe wrote: training continues from it", str, "DIR"),
        Flag("--out", "the run folder: logs, report, checkpoints, export", str, "DIR"),
        Flag("--save-every", "write a resumable checkpoint every N optimizer steps under --out/checkpoints", int, "N"),
        Flag("--async-checkpoint", "write checkpoints in the background while training goes on", BOOL),
    )


PARALLEL_SIZES = ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size", "expert_parallel_size")


@dataclass(frozen=True)
class Default:
    """A recipe's default for a shared flag: ``value`` (None: not given) and how ``--help`` shows it."""

    value: Any = None
    shown: Optional[str] = None

    @classmethod
    def config(cls, key: str, otherwise: str = "") -> "Default":
        """The config's value of ``key`` (the flag's default is None: the recipe reads the config)."""
        return cls(None, f"the config's {key}" + (f"; {otherwise}" if otherwise else ""))

    def text(self) -> str:
        if self.shown is not None:
            return self.shown
        return "off" if self.value is False else "none" if self.value is None else str(self.value)


class _DoesNotApply(argparse.Action):
    """A shared flag this recipe cannot use: giving it (other than its neutral value) is one line, no process."""

    def __init__(self, option_strings: Sequence[str], dest: str, why: str = "", neutral: Any = None,
                 **kwargs: Any) -> None:
        self.why, self.neutral = why, neutral
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        if self.neutral is not None and values == self.neutral:
            return  # asks for nothing (a parallel size of 1)
        shown = option_string if values in (None, []) else f"{option_string} {values}"
        prog = parser.prog.removesuffix(".py")  # as the recipe's own one-line errors say it
        parser.exit(2, f"{prog}: error: {shown} does not apply to this recipe: {self.why}\n")


def add_recipe_flags(parser: argparse.ArgumentParser, defaults: Mapping[str, Any],
                     does_not_apply: Optional[Mapping[str, str]] = None,
                     aliases: Optional[Mapping[str, Sequence[str]]] = None) -> argparse._ArgumentGroup:
    """Add every shared recipe flag (:func:`shared_flags`) to ``parser``, in one group, with its shared help and
    the recipe's default shown.

    defaults: for each flag's dest (``"steps"``), its default: a value, or a :class:`Default`
        (``Default.config("train.steps")`` when the config decides). Each shared flag is here or in
        ``does_not_apply``.
    does_not_apply: flags this recipe cannot use, with why and what to set instead: listed in ``--help`` all the
        same, and giving one (other than a parallel size of 1) exits with that one line before anything starts.
    aliases: older names of a flag (dest -> ``["--max-steps"]``), accepted, and left out of ``--help`` so that
        every recipe lists the same flags.
    """
    does_not_apply = dict(does_not_apply or {})
    flags = shared_flags()
    dests = {flag.dest for flag in flags}
    missing = dests - set(defaults) - set(does_not_apply)
    unknown = (set(defaults) | set(does_not_apply)) - dests
    if missing or unknown:
        raise ValueError(f"add_recipe_flags: give a default or a reason for {sorted(missing)}; not shared flags:"
                         f" {sorted(unknown)}")
    group = parser.add_argument_group("flags every recipe shares")
    for flag in flags:
        if flag.dest in does_not_apply:
            why = does_not_apply[flag.dest]
            kwargs: dict[str, Any] = {"nargs": 0} if flag.type == BOOL else {"type": flag.type}
            group.add_argument(flag.name, action=_DoesNotApply, why=why, neutral=flag.neutral, default=None,
                               metavar=flag.metavar, help=f"{flag.help} (does not apply here: {why})", **kwargs)
            continue
        default = defaults[flag.dest]
        default = default if isinstance(default, Default) else Default(default)
        help_text = f"{flag.help} (default: {default.text()})"
        if flag.type == BOOL:
            group.add_argument(flag.name, action=argparse.BooleanOptionalAction, default=default.value,
                               help=help_text)
        else:
            group.add_argument(flag.name, type=flag.type, default=default.value, metavar=flag.metavar,
                               help=help_text)
    for dest, names in (aliases or {}).items():
        flag = next(f for f in flags if f.dest == dest)
        group.add_argument(*names, dest=dest, type=None if flag.type == BOOL else flag.type, metavar=flag.metavar,
                           help=argparse.SUPPRESS)
    return group


def flag_names() -> dict[str, str]:
    """Option -> the shared flag that sets it (``tensor_parallel_size`` -> ``--tensor-parallel-size``), for the
    messages of :func:`build_strategy`."""
    return {flag.dest: flag.name for flag in shared_flags()}


def strategy_options(args: argparse.Namespace) -> dict[str, Any]:
    """The strategy options the shared flags ask for: the parallel sizes given (a size not given is left to the
    strategy)."""
    return {name: getattr(args, name) for name in PARALLEL_SIZES if getattr(args, name, None) is not None}


__all__ = ["Default", "Flag", "LaunchError", "PARALLEL_SIZES", "add_recipe_flags", "build_strategy", "check_degrees",
           "check_options", "degree_options", "fabric_kwargs", "flag_names", "launched", "launcher_setting",
           "option_names", "owners", "shared_flags", "strategy_name", "strategy_options", "takes", "world_size"]
