"""Seconds of one training step of a set-up (an :class:`~disttrain.planner.estimate.Estimate`) on a machine.

One step is the forward and backward of ``micro_batch`` samples on every device and the optimizer step (the same
global batch for every strategy: tensor/pipeline/context-parallel groups run ``tp x pp x cp`` micro-batches per
data-parallel rank). Its parts, as the engines schedule them:

- **compute**: the FLOPs of forward and backward (x 4/3 with activation checkpointing) at the matmul throughput
  measured at the model's shapes (``disttrain calibrate``; uncalibrated: ``peak_flops x mfu``), plus elementwise
  work bound by memory: the saved activations written in forward, read in backward and their gradients written
  (3 x activation bytes at the memory bandwidth). Pipeline parallelism stretches it by its bubble: 1F1B over ``m``
  microbatches and ``p`` stages idles ``(p-1)/(m+p-1)`` of the time, at the pace of the busiest stage (an LM
  head over the vocabulary weighs on the last).
- **optimizer**: the states this rank holds, swept once by the optimizer (measured with torch's AdamW), plus its
  work per parameter tensor, plain or distributed (DTensor) as the layout says (``Hardware.overheads``): a small
  model's step is mostly the latter. An optimizer over a few flat partitions (DeepSpeed's) counts only their bytes.
- **data-parallel traffic**, overlapped: parameters gathered per unit (FSDP2, ZeRO-3) are prefetched, the next
  unit's all-gather while the current one computes, and gradients reduce-scattered during backward (on a stream of
  their own: CPU processes have none, so there each unit waits for its gather, which then sits between computations
  and costs ``Hardware.overheads.collective`` per call as the critical-path collectives below do); gradients reduced
  in buckets (DDP) go while backward runs. What exceeds ``overlap`` x the compute it can hide behind is exposed, and
  never less than one unit's (bucket's) share: the first gather (the last bucket) has nothing to hide behind. The
  collectives within one copy of the states run on the intra-node link when that copy's ranks fit a node (HSDP
  shards within a node), the all-reduce across copies on the network when the world spans nodes.
- **overhead**: the framework's own work (Python, operator dispatch, the engines' hooks; ``Hardware.overheads``,
  measured by ``disttrain calibrate``) per block executed (x 4/3 with checkpointing), as the layout declares it:
  plain blocks, hooked ones (FSDP2: per unit, blocks, sub-networks such as embeddings and head, and root, where its
  units are FSDP's own), ZeRO-3's (DeepSpeed's hooks on every submodule and their fetches, whose latency is counted
  there and not with the traffic); DTensor ones under tensor parallelism, hooked on top where the data dimension is
  sharded, however few its ranks. A pipeline stage runs its blocks once per microbatch, plus the schedule's own work
  per microbatch, over ``m + p - 1`` slots. On GPUs the device computes while the host dispatches, so a step takes
  the longer of compute and overhead; CPU processes do both in turn.
- **the model's own work**: ``disttrain calibrate --model`` times the model itself (forward, loss and backward on
  every process at once, at one block and at up to four); its time over what the items above predict for one plain
  process is the model's factor (:func:`model_factor`), which scales its compute and plain block overhead under
  every plan. It counts what the matmuls and a tiny block cannot show: an MoE block's routing and loop over experts,
  a model's own norms, activations and loss.
- **critical-path traffic**, not overlapped: tensor-parallel all-reduces (four per block per micro-batch), pipeline
  sends, context-parallel and expert all-to-alls, embedding all-to-alls (recsys), updated partitions gathered after
  the optimizer step (a layout that gathers then, as ZeRO-1/2 do), offload copies and the CPU optimizer. Each
  collective there sits between computations, which costs more than the same collective alone
  (``Hardware.overheads.collective`` per call, measured by ``disttrain calibrate``).

Each collective costs ``latency x calls + bytes / bandwidth`` with the link measured for its kind (all-gather,
reduce-scatter, all-reduce, all-to-all) when calibrated, else the preset's latency and intra-/inter-node bandwidth.
Traffic that crosses nodes (:func:`crosses_nodes`) uses the links measured between nodes (``disttrain calibrate
--num-nodes``); a calibration of one node has none, and that traffic then costs the preset's latency and
``inter_node_bw``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from disttrain.parallel import registry
from disttrain.parallel.engines.layout import Gather, Layout, Reduce, Steps, Units, Work
from disttrain.parallel.mesh import ParallelDims
from disttrain.planner.estimate import Estimate, activation_bytes, flops_per_sample, lora_elements
from disttrain.planner.hardware import Hardware, Overheads
from disttrain.planner.spec import ModelSpec

NETWORK = ("dp", "dp_replicate", "after_step", "tp", "pp", "cp", "ep", "a2a")  # the comm kinds that use a link


@dataclass(frozen=True)
class StepTime:
    """The parts of one step, seconds (see the module docstring)."""

    compute: float
    optimizer: float
    dp: float  # data-parallel traffic in all
    dp_exposed: float  # of which not hidden behind compute
    critical: float  # traffic on the critical path
    overhead: float = 0.0  # the framework's own work
    overlaps: bool = True  # the device computes while the host dispatches: the longer of compute and overhead
    codec: float = 0.0  # encoding and decoding compressed gradients

    @property
    def total(self) -> float:
        busy = max(self.compute, self.overhead) if self.overlaps else self.compute + self.overhead
        return busy + self.optimizer + self.dp_exposed + self.critical + self.codec


def _compute_bytes(precision: str) -> int:
    return 4 if precision.startswith("32") else 2


def _matmul_rate(spec: ModelSpec, e: Estimate, hw: Hardware) -> float:
    if hw.calibration is None:
        return hw.peak_flops * hw.mfu
    d = e.dims
    tokens = e.micro_batch * max(1, e.seq_len) / d.cp
    hidden = spec.hidden or 1024
    return hw.calibration.matmul_flops(tokens, (spec.ffn or 4 * hidden) / d.tp, hidden) * \
        hw.calibration.block_efficiency(tokens, hidden / d.tp)


def _link(hw: Hardware, op: str, sent: float, calls: float, crosses: bool, together: int = 1) -> float:
    """Seconds of ``calls`` ``op`` collectives sending ``sent`` bytes per rank, within a node or (``crosses``)
    between nodes; ``together``: the group's ranks on one node (see :func:`node_share`)."""
    if not sent:
        return 0.0
    if crosses and together > 1:  # the ring's hops inside a node carry every member's bytes at the node's rate
        return max(_link(hw, op, sent / together, calls, True), _link(hw, op, sent, calls, False))
    calibration = hw.calibration
    measured = None if calibration is None else calibration.inter_links if crosses else calibration.links
    if measured is not None:
        return measured[op].time(sent, calls)
    return calls * hw.latency + sent / (hw.inter_node_bw if crosses else hw.intra_node_bw)


