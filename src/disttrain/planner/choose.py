"""Choosing a strategy: rules decide which kinds of parallelism are considered, the memory estimate decides what
fits, and an estimated step time ranks what fits (docs/choosing.md explains them in a user's terms).

Rules (the common practice of the large-model frameworks): under 1B parameters, DDP whenever it fits; a model that does not fit
one device is sharded (FSDP / ZeRO-3); Megatron-style tensor/pipeline parallelism ("3D") is considered above 10B
parameters with many devices, or when no data-parallel strategy fits without recomputation or offload (activations,
not states, are the problem: tensor parallelism is the only way to split them). Embedding-dominated recommenders
(DeepFM) shard their tables (``disttrain_recsys``).

Step time = max(compute, data-parallel traffic / bandwidth) (FSDP/ZeRO/DDP traffic overlaps compute) + the
traffic on the critical path (tensor-parallel all-reduces, pipeline sends, embedding all-to-all, offload copies and
the CPU optimizer) + the pipeline bubble. Compute is 6N + attention FLOPs per token at ``mfu`` of peak; activation
checkpointing adds a forward (x 4/3).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from disttrain.parallel import registry
from disttrain.parallel.ddp import DDPEngine
from disttrain.parallel.engine import FSDPEngine
from disttrain.parallel.megatron import MegatronEngine
from disttrain.parallel.mesh import divisors
from disttrain.parallel.recsys import RecsysEngine
from disttrain.parallel.zero_engine import ZeroEngine
from disttrain.planner.estimate import (
    Estimate,
    analytic,
    estimate,
    flops_per_sample,
    pipelines,
    planned,
    tensor_parallel,
)
from disttrain.planner.hardware import GiB, Hardware
from disttrain.planner.hardware import hardware as make_hardware
from disttrain.planner.spec import ModelLike, ModelSpec, model_spec

SMALL_MODEL = 1e9
# "Over 10B parameters -> hybrid (3D)": beyond the 10B class. The 10B dialogue reference case (10.2B in
# configs/nlp/dialogue_10b.yaml) trains with ZeRO-3, so a model has to be clearly past 10B for the 3D rule.
THREE_D_MODEL = 11e9
THREE_D_DEVICES = 16
TIE = 0.03  # step times within 3% are a tie: the frameworks' preference order decides
LONG_SEQUENCE = 8192  # context parallelism is considered for sequences of at least this many tokens


@dataclass
class Candidate:
    """One strategy set-up with its estimate, whether it fits, and its estimated step time in seconds."""

    estimate: Estimate
    fits: bool
    step_time: float
    usable: int
    why: str = ""

    @property
    def label(self) -> str:
        return self.estimate.label + (" +AC" if self.estimate.activation_checkpointing else "")

    @property
    def row(self) -> registry.Registered:
        return registry.lookup(self.estimate.strategy)

    def strategy_options(self) -> dict:
        """Keyword options of the registered strategy that realise this candidate (beyond its defaults)."""
        return dict(self.estimate.options)


@dataclass
class Plan:
    """Every candidate considered (``candidates``), the choice and the reasons, for one model and machine."""

    spec: ModelSpec
    world_size: int
    hardware: Hardware
    candidates: list[Candidate]
    choice: Candidate | None
    reasons: list[str] = field(default_factory=list)

    @property
    def strategy(self) -> str:
        if self.choice is None:
            raise RuntimeError("no strategy fits:\n" + "\n".join(self.reasons))
        return self.choice.estimate.strategy

    @property
    def unit(self) -> tuple[str, int]:
        return ("GiB", GiB) if self.hardware.memory >= 4 * GiB else ("MiB", 2**20)

    def table(self) -> str:
        name, unit = self.unit
        head = (f"{'strategy':<40} {'states ' + name:>11} {'activations':>11} {'buffers':>8} {'per rank':>9}"
                f" {'host':>7} {'fits':>4} {'step s':>8}")
        lines = [head, "-" * len(head)]
        for c in self.candidates:
            e = c.estimate
            lines.append(f"{c.label:<40} {e.states / unit:>11.1f} {e.activations / unit:>11.1f}"
                         f" {e.buffers / unit:>8.1f} {e.device / unit:>9.1f} {e.host / unit:>7.1f}"
                         f" {'yes' if c.fits else 'no':>4} {c.step_time:>8.3g}"
                         + (f"  {c.why}" if c.fits and c.why else ""))
        return "\n".join(lines)

    def report(self) -> str:
        hw = self.hardware
        name, unit = self.unit
        usable = f"{self.candidates[0].usable / unit:.1f}" if self.candidates else "?"
        out = [f"model: {self.spec.family}, {_count(self.spec.params)} parameters; {self.world_size} x {hw.name}"
               f" ({hw.memory / unit:.1f} {name}, usable {usable} {name} per rank), {hw.gpus_per_node} per node."
               f" Bytes per rank:", "", self.table(), ""]
        if self.choice is not None:
            out.append(f"recommendation: {self.choice.label}  {self.choice.strategy_options() or ''}".rstrip())
        else:
            out.append("recommendation: none fits")
        out += [f"  - {r}" for r in self.reasons]
        return "\n".join(out)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}" if n >= 0.1 * GiB else f"{n / GiB:.3g}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def step_time(spec: ModelSpec, e: Estimate, hw: Hardware) -> float:
    """Estimated seconds of one step (one micro-batch per data-parallel rank's worth of samples per rank)."""
    compute = flops_per_sample(spec, e.seq_len) * e.micro_batch / (hw.peak_flops * hw.mfu)
    if e.activation_checkpointing:
        compute *= 4 / 3
    c = e.comm
    compute *= 1 + c.get("bubble", 0.0)
    spans_nodes = e.world_size > hw.gpus_per_node
    dp_bw = hw.inter_node_bw if spans_nodes else hw.intra_node_bw
    # Tensor- and context-parallel ranks are neighbours in the mesh (one node while tp*cp fits it).
    tp_bw = hw.intra_node_bw if e.dims.tp * e.dims.cp <= hw.gpus_per_node else hw.inter_node_bw
    # Expert-parallel ranks are data-parallel neighbours (one node while tp*ep fits it); their all-to-alls, like the
    # embedding tables', are on the critical path.
    ep_bw = hw.intra_node_bw if e.dims.tp * e.dims.ep <= hw.gpus_per_node else hw.inter_node_bw
    exposed = (c.get("tp", 0) / tp_bw + c.get("cp", 0) / tp_bw + c.get("pp", 0) / dp_bw + c.get("a2a", 0) / dp_bw
               + c.get("ep", 0) / ep_bw
               + c.get("pcie", 0) / hw.pcie_bw + c.get("host_optimizer", 0) / hw.host_optimizer_bw)
    return max(compute, c.get("dp", 0) / dp_bw) + exposed


def _megatron_grid(spec: ModelSpec, world_size: int, hw: Hardware, seq_len: int) -> list[dict]:
    """tp x pp splits (tp inside a node) of the heads and layers the model has, for long sequences tp x cp
    (context parallelism inside a node: its all-to-alls are on every block's critical path), and for MoE models tp x
    ep (the experts split inside a node)."""
    if not tensor_parallel(spec):
        return []
    out = []
    for t in divisors(min(world_size, hw.gpus_per_node)):
        if spec.heads % t or spec.kv_heads % t:
            continue
        for p in divisors(world_size // t):
            if (t, p) != (1, 1) and p <= 16 and spec.layers % p == 0 and (p == 1 or pipelines(spec)):
                out.append({"tensor_parallel_size": t, "pipeline_parallel_size": p})
        experts = (spec.extra.get("experts") or {}).get("count", 0)
        for e in divisors(min(world_size // t, hw.gpus_per_node // t)) if experts else []:
            if e > 1 and experts % e == 0:  # expert parallelism inside a node, over the data-parallel ranks
                out.append({"tensor_parallel_size": t, "expert_parallel_size": e})
        if seq_len < LONG_SEQUENCE or not spec.extra.get("context_parallel"):
            continue
        heads, kv = spec.heads // t, spec.kv_heads // t  # per tensor-parallel rank: what the all-to-all splits
        for c in divisors(hw.gpus_per_node // t):
            if c > 1 and world_size % (t * c) == 0 and seq_len % c == 0 and heads % c == 0 and \
                    (kv % c == 0 or c % kv == 0):
                out.append({"tensor_parallel_size": t, "context_parallel_size": c})
    return out


# The set-ups of a strategy worth estimating, by engine (default: the strategy with its own options).
VARIANTS = {MegatronEngine: _megatron_grid,
            RecsysEngine: lambda spec, world_size, hw, seq_len: [{}] if spec.table_rows else []}


def offloaded(row: registry.Registered, options: Mapping[str, Any] | None = None) -> bool:
    """Whether ``row`` with ``options`` keeps its states in host memory (the _offload names)."""
    merged = {**row.defaults, **(options or {})}
    return bool(merged.get("cpu_offload") or merged.get("offload_optimizer"))


def candidates(spec: ModelSpec, world_size: int, hw: Hardware,
               seq_len: int | None = None) -> list[tuple[registry.Registered, dict]]:
    """Every set-up worth estimating, as (strategy row, options): each planned strategy, Megatron's tp x pp splits,
    recsys for models with tables; tables first, 3D last, offload after the strategies that keep states on the
    device."""
    names = planned()
    rows = [row for row in registry.STRATEGIES if row.name in names]
    rows.sort(key=lambda row: (row.engine is not RecsysEngine, row.engine is MegatronEngine, offloaded(row)))
    return [(row, options) for row in rows
            for options in VARIANTS.get(row.engine, lambda *_: [{}])(spec, world_size, hw,
                                                                     int(seq_len or spec.tokens or 1))]


def recomputable(spec: ModelSpec) -> bool:
    """Activation checkpointing is estimated for blocks whose activations are known (analytic or measured)."""
    return spec.layers > 0 and (analytic(spec) or "activations" in spec.extra)


def choose(model_or_config: ModelLike, world_size: int, hardware: Hardware | str | None = None,
           device_memory: str | int | None = None, micro_batch: int = 1, seq_len: int | None = None,
           precision: str = "bf16-mixed", headroom: float = 0.1, available: Iterable[str] | None = None,
           optimizer: str | None = None) -> Plan:
    """The cheapest strategy that fits ``device_memory`` (minus ``headroom`` and the runtime's reserve) on
    ``world_size`` devices of ``hardware`` (a :class:`Hardware`, a preset name such as "A100-40GB", or None for an
    A100-class node). ``available`` limits the choice to these strategy names (e.g. the registered ones)."""
    spec = model_spec(model_or_config)
    hw = hardware if isinstance(hardware, Hardware) else make_hardware(hardware, device_memory)
    if isinstance(hardware, Hardware) and device_memory is not None:
        hw = hw.with_memory(device_memory)
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom={headroom} must be a fraction in [0, 1), e.g. 0.1 for 10%")
    usable = int(hw.memory * (1 - headroom)) - hw.reserved
    allowed = set(planned() if available is None else available)
    ranks_per_node = min(world_size, hw.gpus_per_node)

    plan = Plan(spec, world_size, hw, [], None)
    for row, options in candidates(spec, world_size, hw, seq_len):
        if row.name not in allowed:
            continue
        recompute = recomputable(spec) and "activation_checkpointing" in row.options_cls.__dataclass_fields__
        for ac in (False, True) if recompute else (False,):
            e = estimate(spec, row.name, world_size, micro_batch=micro_batch, seq_len=seq_len, precision=precision,
                         optimizer=optimizer, **options, **({"activation_checkpointing": True} if ac else {}))
            host_ok = e.host * ranks_per_node <= hw.host_memory * (1 - headroom)
            fits = e.device <= usable and host_ok
            why = "" if fits else (f"needs {_gib(e.device)} GiB > {_gib(usable)} GiB usable" if host_ok else
                                   f"host needs {_gib(e.host * ranks_per_node)} GiB per node")
            plan.candidates.append(Candidate(e, fits, step_time(spec, e, hw), usable, why))
            if fits:
                break  # recomputation only where the plain set-up does not fit
    _decide(plan, allowed)
    note = measurement_note(spec)
    if note:
        plan.reasons.append(note)
    return plan


def measurement_note(spec: ModelSpec) -> str:
    """How the activations of a model outside the analytic families were found, or that they are unknown."""
    if analytic(spec):
        return ""
    measured = spec.extra.get("activations")
    if measured is None:
        return ("activations unknown (counted as 0): nothing to run this module on; give the LightningModule an"
                " example_input_array (or pass model= a config or model disttrain knows)")
    return (f"activations and FLOPs measured by running the model's forward on the meta device with"
            f" {measured.what}; fused attention (SDPA/FlashAttention) counted as it saves for backward")


def _preference(spec: ModelSpec, c: Candidate) -> int:
    """The preference order of the frameworks (DeepSpeed, then Megatron, for 10B+; FSDP below), used to break ties
    in step time."""
    if spec.params >= THREE_D_MODEL:  # "medium-large -> DeepSpeed, very large -> Megatron"
        order = (RecsysEngine, ZeroEngine, MegatronEngine, FSDPEngine, DDPEngine)
    else:  # "small and medium teams -> PyTorch FSDP"
        order = (RecsysEngine, DDPEngine, FSDPEngine, ZeroEngine, MegatronEngine)
    engine = c.row.engine
    rank = order.index(engine) if engine in order else len(order)
    return rank + (10 if offloaded(c.row, c.estimate.options) else 0) + \
        (5 if c.estimate.activation_checkpointing else 0)


def _decide(plan: Plan, allowed: set[str]) -> None:
    spec, n, reasons = plan.spec, plan.world_size, plan.reasons
    fitting = [c for c in plan.candidates if c.fits]
    ddp = next((c for c in fitting if c.row is registry.DDP), None)
    if ddp is not None and spec.params < SMALL_MODEL and not spec.table_rows:
        plan.choice = ddp
        reasons.append(f"under 1B parameters ({spec.params / 1e9:.2f}B) and DDP fits ({_gib(ddp.estimate.device)} of"
                       f" {_gib(ddp.usable)} GiB): the planner's rule, and the least communication (one all-reduce)")
        return
    if ddp is None:
        worst = next((c for c in plan.candidates if c.row is registry.DDP), None)
        if worst is not None:
            reasons.append(f"DDP does not fit: a full replica {worst.why} (model states alone "
                           f"{_gib(worst.estimate.states)} GiB)")
    plain_dp = [c for c in fitting if c.row in (registry.DDP, registry.FSDP, registry.ZERO3)
                and not c.estimate.activation_checkpointing]
    big = spec.params >= THREE_D_MODEL and n >= THREE_D_DEVICES
    admitted = []
    for c in fitting:
        if c.row.engine is MegatronEngine and not (big or not plain_dp):
            c.why = "(not considered: 3D rule)"
            continue
        admitted.append(c)
    if any(c.row.engine is MegatronEngine for c in plan.candidates):
        if big:
            reasons.append(f"3D parallelism considered: {spec.params / 1e9:.1f}B parameters on {n} devices")
        elif not plain_dp:
            reasons.append("3D parallelism considered: no data-parallel strategy fits without recomputation or "
                           "offload (activations dominate; tensor parallelism splits them across heads)")
        else:
            reasons.append(f"3D parallelism not considered: under {THREE_D_MODEL / 1e9:.0f}B parameters and a "
                           f"data-parallel strategy fits")
    context = [c for c in plan.candidates if c.estimate.dims.cp > 1]
    if context:
        reasons.append(f"context parallelism considered: {context[0].estimate.seq_len} tokens per sequence (from"
                       f" {LONG_SEQUENCE}); cp ranks each compute 1/cp of every sequence's tokens (activations / cp)"
                       " for two all-to-alls per block")
    if spec.table_rows and registry.RECSYS.name not in allowed:
        reasons.append("disttrain_recsys (table-wise embedding sharding) is not available here")
    if not admitted:
        reasons.append("nothing fits: " + "; ".join(f"{c.label}: {c.why}" for c in plan.candidates[:6]) +
                       "; use more devices, a smaller micro-batch or a shorter sequence")
        return
    best_time = min(c.step_time for c in admitted)
    near = [c for c in admitted if c.step_time <= best_time * (1 + TIE)]
    near.sort(key=lambda c: (_preference(spec, c), c.step_time))
    plan.choice = choice = near[0]
    e = choice.estimate
    comm = ", ".join(f"{k} {v / 1e9:.1f} GB" for k, v in e.comm.items() if k != "bubble" and v)
    reasons.append(f"{choice.label} fits ({_gib(e.device)} of {_gib(choice.usable)} GiB per rank) with the shortest "
                   f"estimated step ({choice.step_time:.2f} s; traffic per rank per step: {comm or 'none'})")
    runners = sorted((c for c in admitted if c is not choice), key=lambda c: c.step_time)[:2]
    for r in runners:
        reasons.append(f"next: {r.label} at {r.step_time:.2f} s")
    split = min((c for c in admitted if c.estimate.dims.cp > 1), key=lambda c: c.step_time, default=None)
    recompute = min((c for c in admitted if c.estimate.activation_checkpointing and c.estimate.dims.cp == 1),
                    key=lambda c: c.step_time, default=None)
    if split is not None and recompute is not None:
        faster, slower = sorted((split, recompute), key=lambda c: c.step_time)
        reasons.append(f"splitting the sequence against recomputing it: {faster.label} {faster.step_time:.2f} s"
                       f" ({_gib(faster.estimate.device)} GiB) beats {slower.label} {slower.step_time:.2f} s"
                       f" ({_gib(slower.estimate.device)} GiB)")
    if len(near) > 1:
        reasons.append("step times within 3% are ties, broken by the preference order of the frameworks ("
                       + ("DeepSpeed, then Megatron, for 10B+" if spec.params >= THREE_D_MODEL else
                          "DDP, then FSDP, for smaller models") + ")")
