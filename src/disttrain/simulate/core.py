"""Simulate a strategy at its real world size in one process: the recipe's model is built on the meta device, the
real engine code shards it on a fake process group (:mod:`disttrain.simulate.fake`) once per rank role, and the
objects it created are counted: nothing is allocated, nothing is sent.

What is counted, per role (ranks that hold the same kind of part: a pipeline stage x a tensor-parallel rank):
- ``params``: the local tensors of the parameters the engine left on the rank (DTensor local shards, the stage's
  modules, torchrec's table shards).
- ``grads``: gradients as the engines produce them: one per local parameter, of its dtype (FSDP2 reduce-scatters
  into the shard; DDP keeps a full copy); torchrec's fused tables keep none.
- ``optimizer``: the state tensors a real optimizer step creates for those parameters (AdamW, stepped on the meta
  shards), or the fused table optimizer's state (one value per row for row-wise Adagrad).
- ``checkpoint``: the bytes this rank writes in the one DCP layout: the write items torch's DCP save planner makes
  from the engine's model and optimizer state dicts (replicated items are written once per group of ranks holding
  them: DCP's de-duplication, counted as a share).
- ``comm``: bytes this rank sends per optimizer step over the data-parallel ranks, derived from the shapes of the
  units the engine created (a ring collective sends (n-1)/n of the tensor): the fake backend moves nothing and a
  training step cannot run on meta shards, so no step is executed.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from typing import Any, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from disttrain.parallel import registry
from disttrain.parallel.engines.layout import Layout
from disttrain.parallel.mesh import ParallelDims
from disttrain.simulate.fake import fake_world

_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}


@dataclass
class Role:
    """Bytes of one rank role. ``ranks``: how many ranks hold exactly these bytes; ``rank``: the one simulated."""

    name: str
    rank: int
    ranks: int
    params: int
    grads: int
    optimizer: int
    checkpoint: int
    comm: dict[str, float] = field(default_factory=dict)

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optimizer


@dataclass
class Simulation:
    """What :func:`simulate` returns: one :class:`Role` per rank role, how the figures were obtained (``notes``)
    and the wall time of the simulation in seconds; ``layout``: how the strategy holds the states (its engine's
    declaration, with these options)."""

    strategy: str
    dims: ParallelDims
    precision: str
    options: dict[str, Any] = field(default_factory=dict)
    roles: list[Role] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    layout: Layout | None = field(default=None, repr=False)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def row(self) -> registry.Registered:
        return registry.lookup(self.strategy)

    @property
    def busiest(self) -> Role:
        """The role with the most model-state bytes (what the planner estimates)."""
        return max(self.roles, key=lambda r: r.states)

    def table(self) -> str:
        """A Markdown table of the roles, sizes in GiB."""
        gib = 2**30
        lines = [f"{self.strategy} on {self.world_size} ranks ({self.dims.label()}), {self.precision}",
                 "", "| role | ranks | params GiB | grads GiB | optimizer GiB | states GiB | checkpoint GiB |"
                 " traffic/step GiB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in self.roles:
            lines.append(f"| {r.name} | {r.ranks} | {r.params / gib:.3f} | {r.grads / gib:.3f} | "
                         f"{r.optimizer / gib:.3f} | {r.states / gib:.3f} | {r.checkpoint / gib:.3f} | "
                         f"{sum(r.comm.values()) / gib:.3f} |")
        lines += [""] + [f"- {note}" for note in self.notes] + [f"- simulated in {self.seconds:.1f} s"]
        return "\n".join(lines)


# -- counting --------------------------------------------------------------------------------------------------
def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def nbytes(t: torch.Tensor) -> int:
    t = local(t)
    return t.numel() * t.element_size()


def stepped_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW after one step on meta gradients: its state tensors are the ones a real step creates."""
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=False)
    optimizer.step()
    return optimizer


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    # A scalar "step" per parameter lives on the CPU and is not device memory.
    return sum(nbytes(v) for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and local(v).dim() > 0)