def microbatches(e: Estimate) -> int:
    """Pipeline microbatches per step: the option, else the engine's default ``2 x pp``, at most the samples a
    pipeline gets per step (``micro_batch x tp x pp x cp``: the same global batch as the other strategies)."""
    d = e.dims
    if d.pp == 1:
        return 1
    return max(1, min(e.options.get("microbatches") or 2 * d.pp, e.micro_batch * d.tp * d.pp * d.cp))


def layout_of(e: Estimate) -> Layout:
    """How the estimate's strategy holds the states: the layout it was estimated with, else its engine's for the
    options it records."""
    if e.layout is not None:
        return e.layout
    return registry.lookup(e.strategy).layout(e.options)


def block_work(layout: Layout, dims: ParallelDims, o: Overheads) -> float:
    """Seconds of framework work per block executed under ``layout`` at ``dims``: a plain block's (on DTensors
    under tensor parallelism) plus what the layout's hooks add (FSDP2's, counted the same for every hooked module;
    DeepSpeed ZeRO-3's measured ones, or FSDP2's when they were not measured)."""
    base = o.tensor_parallel if dims.tp > 1 else o.eager
    if layout.work is Work.PLAIN:
        return base
    if layout.work is Work.ZERO3 and o.zero3:
        return base + o.zero3
    return base + (o.sharded - o.eager)


