"""Choosing a strategy: the memory estimate decides what fits, the step-time model (:mod:`disttrain.planner.steptime`,
calibrated on the machine when it is the one planned for) ranks what fits by throughput, and a trial
(:mod:`disttrain.planner.trial`) can measure the best few instead. No rule about model size or device count
overrides that: every strategy the planner has a formula for is a candidate, with the degrees its layout lets the
planner choose (the tp x pp (x cp, x ep) splits of a model-parallel layout, replication across nodes of a sharded one:
HSDP), activation checkpointing on and off, and the micro-batch (the largest that fits, up to ``MAX_MICRO_BATCH``)
as searched choices unless the recipe or the caller fixes them (docs/choosing.md explains the choice in a user's
terms). Candidates, their order and the ties are read from each strategy's layout
(:mod:`disttrain.parallel.engines.layout`), never from its engine class or name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from disttrain.parallel import registry
from disttrain.parallel.engines.layout import Layout
from disttrain.parallel.mesh import ParallelDims, divisors
from disttrain.planner.estimate import (
    Estimate,
    analytic,
    estimate,
    pipelines,
    planned,
    tensor_parallel,
)
from disttrain.planner.hardware import GiB, Hardware
from disttrain.planner.hardware import hardware as make_hardware
from disttrain.planner.spec import ModelLike, ModelSpec, model_spec
from disttrain.planner.steptime import (  # noqa: F401  (step_time: public here too)
    StepTime,
    across_nodes,
    breakdown,
    crosses_nodes,
    model_factor,
    step_time,
)

TIE = 0.05  # throughputs within 5% are a tie: the simpler set-up wins (see _simplicity); the ranking bench holds
# the model to choosing within 5% of the fastest measured plan, so closer estimates do not tell set-ups apart
MAX_MICRO_BATCH = 64  # the searched micro-batches: 1, 2, 4, ... up to this
LONG_SEQUENCE = 8192  # context parallelism is considered for sequences of at least this many tokens


@dataclass
class Candidate:
    """One strategy set-up with its estimate, whether it fits, its estimated step time in seconds and (after a
    trial) its measured one."""

    estimate: Estimate
    fits: bool
    step_time: float
    usable: int
    why: str = ""
    measured: float | None = None
    parts: StepTime | None = None

    @property
    def label(self) -> str:
        return self.estimate.label + (" +AC" if self.estimate.activation_checkpointing else "")

    @property
    def row(self) -> registry.Registered:
        return registry.lookup(self.estimate.strategy)

    @property
    def layout(self) -> Layout:
        """How this set-up holds the model's states (its engine's declaration, with its options)."""
        assert self.estimate.layout is not None
        return self.estimate.layout

    @property
    def samples_per_s(self) -> float:
        """Samples per second over all devices, estimated (the ranking's measure)."""
        return self.estimate.micro_batch * self.estimate.world_size / self.step_time

    def strategy_options(self) -> dict:
        """Keyword options of the registered strategy that realise this candidate (beyond its defaults)."""
        return dict(self.estimate.options)


@dataclass
class Plan:
    """Every candidate considered (``candidates``), the choice and the reasons, for one model and machine.
    ``settings``: where the micro-batch, precision and activation checkpointing came from."""

    spec: ModelSpec
    world_size: int
    hardware: Hardware
    candidates: list[Candidate]
    choice: Candidate | None
    reasons: list[str] = field(default_factory=list)
    settings: dict = field(default_factory=dict)

    @property
    def strategy(self) -> str:
        if self.choice is None:
            raise RuntimeError("no strategy fits:\n" + "\n".join(self.reasons))
        return self.choice.estimate.strategy

    @property
    def unit(self) -> tuple[str, int]:
        return ("GiB", GiB) if self.hardware.memory >= 4 * GiB else ("MiB", 2**20)

    def ranked(self) -> list[Candidate]:
        """The set-ups that fit, fastest (by estimated throughput) first."""
        return sorted((c for c in self.candidates if c.fits), key=lambda c: -c.samples_per_s)

    def table(self) -> str:
        name, unit = self.unit
        trial = any(c.measured is not None for c in self.candidates)
        head = (f"{'strategy':<46} {'micro':>5} {'states ' + name:>11} {'activations':>11} {'buffers':>8}"
                f" {'per rank':>9} {'host':>7} {'fits':>4} {'step s':>8} {'samples/s':>9} {'x-node GB':>9}"
                + (f" {'measured s':>10}" if trial else ""))
        lines = [head, "-" * len(head)]
        for c in self.candidates:
            e = c.estimate
            measured = "" if not trial else f" {c.measured:>10.3g}" if c.measured is not None else f" {'-':>10}"
            lines.append(f"{c.label:<46} {e.micro_batch:>5} {e.states / unit:>11.1f} {e.activations / unit:>11.1f}"
                         f" {e.buffers / unit:>8.1f} {e.device / unit:>9.1f} {e.host / unit:>7.1f}"
                         f" {'yes' if c.fits else 'no':>4} {c.step_time:>8.3g} {c.samples_per_s:>9.3g}"
                         f" {across_nodes(e, self.hardware) / 1e9:>9.3g}{measured}")
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


def model_parallel_grid(spec: ModelSpec, world_size: int, hw: Hardware, seq_len: int,
                        searched: Iterable[str]) -> list[dict[str, int]]:
    """Degrees of the model-parallel dimensions among ``searched`` that the model can take: tp x pp splits (tp
    inside a node) of the heads and layers it has, for long sequences tp x cp (context parallelism inside a node: its
    all-to-alls are on every block's critical path), and for MoE models tp x ep (the experts split inside a node)."""
    searched = set(searched)
    if not tensor_parallel(spec) or "tp" not in searched:
        return []
    out: list[dict[str, int]] = []
    for t in divisors(min(world_size, hw.gpus_per_node)):
        if spec.heads % t or spec.kv_heads % t:
            continue
        for p in divisors(world_size // t) if "pp" in searched else [1]:
            if (t, p) != (1, 1) and p <= 16 and spec.layers % p == 0 and (p == 1 or pipelines(spec)):
                out.append({"tp": t, "pp": p})
        experts = (spec.extra.get("experts") or {}).get("count", 0) if "ep" in searched else 0
        for e in divisors(min(world_size // t, hw.gpus_per_node // t)) if experts else []:
            if e > 1 and experts % e == 0:  # expert parallelism inside a node, over the data-parallel ranks
                out.append({"tp": t, "ep": e})
        if "cp" not in searched or seq_len < LONG_SEQUENCE or not spec.extra.get("context_parallel"):
            continue
        heads, kv = spec.heads // t, spec.kv_heads // t  # per tensor-parallel rank: what the all-to-all splits
        for c in divisors(hw.gpus_per_node // t):
            if c > 1 and world_size % (t * c) == 0 and seq_len % c == 0 and heads % c == 0 and \
                    (kv % c == 0 or c % kv == 0):
                out.append({"tp": t, "cp": c})
    return out


def variants(row: registry.Registered, spec: ModelSpec, world_size: int, hw: Hardware,
             seq_len: int) -> list[dict[str, Any]]:
    """The options of ``row`` worth estimating, from its layout: tables placed by torchrec only for a model with
    tables; a model split by model-parallel dimensions at each split of :func:`model_parallel_grid`; otherwise the
    strategy as registered and, when its layout lets the planner replicate across nodes and the world spans them,
    sharded within each node and replicated across (HSDP; not for set-ups that offload, whose point is memory)."""
    layout = row.layout()
    if layout.tables:
        return [{}] if spec.table_rows else []
    if layout.split_by:
        grid = model_parallel_grid(spec, world_size, hw, seq_len, layout.searched)
    else:
        grid = [{}]
        node = hw.gpus_per_node
        if "dp_replicate" in layout.searched and not layout.offloaded and world_size > node and \
                world_size % node == 0:
            grid.append({"dp_replicate": world_size // node, "dp_shard": node})
    return [row.engine.degree_options(degrees) for degrees in grid]  # type: ignore[union-attr]


def offloaded(row: registry.Registered, options: Mapping[str, Any] | None = None) -> bool:
    """Whether ``row`` with ``options`` keeps some of its states off the device (the _offload names)."""
    return row.layout(dict(options or {})).offloaded


def candidates(spec: ModelSpec, world_size: int, hw: Hardware,
               seq_len: int | None = None) -> list[tuple[registry.Registered, dict]]:
    """Every set-up worth estimating, as (strategy row, options) (:func:`variants`); tables first, model-parallel
    splits last, offload after the strategies that keep states on the device."""
    names = planned()
    rows = [row for row in registry.STRATEGIES if row.name in names]

    def order(row: registry.Registered) -> tuple[bool, bool, bool]:
        layout = row.layout()
        return not layout.tables, bool(layout.split_by), layout.offloaded

    rows.sort(key=order)
    return [(row, options) for row in rows for options in variants(row, spec, world_size, hw,
                                                                   int(seq_len or spec.tokens or 1))]


def _split_batch(dims: ParallelDims, options: Mapping[str, Any], micro_batch: int,
                 loader_batch: bool) -> dict | None:
    """The ``microbatches`` option of a pipeline set-up at degrees ``dims``: the most, up to the engine's default
    ``2 x pp``, that divide the samples the pipeline gets and that its 1F1B schedule takes (at least ``pp``); None
    when none does. Empty for set-ups without a pipeline or with microbatches given."""
    pp = dims.pp
    if pp == 1 or options.get("microbatches"):
        return {}
    samples = micro_batch if loader_batch else micro_batch * dims.tp * pp * dims.cp
    valid = [m for m in range(pp, 2 * pp + 1) if samples % m == 0]
    return {"microbatches": max(valid)} if valid else None


def recomputable(spec: ModelSpec) -> bool:
    """Activation checkpointing is estimated for blocks whose activations are known (analytic or measured)."""
    return spec.layers > 0 and (analytic(spec) or "activations" in spec.extra)


def choose(model_or_config: ModelLike, world_size: int, hardware: Hardware | str | None = None,
           device_memory: str | int | None = None, micro_batch: int | None = None, seq_len: int | None = None,
           precision: str | None = None, headroom: float = 0.1, available: Iterable[str] | None = None,
           optimizer: str | None = None, activation_checkpointing: bool | None = None,
           max_micro_batch: int = MAX_MICRO_BATCH, loader_batch: bool = False, lora_rank: int | None = None) -> Plan:
    """The set-up with the highest estimated throughput among those that fit ``device_memory`` (minus ``headroom``
    and the runtime's reserve) on ``world_size`` devices of ``hardware`` (a :class:`Hardware`, a preset name such as
    "A100-40GB", or None for an A100-class node). ``available`` limits the choice to these strategy names (e.g. the
    registered ones).

    ``micro_batch``, ``precision``, ``activation_checkpointing`` and ``seq_len``: given here, else what the recipe
    YAML sets (``train.micro_batch_size`` / ``data.batch_size``, ``train.precision``,
    ``train.activation_checkpointing``, ``data.seq_len``), else searched: the largest micro-batch that fits (powers
    of two up to ``max_micro_batch``), checkpointing on and off; precision ``bf16-mixed``. ``lora_rank`` (else the
    recipe's ``lora.rank``, else 0): only LoRA adapters of that rank train, the base model frozen.

    ``loader_batch``: each rank's DataLoader gives ``micro_batch`` samples whatever the strategy (``disttrain_auto``
    at run time), so a pipeline splits those samples; otherwise it gets ``micro_batch x tp x pp x cp`` (the same
    global batch as every other set-up, as ``--trial`` runs it). Pipeline set-ups whose batch no valid number of
    microbatches divides are left out: the engine would refuse them."""
    spec = model_spec(model_or_config)
    hw = hardware if isinstance(hardware, Hardware) else make_hardware(hardware, device_memory)
    if isinstance(hardware, Hardware) and device_memory is not None:
        hw = hw.with_memory(device_memory)
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom={headroom} must be a fraction in [0, 1), e.g. 0.1 for 10%")
    if micro_batch is not None and (not isinstance(micro_batch, int) or micro_batch < 1):
        raise ValueError(f"micro_batch={micro_batch!r} must be a positive integer (or None: the recipe's, else the"
                         " largest that fits)")
    recipe = spec.extra.get("recipe", {})
    settings = {}
    for key, given in (("micro_batch", micro_batch), ("precision", precision),
                       ("activation_checkpointing", activation_checkpointing), ("seq_len", seq_len),
                       ("lora_rank", lora_rank)):
        if given is not None:
            settings[key] = (given, "given")
        elif key in recipe:
            settings[key] = (recipe[key], "recipe")
    precision_ = planned_precision(settings["precision"][0]) if "precision" in settings else "bf16-mixed"
    seq_len = settings["seq_len"][0] if "seq_len" in settings else None
    lora = int(settings["lora_rank"][0]) if "lora_rank" in settings else 0
    usable = int(hw.memory * (1 - headroom)) - hw.reserved
    allowed = set(planned() if available is None else available)
    ranks_per_node = min(world_size, hw.gpus_per_node)
    if "micro_batch" in settings:
        batches = [int(settings["micro_batch"][0])]
    else:
        batches = [2**i for i in range(max(0, max_micro_batch).bit_length()) if 2**i <= max_micro_batch] or [1]

    plan = Plan(spec, world_size, hw, [], None, settings={k: v for k, v in settings.items()})
    for row, options in candidates(spec, world_size, hw, seq_len):
        if row.name not in allowed:
            continue
        # Searched: the strategy's own activation_checkpointing option, where it has one. Fixed on (the recipe's
        # train.activation_checkpointing): the model checkpoints its blocks itself, under every strategy.
        dims = row.dims(world_size, options)
        fixed = settings.get("activation_checkpointing", (None,))[0]
        option = recomputable(spec) and "activation_checkpointing" in row.options_cls.__dataclass_fields__
        by_model = bool(fixed) and recomputable(spec)
        for ac in ((False, True) if option and fixed is None else (False,)):
            best = None
            for b in batches:  # the largest micro-batch that fits (estimates grow with it)
                split = _split_batch(dims, options, b, loader_batch)
                if split is None:
                    continue
                e = estimate(spec, row.name, world_size, micro_batch=b, seq_len=seq_len, precision=precision_,
                             optimizer=optimizer, model_recomputes=by_model, lora_rank=lora, **options, **split,
                             **({"activation_checkpointing": True} if ac else {}))
                host_ok = e.host * ranks_per_node <= hw.host_memory * (1 - headroom)
                fits = e.device <= usable and host_ok
                if best is None or fits:
                    why = "" if fits else (f"needs {_gib(e.device)} GiB > {_gib(usable)} GiB usable" if host_ok else
                                           f"host needs {_gib(e.host * ranks_per_node)} GiB per node")
                    best = (e, fits, why)
                if not fits:
                    break
            if best is None:  # a pipeline no batch here splits into microbatches
                continue
            e, fits, why = best
            parts = breakdown(spec, e, hw, loader_batch)
            plan.candidates.append(Candidate(e, fits, parts.total, usable, why, parts=parts))
    _decide(plan, allowed, _assumptions(spec, settings, precision_, optimizer))
    note = measurement_note(spec)
    if note:
        plan.reasons.append(note)
    return plan


def planned_precision(precision: Any) -> str:
    """A Lightning precision as the planner names it ("bf16" -> "bf16-mixed", 32 -> "32-true")."""
    p = str(precision)
    return {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}.get(p, p)


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


def _simplicity(c: Candidate) -> tuple:
    """The order that breaks ties in throughput: the set-up with the fewest moving parts (tables sharded, a
    replica, shards, a library's own engine (DeepSpeed), then tensor/pipeline splits; no offload; no recomputation;
    a flat shard group before a hybrid one)."""
    layout, dims = c.layout, c.estimate.dims
    kind = (0 if layout.tables else 4 if layout.split_by else 1 if layout.replica
            else 3 if layout.can.owns_gradients else 2)
    return (layout.offloaded, c.estimate.activation_checkpointing, kind, dims.tp * dims.pp, dims.hybrid)


def _assumptions(spec: ModelSpec, settings: dict, precision: str, optimizer: str | None) -> list[str]:
    """What the plan assumed where neither the caller nor the recipe said: the precision, a language model's sequence
    length (its maximum) and the optimizer, each with the flag that changes it."""
    assumed = []
    if "precision" not in settings:
        assumed.append(f"precision {precision} (--precision to change)")
    if "seq_len" not in settings and spec.vocab and spec.tokens:
        assumed.append(f"seq len {spec.tokens} (the model's longest; --seq-len to change)")
    if not spec.table_rows:
        assumed.append("AdamW with fp32 moments" if optimizer in (None, "adamw") else f"optimizer {optimizer}")
    return assumed


def _settings_note(plan: Plan, assumed: list[str]) -> str:
    said = {"given": "as given", "recipe": "from the recipe"}
    fixed = [f"{key.replace('_', ' ')} {_word(value)} ({said[source]})" for key, (value, source) in plan.settings.items()]
    searched = [what for key, what in (("micro_batch", f"micro-batch (the largest that fits, up to"
                                                       f" {MAX_MICRO_BATCH})"),
                                       ("activation_checkpointing", "activation checkpointing (on and off)"))
                if key not in plan.settings]
    parts = ([f"fixed: {', '.join(fixed)}"] if fixed else []) + ([f"searched: {', '.join(searched)}"] if searched
                                                                  else [])
    return "; ".join(parts + ([f"assumed: {', '.join(assumed)}"] if assumed else []))


def _timing_note(hw: Hardware, spec: ModelSpec, world_size: int) -> str:
    if hw.calibration is not None:
        timed = hw.calibration.model_profile(spec)
        model = (f"this model's own step timed there, {model_factor(spec, hw):.2f}x the modelled compute" if timed
                 else "this model's own step not timed (`disttrain calibrate --model CONFIG` times it)")
        network = ""
        if world_size > hw.gpus_per_node:
            network = (f", between nodes as measured over {hw.calibration.nodes} nodes"
                       if hw.calibration.inter_links is not None else
                       f", between nodes not measured: {hw.inter_node_bw / 1e9:.4g} GB/s and {hw.latency * 1e6:.4g} us"
                       " per collective (`disttrain calibrate --num-nodes` measures them)")
        return (f"step times from the calibration measured on this machine ({hw.calibration.path}): matmul at the"
                f" model's shapes, each collective's latency and bandwidth{network}, overlap"
                f" {hw.calibration.overlap:.2f}; {model}")
    return (f"step times from the {hw.name} figures (peak {hw.peak_flops / 1e12:.4g} TFLOP/s x {hw.mfu}, links"
            f" {hw.intra_node_bw / 1e9:.4g} GB/s in a node, {hw.inter_node_bw / 1e9:.4g} GB/s between nodes), not"
            " measured here")


def _decide(plan: Plan, allowed: set[str], assumed: list[str]) -> None:
    spec, reasons = plan.spec, plan.reasons
    note = _settings_note(plan, assumed)
    if note:
        reasons.append(note)
    fitting = plan.ranked()
    replicas = [c for c in plan.candidates if c.layout.replica]  # a whole copy of the model and states per rank
    if not any(c.fits for c in replicas):
        worst = next(iter(replicas), None)
        if worst is not None:
            reasons.append(f"DDP does not fit: a full replica {worst.why} (model states alone "
                           f"{_gib(worst.estimate.states)} GiB)")
    context = [c for c in plan.candidates if c.estimate.dims.cp > 1]
    if context:
        reasons.append(f"context parallelism considered: {context[0].estimate.seq_len} tokens per sequence (from"
                       f" {LONG_SEQUENCE}); cp ranks each compute 1/cp of every sequence's tokens (activations / cp)"
                       " for two all-to-alls per block")
    placing = [row.name for row in registry.STRATEGIES if row.engine is not None and row.layout().tables]
    if spec.table_rows and not allowed & set(placing):
        reasons.append(f"{' or '.join(placing) or 'a strategy that places tables'} (table-wise embedding sharding)"
                       " is not available here")
    if not fitting:
        reasons.append("nothing fits: " + "; ".join(f"{c.label}: {c.why}" for c in plan.candidates[:6]) +
                       "; use more devices, a smaller micro-batch or a shorter sequence")
        return
    best = fitting[0].samples_per_s
    near = sorted((c for c in fitting if c.samples_per_s >= best / (1 + TIE)), key=_simplicity)
    plan.choice = choice = near[0]
    reasons.append(_why(choice, "the highest estimated throughput", plan.hardware))
    for r in [c for c in fitting if c is not choice][:2]:
        reasons.append(f"next: {r.label} at micro-batch {r.estimate.micro_batch}, {r.samples_per_s:.3g} samples/s"
                       f" ({r.step_time:.3g} s per step)")
    split = min((c for c in fitting if c.estimate.dims.cp > 1), key=lambda c: c.step_time, default=None)
    recompute = min((c for c in fitting if c.estimate.activation_checkpointing and c.estimate.dims.cp == 1),
                    key=lambda c: c.step_time, default=None)
    if split is not None and recompute is not None:
        faster, slower = sorted((split, recompute), key=lambda c: c.step_time)
        reasons.append(f"splitting the sequence against recomputing it: {faster.label} {faster.step_time:.2f} s"
                       f" ({_gib(faster.estimate.device)} GiB) beats {slower.label} {slower.step_time:.2f} s"
                       f" ({_gib(slower.estimate.device)} GiB)")
    if len(near) > 1:
        reasons.append(f"throughputs within {TIE:.0%} are ties, won by the simpler set-up (no offload, no recomputation;"
                       " DDP, FSDP, ZeRO-3, then tensor/pipeline splits)")
    reasons.append(_timing_note(plan.hardware, spec, plan.world_size))


def _why(choice: Candidate, by: str, hw: Hardware) -> str:
    e, p = choice.estimate, choice.parts
    comm = ", ".join(f"{k} {v / 1e9:.3g} GB" for k, v in e.comm.items() if k != "bubble" and v)
    if comm and e.world_size > hw.gpus_per_node:  # the world spans nodes: say what goes over their links
        over = [k for k, crossing in crosses_nodes(e, hw).items() if crossing and e.comm.get(k)]
        comm += (f"; across nodes {across_nodes(e, hw) / 1e9:.3g} GB ({', '.join(over)})" if over
                 else "; none across nodes")
    parts = (f"; compute {p.compute:.3g} s, optimizer {p.optimizer:.3g} s, data-parallel traffic {p.dp:.3g} s of"
             f" which {p.dp_exposed:.3g} s not overlapped, critical-path traffic {p.critical:.3g} s, framework"
             f" overhead {p.overhead:.3g} s") if p else ""
    return (f"{choice.label} at micro-batch {e.micro_batch} fits ({_gib(e.device)} of {_gib(choice.usable)} GiB per"
            f" rank) with {by} ({choice.samples_per_s:.3g} samples/s, {choice.step_time:.3g} s per step{parts};"
            f" traffic per rank per step: {comm or 'none'})")


def _word(value: Any) -> str:
    return {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) else str(value)
