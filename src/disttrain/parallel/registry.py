"""Every disttrain strategy, registered once: its name, engine, options and description.

Everything else finds a strategy here: the Lightning name table (``disttrain.names``: the Trainer and Fabric
adapters of each row's engine), the planner, the simulator and the callbacks (through the engine's layout, how it
holds a model's states: :mod:`disttrain.parallel.engines.layout`), the CLI (``disttrain strategies``, the
``--strategy`` choices), the docs' tables and the tests. A row's options are its engine's options dataclass, with the
row's ``defaults`` (``disttrain_fsdp_offload`` is ``disttrain_fsdp`` with ``cpu_offload=True``); ``Registered.dims``
turns options into :class:`ParallelDims` with the engine's own rule, ``Registered.layout`` into its layout.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional

from disttrain.parallel.options import OptionError, build_options

if TYPE_CHECKING:
    from disttrain.parallel.engines.base import Engine
    from disttrain.parallel.engines.layout import Layout
    from disttrain.parallel.mesh import ParallelDims


@dataclass
class AutoOptions:
    """Options of ``disttrain_auto`` (the same on the Trainer and Fabric).

    model: the model to plan for: a recipe YAML path, its ``model:`` dict, a ModelSpec or a module. Trainer: by
        default the LightningModule (its ``configure_model`` is run on the meta device if it builds the model
        there). Fabric: required.
    micro_batch: samples per device per step (default: the recipe's when ``model`` is a recipe YAML, else 1).
    seq_len: tokens per sample (default: the recipe's, else the model's length).
    headroom: fraction of device memory kept free.
    hardware: a preset name for bandwidths ("A100-40GB"); None: the devices present, with this machine's
        calibration (``disttrain calibrate``) when it has one.
    device_memory: overrides the detected memory per device ("40GiB").
    activation_checkpointing: None: the recipe's, else searched (the plan may turn it on); True or False fixes it.
    trial: run the best plans for a few steps on the devices present and choose the fastest measured (needs
        ``model`` as a recipe YAML or its ``model:`` dict).
    trial_top: plans to try.
    trial_steps: timed steps per plan (after one warm-up).
    """

    model: Any = None
    micro_batch: Optional[int] = None
    seq_len: Optional[int] = None
    headroom: float = 0.1
    hardware: Optional[str] = None
    device_memory: Optional[str] = None
    activation_checkpointing: Optional[bool] = None
    trial: bool = False
    trial_top: int = 3
    trial_steps: int = 3


@dataclass(frozen=True)
class Registered:
    """One registered strategy name. ``engine_path``: where its engine class is, ``"module:Class"`` (None for
    ``disttrain_auto``, which runs as the strategy the planner picks), imported the first time ``engine`` is read;
    ``defaults``: options this name sets (users' keywords override them).

    The engines are imported on first use, not with the registry: what only needs the names (``disttrain run``
    checking ``--strategy`` before it starts any process, ``import disttrain`` registering them with Lightning)
    does not pay for importing FSDP, DTensor and torch's pipelining (~0.8 s of CPU at every launch)."""

    name: str
    engine_path: Optional[str]
    description: str
    defaults: Mapping[str, Any] = field(default_factory=dict)

    @property
    def engine(self) -> Optional[type[Engine]]:
        """The engine class (None for ``disttrain_auto``)."""
        if self.engine_path is None:
            return None
        module, _, name = self.engine_path.partition(":")
        return getattr(importlib.import_module(module), name)

    @property
    def options_cls(self) -> type:
        return self.engine.options_cls if self.engine is not None else AutoOptions

    def options(self, **given: Any) -> Any:
        """The options dataclass built from the row's defaults and ``given`` (an unknown or misspelt key is one
        clear error naming the strategy, the valid options and the strategies that take it)."""
        try:
            return build_options(self.options_cls, self.name, {**self.defaults, **given}, lightning_hints=True)
        except TypeError as e:
            owners = {key: [row.name for row in STRATEGIES if row.engine is not None and row.engine is not self.engine
                            and key in row.options_cls.__dataclass_fields__] for key in given
                      if key not in self.options_cls.__dataclass_fields__}
            hints = [f"{key} is an option of {', '.join(dict.fromkeys(names))}" for key, names in owners.items() if names]
            if not hints:
                raise
            raise TypeError(f"{e} ({'; '.join(hints)})") from None

    def dims(self, world_size: int, options: Any = None, local_size: Optional[int] = None) -> ParallelDims:
        """The degrees this strategy runs with on ``world_size`` ranks (``options``: a dataclass or a dict)."""
        if self.engine is None:
            raise ValueError(f"{self.name} has no degrees of its own: it runs as the strategy the planner chooses")
        if not dataclasses.is_dataclass(options):
            options = self.options(**(options or {}))
        return self.engine.parallel_dims(options, world_size, local_size)

    def layout(self, options: Any = None) -> Layout:
        """How this strategy holds a model's states with ``options`` (a dataclass or a dict; default: the row's)."""
        if self.engine is None:
            raise ValueError(f"{self.name} has no layout of its own: it runs as the strategy the planner chooses")
        if not dataclasses.is_dataclass(options):
            options = self.options(**(options or {}))
        return self.engine.layout(options)

    def given(self, options: Any) -> dict[str, Any]:
        """The options of ``options`` that differ from the dataclass defaults and the row's, for labels and reports."""
        return non_default(options, self.defaults)


ENGINES = "disttrain.parallel.engines."  # the engines' package: a row names its engine's module and class in it
DDP = Registered("disttrain_ddp", ENGINES + "ddp:DDPEngine",
                 "DDP with optional gradient compression (fp16, bf16, int8, PowerSGD); CPU (gloo) and GPU (nccl)")
FSDP = Registered("disttrain_fsdp", ENGINES + "fsdp:FSDPEngine",
                  "FSDP2 fully_shard, one unit per block found automatically, full shard; CPU (gloo) and GPU (nccl)")
FSDP_OFFLOAD = Registered("disttrain_fsdp_offload", ENGINES + "fsdp:FSDPEngine",
                          "FSDP2 with parameters, gradients and optimizer state offloaded to CPU",
                          {"cpu_offload": True})
ZERO3 = Registered("disttrain_zero3", ENGINES + "zero:ZeroEngine",
                   "DeepSpeed ZeRO stage 3; batch settings from the Trainer/Fabric; CPU (gloo) and GPU (nccl)")
ZERO3_OFFLOAD = Registered("disttrain_zero3_offload", ENGINES + "zero:ZeroEngine",
                           "DeepSpeed ZeRO-3 with optimizer state and parameters offloaded to CPU (or NVMe:"
                           " offload_*='nvme', nvme_path=)", {"offload_optimizer": "cpu", "offload_parameters": "cpu"})
ZERO1 = Registered("disttrain_zero1", ENGINES + "zero:ZeroEngine",
                   "DeepSpeed ZeRO stage 1: optimizer state and fp32 master weights partitioned, parameters and"
                   " gradients whole; CPU (gloo) and GPU (nccl)", {"stage": 1})
ZERO2 = Registered("disttrain_zero2", ENGINES + "zero:ZeroEngine",
                   "DeepSpeed ZeRO stage 2: gradients, optimizer state and fp32 master weights partitioned, parameters"
                   " whole; CPU (gloo) and GPU (nccl)", {"stage": 2})
ZERO2_OFFLOAD = Registered("disttrain_zero2_offload", ENGINES + "zero:ZeroEngine",
                           "DeepSpeed ZeRO-2 with optimizer state and fp32 master weights offloaded to CPU"
                           " (ZeRO-Offload)", {"stage": 2, "offload_optimizer": "cpu"})
MEGATRON = Registered("disttrain_megatron", ENGINES + "megatron:MegatronEngine",
                      "Megatron-style 3D: tensor parallel (heads/MLP) x pipeline parallel (torch pipelining) x context"
                      " parallel (long sequences) x FSDP2 data parallel")
RECSYS = Registered("disttrain_recsys", ENGINES + "recsys:RecsysEngine",
                    "torchrec DistributedModelParallel: tables sharded by the planner, dense part data-parallel; CPU"
                    " and GPU")
AUTO = Registered("disttrain_auto", None,
                  "the planner's choice among the registered strategies, from model size, device memory and world"
                  " size")

# ZeRO-1/2 after ZeRO-3: the planner keeps the first of equal estimates, and its formula for ZeroEngine rows is
# ZeRO-3's (with ZeRO-1/2's replicated degrees, it counts every state whole).
STRATEGIES: tuple[Registered, ...] = (DDP, FSDP, FSDP_OFFLOAD, ZERO3, ZERO3_OFFLOAD, ZERO1, ZERO2, ZERO2_OFFLOAD,
                                      MEGATRON, RECSYS, AUTO)


def non_default(options: Any, defaults: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """The fields of an options dataclass that differ from its defaults (and from ``defaults``)."""
    base = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(options)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
    base.update(defaults or {})
    return {k: v for k, v in dataclasses.asdict(options).items() if k not in base or base[k] != v}


def names() -> list[str]:
    return [row.name for row in STRATEGIES]


def closest_names(name: str, choices: Optional[Iterable[str]] = None, n: int = 1) -> list[str]:
    """Up to ``n`` of the registered names (or of ``choices``) ``name`` was most likely meant to be, closest first.
    A disttrain name is compared without its ``disttrain_`` prefix (to ``name`` without it too), which every
    disttrain name shares and which would make any name that has it look close to all of them; ``"fsdpp"`` and
    ``"disttrain_fdsp"`` both find ``disttrain_fsdp``."""
    query = str(name)
    scored = []
    for choice in names() if choices is None else choices:
        ours = choice.startswith("disttrain_")
        a, b = (query.removeprefix("disttrain_"), choice.removeprefix("disttrain_")) if ours else (query, choice)
        scored.append((difflib.SequenceMatcher(None, a, b).ratio(), ours, choice))
    return [choice for ratio, _, choice in sorted(scored, reverse=True) if ratio >= 0.6][:n]


def lookup(name: str) -> Registered:
    """The row of a registered name; an unknown one is one error (an :class:`OptionError`) with the closest name and
    the full list."""
    for row in STRATEGIES:
        if row.name == name:
            return row
    close = closest_names(name)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise OptionError(f"strategy={name!r} is not a registered disttrain strategy; {hint}choose one of"
                      f" {', '.join(names())}")


__all__ = ["AUTO", "AutoOptions", "DDP", "FSDP", "FSDP_OFFLOAD", "MEGATRON", "RECSYS", "Registered", "STRATEGIES",
           "ZERO1", "ZERO2", "ZERO2_OFFLOAD", "ZERO3", "ZERO3_OFFLOAD", "closest_names", "lookup", "names",
           "non_default"]