def overhead(spec: ModelSpec, e: Estimate, hw: Hardware, loader_batch: bool = False, factor: float = 1.0) -> float:
    """Seconds of framework work in one step of ``e`` (see the module docstring). ``loader_batch``: each rank's
    DataLoader gives ``micro_batch`` samples whatever the strategy, so a tensor/pipeline/context-parallel group
    runs ``tp x pp x cp`` steps for the samples the step counts; otherwise one step of them all. ``factor``
    (:func:`model_factor`) scales the plain block's share of each block's work: the engine's own adds to it."""
    o, d, layout = hw.overheads, e.dims, layout_of(e)
    blocks = max(1, spec.layers // d.pp) + (1 if d.pp == 1 else 0)  # the ends (embeddings, head, loss) as one more
    if layout.params.units is Units.FSDP:  # every unit's hooks run: the blocks', the sub-networks' and the root's
        blocks = max(blocks, fsdp_units(spec))
    per_block = block_work(layout, d, o) + (factor - 1) * o.eager
    if d.pp == 1:
        step = blocks * per_block
    else:
        m = microbatches(e)
        step = (m + d.pp - 1) * (blocks * per_block + o.microbatch)  # bubbles idle the host as much as the device
    recompute = 4 / 3 if e.activation_checkpointing else 1  # checkpointed blocks run their forward twice
    return step * recompute * (d.tp * d.pp * d.cp if loader_batch else 1)


def counted(spec: ModelSpec, key: str) -> int | None:
    """A count made on the model: ``fsdp_units`` (the units ``disttrain_fsdp`` makes of it,
    :func:`disttrain.parallel.split.fsdp.unit_count`) or ``tensors`` (its parameter tensors). Counted on the module the
    spec was built from, or on the model its config describes built on the meta device (once; both kept in the
    spec); None when neither is at hand (a spec of plain sizes, a config the planner cannot build)."""
    if key not in spec.extra and spec.extra.get("config") and not spec.extra.get("uncounted"):
        from disttrain.parallel.split.fsdp import unit_count
        from disttrain.planner.spec import meta_model

        try:
            model = meta_model(spec.extra["config"])
        except (ValueError, TypeError, ImportError):  # a config the planner counts but cannot build: estimated
            spec.extra["uncounted"] = True
        else:
            spec.extra.setdefault("fsdp_units", unit_count(model))
            spec.extra.setdefault("tensors", sum(1 for _ in model.parameters()))
    return spec.extra.get(key)


def fsdp_units(spec: ModelSpec) -> int:
    """The FSDP units ``disttrain_fsdp`` makes of the model (:func:`counted`), else one per block and the root."""
    return counted(spec, "fsdp_units") or (spec.layers + 1 if spec.layers else 1)


def parameter_tensors(spec: ModelSpec) -> int:
    """The model's parameter tensors (:func:`counted`), else ~9 a block (Llama's: two norms, four attention and
    three MLP weights) and 3 outside them (embedding, final norm, head)."""
    return int(counted(spec, "tensors") or 9 * spec.layers + 3)


# DeepSpeed ZeRO-1/2's Python work per parameter each step (its gradient hook copying into the bucket, the bucket's
# bookkeeping, the partition's copies after the step), in plain per-tensor optimizer updates: timm's DeiT-tiny (152
# tensors, micro-batch 2) on 2 CPU processes steps in 150 ms under disttrain_zero2 against 86 ms under disttrain_ddp
# (1.7x; the CPU preset with this factor: 118 against 65 ms, 1.8x). Without it the sharded optimizer sweep made ZeRO-2
# look faster than DDP on small models; on large ones the sweep, not the tensors, dominates, as it should.
GRADIENT_HOOK = 10.0


def optimizer_overhead(spec: ModelSpec, e: Estimate, hw: Hardware) -> float:
    """Seconds of the optimizer step's (and ``zero_grad``'s) work per parameter tensor this rank holds: a pipeline
    stage holds its share of them, plain tensors or distributed ones as the layout says; an optimizer over a few flat
    partitions none counted (ZeRO-3's), unless a hook per parameter feeds them (ZeRO-1/2's: :data:`GRADIENT_HOOK`
    plain updates per tensor)."""
    steps, d, o = layout_of(e).optimizer.steps, e.dims, hw.overheads
    if steps is Steps.FLAT:
        return 0.0
    per_tensor = {Steps.DTENSORS: o.optimizer_dtensor, Steps.FLAT_PER_GRADIENT: GRADIENT_HOOK * o.optimizer_tensor}
    return parameter_tensors(spec) / d.pp * per_tensor.get(steps, o.optimizer_tensor)


def stage_imbalance(spec: ModelSpec, e: Estimate) -> float:
    """The busiest pipeline stage's compute over the average stage's, under the engine's own cost-balanced split
    (:func:`disttrain.parallel.split.pipeline.plan_stages`): equal blocks, and an LM head over the vocabulary counted
    with the last stage (a ViT's or classifier's head is negligible). 1 when the blocks cannot fill the stages."""
    from disttrain.parallel.split.pipeline import plan_stages

    stages = e.dims.pp * int(e.options.get("virtual_stages") or 1)
    if spec.layers < stages:
        return 1.0
    seq = max(1, e.seq_len)
    head = 2.0 * spec.vocab * spec.hidden * seq if spec.vocab and spec.hidden else 0.0  # forward FLOPs, one sample
    block = max(0.0, flops_per_sample(spec, seq) / 3 - head) / spec.layers
    costs = [block] * spec.layers
    plan = plan_stages(costs, e.dims.pp, stages // e.dims.pp, last_extra=head)
    loads = [sum(costs[a:b]) + (head if b == spec.layers else 0.0) for a, b in plan.bounds]
    return max(loads) / (sum(loads) / len(loads)) if sum(loads) else 1.0


def profile_seconds(profile: dict, layers: int) -> float:
    """Seconds of a timed model (:func:`disttrain.planner.calibrate.measure_models`) at ``layers`` blocks: the
    line through its timings at two depths (ends + blocks x one block's), or its one timing."""
    depths, seconds = profile["depths"], profile["seconds"]
    if len(depths) < 2 or depths[-1] == depths[0]:
        return seconds[-1]
    block = max(0.0, (seconds[-1] - seconds[0]) / (depths[-1] - depths[0]))
    return seconds[0] + (max(1, layers) - depths[0]) * block


def model_factor(spec: ModelSpec, hw: Hardware) -> float:
    """The model's own forward + backward on one process, as the calibration timed it (``disttrain calibrate
    --model``), over what this model predicts for it: the work of the model's blocks that matmul throughput and a
    tiny block do not show (an MoE's routing and loop over experts, its own norms and loss). It scales the compute
    and the plain block's overhead of every plan of that model; 1 when the model was not timed."""
    profile = hw.calibration.model_profile(spec) if hw.calibration is not None else None
    if profile is None:
        return 1.0
    from disttrain.planner.estimate import estimate

    precision = "32-true" if hw.calibration.device == "cpu" else "bf16-mixed"
    one = estimate(spec, "disttrain_ddp", 1, micro_batch=profile["micro_batch"], seq_len=profile["seq_len"],
                   precision=precision)
    parts = breakdown(spec, one, hw, factor=1.0)
    modelled = max(parts.compute, parts.overhead) if parts.overlaps else parts.compute + parts.overhead
    return profile_seconds(profile, spec.layers) / modelled if modelled > 0 else 1.0


def crosses_nodes(e: Estimate, hw: Hardware) -> dict[str, bool]:
    """For each kind of traffic of ``e`` (the keys of ``Estimate.comm`` that use a link), whether it goes over the
    links between nodes. Ranks of one tensor-, context- and expert-parallel group are neighbours in the mesh (one node
    while they fit it); a gradient reduction over the ranks that share one copy of the states (and its gathers) stays
    in a node when that copy's ranks fit one (HSDP: sharded within a node, replicated across); an all-reduce over
    every data-parallel rank, the replicas' all-reduce, pipeline sends and embedding all-to-alls cross nodes when the
    world spans them."""
    d, per_node = e.dims, hw.gpus_per_node
    spans = e.world_size > per_node
    one_copy = spans if layout_of(e).grads.reduce is Reduce.ALL_REDUCE else e.world_size // d.dp_replicate > per_node
    return {"dp": one_copy, "after_step": one_copy, "dp_replicate": spans, "pp": spans, "a2a": spans,
            "tp": d.tp * d.cp > per_node, "cp": d.tp * d.cp > per_node, "ep": d.tp * d.ep > per_node}


# The traffic of a data-parallel group over every rank: what node_share divides when it crosses nodes.
SHARED_KINDS = ("dp", "after_step")


def node_share(e: Estimate, hw: Hardware) -> int:
    """How many ranks of one data-parallel group sit on a node: what a reduction or gather over that group sends
    between nodes per node is one of them's bytes, not all of theirs. A ring (gloo's, NCCL's) over ranks laid out
    node by node leaves a node once per ring: the node's link carries one member's share (read on the interfaces of
    2 hosts x 2 processes: FSDP over all 4 sends one rank's bytes per host per step), while the calibrated figure
    between nodes is each rank's share of the link with every local rank's group busy at once (HSDP's replicas, one
    member per node). So a group with ``k`` members per node moves its crossing bytes ``k`` times faster per rank.

    Only with links measured between nodes (``disttrain calibrate`` over several nodes): a preset's ``inter_node_bw``
    is the figure a collective over every rank reaches per device, as the presets were chosen."""
    if hw.calibration is None or hw.calibration.inter_links is None:
        return 1
    d, per_node = e.dims, hw.gpus_per_node
    inner = d.tp * d.cp  # the mesh's innermost dimensions: a data-parallel group's members are that far apart
    if inner >= per_node or per_node % inner:
        return 1
    return max(1, min(per_node // inner, e.world_size // (inner * d.pp)))


def across_nodes(e: Estimate, hw: Hardware) -> float:
    """Bytes one rank sends over the links between nodes per step (on average over a node's ranks)."""
    crossing, share = crosses_nodes(e, hw), node_share(e, hw)
    return sum(e.comm.get(kind, 0.0) / (share if kind in SHARED_KINDS else 1) for kind in NETWORK
               if crossing[kind])


def breakdown(spec: ModelSpec, e: Estimate, hw: Hardware, loader_batch: bool = False,
              factor: float | None = None) -> StepTime:
    """The parts of one step of ``e`` on ``hw`` (``loader_batch``: see :func:`overhead`; ``factor``: the
    :func:`model_factor` to use, by default the calibration's for this model)."""
    layout = layout_of(e)
    d, c = e.dims, e.comm
    factor = model_factor(spec, hw) if factor is None else factor
    # forward 1, backward 2 (input and weight gradients), a recomputed forward 1 more; a frozen base under LoRA
    # skips its weight gradients, leaving the adapters' (their share of the parameters)
    weight_grads = lora_elements(spec, e.lora_rank) / spec.params if e.lora_rank else 1.0
    passes = 2 + weight_grads + (1 if e.activation_checkpointing else 0)
    flops = flops_per_sample(spec, e.seq_len) * e.micro_batch * passes / 3
    saved = activation_bytes(spec, e.micro_batch, e.seq_len, _compute_bytes(e.precision), False, d)
    elementwise = 3 * saved * (4 / 3 if e.activation_checkpointing else 1) / hw.memory_bw
    compute = (flops / _matmul_rate(spec, e, hw) + elementwise) * factor
    micro_steps = d.tp * d.pp * d.cp
    m = microbatches(e)
    if d.pp > 1:  # 1F1B: (p-1) of (m+p-1) slots idle, at the pace of the busiest stage
        compute *= stage_imbalance(spec, e) / (1 - (d.pp - 1) / (m + d.pp - 1))
    optimizer = (0.0 if c.get("host_optimizer") else e.states / hw.optimizer_sweep) + optimizer_overhead(spec, e, hw)

    crossing, share = crosses_nodes(e, hw), node_share(e, hw)
    layers = max(1, spec.layers // d.pp)
    params, grads = layout.params, layout.grads

    if params.gather is not Gather.PER_UNIT:  # gradients reduced bucket by bucket while backward runs
        calls = max(1, math.ceil(e.grads / grads.bucket_bytes)) if grads.bucket_bytes else 1
        calls *= grads.low_rank_calls or 1  # PowerSGD: the uncompressed tensors, then P, then Q
        op = "all_reduce" if grads.reduce is Reduce.ALL_REDUCE else "reduce_scatter"
        dp = _link(hw, op, c.get("dp", 0), calls, crossing["dp"], share)
        hidden_behind = compute * 2 / 3  # buckets reduce while backward (two thirds of the compute) runs
        inline = 0.0
    else:
        units = fsdp_units(spec) if params.units is Units.FSDP else (layers + 1 if spec.layers else 1)
        calls = units * params.calls
        # ZeRO-3's many small fetches: their latency is in its measured work per block (Overheads.zero3)
        paid = 0 if layout.work is Work.ZERO3 and hw.overheads.zero3 else calls
        sent = c.get("dp", 0)
        # Forward and backward all-gathers (2 x compute bytes of every 2 x compute + reduce) and one reduce-scatter;
        # the replicas' all-reduce of each unit's gradient shard (HSDP).
        gathers = params.gather.per_step
        dp = (_link(hw, "all_gather", sent * gathers / (gathers + 1), gathers * paid, crossing["dp"], share)
              + _link(hw, "reduce_scatter", sent / (gathers + 1), paid, crossing["dp"], share)
              + _link(hw, "all_reduce", c.get("dp_replicate", 0), units, crossing["dp_replicate"]))
        # FSDP2 and DeepSpeed prefetch on a separate stream; a device without streams (CPU processes) waits for
        # each unit's (submodule's) gather as it enters it: there each of them sits between computations.
        hidden_behind = compute if hw.overheads.overlaps else 0.0
        inline = 0.0 if hw.overheads.overlaps or not sent else (gathers + 1) * paid * hw.overheads.collective
    dp_exposed = max(dp - hw.overlap * hidden_behind, dp / calls) + inline if dp else 0.0

    per_block = 4 * layers * micro_steps  # collectives per block per micro-batch, forward and backward

    def between(op: str, kind: str, calls: float) -> float:
        """A collective between computations: its link's time and what it costs there beyond it."""
        sent = c.get(kind, 0)
        together = share if kind in SHARED_KINDS else 1
        return _link(hw, op, sent, calls, crossing[kind], together) + (calls * hw.overheads.collective if sent
                                                                         else 0.0)

    critical = (between("all_reduce", "tp", per_block)
                + between("all_to_all", "pp", 2 * m)  # point-to-point sends, per microbatch
                + between("all_to_all", "cp", per_block)
                + between("all_to_all", "ep", per_block)
                + between("all_to_all", "a2a", 4)  # ids out, embeddings back, their gradients
                + between("all_gather", "after_step", 1)  # after the optimizer step
                + c.get("pcie", 0) / hw.pcie_bw + c.get("host_optimizer", 0) / hw.host_optimizer_bw)
    # compressed gradients: passes over the fp32 gradients of every trained element this rank holds (whole, before
    # a reduce-scatter), each a read and a write at the measured memory speed
    codec = grads.codec_passes * 8 * (e.lora_rank and lora_elements(spec, e.lora_rank) or spec.params) / \
        (d.tp * d.pp) / hw.memory_bw
    return StepTime(compute, optimizer, dp, dp_exposed, critical, overhead(spec, e, hw, loader_batch, factor),
                    hw.overheads.overlaps, codec)


def step_time(spec: ModelSpec, e: Estimate, hw: Hardware, loader_batch: bool = False) -> float:
    """Estimated seconds of one step (``micro_batch`` samples per device, forward, backward and optimizer)."""
    return breakdown(spec, e, hw, loader_batch).total