def checkpoint_bytes(state: dict[str, Any], replicas: int = 1) -> int:
    """Bytes of this rank's write items in torch's DCP save planner; items that are not sharded are held by
    ``replicas`` ranks and written by one of them (counted as a 1/replicas share), as are shards their mesh replicates
    (HSDP)."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=False)
    total = 0.0
    for item in planner.create_local_plan().items:
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            continue
        size = math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize
        value = _lookup(state, item.index.fqn)
        if isinstance(value, DTensor):  # a shard, written once by the ranks that hold it (HSDP's replicas)
            total += size / math.prod(value.device_mesh.size(i) for i, p in enumerate(value.placements)
                                      if p.is_replicate())
        else:
            total += size / replicas
    return int(total)


def _lookup(state: dict[str, Any], fqn: str) -> Any:
    if fqn in state:
        return state[fqn]
    head, _, rest = fqn.partition(".")
    value = state.get(head)
    return _lookup(value, rest) if isinstance(value, dict) else None


def count(module: nn.Module, engine: Any, replicas: int = 1) -> tuple[int, int, int, int]:
    """(params, grads, optimizer, checkpoint) bytes of the parameters ``module`` holds on this rank."""
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = stepped_optimizer(params)
    state = {"model": engine.model_state(module), "optimizer": engine.optimizer_state(module, optimizer)}
    p_bytes = sum(nbytes(p) for p in params)
    g_bytes = sum(nbytes(p.grad) for p in params)
    return p_bytes, g_bytes, optimizer_bytes(optimizer), checkpoint_bytes(state, replicas)


def fsdp_traffic(module: nn.Module, dp: int, compute_bytes: int, reduce_bytes: int) -> float:
    """Per step over ``dp`` ranks: every FSDP unit's parameters all-gathered in forward and again in backward (the
    last block keeps them, see ``shard_blocks``), gradients reduce-scattered; sizes from the units' global shapes."""
    from torch.distributed.fsdp import FSDPModule

    if dp <= 1:
        return 0.0
    total = 0.0
    for unit in (m for m in module.modules() if isinstance(m, FSDPModule)):
        state = unit._get_fsdp_state()
        for group in state._fsdp_param_groups:
            numel = sum(fp.sharded_param.numel() for fp in group.fsdp_params)  # global numel of the DTensors
            gathers = 2 if group.post_forward_mesh_info is not None else 1
            total += (dp - 1) / dp * numel * (gathers * compute_bytes + reduce_bytes)
    return total


# -- building -------------------------------------------------------------------------------------------------
def meta_model(config: Union[str, dict]) -> nn.Module:
    """A fresh meta-device copy of the recipe's model. Every rank role shards its own copy; building a 2B ViT's
    modules takes seconds, copying the built one a fraction of that, so each config is built once per process."""
    from disttrain.planner.spec import meta_model as build
    from disttrain.planner.spec import recipe_model

    mapping = config if isinstance(config, dict) else recipe_model(config)
    key = json.dumps(mapping, sort_keys=True, default=str)
    if key not in _BUILT:
        with torch.device("meta"):
            _BUILT[key] = build(mapping)
    return copy.deepcopy(_BUILT[key])


_BUILT: dict[str, nn.Module] = {}


def precision_sizes(precision: str) -> tuple[int, int]:
    """(compute, reduce) bytes per element of the collectives of a sharded step."""
    if precision == "32-true":
        return 4, 4
    return 2, (2 if precision.endswith("-true") else 4)


def prepared(config: Union[str, dict], precision: str) -> nn.Module:
    module = meta_model(config)
    if precision in _DTYPES:
        module.to(_DTYPES[precision])
    return module


__all__ = ["Role", "Simulation", "fake_world"]


def versus(sim: Simulation, estimate: Any) -> str:
    """The planner's model-state estimate of the busiest rank beside the simulated one (``disttrain plan
    --simulate``); ``estimate`` is a :class:`disttrain.planner.Estimate` of the same set-up."""
    gib = 2**30
    busiest = sim.busiest
    # Offloaded states are the same bytes in host memory (the estimate counts them there, not per state).
    offload = estimate.layout is not None and estimate.layout.offloaded
    total = estimate.states + estimate.host
    rows = ["| model states per rank (busiest) | params GiB | grads GiB | optimizer GiB | total GiB |",
            "|---|---:|---:|---:|---:|",
            f"| simulated ({busiest.name}) | {busiest.params / gib:.3f} | {busiest.grads / gib:.3f} | "
            f"{busiest.optimizer / gib:.3f} | {busiest.states / gib:.3f} |",
            ("| planner estimate (device + host, offloaded) | | | | " if offload else
             f"| planner estimate | {estimate.params / gib:.3f} | {estimate.grads / gib:.3f} |"
             f" {estimate.optimizer / gib:.3f} | ") + f"{total / gib:.3f} |",
            "", f"planner error: {total / busiest.states - 1:+.2%} (simulated in {sim.seconds:.1f} s)"]
    return "\n".join(rows)
